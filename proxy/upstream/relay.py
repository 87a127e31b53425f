"""Relaying an upstream response to the client: the :class:`Relay` a caller hands to ``call_arm``,
and the per-read work of a streamed answer.

:class:`StreamConsumer` runs inside the upstream connection's read callback (:mod:`.wire`): it
forwards each read to the relay as received (or its events rewritten by :class:`EventRewriter` where
the client did not ask for what the proxy added) and feeds the :class:`CompletionTap`, with no task
switch per chunk; it returns True when the client's buffer is full.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from specproxy.proxy.upstream.extras import DROP, KEEP, Strip, strip_chunk
from specproxy.proxy.upstream.sse import CompletionTap, MalformedEvent, SSEEvent, SSEParser


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


def relay_send(relay: Relay, data: bytes) -> bool:
    try:
        return relay.send(data)
    except ConnectionError as exc:  # (aiohttp's ClientConnectionResetError is one)
        raise ClientGone() from exc


async def relay_drain(relay: Relay) -> None:
    try:
        await relay.drain()
    except ConnectionError as exc:  # (aiohttp's ClientConnectionResetError is one)
        raise ClientGone() from exc


class StreamConsumer:
    """One read of a streamed body: forward it (or its stripped events) to the relay, feed the tap.

    Runs inside the upstream connection's ``data_received``; returns True when the client's buffer is
    full (the connection then stops reading until the client has caught up)."""

    __slots__ = ("parser", "tap", "relay", "strip", "rewrite", "usage_only", "rewriter")

    def __init__(self, tap: CompletionTap, relay: Relay | None, strip: Strip) -> None:
        self.parser = SSEParser()
        self.tap = tap
        self.relay = relay
        self.strip = strip
        self.rewrite = relay is not None and strip.any
        # Only a usage object can need stripping when the proxy asked for nothing but the final usage: a
        # read of whole events without one is forwarded as received (a JSON string holds `\"usage\"`,
        # never `"usage"`).
        self.usage_only = strip.usage and not strip.token_ids
        self.rewriter = EventRewriter(tap, strip)

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
            pause = relay_send(relay, raw)
        events = parser.feed(raw)
        was_done = tap.done
        if rewrite:
            out = self.rewriter.events(events, now)
            if out and relay is not None:
                pause = relay_send(relay, out)
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
                relay_send(self.relay, self.rewriter.release() + ev.raw)
            if tap.done and not was_done:
                tap.relayed_done = now
        held = self.rewriter.release()
        if held and self.relay is not None:
            relay_send(self.relay, held)
        if tap.malformed is not None:
            raise MalformedEvent(tap.malformed)


# Keys an engine moves from a stream's last chunk onto the usage-only chunk when include_usage is asked
# for (llama-server's `timings`): given back to the finishing chunk when the proxy drops the usage.
_MOVED_TO_USAGE_CHUNK = ("timings",)


class EventRewriter:
    """The rewritten events of a stream whose extensions the client did not ask for.

    llama-server puts ``timings`` on the last chunk of a chat stream, which is the usage-only chunk
    when ``include_usage`` was asked for (tools/server/server-task.cpp,
    ``to_json_oaicompat_chat_stream``). So when the proxy asked for the usage and drops that chunk, the
    chunk that finished the choice is held until the next event and gets those keys back: the client
    sees the chunk the engine would have sent it."""

    __slots__ = ("tap", "strip", "hold", "held", "held_obj")

    def __init__(self, tap: CompletionTap, strip: Strip) -> None:
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
            action = strip_chunk(obj, self.strip, bool(self.tap.usage_from_first_chunk))
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
