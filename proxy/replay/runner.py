"""The replay runner: drive replay items against the arms and record one span per upstream call.

Replay calls every arm through :func:`~specproxy.proxy.upstream.calls.call_arm`, the function the proxy
uses, so a replayed call's span is measured exactly like a live one; it then adds what only replay
knows (``source = replay``, ``routed_as``, ``concurrency_level`` or ``offered_rate``, ``category``)
and, in paired mode, greedy identity against the baseline's output of the same ``request_id``.

    paired   every item goes to every arm at the same time, each arm with its own concurrency
             slots; spans share request_id across arms (routed_as = "replay")
    split    each item goes to one arm, chosen by weight with a seeded draw (routed_as = "split")

Load (:class:`LoadPlan`): a closed-loop sweep over concurrency levels, an open-loop sweep over
Poisson rates, or the recorded timestamps with a speed-up. Each level (or the timed loop) is measured
in ``rounds`` rounds, each a labelled phase (``c=16 r2/3``, ``r=4 r2/3``): a /metrics scrape and a
reading of the simulators' clocks, the measured calls, the same again. A level starts with a short
unrecorded warm-up. A rate level's calls carry ``offered_rate`` (requests/s) and no
``concurrency_level``; with a duration it sends Poisson arrivals for that long (cycling the items),
else each item once, on the same arrival schedule in every round. Every call's span carries its
round; from one round to the next the arms' order is rotated (in paired mode, the order in which each
item's copies go out) and the items are shuffled with the seed, so that a slow moment of the machine
does not always fall on the same arm or the same items. A level whose rounds left too few that passed
every health check gets up to ``extra_rounds`` more, one at a time at the same pace, numbered after
the planned ones (``c=256 r6 extra``; :mod:`.extra_rounds`); a timed loop is never rerun. With a
``decider``, the levels where the deploy verdict reads (the operating point, the peak) then get up
to ``deciding_rounds`` more in all, after the sweep, labelled the same way, while a verdict read there
is unsettled on a copy of the store as written so far (:mod:`.rounds`,
:mod:`specproxy.analysis.verdicts.settled`).
Each round also records the measurement's health (:mod:`specproxy.proxy.health`) in table ``health``. Before
anything runs, every arm's ``/v1/models`` is asked for its served model (an unreachable arm fails
the run, naming its URL) and ``/version`` with it; both land in the run's ``stacks_json``.

``run_replay(settings, items)`` returns a :class:`ReplayResult`; a :class:`ReplayError` carries a
sentence for the user. Setting ``stop`` (the CLI does on Ctrl-C) ends the run cleanly: no new calls,
calls in flight are cancelled and recorded as ``client_cancelled``, the spans so far are flushed.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import secrets
import signal
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import aiohttp

from specproxy.config import Experiment, experiment_json
from specproxy.proxy.health import p99
from specproxy.proxy.replay.clients import SharedLoad
from specproxy.proxy.replay.driving import Drive, PhaseDriver, probe_arms
from specproxy.proxy.replay.formats import ItemSet, ReplayItem
from specproxy.proxy.replay.loadgen import LoadStats, closed_loop, open_loop, timed_offsets
from specproxy.proxy.replay.planning import (
    WARMUP_MAX_TOKENS,
    CallPlanner,
    Decider,
    LevelPacer,
    LevelTrial,
    LoadPlan,
    Phase,
    ReplayCall,
    ReplayError,
    ReplayMode,
    ReplaySettings,
    check_settings,
    phase_label,
)
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.replay.recording import ArmTotals, ReplayResult, RunRecorder
from specproxy.proxy.replay.rounds import RoundLoop
from specproxy.proxy.spans.sink import SpanSink
from specproxy.proxy.upstream.scrape import MetricsScraper
from specproxy.proxy.upstream.wire import UpstreamClient
from specproxy.schema import rate_label

# The replay's public names, wherever they are defined (its CLI, the lab and the tests import them here).
__all__ = [
    "WARMUP_MAX_TOKENS",
    "ArmTotals",
    "Decider",
    "LevelPacer",
    "LevelTrial",
    "LoadPlan",
    "ReplayError",
    "ReplayMode",
    "ReplayResult",
    "ReplayRunner",
    "ReplaySettings",
    "replay_until_stopped",
    "run_replay",
    "stop_on_sigint",
]


class ReplayRunner:
    """One replay run: opens the arms' sessions and the span store, then sweeps the levels, each
    level's rounds planned (:mod:`.planning`), sent (:mod:`.driving`), counted (:mod:`.rounds`) and
    recorded (:mod:`.recording`)."""

    def __init__(
        self, settings: ReplaySettings, items: Sequence[ReplayItem], stop: asyncio.Event | None = None
    ) -> None:
        check_settings(settings, items)
        self.s = settings
        self.items = list(items)
        self.stop = stop or asyncio.Event()
        self.run_id = f"replay-{secrets.token_hex(6)}"
        self.progress = ReplayProgress([a.name for a in settings.arms], enabled=settings.show_progress)
        self.recorder = RunRecorder(
            self.run_id, settings.db_path, [a.name for a in settings.arms], self.progress
        )
        self.result = self.recorder.result
        self.planner = CallPlanner(settings, self.run_id, self.items)
        self.driver = PhaseDriver(settings, self.planner, self.recorder, self.progress, self.stop)
        self.rounds = RoundLoop(settings, self.recorder, self.progress, self.stop)

    async def _closed_sweep(self) -> None:
        plan = self.s.load
        driver = self.driver
        for level in plan.levels:
            if self.stop.is_set():
                break
            items = self.planner.level_items(level)
            n_warm = level if plan.warmup is None else plan.warmup
            if self.s.pacer is not None:
                self.recorder.level_notes = await self.s.pacer.settle(
                    level, functools.partial(driver.trial, level, items)
                )
                if plan.level_rounds(level) == 0:  # the pacer found this level cannot be measured here
                    continue
                await driver.warm_level(items, 0, level)  # prompts the trial's one wave did not send
            else:
                await driver.warm_level(items, n_warm, level)

            def drive(
                seq: Sequence[Any], send: Callable[[Any], Awaitable[float | None]], level: int = level
            ) -> Awaitable[LoadStats]:
                return closed_loop(seq, level, send, deadline_s=plan.duration_s, stop=self.stop)

            async def measure(phase: Phase, items: list[ReplayItem] = items, drive: Drive = drive) -> None:
                calls = self.planner.calls(f"c{phase.level}", self.planner.round_order(items, phase), phase)
                shared = SharedLoad(level=phase.level, deadline_s=plan.duration_s)
                await driver.phase(phase, calls, drive, shared=shared)

            async def resume(level: int = level, items: list[ReplayItem] = items, warm: int = n_warm) -> None:
                if self.s.pacer is not None:
                    self.recorder.level_notes = await self.s.pacer.resume(level)
                await driver.warm_level(items, warm, level)

            base = f"c={level}"
            await self.rounds.run_level(base, plan.level_rounds(level), measure, level=level, resume=resume)
            if self.stop.is_set():
                return
            if self.s.pacer is not None:
                # Every round's health, the extra rounds' too: a level rescued by extra rounds still had
                # rounds this machine could not keep up with, so the next (heavier) level starts slower.
                self.s.pacer.measured(level, [r for r in self.result.health if r.concurrency_level == level])
        judge = self.s.judged_peak
        await self.rounds.decide(None if judge is None else judge(self.result.levels))

    async def _rate_sweep(self) -> None:
        plan = self.s.load
        lags: list[float] = []
        for rate in plan.rates:
            if self.stop.is_set():
                break
            items, offsets = self.planner.rate_schedule(rate)
            await self.driver.warm_level(items, 1 if plan.warmup is None else plan.warmup, 1)
            label = rate_label(rate)

            async def measure(
                phase: Phase,
                items: list[ReplayItem] = items,
                offsets: list[float] = offsets,
                tag: str = label,
            ) -> None:
                calls = self.planner.calls(
                    tag.replace("=", ""), self.planner.round_order(items, phase), phase
                )
                lags.extend(await self._open_phase(phase, calls, offsets))

            async def resume(items: list[ReplayItem] = items) -> None:
                await self.driver.warm_level(items, 1 if plan.warmup is None else plan.warmup, 1)

            await self.rounds.run_level(label, plan.rounds, measure, rate=rate, resume=resume)
        await self.rounds.decide()
        self.result.lag_p99_s = p99(lags)

    async def _timed(self) -> None:
        plan = self.s.load
        items = self.planner.timed_items()
        offsets = timed_offsets([it.arrival_s or 0.0 for it in items], plan.speedup)
        label = f"timed x{plan.speedup:g}"
        lags: list[float] = []
        for round_ in range(1, plan.rounds + 1):
            if self.stop.is_set():
                break
            phase = Phase(phase_label(label, round_, plan.rounds), None, round_)
            lags += await self._open_phase(phase, self.planner.calls(plan.kind, items, phase), offsets)
        self.result.lag_p99_s = p99(lags)

    async def _open_phase(
        self, phase: Phase, calls: list[ReplayCall], offsets: Sequence[float]
    ) -> list[float]:
        """One round of an open loop: call i leaves at offsets[i]; returns the calls' start lags."""
        plan = self.s.load
        # A timed run's duration is the whole run's; a rate level's schedule already ends there.
        deadline = plan.duration_s if phase.offered_rate is None else None
        schedule = dict(zip((c.request_id for c in calls), offsets, strict=True))

        def drive(seq: Sequence[Any], send: Callable[[Any], Awaitable[float | None]]) -> Awaitable[LoadStats]:
            def rid(x: Any) -> str:
                return str(x[1].request_id if isinstance(x, tuple) else x.request_id)

            return open_loop(seq, [schedule[rid(x)] for x in seq], send, deadline_s=deadline, stop=self.stop)

        shared = SharedLoad(offsets_s=offsets, deadline_s=deadline)
        stats = await self.driver.phase(phase, calls, drive, shared=shared)
        return [lag for st in stats for lag in st.lag_s]

    async def run(self) -> ReplayResult:
        connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=False)
        driver = self.driver
        async with aiohttp.ClientSession(connector=connector) as session, UpstreamClient() as client:
            driver.client = client
            driver.session = session
            exp = self.s.experiment or Experiment(name=self.s.run_name, arms=self.s.arms)
            stacks, served = await probe_arms(session, exp, driver.state.engines)
            driver.choose_models(served)
            sink = self.recorder.sink = SpanSink(self.s.db_path)
            sink.start()
            try:
                sink.begin_run(
                    self.run_id,
                    name=self.s.run_name,
                    mode=f"replay-{self.s.mode}",
                    source="replay",
                    config_json=experiment_json(exp),
                    stacks_json=stacks,
                )
                # Replay scrapes only around phases (scrape_once); the interval bounds each scrape's timeout.
                driver.scraper = MetricsScraper(
                    self.s.arms, sink, session, run_id=self.run_id, interval_s=5.0
                )
                async with driver.client_processes():
                    with self.progress, _startup_heap_frozen():
                        await self._run_until_stopped()
                self.result.interrupted = self.stop.is_set()
            finally:
                self.recorder.recording = False
                sink.end_run(self.run_id)
                sink.close()
                # What the store holds: a span accepted by emit() can still be refused by the file.
                self.result.spans_written, self.result.spans_dropped = sink.written, sink.dropped
        return self.result

    async def _run_until_stopped(self) -> None:
        """The load, until it is done or ``stop`` is set; then the calls in flight are cancelled (their
        spans say client_cancelled) and each phase still scrapes its "after" metrics."""
        kind = self.s.load.kind
        sweep = {"closed": self._closed_sweep, "rate": self._rate_sweep, "timed": self._timed}[kind]
        work = asyncio.ensure_future(sweep())
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
            try:
                await work
            except asyncio.CancelledError:
                if not self.stop.is_set():
                    raise
        finally:
            for task in (work, stopper):
                task.cancel()
            await asyncio.gather(work, stopper, return_exceptions=True)


@contextmanager
def _startup_heap_frozen() -> Iterator[None]:
    """While inside, what exists now (imports, the workload, sessions, the span writer) is out of the
    collector's sight: it lives for the whole replay, and a full collection walking it again and again
    stalled the client's event loop for up to 270 ms at a time in a lab at c=256, a pause every
    stream in flight feels. Given back to the collector at the end (replay also runs inside tests)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def run_replay(
    settings: ReplaySettings, items: Sequence[ReplayItem], stop: asyncio.Event | None = None
) -> ReplayResult:
    """Replay ``items`` against ``settings.arms``; see the module docstring."""
    return await ReplayRunner(settings, items, stop).run()


@contextmanager
def stop_on_sigint(stop: asyncio.Event) -> Iterator[None]:
    """While inside, Ctrl-C (SIGINT) sets ``stop`` instead of raising KeyboardInterrupt."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        loop.remove_signal_handler(signal.SIGTERM)


async def replay_until_stopped(settings: ReplaySettings, items: ItemSet) -> ReplayResult:
    """Replay with Ctrl-C (and SIGTERM) turned into a clean stop that keeps the spans measured so far."""
    stop = asyncio.Event()
    with stop_on_sigint(stop):
        return await run_replay(settings, items.items, stop)
