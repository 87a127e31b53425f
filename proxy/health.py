"""The measurement's own health, per level and round: did this machine keep up while it measured?

One row of table ``health`` per check, level and round (``arm`` set only for the first):

    engine_clock_lag         share of a simulator's busy time that it ran behind its own clock over the
                             level-round (``/sim/stats`` read before and after); arms that are not
                             simulators have no clock to read and get no row
    loadgen_start_lag_p99_s  how late calls started: behind their schedule (open loops), or after the
                             slot they take was freed by the previous response's last byte (closed loop)
    event_loop_lag_share     how far the client's event loop lag moves a call's measured decode time:
                             its mean lag as a share of the round's median decode time (first to last
                             token)
    event_loop_lag_p99_s     the P99 lag in seconds (shown, never gates: it bounds tail figures such
                             as a P95 time to first token)
    proxy_queue_p99_s        from the load generator handing a call over to its upstream request being sent
    engine_write_delay_p99_s per simulator: the P99 time from a step landing to its chunks going to the
                             socket over the level-round (``/sim/stats``'s histogram read before and
                             after; shown, never gates: with the loop lag P99 it is the noise a single
                             inter-token gap can carry, which the analysis holds the ITL tails to)

An open-loop (rate) level adds two rows, ``offered_rate`` set on every row of the level:

    open_loop_achieved_rate   the calls per second that actually left (over all arms' schedules, the
                              slowest); shown, never gates: Poisson arrivals over a few calls differ
                              from the nominal rate by chance
    open_loop_rate_shortfall  1 − achieved / scheduled rate over the same calls: how far the sends fell
                              behind the schedule as a whole (a generator that keeps up has ~0)

The loop lag is held to the figures it distorts rather than to a fixed number of milliseconds: a
chunk's arrival is stamped when the loop gets to it, so a call's first and last token times are each
late by the lag at that moment, and its decode time (their difference) is typically off by about the
mean lag: 20 ms is 2 % of a one-second decode and 0.2 % of a ten-second one. The verdicts use medians
and totals, which a rare long stall moves little, hence the mean rather than the P99. The arms of a
paired run share the loop, so its lag adds noise to every arm alike rather than bias to one.

``threshold`` is the limit applied (:data:`THRESHOLDS`; None: shown, never gates); above it the level's
figures are stretched by the machine rather than by the arms, and the analysis does not trust them.

Example::

    before = await read_sim_clocks(session, arms)
    async with LoopLagSampler() as loop_lag:
        ...  # the level-round
    after = await read_sim_clocks(session, arms)
    rows = health_rows(run_id, 16, 1, clock_lag(before, after), start_lags, loop_lag.lags_s, queue_s,
                       decode_s, write_delay=write_delay_p99(before, after))
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import NamedTuple

import aiohttp

from specproxy.config import Arm
from specproxy.proxy.spans.sink import HealthRow
from specproxy.schema import MIN_HEALTHY_ROUNDS as MIN_HEALTHY_ROUNDS

ENGINE_CLOCK_LAG = "engine_clock_lag"
LOADGEN_START_LAG = "loadgen_start_lag_p99_s"
EVENT_LOOP_LAG = "event_loop_lag_p99_s"
EVENT_LOOP_LAG_SHARE = "event_loop_lag_share"
PROXY_QUEUE = "proxy_queue_p99_s"
ENGINE_WRITE_DELAY = "engine_write_delay_p99_s"
ACHIEVED_RATE = "open_loop_achieved_rate"
RATE_SHORTFALL = "open_loop_rate_shortfall"

# Engine clock lag is a fraction of busy time: 2 % stretches every time and rate by up to 2 %, the size of
# the smallest effect worth reporting; it can differ between arms, so it biases their ratio. The client's
# loop lag is held to the same 2 % of a call's decode time. Start lag and queueing are in seconds: 50 ms
# late is several decode steps of a fast engine.
THRESHOLDS: Mapping[str, float | None] = {
    ENGINE_CLOCK_LAG: 0.02,
    LOADGEN_START_LAG: 0.05,
    EVENT_LOOP_LAG_SHARE: 0.02,
    EVENT_LOOP_LAG: None,
    PROXY_QUEUE: 0.05,
    ENGINE_WRITE_DELAY: None,
    # An open loop that sent 5 % slower than its schedule measured a lower load than it reports.
    RATE_SHORTFALL: 0.05,
}


class SimClock(NamedTuple):
    """A simulator's cumulative clock figures (``/sim/stats``): seconds behind, seconds of ideal busy time,
    and its write delay histogram (empty from a simulator that has none)."""

    lag_s: float
    ideal_busy_wall_s: float
    write_delay_bounds_s: tuple[float, ...] = ()
    write_delay_counts: tuple[int, ...] = ()


async def read_sim_clocks(
    session: aiohttp.ClientSession, arms: Sequence[Arm], timeout_s: float = 5.0
) -> dict[str, SimClock]:
    """arm → its clock, for the arms that answer ``GET /sim/stats`` (simulators); others are left out."""

    async def one(arm: Arm) -> tuple[str, SimClock | None]:
        try:
            async with session.get(
                f"{arm.url}/sim/stats", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    return arm.name, None
                stats = await resp.json()
            return arm.name, SimClock(
                float(stats["lag_s"]),
                float(stats["ideal_busy_wall_s"]),
                tuple(float(b) for b in stats.get("write_delay_bounds_s", ())),
                tuple(int(n) for n in stats.get("write_delay_counts", ())),
            )
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return arm.name, None

    found = await asyncio.gather(*(one(arm) for arm in arms))
    return {name: clock for name, clock in found if clock is not None}


def clock_lag(before: Mapping[str, SimClock], after: Mapping[str, SimClock]) -> dict[str, float]:
    """arm → share of its busy time between two readings that it ran behind its clock (0 when idle)."""
    out: dict[str, float] = {}
    for arm, end in after.items():
        start = before.get(arm)
        if start is None or end.ideal_busy_wall_s < start.ideal_busy_wall_s:
            continue  # not read before, or the simulator restarted in between
        busy = end.ideal_busy_wall_s - start.ideal_busy_wall_s
        out[arm] = (end.lag_s - start.lag_s) / busy if busy > 0 else 0.0
    return out


def histogram_quantile(bounds_s: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The upper bound of the bucket that holds the ``q`` quantile of ``counts`` (one count per bound,
    then one above them all; that last bucket reports the last bound). None when empty.

    >>> histogram_quantile((0.001, 0.002, 0.004), (90, 9, 1, 0), 0.99)
    0.002
    """
    total = sum(counts)
    if total <= 0 or not bounds_s:
        return None
    seen = 0
    for bound, n in zip(bounds_s, counts, strict=False):
        seen += n
        if seen >= q * total:
            return bound
    return bounds_s[-1]


def write_delay_p99(before: Mapping[str, SimClock], after: Mapping[str, SimClock]) -> dict[str, float]:
    """arm → the P99 of its simulator's write delays between two readings (arms that wrote no chunk
    in between, or have no histogram, are left out)."""
    out: dict[str, float] = {}
    for arm, end in after.items():
        start = before.get(arm)
        if start is None or start.write_delay_bounds_s != end.write_delay_bounds_s:
            continue
        counts = [b - a for a, b in zip(start.write_delay_counts, end.write_delay_counts, strict=True)]
        if any(n < 0 for n in counts):
            continue  # the simulator restarted in between
        value = histogram_quantile(end.write_delay_bounds_s, counts, 0.99)
        if value is not None:
            out[arm] = value
    return out


def p99(values: Iterable[float]) -> float | None:
    """The 99th percentile (nearest rank); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class LoopLagSampler:
    """While open, a task sleeps ``interval_s`` again and again and keeps how late each wake-up was
    (only when ``keep()`` says so at the wake-up, if given). A wake-up already overdue when the
    sampler closes counts as late by then: a loop too busy to run it before the measured work ended
    would otherwise leave no reading at all."""

    interval_s = 0.01

    def __init__(self, keep: Callable[[], bool] | None = None) -> None:
        self.lags_s: list[float] = []
        self._keep = keep
        self._task: asyncio.Task[None] | None = None
        self._due: float | None = None  # the pending wake-up's time

    async def __aenter__(self) -> LoopLagSampler:
        self._task = asyncio.create_task(self._sample(), name="specproxy-loop-lag")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        now = time.perf_counter()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._due is not None and now > self._due and (self._keep is None or self._keep()):
            self.lags_s.append(now - self._due)
        self._due = None

    async def _sample(self) -> None:
        while True:
            self._due = due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._due = None
            if self._keep is None or self._keep():
                self.lags_s.append(max(0.0, time.perf_counter() - due))


def median(values: Iterable[float]) -> float | None:
    """The median (upper of the middle two); None for no values."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def loop_lag_share(loop_lags_s: Sequence[float], decode_s: Sequence[float]) -> float | None:
    """The loop's mean lag as a share of the median decode time; None without both."""
    decode = median(d for d in decode_s if d > 0)
    if not loop_lags_s or not decode:
        return None
    return sum(loop_lags_s) / len(loop_lags_s) / decode


def health_rows(
    run_id: str,
    level: int | None,
    round_: int | None,
    engine_lag: Mapping[str, float],
    start_lags_s: Sequence[float],
    loop_lags_s: Sequence[float],
    queue_s: Sequence[float],
    decode_s: Sequence[float] = (),
    measured_at: datetime | None = None,
    notes: Mapping[str, float] | None = None,
    *,
    offered_rate: float | None = None,
    rates: Sequence[tuple[float | None, float | None]] = (),
    write_delay: Mapping[str, float] | None = None,
) -> list[HealthRow]:
    """The ``health`` rows of one level-round: one per simulator, then the client-side checks (left
    out when nothing was measured, e.g. no call was sent), then ``notes``: figures shown with the
    level that never gate (e.g. the time scale the lab ran it at). ``decode_s``: the round's calls'
    times from first to last token. An open-loop level (``offered_rate``) adds its achieved rate and
    shortfall from ``rates``: (achieved, scheduled) per schedule driven. ``write_delay``: arm → its
    simulator's write delay P99 (:func:`write_delay_p99`)."""
    at = measured_at or datetime.now(UTC)

    def row(arm: str | None, check: str, value: float | None) -> HealthRow:
        return HealthRow(run_id, arm, level, round_, check, value, THRESHOLDS.get(check), at, offered_rate)

    rows = [row(arm, ENGINE_CLOCK_LAG, lag) for arm, lag in sorted(engine_lag.items())]
    rows += [row(arm, ENGINE_WRITE_DELAY, delay) for arm, delay in sorted((write_delay or {}).items())]
    for check, value in (
        (LOADGEN_START_LAG, p99(start_lags_s)),
        (EVENT_LOOP_LAG_SHARE, loop_lag_share(loop_lags_s, decode_s)),
        (EVENT_LOOP_LAG, p99(loop_lags_s)),
        (PROXY_QUEUE, p99(queue_s)),
    ):
        if value is not None:
            rows.append(row(None, check, value))
    measured = [(a, s) for a, s in rates if a is not None and s is not None]
    if offered_rate is not None and measured:
        achieved, scheduled = min(measured, key=lambda m: m[0] / m[1])
        rows.append(row(None, ACHIEVED_RATE, achieved))
        rows.append(row(None, RATE_SHORTFALL, max(0.0, 1.0 - achieved / scheduled)))
    rows += [row(None, check, value) for check, value in sorted((notes or {}).items())]
    return rows


def over_threshold(rows: Iterable[HealthRow]) -> list[HealthRow]:
    """The rows whose value is above their threshold."""
    return [r for r in rows if r.value is not None and r.threshold is not None and r.value > r.threshold]
