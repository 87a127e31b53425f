"""Server-sent events in, span facts out: a pure, synchronous SSE parser and a completions tap.

Two small pieces, both fed bytes and free of I/O so that the proxy and replay share them:

- :class:`SSEParser` splits a byte stream into events. It works on bytes, never on text: the event
  separator (a blank line) and the ``data:`` prefix are ASCII, and an ASCII byte never occurs inside a
  multi-byte UTF-8 sequence, so a code point split across two network reads stays whole (decoding is
  left to the JSON parser, which reads UTF-8 bytes directly). ``:`` comment lines are skipped.
- :class:`CompletionTap` turns OpenAI/vLLM chat or completions chunks (or one non-streaming response
  body) into what a span needs: first content chunk time, last token time, chunks, each chunk's
  arrival time and tokens, completion tokens, finish reason, output text and token ids, vLLM's
  per-request speculation stats and the top-1/top-2 logprob margin of each generated token.

The tap never raises on what an upstream sends: an event or body whose shape is not a completion
(``{"choices": "abc"}``, ``[null]``, a count that is not an integer) sets :attr:`CompletionTap.malformed`
to what was wrong, and the caller ends the call as an upstream error.

Tokens per chunk come from the chunk's ``token_ids`` (vLLM ``return_token_ids``), else from the change
in continuous ``usage.completion_tokens`` (vLLM ``stream_options.continuous_usage_stats``: usage on every
chunk from the first), else one per content chunk (a count whose truth is judged elsewhere, see
:mod:`.tokens`). A ``usage`` that first appears on a late chunk next to ``choices`` is a final total
(llama.cpp's ``llama-server`` puts it on the last chunk of a streamed ``/v1/completions``), never a
per-chunk increment. The last usage seen is the response's count.

What an engine reports beside the OpenAI fields (vLLM's ``metrics``, llama.cpp's ``timings``,
SGLang's ``sglext``, TensorRT-LLM's per-choice ``speculative_decoding``) is kept raw in
:attr:`CompletionTap.extras` for :mod:`.engines` to read, with the signals that name the engine.

Example::

    parser, tap = SSEParser(), CompletionTap("chat")
    for raw in network_reads:                      # bytes, split anywhere
        now = time.perf_counter()
        for event in parser.feed(raw):
            if event.data is not None:
                tap.feed_data(event.data, now)
    tap.completion_tokens, tap.tokens_per_chunk, tap.text()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import orjson

Endpoint = Literal["chat", "completions"]

DONE = b"[DONE]"


class MalformedEvent(ValueError):
    """An upstream event or body that is not an OpenAI/vLLM completion (its message says why)."""


# What a field of the wrong type raises while a chunk is read; the tap turns each into `malformed`.
_SHAPE_ERRORS = (MalformedEvent, TypeError, ValueError, AttributeError, KeyError, OverflowError)

# Past this many bytes without the blank line that ends it, an event is not one an engine sends (vLLM's
# largest, a first chunk carrying a 1M-token prompt's ids, is under 8 MiB): the stream is cut.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class EventTooLarge(MalformedEvent):
    """An event grew past :data:`MAX_EVENT_BYTES` without its end."""


@dataclass(slots=True)
class SSEEvent:
    """One event: its raw bytes (including the blank-line terminator) and its joined ``data`` field.

    ``data`` is None for an event without data lines (a comment, a bare ``event:``/``id:``).
    """

    raw: bytes
    data: bytes | None


class SSEParser:
    """Incremental SSE splitter. ``feed(bytes) -> [SSEEvent]``; call :meth:`flush` at end of stream.

    Linear in what it is fed: each read is normalised and scanned once, with ``memchr`` (a search for
    the two-byte separator costs some forty times more on bytes without one), and never rescanned. The
    reads of an event not yet ended are kept as pieces of at least 4 KiB (small reads gathered in one
    buffer first) and joined once, when it ends: no copy per read of what is held, and few objects
    however small the reads. An event longer than ``max_event`` bytes raises :class:`EventTooLarge`.
    """

    __slots__ = ("_parts", "_tail", "_held", "_cr", "max_event")

    def __init__(self, max_event: int = MAX_EVENT_BYTES) -> None:
        self._parts: list[bytes] = []  # the event not yet ended: pieces of at least _PIECE bytes...
        self._tail = bytearray()  # ...then the small reads since
        self._held = 0  # bytes in both
        self._cr = False  # the last read ended with a CR: a LF at the start of the next one is its pair
        self.max_event = max_event

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._cr:
            self._cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if b"\r" in chunk:
            # CRLF or bare CR line endings (allowed by the SSE spec); vLLM sends plain LF. A CR at the
            # very end may be the first half of a CRLF split across reads: the LF is dropped next feed.
            self._cr = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if (
            not self._held
            and chunk.startswith(b"data: ")
            and chunk.endswith(b"\n\n")
            and chunk.find(b"\n") == len(chunk) - 2
        ):
            # The common read: exactly one one-line `data: {...}` event (how vLLM flushes a chunk).
            return [SSEEvent(chunk, chunk[6:-2])]
        events: list[SSEEvent] = []
        start = pos = 0
        if self._held and chunk.startswith(b"\n") and self._ends_with_lf():
            # The separator straddles the two reads.
            self._emit(events, self._take(b"")[:-1])
            start = pos = 1
        while True:
            nl = chunk.find(b"\n", pos)
            if nl < 0 or nl + 1 >= len(chunk):
                break
            if chunk[nl + 1] != 10:  # (10: LF) a line ends, not the event
                pos = nl + 1
                continue
            block = chunk[start:nl]
            self._emit(events, self._take(block) if self._held else block)
            start = pos = nl + 2
        if start < len(chunk):
            self._hold(chunk[start:] if start else chunk)
        if self._held > self.max_event:
            self._parts.clear()
            self._tail.clear()
            self._held = 0
            raise EventTooLarge(f"event over {self.max_event} bytes")
        return events

    def _hold(self, piece: bytes) -> None:
        tail = self._tail
        if len(piece) >= _PIECE:
            if tail:
                self._parts.append(bytes(tail))
                tail.clear()
            self._parts.append(piece)
        else:
            tail += piece
            if len(tail) >= _PIECE:
                self._parts.append(bytes(tail))
                tail.clear()
        self._held += len(piece)

    def _ends_with_lf(self) -> bool:
        return self._tail.endswith(b"\n") if self._tail else self._parts[-1].endswith(b"\n")

    def _take(self, last: bytes) -> bytes:
        """What is held, then ``last``, as one piece; nothing is held after."""
        block = b"".join((*self._parts, self._tail, last))
        self._parts.clear()
        self._tail.clear()
        self._held = 0
        return block

    @staticmethod
    def _emit(events: list[SSEEvent], block: bytes) -> None:
        if block:
            data = block[6:] if block.startswith(b"data: ") and b"\n" not in block else _data_of(block)
            events.append(SSEEvent(block + b"\n\n", data))

    def flush(self) -> list[SSEEvent]:
        """The last event when the stream ended without its blank line (a truncated stream)."""
        block = self._take(b"").strip(b"\n")
        self._cr = False
        return [SSEEvent(block + b"\n\n", _data_of(block))] if block else []

    @property
    def pending(self) -> int:
        """Bytes held back waiting for the end of an event."""
        return self._held


_PIECE = 4096  # (see SSEParser: the smallest piece of a held event kept on its own)


def _data_of(block: bytes) -> bytes | None:
    # Fast path: the one-line `data: {...}` event that vLLM and OpenAI send.
    if block.startswith(b"data: ") and b"\n" not in block:
        return block[6:]
    parts: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


# Keys in a delta / choice whose presence with a non-empty value makes a chunk a "content" chunk.
_CHAT_CONTENT_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")


@dataclass(slots=True)
class SpecStats:
    """Per-request speculation counts, from vLLM's ``metrics.speculative_decoding`` or the stream shape."""

    num_drafts: int | None
    draft_tokens: int | None
    accepted_tokens: int | None
    acceptance_length: float | None


class CompletionTap:
    """Accumulates the facts of one chat/completions response, chunk by chunk (or in one body).

    Times are whatever clock the caller passes (the proxy uses ``time.perf_counter()``).
    Only choice index 0 contributes text, token ids and logprobs (identity compares n=1 requests);
    tokens of every choice are counted.
    """

    __slots__ = (
        "endpoint",
        "t_first",
        "t_last",
        "chunks",
        "tokens_per_chunk",
        "_text",
        "token_ids",
        "_have_token_ids",
        "_usage_tokens",
        "_continuous",
        "final_usage",
        "finish_reason",
        "margins",
        "token_texts",
        "done",
        "error",
        "count_source",
        "prompt_tokens",
        "relayed_done",
        "extras",
        "engine_hint",
        "content_chunks",
        "prompt_token_ids",
        "malformed",
        "usage_from_first_chunk",
        "chunk_times",
    )

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.t_first: float | None = None  # first chunk carrying content (or tokens)
        self.t_last: float | None = None  # last chunk carrying tokens
        self.chunks = 0  # chunks carrying content or tokens
        self.tokens_per_chunk: list[int] = []
        self._text: list[str] = []
        self.token_ids: list[int] = []
        self._have_token_ids = False
        self._usage_tokens = 0  # last cumulative completion_tokens seen in a chunk
        self._continuous = False
        self.final_usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.margins: list[float | None] = []  # top-1 minus top-2 logprob per generated token
        self.token_texts: list[str] = []  # token strings from logprobs, to map a char index to a token
        self.done = False  # saw data: [DONE]
        # When [DONE] had been passed on to the proxy's client (set by the relay, not by the tap).
        self.relayed_done: float | None = None
        self.error: Any = None  # an in-stream {"error": ...} event
        # How tokens were counted: token_ids | continuous_usage | chunks (one per content chunk)
        self.count_source = "chunks"
        self.prompt_tokens: int | None = None
        # Engine-specific objects, raw (see .engines): metrics, timings, sglext, speculative_decoding
        self.extras: dict[str, Any] = {}
        self.engine_hint: str | None = None  # the engine the response's shape names, when it names one
        self.content_chunks = 0  # chunks with content for the client (text, reasoning, tool calls)
        self.prompt_token_ids: list[int] | None = None  # vLLM return_token_ids: the templated prompt
        self.malformed: str | None = None  # the first thing an upstream sent that is not a completion
        # Whether the first chunk with choices carried a usage: per-chunk (continuous) usage, not only
        # a final one (None: no chunk with choices yet).
        self.usage_from_first_chunk: bool | None = None
        # Arrival time of each chunk counted in `chunks` (next to `tokens_per_chunk`): the gaps are the
        # inter-token latency, computed once at the end (.latency), never per chunk.
        self.chunk_times: list[float] = []

    def feed_data(self, data: bytes, now: float) -> dict[str, Any] | None:
        """One event's data; returns the parsed chunk (None for ``[DONE]`` or a malformed event)."""
        if data == DONE:
            self.done = True
            return None
        if not data.strip():
            return None  # an empty `data:` line (a keep-alive some servers send) says nothing
        return self._take_object(data, now, self.feed_chunk, "an event", "an event's data")

    def _take_object(
        self,
        data: bytes,
        now: float,
        take: Callable[[dict[str, Any], float], None],
        what: str,
        what_holds: str,
    ) -> dict[str, Any] | None:
        """``data`` parsed and given to ``take``; None, ``malformed`` saying so, when it is not a JSON
        object (``what``: the event or the body; ``what_holds``: its bytes) or not of the shape ``take``
        reads."""
        try:
            obj = orjson.loads(data)
            if not isinstance(obj, dict):
                raise MalformedEvent(f"{what} is {type(obj).__name__}, not a JSON object")
            take(obj, now)
        except orjson.JSONDecodeError:
            self._malformed(f"{what_holds} is not JSON")
            return None
        except _SHAPE_ERRORS as exc:
            self._malformed(str(exc) or exc.__class__.__name__)
            return None
        return obj

    def _malformed(self, what: str) -> None:
        if self.malformed is None:
            self.malformed = f"malformed response from upstream: {what}"[:300]

    def feed_chunk(self, obj: dict[str, Any], now: float) -> None:
        """One parsed streaming chunk; raises :class:`MalformedEvent` (or a TypeError and the like)
        when its fields have the wrong types (:meth:`feed_data` turns that into ``malformed``)."""
        if "error" in obj and "choices" not in obj:
            self.error = obj["error"]
            return
        usage = _dict_or_none(obj.get("usage"), "usage")
        metrics = obj.get("metrics")
        if metrics:
            self._take_metrics(metrics)
        self._take_extras(obj)
        choices = _list_or_none(obj.get("choices"), "choices")
        if not choices:
            # The usage-only chunk at the end (include_usage): final counts.
            if usage:
                self._take_final_usage(usage)
            return
        n_ids = 0
        has_content = False
        for choice in choices:
            if not isinstance(choice, dict):
                raise MalformedEvent("a choice is not an object")
            first = choice.get("index", 0) == 0
            ids = _token_ids(choice.get("token_ids"))
            if ids:
                n_ids += len(ids)
                self._have_token_ids = True
                if first:
                    self.token_ids.extend(ids)
            if self.endpoint == "chat":
                delta = _dict_or_none(choice.get("delta"), "delta") or {}
                text = _str_or_none(delta.get("content"), "delta.content")
                if text or any(delta.get(k) for k in _CHAT_CONTENT_KEYS):
                    has_content = True
            else:
                text = _str_or_none(choice.get("text"), "text")
                if text:
                    has_content = True
            if first:
                if text:
                    self._text.append(text)
                lp = choice.get("logprobs")
                if lp:
                    self._take_logprobs(lp)
            reason = _str_or_none(choice.get("finish_reason"), "finish_reason")
            if reason:
                self.finish_reason = reason
                self.engine_hint = _choice_extras(choice, self.extras) or self.engine_hint
        has_usage = isinstance(usage, dict) and usage.get("completion_tokens") is not None
        if self.usage_from_first_chunk is None:
            self.usage_from_first_chunk = has_usage
        if usage and has_usage:
            # The last usage seen is the count: cumulative when continuous, the total when final.
            self._take_final_usage(usage)
        if self._have_token_ids:
            n = n_ids
            self.count_source = "token_ids"
        elif usage and has_usage and (self._continuous or self.chunks == 0):
            cum = _count(usage["completion_tokens"], "usage.completion_tokens")
            n = cum - self._usage_tokens
            self._usage_tokens = cum
            self._continuous = True
            self.count_source = "continuous_usage"
        else:
            n = 1 if has_content else 0
        if has_content:
            self.content_chunks += 1
        if n > 0 or has_content:
            if self.t_first is None:
                self.t_first = now
            if n > 0:
                self.t_last = now
            self.chunks += 1
            self.tokens_per_chunk.append(n)
            self.chunk_times.append(now)

    def feed_body(self, body: bytes, now: float) -> dict[str, Any] | None:
        """A whole non-streaming response body (arriving at ``now``); returns it parsed, or None
        (not JSON, or ``malformed``)."""
        return self._take_object(body, now, self._take_body, "the body", "the body")

    def _take_body(self, obj: dict[str, Any], now: float) -> None:
        if obj.get("metrics"):
            self._take_metrics(obj["metrics"])
        self._take_extras(obj)
        for choice in _body_choices(obj):
            if not isinstance(choice, dict):
                raise MalformedEvent("a choice is not an object")
            self.engine_hint = _choice_extras(choice, self.extras) or self.engine_hint
            if choice.get("index", 0) != 0:
                continue
            if self.endpoint == "chat":
                message = _dict_or_none(choice.get("message"), "message") or {}
                text = _str_or_none(message.get("content"), "message.content")
            else:
                text = _str_or_none(choice.get("text"), "text")
            if text:
                self._text.append(text)
            ids = _token_ids(choice.get("token_ids"))
            if ids:
                self.token_ids.extend(ids)
                self._have_token_ids = True
            lp = choice.get("logprobs")
            if lp:
                self._take_logprobs(lp)
            self.finish_reason = (
                _str_or_none(choice.get("finish_reason"), "finish_reason") or self.finish_reason
            )
        usage = _dict_or_none(obj.get("usage"), "usage")
        if usage:
            self._take_final_usage(usage)
        if self._text or self.token_ids or self.final_usage:
            self.t_first = self.t_last = now

    def _take_final_usage(self, usage: dict[str, Any]) -> None:
        if usage.get("completion_tokens") is not None:
            _count(usage["completion_tokens"], "usage.completion_tokens")
        if usage.get("prompt_tokens") is not None:
            self.prompt_tokens = _count(usage["prompt_tokens"], "usage.prompt_tokens")
        self.final_usage = usage

    def _take_metrics(self, metrics: Any) -> None:
        if isinstance(metrics, dict):
            self.extras["metrics"] = metrics
            sd = metrics.get("speculative_decoding")
            if isinstance(sd, dict):
                for key in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"):
                    if sd.get(key) is not None:
                        _count(sd[key], f"speculative_decoding.{key}")
                mal = sd.get("mean_acceptance_length")
                if mal is not None and (isinstance(mal, bool) or not isinstance(mal, int | float)):
                    raise MalformedEvent("speculative_decoding.mean_acceptance_length is not a number")

    def _take_extras(self, obj: dict[str, Any]) -> None:
        """Engine-specific top-level objects, and the first signal of which engine answered."""
        timings = obj.get("timings")
        if isinstance(timings, dict):
            self.extras["timings"] = timings
        sglext = obj.get("sglext")
        if isinstance(sglext, dict):
            self.extras["sglext"] = sglext
        if self.engine_hint is None:
            self.engine_hint = _engine_signal(obj)
        if self.prompt_token_ids is None:
            ids = obj.get("prompt_token_ids")  # chat: on the first chunk
            choices = obj.get("choices")
            if not ids and isinstance(choices, list) and choices and isinstance(choices[0], dict):
                ids = choices[0].get("prompt_token_ids")  # completions: on the first choice
            if isinstance(ids, list) and ids:
                self.prompt_token_ids = ids

    def _take_logprobs(self, lp: Any) -> None:
        for token, margin in _logprob_tokens(lp):
            self.token_texts.append(token)
            self.margins.append(margin)

    @property
    def usage_tokens(self) -> int | None:
        """``completion_tokens`` of the last usage the backend sent (None: it sent none)."""
        if self.final_usage and self.final_usage.get("completion_tokens") is not None:
            return int(self.final_usage["completion_tokens"])
        return None

    @property
    def completion_tokens(self) -> int | None:
        """Final usage when the backend sent it, else the counted tokens (None if nothing arrived).

        The counted figure is exact only with token ids or continuous usage; :mod:`.tokens` decides
        what a span records and says where it came from."""
        used = self.usage_tokens
        if used is not None:
            return used
        counted = sum(self.tokens_per_chunk)
        if counted:
            return counted
        if self.token_ids:
            return len(self.token_ids)
        return None

    @property
    def has_token_ids(self) -> bool:
        return self._have_token_ids

    def text(self) -> str:
        return "".join(self._text)


def _choice_extras(choice: dict[str, Any], extras: dict[str, Any]) -> str | None:
    """Per-choice engine objects, which ride the choice that carries ``finish_reason``, into
    ``extras``; the engine the choice's own fields name, if they name one."""
    sd = choice.get("speculative_decoding")
    if isinstance(sd, dict):
        extras["choice_speculative_decoding"] = sd
    sglext = choice.get("sglext")
    if isinstance(sglext, dict):
        extras["sglext"] = sglext
    if "avg_decoded_tokens_per_iter" in choice:
        return "trtllm"
    if "matched_stop" in choice:
        return "sglang"
    return None


def _logprob_tokens(lp: Any) -> Iterator[tuple[str, float | None]]:
    """Each generated token's text and its top-1 minus top-2 logprob margin, from a choice's logprobs."""
    if not isinstance(lp, dict):
        return
    content = lp.get("content")
    if content is not None:  # chat: [{token, logprob, top_logprobs: [{token, logprob}]}]
        for item in content:
            tops = item.get("top_logprobs") or ()
            token = _str_or_none(item.get("token"), "logprobs token") or ""
            yield token, _margin([t.get("logprob") for t in tops])
        return
    tops_list = lp.get("top_logprobs")  # completions: top_logprobs: [{token: logprob}]
    tokens = lp.get("tokens") or ()
    for i, tops in enumerate(tops_list or ()):
        token = tokens[i] if i < len(tokens) else ""
        yield (
            _str_or_none(token, "logprobs token") or "",
            _margin(tops.values() if isinstance(tops, dict) else ()),
        )


def _engine_signal(obj: dict[str, Any]) -> str | None:
    """The engine a response object's own shape names: a key only that engine sends."""
    if "timings" in obj:
        return "llamacpp"  # llama-server: tools/server/server-task.cpp, result_timings::to_json
    if "sglext" in obj or "meta_info" in obj:
        return "sglang"
    if "kv_transfer_params" in obj or "prompt_logprobs" in obj:
        return "vllm"  # fields of vLLM's ChatCompletionResponse / CompletionStreamResponse models
    model = obj.get("model")
    if isinstance(model, str) and model.lower().endswith(".gguf"):
        return "llamacpp"  # llama-cpp-python's server names the model by its GGUF path
    return None


def _body_choices(obj: dict[str, Any]) -> list[Any]:
    """A whole response's choices: a completion has a list of them (``{}`` is not a completion)."""
    choices = _list_or_none(obj.get("choices"), "choices")
    if choices is None:
        raise MalformedEvent("the body has no choices")
    return choices


def _int_or_none(v: Any) -> int | None:
    return int(v) if v is not None else None


def _dict_or_none(v: Any, what: str) -> dict[str, Any] | None:
    if v is None or isinstance(v, dict):
        return v
    raise MalformedEvent(f"{what} is not an object")


def _list_or_none(v: Any, what: str) -> list[Any] | None:
    if v is None or isinstance(v, list):
        return v
    raise MalformedEvent(f"{what} is not a list")


def _str_or_none(v: Any, what: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise MalformedEvent(f"{what} is not a string")


def _count(v: Any, what: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    raise MalformedEvent(f"{what} is not a count")


def _token_ids(v: Any) -> list[int] | None:
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    raise MalformedEvent("token_ids is not a list of integers")


def _margin(logprobs: Iterable[Any]) -> float | None:
    vals = sorted((float(v) for v in logprobs if v is not None), reverse=True)
    if len(vals) < 2:
        return None
    return vals[0] - vals[1]
