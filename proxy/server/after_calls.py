"""A finished call's bookkeeping, run once the requests that follow it have gone upstream.

When a client's call is over, the proxy still has work to do for it: the span's figures (tokens,
latency, the prompt's hash), the metrics, the hand-off to the span sink, the identity check, the
capture line. None of it changes what the client receives. Done at once, it lands in the loop passes
where the next requests arrive: clients whose streams ended together (a closed loop's cohort, an
engine step that ends many streams) send again together, and each new request would wait for the
bookkeeping of every call in its cohort before its turn to go upstream.

So :class:`AfterCalls` queues that work and runs it ``delay_s`` later, in slices of at most
``slice_s`` per loop pass, so that requests arriving meanwhile are read and sent between slices.
Whatever reads what the bookkeeping writes (``/metrics``, a level's health, shutdown) calls
:meth:`drain` first, so it sees every call that has ended.

Example::

    after = AfterCalls()
    after.add(functools.partial(st.finish, record))  # in a handler, once the client has its answer
    after.drain()                                    # before reading the metrics
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from aiohttp import web

log = logging.getLogger(__name__)

# How long a finished call's bookkeeping waits: long enough for the clients of a cohort to send their
# next requests and for those to go upstream (a loop pass or two), short enough that /metrics and the
# span store lag the calls by no more than a few milliseconds.
DELAY_S = 0.002
# The most bookkeeping one loop pass runs before it lets the loop read what has arrived.
SLICE_S = 0.0003


class AfterCalls:
    """Callables queued by finished calls, run in order ``delay_s`` later (see the module docstring)."""

    def __init__(self, delay_s: float = DELAY_S, slice_s: float = SLICE_S) -> None:
        self.delay_s, self.slice_s = delay_s, slice_s
        self._queue: deque[Callable[[], None]] = deque()
        self._scheduled: asyncio.Handle | None = None
        self._closed = False

    def add(self, work: Callable[[], None]) -> None:
        """Run ``work`` later (at once after :meth:`close`)."""
        if self._closed:
            _run(work)
            return
        self._queue.append(work)
        if self._scheduled is None:
            self._scheduled = asyncio.get_running_loop().call_later(self.delay_s, self._run_slice)

    def drain(self) -> None:
        """Run everything queued, now."""
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
        queue = self._queue
        while queue:
            _run(queue.popleft())

    def close(self) -> None:
        """Run what is queued; from now on :meth:`add` runs its work at once."""
        self.drain()
        self._closed = True

    async def cleanup_ctx(self, _app: web.Application) -> AsyncIterator[None]:
        """An aiohttp ``cleanup_ctx`` entry: :meth:`close` at shutdown, once the handlers have returned."""
        try:
            yield
        finally:
            self.close()

    def __len__(self) -> int:
        return len(self._queue)

    def _run_slice(self) -> None:
        self._scheduled = None
        queue, end = self._queue, time.perf_counter() + self.slice_s
        while queue:
            _run(queue.popleft())
            if time.perf_counter() >= end:
                break
        if queue and self._scheduled is None:  # (unless an item's work queued more and scheduled it)
            # The rest in the next loop pass, after the reads that came in meanwhile.
            self._scheduled = asyncio.get_running_loop().call_soon(self._run_slice)


def _run(work: Callable[[], None]) -> None:
    try:
        work()
    except Exception:  # one call's bookkeeping failing must not lose the others'
        log.exception("bookkeeping of a finished call failed")
