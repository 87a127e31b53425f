"""Cutting the calls still serving clients when the shutdown grace runs out.

At shutdown aiohttp waits ``shutdown_grace_s`` for the handlers, then cancels them: a stream so cut
ends without a word to its client, and its span reads like a client that left. :class:`ShutdownCutter`
gets there first: :data:`CUT_MARGIN_S` before the grace ends it cancels each primary call still
running, and the call's handler, told that the proxy cut it, ends the stream with an error event
(``the proxy is shutting down``; a 503 where nothing was sent yet) and records the span as
``proxy_shutdown``. The handlers are then done before aiohttp's wait ends, so the process exits
within the grace period plus what the span store and the last scrape take.

Example::

    cutter = ShutdownCutter()
    result = await cutter.run(call_arm(...), record)   # in the handler
    cutter.start(grace_s)                              # when the shutdown begins
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from specproxy.record import SpanRecord

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long before the end of the grace period the calls are cut: time for each handler to write its
# error event and end its response before aiohttp's own wait runs out.
CUT_MARGIN_S = 0.5
SHUTDOWN_ERROR = "cut by the proxy's shutdown: the call was still running when shutdown_grace_s ran out"
CLIENT_MESSAGE = "the proxy is shutting down; this call was cut before its end (retry it)"


class ProxyCut(Exception):
    """Raised by :meth:`ShutdownCutter.run` in place of the cancellation the cutter caused."""


class ShutdownCutter:
    """The primary calls in flight, and cutting them at the end of the shutdown grace."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None

    async def run(self, call: Coroutine[Any, Any, T], record: SpanRecord) -> T:
        """Await ``call``; when the cutter cancels it, mark ``record`` (unless the call had already
        completed for its client) and raise :class:`ProxyCut` instead of the cancellation."""
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            return await call
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            task.uncancel()
            if record.status == "client_cancelled":  # (as call_arm records any cancellation)
                record.status, record.error = "proxy_shutdown", SHUTDOWN_ERROR
            raise ProxyCut() from None
        finally:
            self._running.discard(task)
            self._cut.discard(task)

    def start(self, grace_s: float) -> None:
        """The shutdown has begun: cut what still runs ``grace_s - CUT_MARGIN_S`` from now."""
        if self._timer is None:
            delay = max(0.0, grace_s - CUT_MARGIN_S)
            self._timer = asyncio.get_running_loop().call_later(delay, self.cut)

    def cut(self) -> None:
        if self._running:
            log.warning("shutdown grace over: cutting %d calls still serving clients", len(self._running))
        for task in self._running:
            self._cut.add(task)
            task.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
