"""Load shapes for replay: a closed loop at fixed concurrency, and open loops on a schedule.

    closed_loop(items, c, send)          exactly c calls in flight until the items (or the time) run out
    open_loop(items, offsets, send)      each call starts at its offset, whatever is still in flight
    poisson_offsets(n, rate, seed)       offsets of a Poisson process at `rate` per second
    timed_offsets(arrivals, speedup)     recorded arrival times, compressed by `speedup`

They know nothing about HTTP: ``send(item)`` is any coroutine function (replay passes one that calls an
arm and records a span) and must not raise for a failed request. An :class:`InflightGauge` counts the
calls in flight and keeps the time spent at each in-flight count, which is how the benchmark shows the
closed loop holds its concurrency. Both loops record how late each call started (``lag_s``): open
loops behind the schedule; the closed loop after its slot was freed, which is when the previous call's
response ended if ``send`` returns that moment (a ``time.perf_counter()`` value), else when it returned.

Example::

    stats = await closed_loop(items, 16, send, stop=stop_event)
    stats.sent, stats.gauge.distribution()
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
# Returns the moment the call's response ended (time.perf_counter), or None.
Send = Callable[[T], Awaitable[float | None]]


class InflightGauge:
    """In-flight count plus the total time spent at each count (a time-weighted distribution)."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._since = time.perf_counter()
        self._time_at: dict[int, float] = {}

    def _account(self) -> None:
        now = time.perf_counter()
        self._time_at[self.current] = self._time_at.get(self.current, 0.0) + now - self._since
        self._since = now

    def enter(self) -> int:
        """Count one more call; returns the count before it (the call's `inflight_at_start`)."""
        self._account()
        before = self.current
        self.current += 1
        self.peak = max(self.peak, self.current)
        return before

    def leave(self) -> None:
        self._account()
        self.current -= 1

    def distribution(self) -> dict[int, float]:
        """Share of the observed time spent at each in-flight count (shares sum to 1)."""
        self._account()
        total = sum(self._time_at.values()) or 1.0
        return {k: v / total for k, v in sorted(self._time_at.items()) if v > 0}


@dataclass(slots=True)
class LoadStats:
    sent: int = 0
    started_at: float = 0.0
    ended_at: float = 0.0
    # How late each call started, in seconds: behind its schedule (open loops), or after its slot was
    # freed (closed loop).
    lag_s: list[float] = field(default_factory=list)
    gauge: InflightGauge = field(default_factory=InflightGauge)
    stopped: bool = False
    # Open loops: the first and last moments (loop time) a call was due, and a call actually left.
    first_due: float | None = None
    last_due: float | None = None
    first_sent: float | None = None
    last_sent: float | None = None

    @property
    def wall_s(self) -> float:
        return self.ended_at - self.started_at

    def achieved_rate(self) -> float | None:
        """Open loops: calls per second as they actually left (None for fewer than two calls)."""
        return _rate(self.sent, self.first_sent, self.last_sent)

    def scheduled_rate(self) -> float | None:
        """Open loops: calls per second the schedule asked for, over the same calls."""
        return _rate(self.sent, self.first_due, self.last_due)


def _rate(n: int, first: float | None, last: float | None) -> float | None:
    if n < 2 or first is None or last is None or last <= first:
        return None
    return (n - 1) / (last - first)


async def closed_loop(
    items: Sequence[T],
    concurrency: int,
    send: Send[T],
    *,
    deadline_s: float | None = None,
    stop: asyncio.Event | None = None,
    gauge: InflightGauge | None = None,
) -> LoadStats:
    """Send ``items`` in order with exactly ``concurrency`` calls in flight.

    Each of ``concurrency`` workers takes the next item as soon as its previous call returns, so the
    in-flight count stays at the target until the list runs out. ``deadline_s`` (seconds from now)
    and ``stop`` end the loop early: no new call starts, calls in flight finish.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be ≥ 1")
    stats = LoadStats(gauge=gauge or InflightGauge())
    loop = asyncio.get_running_loop()
    stats.started_at = loop.time()
    end = None if deadline_s is None else stats.started_at + deadline_s
    queue = iter(items)

    async def worker() -> None:
        freed: float | None = None  # the first call of a slot has no previous one to be late after
        for item in queue:
            if (stop is not None and stop.is_set()) or (end is not None and loop.time() >= end):
                stats.stopped = stop is not None and stop.is_set()
                return
            stats.sent += 1
            if freed is not None:
                stats.lag_s.append(max(0.0, time.perf_counter() - freed))
            stats.gauge.enter()
            try:
                ended = await send(item)
            finally:
                stats.gauge.leave()
            freed = ended if ended is not None else time.perf_counter()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, max(1, len(items))))))
    stats.ended_at = loop.time()
    return stats


async def open_loop(
    items: Sequence[T],
    offsets_s: Sequence[float],
    send: Send[T],
    *,
    deadline_s: float | None = None,
    stop: asyncio.Event | None = None,
    gauge: InflightGauge | None = None,
) -> LoadStats:
    """Start ``send(items[i])`` at ``offsets_s[i]`` seconds from now, then wait for all calls.

    The schedule never waits for responses (an open loop): a slow backend builds a queue, as real
    users would. Each call's start lag behind its schedule goes to ``stats.lag_s``; the rate the
    calls actually left at is ``stats.achieved_rate()``, the schedule's ``stats.scheduled_rate()``.
    """
    if len(items) != len(offsets_s):
        raise ValueError("items and offsets_s must have the same length")
    stats = LoadStats(gauge=gauge or InflightGauge())
    loop = asyncio.get_running_loop()
    t0 = stats.started_at = loop.time()
    tasks: set[asyncio.Task[None]] = set()

    async def one(item: T, due: float) -> None:
        now = loop.time()
        stats.lag_s.append(now - due)
        stats.first_sent = now if stats.first_sent is None else min(stats.first_sent, now)
        stats.last_sent = now if stats.last_sent is None else max(stats.last_sent, now)
        stats.gauge.enter()
        try:
            await send(item)
        finally:
            stats.gauge.leave()

    try:
        for item, offset in zip(items, offsets_s, strict=True):
            if deadline_s is not None and offset >= deadline_s:
                break
            due = t0 + offset
            delay = due - loop.time()
            if delay > 0:
                if stop is not None:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                    except TimeoutError:
                        pass
                else:
                    await asyncio.sleep(delay)
            if stop is not None and stop.is_set():
                stats.stopped = True
                break
            stats.sent += 1
            stats.first_due = due if stats.first_due is None else stats.first_due
            stats.last_due = due
            task = asyncio.create_task(one(item, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        # Cancelled from outside (Ctrl-C): cancel what is in flight and wait for it, never leave it.
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    stats.ended_at = loop.time()
    return stats


def poisson_offsets(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Start offsets of ``n`` arrivals of a Poisson process (exponential gaps), the first at 0."""
    if not math.isfinite(rate_per_s) or rate_per_s <= 0:
        raise ValueError(f"rate must be a finite number > 0, got {rate_per_s}")
    rng = random.Random(seed)
    gaps = (0.0, *(rng.expovariate(rate_per_s) for _ in range(max(0, n - 1))))
    return list(itertools.accumulate(gaps))[:n]


def timed_offsets(arrivals_s: Sequence[float], speedup: float = 1.0) -> list[float]:
    """Recorded arrival times (seconds, any origin) as offsets from the first, divided by ``speedup``."""
    if not math.isfinite(speedup) or speedup <= 0:
        raise ValueError(f"speedup must be a finite number > 0, got {speedup}")
    if not arrivals_s:
        return []
    if not all(math.isfinite(t) for t in arrivals_s):
        raise ValueError("arrival times must be finite numbers")
    t0 = min(arrivals_s)
    return [(t - t0) / speedup for t in arrivals_s]
