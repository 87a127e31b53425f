"""One call to one arm: send a chat/completions request, optionally relay the response, fill its span.

The proxy and ``specproxy replay`` both call arms through :func:`call_arm`, so a replayed call and a
live one are measured the same way.

What :func:`call_arm` does:

- asks every arm's streams for the standard ``stream_options.include_usage`` (the final count), and
  vLLM arms, unless the arm has ``vllm_extensions = "off"``, for ``continuous_usage_stats`` (tokens
  per chunk) where the arm speculates and ``return_token_ids`` when the arm sets it. A 400/422 that
  names them, to a request the proxy added something to, is retried without (the extensions first,
  then ``stream_options``); only when a retry succeeds does the arm's URL count as refusing what it
  left out (:class:`UpstreamState`), and only for ``reprobe_after_s``: then it is tried again. A
  client's own bad request (every retry fails too, or the proxy added nothing) changes nothing. A
  llama.cpp arm is asked for nothing: it reports its counts in ``timings`` (chat) or ``usage``
  (completions) on its own;
- relays the response to an optional :class:`Relay` (the proxy's client writer) as it arrives, with
  everything the client did not ask for stripped again, so the client gets what the backend would have
  sent it; when nothing needs stripping the received bytes are forwarded untouched. A stream's bytes
  are parsed and relayed inside the upstream connection's read callback (:mod:`.wire`): no task switch
  per chunk; the call's coroutine only wakes at the end, or to wait for a slow client (backpressure);
- never raises for upstream trouble: the record's ``status`` says ``ok``, ``http_error`` (upstream
  4xx/5xx, passed through to the relay as it is), ``upstream_error`` (refused, reset, bad stream),
  ``timeout`` or ``client_cancelled`` (the relay raised :class:`ClientGone`);
- ``asyncio.CancelledError`` is never swallowed: the upstream connection is closed (vLLM then aborts
  the generation), the record says ``client_cancelled`` and the error propagates;
- a stream is complete once its final event (``data: [DONE]``) has been relayed: a client that goes
  away after that (the sync ``openai`` client closes its connection at [DONE] without reading the end
  of the body) is not a cancellation. The call stops there, its record stays ``ok`` with the end time of
  [DONE], and a caller that passed its own ``tap`` still has the output when CancelledError arrives.

Example (replay-style, no relay)::

    async with UpstreamClient() as client:
        rec = new_record(run_id, "req-1", arm, body, endpoint="chat", routed_as="replay", source="replay")
        result = await call_arm(client, arm, body, endpoint="chat", record=rec)
        result.record.status, result.record.ttft_s, result.text, result.token_ids
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
import orjson
from multidict import CIMultiDict

from specproxy.config import Arm
from specproxy.proxy.spans.trace import TRACEPARENT_HEADER, new_span_id, new_trace_id, traceparent
from specproxy.proxy.upstream.acceptance import MergeCalibration, speculation_for
from specproxy.proxy.upstream.engines import engine_report
from specproxy.proxy.upstream.latency import chunk_latency, tpot_s
from specproxy.proxy.upstream.redact import redact_request_text
from specproxy.proxy.upstream.sse import CompletionTap, Endpoint, MalformedEvent, SSEEvent, SSEParser
from specproxy.proxy.upstream.tokens import ChunkEvidence, count_completion_tokens, load_tokenizer
from specproxy.proxy.upstream.wire import Exchange, UpstreamClient
from specproxy.record import RoutedAs, Source, SpanRecord, decode_tok_s, fit_to_columns

ENDPOINT_PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
CATEGORY_HEADER = "X-Specproxy-Category"
# Sent by `specproxy replay` with each call: the concurrency level of its load phase, so that a proxy
# in between (`specproxy replay --target`) labels its spans with it. serve never forwards it.
CONCURRENCY_HEADER = "X-Specproxy-Concurrency-Level"
# The same for an open-loop level: its offered rate in requests/s (`replay --rates`).
OFFERED_RATE_HEADER = "X-Specproxy-Offered-Rate"
# With it, the round of the level (1, 2, ...): a --target proxy's spans carry it too.
ROUND_HEADER = "X-Specproxy-Round"
REQUEST_ID_HEADER = "X-Request-Id"
# A UUID as text: 8-4-4-4-12 hex digits, or the same 32 without dashes.
_UUID_TEXT = re.compile(r"[0-9a-fA-F]{8}(-?)[0-9a-fA-F]{4}\1[0-9a-fA-F]{4}\1[0-9a-fA-F]{4}\1[0-9a-fA-F]{12}")
_REQUEST_ID_NAMESPACE = uuid.UUID("5f0c3d52-8a4e-4d6b-9a1f-7e2b6c9d0a14")


def upstream_request_id(request_id: str) -> str:
    """The X-Request-Id an arm gets for a span's ``request_id``: itself when it is a UUID, else a
    UUID derived from it (uuid5), the same for every arm and every call.

    Some servers (llama-cpp-python's) refuse any other X-Request-Id. An arm's own logs still join the
    spans: ``upstream_request_id(span.request_id)`` is the id they show.

    >>> upstream_request_id("3f2b9c1e-0d4a-4e8b-9c7d-1a2b3c4d5e6f")
    '3f2b9c1e-0d4a-4e8b-9c7d-1a2b3c4d5e6f'
    >>> upstream_request_id("a1b2c3-c4-00001-q7") == upstream_request_id("a1b2c3-c4-00001-q7")
    True
    """
    if _UUID_TEXT.fullmatch(request_id):
        return request_id
    # uuid5's own recipe, on bytes: an id read from a header may hold undecodable bytes (surrogates).
    name = request_id.encode("utf-8", "surrogateescape")
    digest = hashlib.sha1(_REQUEST_ID_NAMESPACE.bytes + name, usedforsecurity=False).digest()
    return str(uuid.UUID(bytes=digest[:16], version=5))


# Words in a 400/422 body that mean "this backend does not know vLLM's extensions".
_REJECTION_MARKERS = (
    b"stream_options",
    b"continuous_usage_stats",
    b"return_token_ids",
    b"nrecognized",
    b"xtra",
    b"not permitted",
    b"unknown field",
)


class ClientGone(Exception):
    """Raised by a :class:`Relay` when the client it writes to has disconnected."""


class Relay(Protocol):
    """Where a relayed response goes (the proxy's client response)."""

    async def start(self, status: int, content_type: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Called once, before the first send, with the upstream status, its Content-Type header
        (parameters included: ``application/json; charset=utf-8``) and all its headers as received
        (lower-case names, hop-by-hop ones too: the relay picks what the client gets)."""

    def send(self, data: bytes) -> bool:
        """Bytes for the client, in order, handed over at once (never blocks; raises
        :class:`ClientGone`). True when the client's buffer is full: await :meth:`drain` before more."""

    async def drain(self) -> None:
        """Until the client has taken what was sent (the backpressure)."""


@dataclass(frozen=True, slots=True)
class UpstreamTimeout:
    """Seconds. ``read`` bounds each wait for the next bytes; ``total`` the whole call (None: no cap)."""

    connect: float = 10.0
    read: float | None = 600.0
    total: float | None = None

    def client_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.total, sock_connect=self.connect, sock_read=self.read)


# How long an arm that refused vLLM's extensions (or stream_options) goes without them before they
# are tried again (it may have been upgraded or replaced behind the same URL).
REPROBE_EXTENSIONS_S = 600.0


@dataclass(slots=True)
class UpstreamState:
    """Per-process memory about arms: which refuse vLLM's extensions or ``stream_options`` (URL ->
    since when, monotonic seconds), calls in flight, the engine each arm URL answered as, and what
    their streams showed about chunking."""

    rejects_extensions: dict[str, float] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    rejects_stream_options: dict[str, float] = field(default_factory=dict)
    engines: dict[str, str] = field(default_factory=dict)
    chunk_evidence: ChunkEvidence = field(default_factory=ChunkEvidence)
    merging: MergeCalibration = field(default_factory=MergeCalibration)
    reprobe_after_s: float = REPROBE_EXTENSIONS_S

    def refuses(self, refusals: dict[str, float], url: str) -> bool:
        """Whether ``url`` is in ``refusals`` (one of the two above) and not yet due a new probe."""
        since = refusals.get(url)
        if since is None:
            return False
        if time.monotonic() - since >= self.reprobe_after_s:
            del refusals[url]  # probe again
            return False
        return True

    def engine_of(self, arm: Arm) -> str:
        """The arm's engine: as configured, else as detected from its responses, else unknown."""
        if arm.engine_kind != "auto":
            return arm.engine_kind
        return self.engines.get(arm.url, "unknown")


DEFAULT_STATE = UpstreamState()


@dataclass(slots=True)
class _Strip:
    """What to remove from the upstream response because the proxy, not the client, asked for it."""

    usage: bool = False  # client did not ask include_usage: drop the usage-only chunk and null usages
    chunk_usage: bool = False  # client did not ask continuous stats: drop usage beside choices
    token_ids: bool = False  # client did not ask return_token_ids
    # vLLM sends `"token_ids": null` when not asked: the value goes back to null, the key stays.
    # Another backend's unasked ids are removed with their key.
    null_ids: bool = False
    added: bool = False  # the body sent upstream holds something the client did not send

    @property
    def any(self) -> bool:
        return self.usage or self.chunk_usage or self.token_ids


@dataclass(slots=True)
class CallResult:
    """The outcome of one upstream call. ``record`` is filled in; ``tap`` holds the output facts."""

    record: SpanRecord
    tap: CompletionTap
    http_status: int | None = None
    relay_started: bool = False  # the relay got start(): the client response is under way
    client_gone: bool = False
    t_send: float = 0.0  # perf_counter at send
    t_end: float | None = None  # perf_counter at the response's end (None: not read to its end)

    @property
    def ok(self) -> bool:
        return self.record.status == "ok"

    @property
    def text(self) -> str:
        return self.tap.text()

    @property
    def token_ids(self) -> list[int] | None:
        return self.tap.token_ids if self.tap.has_token_ids else None


def level_header(level: int | None, offered_rate: float | None = None) -> dict[str, str] | None:
    """The request header that tells a proxy the level of this call: its concurrency, or the offered
    rate of its open loop (None: no level)."""
    if level is not None:
        return {CONCURRENCY_HEADER: str(level)}
    return {OFFERED_RATE_HEADER: repr(float(offered_rate))} if offered_rate is not None else None


def phase_headers(
    level: int | None, round_: int | None, offered_rate: float | None = None
) -> dict[str, str] | None:
    """The request headers that tell a proxy the load phase of this call: its level (a concurrency or
    an open loop's offered rate) and round (None: neither)."""
    headers = level_header(level, offered_rate) or {}
    if round_ is not None:
        headers[ROUND_HEADER] = str(round_)
    return headers or None


def prompt_sha256(body: dict[str, Any], endpoint: str) -> str:
    """sha256 of the prompt part of a request (messages or prompt), canonical JSON, so arms agree."""
    part = body.get("messages") if endpoint == "chat" else body.get("prompt")
    return hashlib.sha256(orjson.dumps(part, option=orjson.OPT_SORT_KEYS)).hexdigest()


def new_record(
    run_id: str,
    request_id: str,
    arm: Arm,
    body: dict[str, Any],
    *,
    endpoint: Endpoint,
    routed_as: RoutedAs,
    source: Source = "live",
    category: str | None = None,
    trace_id: str | None = None,
    concurrency_level: int | None = None,
    engine_load: tuple[float | None, float | None] | None = None,
    offered_rate: float | None = None,
) -> SpanRecord:
    """A span record with identity and request fields filled from the arm and the client's body.

    ``engine_load``: the arm's (running, waiting) gauges from its latest /metrics scrape, if known."""
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    temperature = body.get("temperature")
    seed = body.get("seed")
    return SpanRecord(
        run_id=run_id,
        request_id=request_id,
        arm=arm.name,
        arm_role=arm.role,
        backend_url=arm.url,
        trace_id=trace_id or new_trace_id(),
        span_id=new_span_id(),
        spec_method=arm.spec_method,
        num_speculative_tokens=arm.num_speculative_tokens,
        source=source,
        routed_as=routed_as,
        category=category,
        concurrency_level=concurrency_level,
        offered_rate=offered_rate,
        endpoint=endpoint,
        model=body.get("model") if isinstance(body.get("model"), str) else None,
        stream=bool(body.get("stream")),
        temperature=float(temperature) if isinstance(temperature, int | float) else None,
        max_tokens=int(max_tokens) if isinstance(max_tokens, int) else None,
        seed=int(seed) if isinstance(seed, int) else None,
        prompt_sha256=prompt_sha256(body, endpoint),
        engine_running=engine_load[0] if engine_load is not None else None,
        engine_waiting=engine_load[1] if engine_load is not None else None,
    )


def _upstream_body(
    arm: Arm, body: dict[str, Any], *, with_extensions: bool, with_usage: bool = True
) -> tuple[bytes, _Strip]:
    """The body sent upstream and what must be stripped from its response for the client.

    ``with_usage``: ask a stream for the standard final usage even without vLLM's extensions."""
    strip = _Strip()
    if not with_extensions:
        return _with_standard_usage(body, strip) if with_usage else orjson.dumps(body), strip
    out = dict(body)
    if body.get("stream"):
        opts = body.get("stream_options")
        client_opts = opts if isinstance(opts, dict) else {}
        strip.usage = not client_opts.get("include_usage")
        # Per-chunk usage (tokens per chunk) only where the stream's shape is measured: arms with
        # speculation. Other arms (the production baseline among them) only add the final usage
        # chunk, so their chunks reach the client byte for byte and cost the server nothing extra.
        continuous = arm.spec_method != "none" or bool(client_opts.get("continuous_usage_stats"))
        strip.chunk_usage = continuous and not client_opts.get("continuous_usage_stats")
        out["stream_options"] = {**client_opts, "include_usage": True, "continuous_usage_stats": continuous}
    if arm.return_token_ids:
        strip.token_ids = not body.get("return_token_ids")
        out["return_token_ids"] = True
    strip.added = out != body
    return orjson.dumps(out), strip


def _with_standard_usage(body: dict[str, Any], strip: _Strip) -> bytes:
    """A stream's body asking for ``stream_options.include_usage`` (OpenAI's own option)."""
    opts = body.get("stream_options")
    client_opts = opts if isinstance(opts, dict) else {}
    if not body.get("stream") or client_opts.get("include_usage"):
        return orjson.dumps(body)
    strip.usage = strip.added = True
    return orjson.dumps({**body, "stream_options": {**client_opts, "include_usage": True}})


DROP, KEEP, CHANGED = 0, 1, 2


def _strip_chunk(obj: dict[str, Any], strip: _Strip, per_chunk_usage: bool = True) -> int:
    """Remove what the client did not ask for from one chunk: DROP the event, KEEP it as received, or
    send it CHANGED (re-serialised). ``per_chunk_usage``: the stream's first chunk carried a usage
    (continuous usage); without it a usage beside choices is the engine's own final count."""
    choices = obj.get("choices")
    changed = False
    if "usage" in obj:
        if not choices:
            if strip.usage:
                return DROP
        elif (strip.chunk_usage and per_chunk_usage) or (strip.usage and obj["usage"] is None):
            # A usage beside choices that the proxy did not cause stays: llama-server ends every
            # streamed /v1/completions with its usage there, asked or not.
            changed = _pop(obj, "usage")
    if strip.token_ids:
        unset = _null if strip.null_ids or _vllm_shaped(obj) else _pop
        changed = unset(obj, "prompt_token_ids") or changed
        for c in choices or ():
            changed = unset(c, "token_ids") or changed
            changed = unset(c, "prompt_token_ids") or changed
    return CHANGED if changed else KEEP


def _vllm_shaped(obj: dict[str, Any]) -> bool:
    # Fields only vLLM's response models have (ChatCompletionStreamResponse, CompletionResponse).
    return "kv_transfer_params" in obj or "prompt_text" in obj


def _null(d: dict[str, Any], key: str) -> bool:
    if d.get(key) is not None:
        d[key] = None
        return True
    return False


def _pop(d: dict[str, Any], key: str) -> bool:
    if key in d:
        del d[key]
        return True
    return False


def _strip_body(body: bytes, strip: _Strip) -> bytes:
    """A non-streaming response without the token ids the proxy added (unchanged when nothing to do)."""
    if not strip.token_ids:
        return body
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(obj, dict):
        return body
    _strip_chunk(obj, _Strip(token_ids=True, null_ids=strip.null_ids))
    return orjson.dumps(obj)


def _error_message(body: bytes) -> str:
    try:
        obj = orjson.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        msg = err.get("message") if isinstance(err, dict) else (err if isinstance(err, str) else None)
        if msg is None and isinstance(obj, dict):
            msg = obj.get("message") or obj.get("detail")
        if msg:
            return str(msg)[:500]
    except orjson.JSONDecodeError:
        pass
    return body[:500].decode("utf-8", errors="replace")


def _headers(
    arm: Arm,
    request_id: str,
    category: str | None,
    extra: Mapping[str, str] | None,
    trace_id: str = "",
    span_id: str = "",
) -> CIMultiDict[str]:
    """The request headers of one call: ``extra`` (the client's end-to-end headers, or replay's phase
    headers) with the proxy's own set over them."""
    headers: CIMultiDict[str] = CIMultiDict(extra) if extra else CIMultiDict()
    headers["Content-Type"] = "application/json"
    headers[REQUEST_ID_HEADER] = upstream_request_id(request_id)
    if trace_id and span_id:
        # The arm's own tracing (vLLM --otlp-traces-endpoint) then nests under this call's span.
        headers[TRACEPARENT_HEADER] = traceparent(trace_id, span_id)
    if category:
        headers[CATEGORY_HEADER] = category
    if arm.api_key_env:
        key = os.environ.get(arm.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
    return headers


async def call_arm(
    client: UpstreamClient,
    arm: Arm,
    body: dict[str, Any],
    *,
    endpoint: Endpoint,
    record: SpanRecord,
    relay: Relay | None = None,
    timeout: UpstreamTimeout | None = None,
    headers: Mapping[str, str] | None = None,
    capture_output: bool = False,
    state: UpstreamState | None = None,
    tap: CompletionTap | None = None,
) -> CallResult:
    """Send ``body`` to ``arm`` and fill ``record``; see the module docstring. Never raises for upstream
    trouble; re-raises ``asyncio.CancelledError`` after closing the upstream connection (the record
    stays ``ok`` when the stream's final event had already been relayed). ``tap``: the caller's own
    :class:`CompletionTap` to fill (a new one by default)."""
    state = state or DEFAULT_STATE
    timeout = timeout or UpstreamTimeout()
    url = arm.url + ENDPOINT_PATHS[endpoint]
    hdrs = _headers(arm, record.request_id, record.category, headers, record.trace_id, record.span_id)
    tap = tap if tap is not None else CompletionTap(endpoint)
    result = CallResult(record=record, tap=tap)
    inflight = state.inflight.get(arm.url, 0)
    record.inflight_at_start = inflight
    state.inflight[arm.url] = inflight + 1
    asks = _Asks.for_arm(arm, state)
    record.t_start_ns = time.time_ns()
    result.t_send = time.perf_counter()
    try:
        async with asyncio.timeout(timeout.total):
            await _exchange(client, url, hdrs, body, timeout, relay, asks, result)
    except ClientGone:
        result.client_gone = True
        _cut_short(result, "client disconnected")
    except asyncio.CancelledError:
        _cut_short(result, "cancelled")
        raise
    except TimeoutError as exc:  # connect, read (wire.UpstreamReadTimeout) or the call's total
        record.status, record.error = "timeout", _timeout_error(exc, timeout)
    except MalformedEvent as exc:
        record.status, record.error = "upstream_error", str(exc)
    except (OSError, ValueError) as exc:  # refused, reset, closed early (wire.UpstreamDisconnected), bad HTTP
        record.status = "upstream_error"
        record.error = f"{exc.__class__.__name__}: {exc}"[:500]
    finally:
        state.inflight[arm.url] -= 1
        _settle_record(result, arm, body, state, capture_output)
    return result


@dataclass(slots=True)
class _Asks:
    """What the proxy asks an arm for beyond the client's request, narrowed at each refusal: vLLM's
    extensions, then the standard usage; ``left_out`` holds the refusals to remember once a request
    without them succeeds."""

    arm: Arm
    state: UpstreamState
    extensions: bool
    usage: bool
    left_out: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def for_arm(cls, arm: Arm, state: UpstreamState) -> _Asks:
        """Everything the arm is not known to refuse (a llama.cpp arm: nothing)."""
        engine = state.engine_of(arm)
        extensions = engine != "llamacpp" and (
            arm.vllm_extensions == "on"
            or (arm.vllm_extensions == "auto" and not state.refuses(state.rejects_extensions, arm.url))
        )
        usage = engine != "llamacpp" and not state.refuses(state.rejects_stream_options, arm.url)
        return cls(arm, state, extensions, usage)

    def body(self, body: dict[str, Any]) -> tuple[bytes, _Strip]:
        """The body to send now and what to strip from its response."""
        data, strip = _upstream_body(self.arm, body, with_extensions=self.extensions, with_usage=self.usage)
        strip.null_ids = self.state.engine_of(self.arm) == "vllm"
        return data, strip

    def drop_refused(self, status: int, err_body: bytes, strip: _Strip) -> bool:
        """Whether this error refuses something the proxy added, and the next try leaves it out."""
        rejected = status in (400, 422) and strip.added and any(m in err_body for m in _REJECTION_MARKERS)
        if rejected and self.extensions and self.arm.vllm_extensions == "auto":
            self.extensions = False
            self.left_out.append(self.state.rejects_extensions)
            return True
        if rejected and not self.extensions and strip.usage:
            self.usage = False
            self.left_out.append(self.state.rejects_stream_options)
            return True
        return False

    def accepted(self) -> None:
        """Refused with what the proxy added, accepted without: the arm refuses it."""
        for refusals in self.left_out:
            refusals[self.arm.url] = time.monotonic()


async def _exchange(
    client: UpstreamClient,
    url: str,
    headers: Mapping[str, str],
    body: dict[str, Any],
    timeout: UpstreamTimeout,
    relay: Relay | None,
    asks: _Asks,
    result: CallResult,
) -> None:
    """Post until the arm answers something other than a refusal of what the proxy added, then relay
    and tap that answer; ``result.t_end`` is set once the answer has been read to its end."""
    record = result.record
    while True:
        data, strip = asks.body(body)
        ex = await client.post(url, data, headers, connect_timeout=timeout.connect, read_timeout=timeout.read)
        try:
            result.http_status = record.http_status = ex.status
            if ex.status >= 400:
                err_body = await ex.read()
                if asks.drop_refused(ex.status, err_body, strip):
                    continue
                result.t_end = time.perf_counter()
                await _pass_http_error(ex, err_body, relay, result)
                return
            asks.accepted()
            await _read_answer(ex, relay, strip, result)
            result.t_end = time.perf_counter()
            return
        finally:
            # A body read to its end leaves the connection reusable; anything else closes it, which
            # makes vLLM abort the generation.
            if result.t_end is None:
                ex.abort()
            else:
                ex.release()


async def _pass_http_error(ex: Exchange, err_body: bytes, relay: Relay | None, result: CallResult) -> None:
    """An upstream 4xx/5xx: the record says ``http_error`` and the relay gets the response as it is."""
    result.record.status = "http_error"
    result.record.error = _error_message(err_body)
    if relay is not None:
        await _relay_start(relay, result, ex)
        await _relay_body(relay, err_body)


async def _read_answer(ex: Exchange, relay: Relay | None, strip: _Strip, result: CallResult) -> None:
    """Relay and tap a successful response, a stream or a JSON body, and judge what it held."""
    record, tap = result.record, result.tap
    if ex.content_type == "text/event-stream":
        await _read_stream(ex, tap, relay, strip, result)
        if not tap.done and tap.error is None:
            record.status = "upstream_error"
            record.error = "stream ended before data: [DONE]"
    else:
        payload = await ex.read()
        now = time.perf_counter()
        if tap.feed_body(payload, now) is None:
            # Not a completion: the relay is not started, so the client gets a 502.
            record.status = "upstream_error"
            record.error = tap.malformed or "response is not a JSON object"
        elif relay is not None:
            await _relay_start(relay, result, ex)
            await _relay_body(relay, _strip_body(payload, strip))
    if tap.error is not None:
        record.status = "upstream_error"
        record.error = _error_message(orjson.dumps({"error": tap.error}))


def _cut_short(result: CallResult, error: str) -> None:
    """A call the client ended: complete if the stream's final event had already been relayed (its end
    time is then that of the final event), else ``client_cancelled``."""
    record, tap = result.record, result.tap
    if tap.relayed_done is not None:
        result.t_end = tap.relayed_done
        if tap.error is not None:
            record.status = "upstream_error"
            record.error = _error_message(orjson.dumps({"error": tap.error}))
    else:
        record.status = "client_cancelled"
        record.error = error


def _timeout_error(exc: TimeoutError, timeout: UpstreamTimeout) -> str:
    if str(exc):
        return f"upstream timed out: {exc}"
    if timeout.total is not None:
        return f"upstream timed out (the call's limit of {timeout.total:g} s)"
    return "upstream timed out"


def _settle_record(
    result: CallResult, arm: Arm, body: dict[str, Any], state: UpstreamState, capture_output: bool
) -> None:
    """The span's figures once the call is over, however it ended."""
    record, tap = result.record, result.tap
    if record.error and not capture_output and (record.status == "http_error" or tap.error is not None):
        record.error = redact_request_text(record.error, body)  # the arm's text may quote the prompt
    _finish_record(record, arm, tap, result.t_send, result.t_end, capture_output)
    _record_engine_facts(record, arm, tap, state)
    _record_latency(record, tap)
    # Values from the client and the backend (a seed of 2**64 - 1, an undecodable request id) are made
    # to fit the store's columns here, each change noted in the record, so no row is lost to them.
    fit_to_columns(record)


def _content_type(ex: Exchange) -> str:
    """The response's Content-Type header as the backend sent it (``charset`` and all)."""
    return ex.headers.get("content-type") or ex.content_type


async def _relay_start(relay: Relay, result: CallResult, ex: Exchange) -> None:
    result.relay_started = True
    try:
        await relay.start(ex.status, _content_type(ex), ex.header_items)
    except ConnectionError as exc:  # (aiohttp's ClientConnectionResetError is one)
        raise ClientGone() from exc


def _relay_send(relay: Relay, data: bytes) -> bool:
    try:
        return relay.send(data)
    except ConnectionError as exc:  # (aiohttp's ClientConnectionResetError is one)
        raise ClientGone() from exc


async def _relay_drain(relay: Relay) -> None:
    try:
        await relay.drain()
    except ConnectionError as exc:  # (aiohttp's ClientConnectionResetError is one)
        raise ClientGone() from exc


async def _relay_body(relay: Relay, data: bytes) -> None:
    if _relay_send(relay, data):
        await _relay_drain(relay)


async def _read_stream(
    ex: Exchange, tap: CompletionTap, relay: Relay | None, strip: _Strip, result: CallResult
) -> None:
    """Relay and tap a streamed body. The work per read happens in :class:`_StreamConsumer`, called from
    the connection's read callback; this coroutine only waits for the end, or for a full client."""
    if relay is not None:
        await _relay_start(relay, result, ex)
    consumer = _StreamConsumer(tap, relay, strip)
    ex.consume(consumer)
    while not await ex.wait():
        assert relay is not None  # only a relay asks to pause
        await _relay_drain(relay)
        ex.resume()
    consumer.flush()


class _StreamConsumer:
    """One read of a streamed body: forward it (or its stripped events) to the relay, feed the tap.

    Runs inside the upstream connection's ``data_received``; returns True when the client's buffer is
    full (the connection then stops reading until the client has caught up)."""

    __slots__ = ("parser", "tap", "relay", "strip", "rewrite", "usage_only", "rewriter")

    def __init__(self, tap: CompletionTap, relay: Relay | None, strip: _Strip) -> None:
        self.parser = SSEParser()
        self.tap = tap
        self.relay = relay
        self.strip = strip
        self.rewrite = relay is not None and strip.any
        # Only a usage object can need stripping when the proxy asked for nothing but the final usage: a
        # read of whole events without one is forwarded as received (a JSON string holds `\"usage\"`,
        # never `"usage"`).
        self.usage_only = strip.usage and not strip.token_ids
        self.rewriter = _EventRewriter(tap, strip)

    def __call__(self, raw: bytes) -> bool:
        now = time.perf_counter()
        parser, tap, relay = self.parser, self.tap, self.relay
        rewrite = self.rewrite and not (
            self.usage_only
            and not parser.pending
            and raw.endswith(b"\n\n")
            and b'"usage"' not in raw
            and not self.rewriter.held
            and not self.rewriter.holds_finish(raw)
        )
        pause = False
        if relay is not None and not rewrite:
            # Forward first, parse after: the client's latency does not include our parsing.
            pause = _relay_send(relay, raw)
        events = parser.feed(raw)
        was_done = tap.done
        if rewrite:
            out = self.rewriter.events(events, now)
            if out and relay is not None:
                pause = _relay_send(relay, out)
        else:
            for ev in events:
                if ev.data is not None:
                    tap.feed_data(ev.data, now)
        if tap.malformed is not None:
            # Ends the exchange (the upstream connection closes) and the call: an upstream_error.
            raise MalformedEvent(tap.malformed)
        if tap.done and not was_done:
            # The final event has reached the client (or there is no client): the call is complete.
            tap.relayed_done = now
        return pause

    def flush(self) -> None:
        """The end of the body: an event left without its blank line (a truncated stream)."""
        now = time.perf_counter()
        tap = self.tap
        for ev in self.parser.flush():
            was_done = tap.done
            if ev.data is not None:
                tap.feed_data(ev.data, now)
            if self.rewrite and self.relay is not None:
                _relay_send(self.relay, self.rewriter.release() + ev.raw)
            if tap.done and not was_done:
                tap.relayed_done = now
        held = self.rewriter.release()
        if held and self.relay is not None:
            _relay_send(self.relay, held)
        if tap.malformed is not None:
            raise MalformedEvent(tap.malformed)


# Keys an engine moves from a stream's last chunk onto the usage-only chunk when include_usage is asked
# for (llama-server's `timings`): given back to the finishing chunk when the proxy drops the usage.
_MOVED_TO_USAGE_CHUNK = ("timings",)


class _EventRewriter:
    """The rewritten events of a stream whose extensions the client did not ask for.

    llama-server puts ``timings`` on the last chunk of a chat stream, which is the usage-only chunk
    when ``include_usage`` was asked for (tools/server/server-task.cpp,
    ``to_json_oaicompat_chat_stream``). So when the proxy asked for the usage and drops that chunk, the
    chunk that finished the choice is held until the next event and gets those keys back: the client
    sees the chunk the engine would have sent it."""

    __slots__ = ("tap", "strip", "hold", "held", "held_obj")

    def __init__(self, tap: CompletionTap, strip: _Strip) -> None:
        self.tap = tap
        self.strip = strip
        self.hold = strip.usage and tap.endpoint == "chat"
        self.held = b""
        self.held_obj: dict[str, Any] | None = None

    def holds_finish(self, raw: bytes) -> bool:
        """Does this read hold a finishing chat chunk that must wait for the next event?"""
        return self.hold and (b'"finish_reason":"' in raw or b'"finish_reason": "' in raw)

    def events(self, events: list[SSEEvent], now: float) -> bytes:
        out: list[bytes] = []
        for ev in events:
            obj = self.tap.feed_data(ev.data, now) if ev.data is not None else None
            if obj is None:
                out.append(self.release() + ev.raw)
                continue
            action = _strip_chunk(obj, self.strip, bool(self.tap.usage_from_first_chunk))
            if action == DROP:
                out.append(self._release_with(obj))
                continue
            data = ev.raw if action == KEEP else b"data: " + orjson.dumps(obj) + b"\n\n"
            out.append(self.release())
            if self.hold and any(c.get("finish_reason") for c in obj.get("choices") or ()):
                self.held, self.held_obj = data, obj
            else:
                out.append(data)
        return b"".join(out)

    def release(self) -> bytes:
        """The held chunk as it was (nothing to give back to it)."""
        held, self.held, self.held_obj = self.held, b"", None
        return held

    def _release_with(self, dropped: dict[str, Any]) -> bytes:
        extra = {k: dropped[k] for k in _MOVED_TO_USAGE_CHUNK if k in dropped}
        if not extra or self.held_obj is None:
            return self.release()
        obj = {**self.held_obj, **extra}
        self.held, self.held_obj = b"", None
        return b"data: " + orjson.dumps(obj) + b"\n\n"


def _finish_record(
    record: SpanRecord, arm: Arm, tap: CompletionTap, t_send: float, t_end: float | None, capture: bool
) -> None:
    end = t_end if t_end is not None else time.perf_counter()
    record.t_start = datetime.fromtimestamp((record.t_start_ns or 0) / 1e9, UTC)
    record.e2e_s = end - t_send
    streamed = record.stream
    if streamed and tap.t_first is not None:
        record.ttft_s = tap.t_first - t_send
        record.chunks = tap.chunks
    record.completion_tokens = tap.completion_tokens
    if tap.prompt_tokens is not None:
        record.prompt_tokens = tap.prompt_tokens
    if streamed:
        record.decode_tok_s = decode_tok_s(record.completion_tokens, tap.t_first, tap.t_last)
    record.finish_reason = tap.finish_reason
    text = tap.text()
    if text or tap.t_first is not None:
        record.output_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if capture:
        record.output_text = text


def _record_engine_facts(record: SpanRecord, arm: Arm, tap: CompletionTap, state: UpstreamState) -> None:
    """What the engine told about the call (its name, queueing, speculation) and the completion tokens
    with their source: the parts of a span that depend on which engine answered."""
    if tap.engine_hint is not None and arm.url not in state.engines:
        state.engines[arm.url] = tap.engine_hint
    engine = arm.engine_kind if arm.engine_kind != "auto" else tap.engine_hint or state.engine_of(arm)
    record.engine = engine
    report = engine_report(tap, engine)
    if report is not None:
        record.queue_s = report.queue_s
    tokenizer = load_tokenizer(arm.tokenizer) if arm.tokenizer else None
    count = count_completion_tokens(
        tap,
        arm,
        state.chunk_evidence,
        tokenizer=tokenizer,
        reported=report.completion_tokens if report is not None else None,
        complete=record.status == "ok",
        engine=engine,
    )
    record.completion_tokens, record.tokens_source = count.tokens, count.source
    if record.stream:
        record.decode_tok_s = decode_tok_s(record.completion_tokens, tap.t_first, tap.t_last)
    spec, record.spec_source = speculation_for(tap, arm, report, state.merging)
    if spec is not None:
        record.num_drafts = spec.num_drafts
        record.draft_tokens = spec.draft_tokens
        record.accepted_tokens = spec.accepted_tokens
        record.acceptance_length = spec.acceptance_length


def _record_latency(record: SpanRecord, tap: CompletionTap) -> None:
    """TPOT, inter-token latency and the chunk gaps and sizes of a streamed call (see .latency); after
    :func:`_record_engine_facts`, which settles ``completion_tokens``."""
    if not record.stream:
        return
    if len(tap.chunk_times) >= 2:
        # One chunk (or a whole JSON body to a stream request) shows no time between tokens.
        record.tpot_s = tpot_s(record.e2e_s, record.ttft_s, record.completion_tokens)
    lat = chunk_latency(
        tap.chunk_times, tap.tokens_per_chunk, tokens_exact=tap.count_source in _EXACT_CHUNK_COUNTS
    )
    record.chunk_gaps_us, record.chunk_tokens = lat.gaps_us, lat.tokens
    record.itl_p50_s, record.itl_p95_s, record.itl_p99_s, record.itl_max_s = (
        lat.p50_s,
        lat.p95_s,
        lat.p99_s,
        lat.max_s,
    )


# How the tap counted tokens per chunk when each chunk's count is the engine's own (exact).
_EXACT_CHUNK_COUNTS = ("token_ids", "continuous_usage")
