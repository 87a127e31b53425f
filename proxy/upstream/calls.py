"""One call to one arm: send a chat/completions request, optionally relay the response, fill its span.

The proxy and ``specproxy replay`` both call arms through :func:`call_arm`, so a replayed call and a
live one are measured the same way. Its parts: :mod:`.extras` (what is asked of an arm beyond the
client's request, and stripped again), :mod:`.relay` (the client side, and the per-read work of a
stream), :mod:`.figures` (the span's figures once the call is over), :mod:`.wire` (the HTTP client).

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
  4xx/5xx, passed through to the relay as it is), ``upstream_error`` (refused, reset, bad stream, or
  a stream the engine cut: ``data: [DONE]`` before any ``finish_reason`` in a call with no relay, a
  shadow copy or a replayed call, :data:`ENGINE_CUT_ERROR`),
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
import functools
import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from specproxy.config import Arm
from specproxy.proxy.spans.trace import TRACEPARENT_HEADER, new_span_id, new_trace_id, traceparent
from specproxy.proxy.upstream.acceptance import MergeCalibration
from specproxy.proxy.upstream.extras import REJECTION_MARKERS, Strip, strip_body, upstream_body
from specproxy.proxy.upstream.figures import finish_record, learn_engine, record_engine_facts, record_latency
from specproxy.proxy.upstream.redact import redact_request_text
from specproxy.proxy.upstream.relay import ClientGone, Relay, StreamConsumer, relay_drain, relay_send
from specproxy.proxy.upstream.scrape import EngineLoad
from specproxy.proxy.upstream.sse import CompletionTap, Endpoint, MalformedEvent
from specproxy.proxy.upstream.tokens import ChunkEvidence
from specproxy.proxy.upstream.wire import Exchange, UpstreamClient
from specproxy.record import RoutedAs, Source, SpanRecord, fit_to_columns

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
# The error of a stream that ended with data: [DONE] before any choice had a finish_reason.
ENGINE_CUT_ERROR = "stream cut by the engine: data: [DONE] before any finish_reason"

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
class CallResult:
    """The outcome of one upstream call. ``record`` is filled in; ``tap`` holds the output facts."""

    record: SpanRecord
    tap: CompletionTap
    http_status: int | None = None
    relay_started: bool = False  # the relay got start(): the client response is under way
    client_gone: bool = False
    t_send: float = 0.0  # perf_counter at send
    t_end: float | None = None  # perf_counter at the response's end (None: not read to its end)
    t_over: float | None = None  # perf_counter when the call was over, however it ended

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
    engine_load: EngineLoad | None = None,
    offered_rate: float | None = None,
) -> SpanRecord:
    """A span record with identity and request fields filled from the arm and the client's body.

    ``engine_load``: the arm's running and waiting gauges from its latest /metrics scrape, if known."""
    record = call_record(
        run_id,
        request_id,
        arm,
        endpoint=endpoint,
        routed_as=routed_as,
        source=source,
        category=category,
        trace_id=trace_id,
        concurrency_level=concurrency_level,
        engine_load=engine_load,
        offered_rate=offered_rate,
    )
    describe_request(record, body)
    return record


def call_record(
    run_id: str,
    request_id: str,
    arm: Arm,
    *,
    endpoint: Endpoint,
    routed_as: RoutedAs,
    source: Source = "live",
    category: str | None = None,
    trace_id: str | None = None,
    concurrency_level: int | None = None,
    engine_load: EngineLoad | None = None,
    offered_rate: float | None = None,
) -> SpanRecord:
    """:func:`new_record` without the fields read from the body (:func:`describe_request` adds them):
    what a call needs before its request goes out."""
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
        engine_running=engine_load[0] if engine_load is not None else None,
        engine_waiting=engine_load[1] if engine_load is not None else None,
        engine_load_age_s=_age_s(engine_load),
    )


def _age_s(load: EngineLoad | None) -> float | None:
    """How long ago the gauges were read: the analysis compares them with the proxy's own count of the
    calls in flight at that moment, not at the call's start."""
    if load is None or load.read_at is None:
        return None
    return max(0.0, time.monotonic() - load.read_at)


def describe_request(record: SpanRecord, body: dict[str, Any]) -> None:
    """The span's request fields, read from the client's body: model, sampling, the prompt's hash."""
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    temperature = body.get("temperature")
    seed = body.get("seed")
    model = body.get("model")
    record.model = model if isinstance(model, str) else None
    record.stream = bool(body.get("stream"))
    record.temperature = float(temperature) if isinstance(temperature, int | float) else None
    record.max_tokens = int(max_tokens) if isinstance(max_tokens, int) else None
    record.seed = int(seed) if isinstance(seed, int) else None
    record.prompt_sha256 = prompt_sha256(body, record.endpoint)


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
    describe: bool = False,
    later: Callable[[Callable[[], None]], None] | None = None,
) -> CallResult:
    """Send ``body`` to ``arm`` and fill ``record``; see the module docstring. Never raises for upstream
    trouble; re-raises ``asyncio.CancelledError`` after closing the upstream connection (the record
    stays ``ok`` when the stream's final event had already been relayed). ``tap``: the caller's own
    :class:`CompletionTap` to fill (a new one by default). ``describe``: ``record`` came from
    :func:`call_record`; its request fields are filled from ``body`` when the call is over, so that
    reading and hashing the body does not delay the request (the proxy's calls that serve clients).
    ``later``: where the span's figures are computed once the call is over: None, at once; else they
    are handed to ``later`` to run when the client has its answer (the proxy's :class:`AfterCalls`)."""
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
        if timeout.total is None:  # (the calls that serve clients: no cap, no timer to arm)
            await _exchange(client, url, hdrs, body, timeout, relay, asks, result)
        else:
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
        result.t_over = time.perf_counter()
        learn_engine(arm, tap, state)  # (at once: the arm's next call asks by what it answered as)
        if record.error and not capture_output and (record.status == "http_error" or tap.error is not None):
            record.error = redact_request_text(record.error, body)  # the arm's text may quote the prompt
        settle = functools.partial(settle_call, result, arm, body, state, capture_output, describe=describe)
        if later is None:
            settle()
        else:
            later(settle)
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

    def body(self, body: dict[str, Any]) -> tuple[bytes, Strip]:
        """The body to send now and what to strip from its response."""
        data, strip = upstream_body(self.arm, body, with_extensions=self.extensions, with_usage=self.usage)
        strip.null_ids = self.state.engine_of(self.arm) == "vllm"
        return data, strip

    def drop_refused(self, status: int, err_body: bytes, strip: Strip) -> bool:
        """Whether this error refuses something the proxy added, and the next try leaves it out."""
        rejected = status in (400, 422) and strip.added and any(m in err_body for m in REJECTION_MARKERS)
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


async def _read_answer(ex: Exchange, relay: Relay | None, strip: Strip, result: CallResult) -> None:
    """Relay and tap a successful response, a stream or a JSON body, and judge what it held."""
    record, tap = result.record, result.tap
    if ex.content_type == "text/event-stream":
        await _read_stream(ex, tap, relay, strip, result)
        if not tap.done and tap.error is None:
            record.status = "upstream_error"
            record.error = "stream ended before data: [DONE]"
        elif relay is None and tap.done and tap.finish_reason is None and tap.error is None:
            # The engine stopped generating mid-call (llama-cpp-python's single-slot server does so
            # when another request arrives): a partial output, neither a mismatch nor a fast call.
            # Only for calls nobody is relayed to (shadow copies, replay): a relayed stream's status
            # also decides what its client is sent, and the client gets the stream as it came.
            record.status = "upstream_error"
            record.error = ENGINE_CUT_ERROR
    else:
        payload = await ex.read()
        now = time.perf_counter()
        if tap.feed_body(payload, now) is None:
            # Not a completion: the relay is not started, so the client gets a 502.
            record.status = "upstream_error"
            record.error = tap.malformed or "response is not a JSON object"
        elif relay is not None:
            await _relay_start(relay, result, ex)
            await _relay_body(relay, strip_body(payload, strip))
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


def settle_call(
    result: CallResult,
    arm: Arm,
    body: dict[str, Any],
    state: UpstreamState,
    capture_output: bool,
    *,
    describe: bool = False,
) -> None:
    """The span's figures once the call is over, however it ended (``describe``: and its request
    fields, read from ``body``); what :func:`call_arm` runs, or hands to its ``later``."""
    record, tap = result.record, result.tap
    if describe:
        describe_request(record, body)
    end = result.t_end if result.t_end is not None else result.t_over
    finish_record(record, arm, tap, result.t_send, end, capture_output)
    record_engine_facts(record, arm, tap, state)
    record_latency(record, tap)
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


async def _relay_body(relay: Relay, data: bytes) -> None:
    if relay_send(relay, data):
        await relay_drain(relay)


async def _read_stream(
    ex: Exchange, tap: CompletionTap, relay: Relay | None, strip: Strip, result: CallResult
) -> None:
    """Relay and tap a streamed body. The work per read happens in :class:`StreamConsumer`, called from
    the connection's read callback; this coroutine only waits for the end, or for a full client."""
    if relay is not None:
        await _relay_start(relay, result, ex)
    consumer = StreamConsumer(tap, relay, strip)
    ex.consume(consumer)
    while not await ex.wait():
        assert relay is not None  # only a relay asks to pause
        await relay_drain(relay)
        ex.resume()
    consumer.flush()
