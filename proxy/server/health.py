"""The proxy's own health while it serves live traffic: could it keep up with what it measured?

Every ``interval_s`` (and once more at shutdown) :class:`ServeHealth` writes rows to table ``health``
with no concurrency level or round (the analysis shows them as level ``live``):

    event_loop_lag_share   the proxy loop's P99 lag over the median decode time of the calls that ended
                           in the interval (the checks of :mod:`specproxy.proxy.health`)
    event_loop_lag_p99_s   the lag itself (shown, never gates)
    proxy_queue_p99_s      per arm: from the proxy having the request (or handing a copy over) to its
                           upstream request being sent

The loop is sampled only while a call is in flight: lag while idle (at startup, between bursts of
traffic) delays no timestamp. An interval without calls writes nothing.

A replay driving the proxy (``replay --target``) names each level-round's start and end
(``POST /specproxy/scrape``); over that window the same checks are kept again, with the level and
round, and each simulator arm's clock lag and write delay (its ``/sim/stats`` read at both ends):
the rows a replay writes for its own arms, so the analysis gates the proxy's levels as it gates a
replay's. Example::

    health = ServeHealth(run_id, sink, busy=lambda: any(upstream.inflight.values()))
    task = asyncio.create_task(health.run())
    health.queued("baseline", result.t_send - handed_over)   # per call
    health.ended(record)                                       # per span
    task.cancel(); await health.flush()                        # at shutdown

    await health.begin_phase("c=16 r1/3", PhaseKey(16, 1, None), await read_sim_clocks(session, arms))
    rows = await health.end_phase("c=16 r1/3", await read_sim_clocks(session, arms))
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple

from specproxy.proxy.health import (
    PROXY_QUEUE,
    THRESHOLDS,
    LoopLagSampler,
    SimClock,
    clock_lag,
    health_rows,
    p99,
    write_delay_p99,
)
from specproxy.proxy.spans.sink import HealthRow, SpanSink
from specproxy.record import SpanRecord

SERVE_HEALTH_INTERVAL_S = 10.0


class PhaseKey(NamedTuple):
    """Which level-round a client's phase is: its concurrency level or offered rate, and its round."""

    level: int | None
    round: int
    offered_rate: float | None


@dataclass
class _PhaseWindow:
    key: PhaseKey
    clocks: Mapping[str, SimClock]
    sampler: LoopLagSampler
    queue_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)


class ServeHealth:
    """Collects the proxy's loop lag, queueing and decode times; writes them as health rows."""

    def __init__(
        self,
        run_id: str,
        sink: SpanSink,
        busy: Callable[[], bool],
        interval_s: float = SERVE_HEALTH_INTERVAL_S,
    ) -> None:
        """``busy()``: whether a call is in flight now (the loop's lag counts only then)."""
        self.run_id = run_id
        self.sink = sink
        self.interval_s = interval_s
        self._queue_s: dict[str, list[float]] = defaultdict(list)
        self._decode_s: list[float] = []
        self._busy = busy
        self._sampler = LoopLagSampler(keep=busy)
        self._phases: dict[str, _PhaseWindow] = {}

    def queued(self, arm: str, seconds: float) -> None:
        """One call's wait inside the proxy before its upstream request was sent."""
        self._queue_s[arm].append(seconds)
        for window in self._phases.values():
            window.queue_s.append(seconds)

    def ended(self, record: SpanRecord) -> None:
        """A call's span: its decode time (first to last token) when it streamed to the end."""
        if record.status == "ok" and record.ttft_s is not None and record.e2e_s is not None:
            self._decode_s.append(record.e2e_s - record.ttft_s)
            for window in self._phases.values():
                window.decode_s.append(record.e2e_s - record.ttft_s)

    async def begin_phase(self, label: str, key: PhaseKey, clocks: Mapping[str, SimClock]) -> None:
        """A client's level-round starts (``clocks``: the simulator arms' clocks now)."""
        await self._close(self._phases.pop(label, None))
        sampler = LoopLagSampler(keep=self._busy)
        await sampler.__aenter__()
        self._phases[label] = _PhaseWindow(key, clocks, sampler)

    async def end_phase(self, label: str, clocks: Mapping[str, SimClock]) -> list[HealthRow]:
        """The level-round ``label`` ended: its health rows, written to the store and returned (none
        for a phase that was never begun)."""
        window = self._phases.pop(label, None)
        if window is None:
            return []
        await self._close(window)
        key = window.key
        rows = health_rows(
            self.run_id,
            key.level,
            key.round,
            clock_lag(window.clocks, clocks),
            (),
            window.sampler.lags_s,
            window.queue_s,
            window.decode_s,
            offered_rate=key.offered_rate,
            write_delay=write_delay_p99(window.clocks, clocks),
        )
        await asyncio.to_thread(self.sink.write_health, rows)
        return rows

    async def close_phases(self) -> None:
        """Stop sampling for phases a client began and never ended (at shutdown)."""
        for label in list(self._phases):
            await self._close(self._phases.pop(label))

    @staticmethod
    async def _close(window: _PhaseWindow | None) -> None:
        if window is not None:
            await window.sampler.__aexit__(None, None, None)

    def take_rows(self) -> list[HealthRow]:
        """The rows for what was collected since the last call (and start collecting anew)."""
        lags, self._sampler.lags_s = self._sampler.lags_s, []
        queues, self._queue_s = self._queue_s, defaultdict(list)
        decode, self._decode_s = self._decode_s, []
        at = datetime.now(UTC)
        rows = health_rows(self.run_id, None, None, {}, (), lags, (), decode, measured_at=at)
        limit = THRESHOLDS[PROXY_QUEUE]
        for arm, values in sorted(queues.items()):
            value = p99(values)
            if value is not None:
                rows.append(HealthRow(self.run_id, arm, None, None, PROXY_QUEUE, value, limit, at))
        return rows

    async def run(self) -> None:
        """Sample the loop and write rows every interval until cancelled."""
        async with self._sampler:
            while True:
                await asyncio.sleep(self.interval_s)
                await self.flush()

    async def flush(self) -> None:
        """Write what was collected so far (off the event loop)."""
        rows = self.take_rows()
        if rows:
            await asyncio.to_thread(self.sink.write_health, rows)
