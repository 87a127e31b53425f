"""Sending a replay's calls: every arm through :func:`~specproxy.proxy.upstream.calls.call_arm`, the
function the proxy uses, so a replayed call is measured exactly like a live one. A measured round
(:meth:`PhaseDriver.phase`) is bounded by a /metrics scrape and a reading of the simulators' clocks
on each side; warm-ups and a pacer's trial waves are sent here too, unrecorded.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from specproxy.config import Arm, Experiment
from specproxy.proxy.health import LoopLagSampler, clock_lag, loop_lag_share, read_sim_clocks, write_delay_p99
from specproxy.proxy.identity import is_comparable
from specproxy.proxy.replay.clients import (
    ClientPool,
    ClientReport,
    SharedLoad,
    client_pool,
    client_rows,
    round_stats,
    worst,
)
from specproxy.proxy.replay.formats import ReplayItem
from specproxy.proxy.replay.loadgen import LoadStats, closed_loop
from specproxy.proxy.replay.planning import (
    CallPlanner,
    LevelTrial,
    Phase,
    ReplayCall,
    ReplayError,
    ReplaySettings,
    rotated,
)
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.replay.recording import PairJoiner, RunRecorder
from specproxy.proxy.spans.sink import HealthRow
from specproxy.proxy.upstream.calls import UpstreamState, call_arm, new_record, phase_headers
from specproxy.proxy.upstream.scrape import EngineLoad, MetricsScraper
from specproxy.proxy.upstream.stacks import arm_stacks
from specproxy.proxy.upstream.wire import UpstreamClient
from specproxy.record import RoutedAs

# Calls in flight while a level's prompts the arms have not seen yet are warmed.
FRESH_WARMUP_SLOTS = 16
# While a phase runs, each arm's running/waiting gauges are read from its /metrics this often (the first
# time half as soon), so that every call's span carries the engine's load from a recent scrape. Calls
# before the first have none: the scrape before the phase saw the engine idle, which says nothing about
# the load the call meets.
SCRAPE_DURING_PHASE_S = 1.0

# Sends a round's calls (or (arm, call) pairs) through the given send function, closed or open loop.
Drive = Callable[[Sequence[Any], Callable[[Any], Awaitable[float | None]]], Awaitable[LoadStats]]


async def probe_arms(
    session: aiohttp.ClientSession, exp: Experiment, engines: dict[str, str] | None = None
) -> tuple[str, dict[str, list[str]]]:
    """Each arm's stack (the proxy's ``arm_stacks``: /version, /v1/models, description) and its served
    models; ReplayError naming the URL of an arm whose /v1/models does not answer. ``engines``: filled
    with each arm's engine where /v1/models names it."""
    stacks = await arm_stacks(session, exp, timeout_s=10.0, engines=engines)
    parsed = json.loads(stacks)
    served: dict[str, list[str]] = {}
    for arm in exp.arms:
        info = parsed[arm.name]
        error = info.get("errors", {}).get("models")
        if error:
            raise ReplayError(
                f"arm {arm.name!r} at {arm.url} is not reachable (GET /v1/models: {error}); "
                "start it or fix its url"
            )
        data = info["models"].get("data") if isinstance(info["models"], dict) else None
        served[arm.name] = [
            m["id"] for m in data or () if isinstance(m, dict) and isinstance(m.get("id"), str)
        ]
    return stacks, served


class PhaseDriver:
    """Sends calls to the arms and runs measured rounds; what they leave goes to the recorder.
    ``client``, ``session`` and ``scraper`` are set by the runner once it has opened them."""

    client: UpstreamClient  # the calls (the proxy's own HTTP client: the same measurement as serve's)
    session: aiohttp.ClientSession  # /v1/models, /metrics and /sim/stats
    scraper: MetricsScraper

    def __init__(
        self,
        settings: ReplaySettings,
        planner: CallPlanner,
        recorder: RunRecorder,
        progress: ReplayProgress,
        stop: asyncio.Event,
    ) -> None:
        self.s = settings
        self.planner = planner
        self.recorder = recorder
        self.progress = progress
        self.stop = stop
        self.run_id = recorder.run_id
        self.state = UpstreamState()
        self.models: dict[str, str | None] = {}
        self._rng = random.Random(settings.seed)
        self._warmups = 0
        self._warmed: set[int] = set()  # ids of the items every arm has been sent at least once
        self.pool: ClientPool | None = None  # the client processes, with --client-processes N > 1

    def engine_load_of(self, arm: str) -> EngineLoad | None:
        """The arm's running/waiting gauges from the latest scrape, for the span of a call starting now."""
        return self.scraper.engine_load.get(arm)

    @asynccontextmanager
    async def client_processes(self) -> AsyncIterator[None]:
        """While inside, closed-loop rounds are sent by ``settings.client_processes`` processes
        (:mod:`.clients`) when that is more than one; they start once the arms' models are known."""
        async with client_pool(self.s, self.run_id, self.models, self.state.engines) as self.pool:
            yield
        self.pool = None

    def choose_models(self, served: dict[str, list[str]]) -> None:
        """Each arm's model: the one asked for where the arm serves it (or says nothing), else the
        first it serves."""
        wanted = self.s.model or (self.s.experiment.model if self.s.experiment else None)
        for arm in self.s.arms:
            names = served[arm.name]
            if wanted and (not names or wanted in names):
                self.models[arm.name] = wanted
            else:
                self.models[arm.name] = names[0] if names else wanted

    def _for_arm(self, arm: Arm, body: dict[str, Any]) -> dict[str, Any]:
        """The body as this arm gets it: with the model name it serves."""
        model = self.models.get(arm.name)
        return body if model is None else {**body, "model": model}

    async def send(
        self, arm: Arm, call: ReplayCall, *, routed_as: RoutedAs, joiner: PairJoiner | None
    ) -> float | None:
        """One call and its span; returns when its response ended (perf_counter), None if not sent."""
        handed_over = time.perf_counter()
        body = self._for_arm(arm, call.body)
        record = new_record(
            self.run_id,
            call.request_id,
            arm,
            body,
            endpoint=call.item.endpoint,
            routed_as=routed_as,
            source="replay",
            category=call.item.category,
            concurrency_level=call.concurrency_level,
            engine_load=self.engine_load_of(arm.name),
        )
        record.round = call.round
        record.offered_rate = call.offered_rate
        try:
            result = await call_arm(
                self.client,
                arm,
                body,
                endpoint=call.item.endpoint,
                record=record,
                timeout=self.s.timeout,
                capture_output=self.s.capture_output,
                state=self.state,
                headers=phase_headers(call.concurrency_level, call.round, call.offered_rate),
            )
        except asyncio.CancelledError:
            # Stopped by the user mid-call: keep the span (status client_cancelled), never the output.
            if self.recorder.recording:
                self.recorder.emit(record)
            raise
        if self.recorder.recording:
            self.recorder.call(arm.name, result, result.t_send - handed_over, joiner, is_comparable(body))
        return result.t_send + (record.e2e_s or 0.0)

    async def _send_split(self, assigned: tuple[Arm, ReplayCall]) -> float | None:
        return await self.send(assigned[0], assigned[1], routed_as="split", joiner=None)

    async def _warm(self, arm: Arm, item: ReplayItem, decode_s: list[float] | None = None) -> None:
        """An unrecorded call: short (a warm-up), or at full length when ``decode_s`` collects its
        decode time (a pacer's trial)."""
        body = self._for_arm(arm, self.planner.body(item, warmup=decode_s is None))
        self._warmups += 1
        rid = f"{self.run_id.removeprefix('replay-')[:6]}-warmup-{self._warmups:05d}"
        record = new_record(
            self.run_id,
            rid,
            arm,
            body,
            endpoint=item.endpoint,
            routed_as="replay",
            source="replay",
            category=item.category,
        )
        result = await call_arm(
            self.client,
            arm,
            body,
            endpoint=item.endpoint,
            record=record,
            timeout=self.s.timeout,
            state=self.state,
        )
        if decode_s is not None and result.ok and record.ttft_s is not None and record.e2e_s is not None:
            decode_s.append(record.e2e_s - record.ttft_s)

    async def trial(self, level: int, items: Sequence[ReplayItem]) -> LevelTrial:
        """One unrecorded wave of full-length calls at ``level`` on every arm, and how the machine kept up."""
        before = await read_sim_clocks(self.session, self.s.arms)
        decode_s: list[float] = []
        wave = [items[i % len(items)] for i in range(level)]
        self._warmed.update(id(it) for it in wave)
        stop = self.stop
        # The engines are scraped as during a measured round: that is part of the load the wave predicts.
        scraping = asyncio.ensure_future(self._scrape_during())
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        try:
            async with LoopLagSampler() as loop_lag:
                await asyncio.gather(
                    *(
                        closed_loop(
                            wave, level, functools.partial(self._warm, arm, decode_s=decode_s), stop=stop
                        )
                        for arm in self.s.arms
                    )
                )
        finally:
            scraping.cancel()
            await asyncio.gather(scraping, return_exceptions=True)
        busy = (time.thread_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
        after = await read_sim_clocks(self.session, self.s.arms)
        return LevelTrial(clock_lag(before, after), loop_lag_share(loop_lag.lags_s, decode_s), busy)

    def _split_arm(self) -> Arm:
        arms = [a for a in self.s.arms if a.weight > 0] or list(self.s.arms)
        return self._rng.choices(arms, weights=[a.weight or 1.0 for a in arms])[0]

    async def phase(
        self, phase: Phase, calls: list[ReplayCall], drive: Drive, *, shared: SharedLoad | None = None
    ) -> list[LoadStats]:
        """Run one measured round: scrape and read the clocks, send every call as ``drive`` schedules
        it (paired: to the arms in this round's order), scrape and read again, record the health.
        ``shared``: the round's load as the client processes, if any, send it instead of ``drive``."""
        label = phase.label
        if self.pool is not None and shared is not None:
            # The shares travel before the round's window opens: their pickling is no part of it.
            joiner = await self.pool.send_round(
                phase, calls, shared, self.recorder, self._split_arm, self.state
            )
        await self._scrape_boundary(f"{label}:before", phase)
        self.scraper.engine_load.clear()
        clocks_before = await read_sim_clocks(self.session, self.s.arms)
        self.progress.begin_phase(label, len(calls) if self.s.mode == "paired" else None)
        self.recorder.begin_phase(label)
        stats: list[LoadStats] = []
        reports: list[ClientReport] = []
        loop_lag = LoopLagSampler()
        scraping = asyncio.ensure_future(self._scrape_during())
        try:
            async with loop_lag:
                if self.pool is not None and shared is not None:
                    stats, reports = await self._in_processes(self.pool, joiner)
                elif self.s.mode == "paired":
                    stats = await self._paired(phase, calls, drive)
                else:
                    assigned = [(self._split_arm(), c) for c in calls]
                    stats = [await drive(assigned, self._send_split)]
        finally:
            scraping.cancel()
            await asyncio.gather(scraping, return_exceptions=True)
            self.progress.end_phase()
            proxy_rows = await self._scrape_boundary(f"{label}:after", phase)
            clocks_after = await read_sim_clocks(self.session, self.s.arms)
            # Client processes stamped the chunks: the loop lag is the worst one's (each has rows too).
            slowest = worst(reports)
            await self.recorder.health(
                phase,
                clock_lag(clocks_before, clocks_after),
                stats,
                loop_lag.lags_s if slowest is None else slowest.loop_lags_s,
                write_delay_p99(clocks_before, clocks_after),
                [*proxy_rows, *client_rows(self.run_id, phase, reports, loop_lag.lags_s)],
            )
        return stats

    async def _in_processes(
        self, pool: ClientPool, joiner: PairJoiner | None
    ) -> tuple[list[LoadStats], list[ClientReport]]:
        """The round given out by :meth:`.ClientPool.send_round`, run by the client processes."""
        try:
            reports = await pool.run_round(self.recorder, joiner)
        finally:
            if joiner is not None:
                joiner.flush()
        return round_stats(reports), reports

    async def _paired(self, phase: Phase, calls: list[ReplayCall], drive: Drive) -> list[LoadStats]:
        """Every call to every arm, each arm driven on its own, in this round's order of the arms."""
        arms = self.s.arms
        joiner = PairJoiner(len(arms), self.recorder.emit) if len(arms) > 1 else None
        try:
            return list(
                await asyncio.gather(
                    *(
                        drive(calls, functools.partial(self.send, arm, routed_as="replay", joiner=joiner))
                        for arm in rotated(arms, phase.round)
                    )
                )
            )
        finally:
            if joiner is not None:
                joiner.flush()

    async def _scrape_boundary(self, phase: str, key: Phase) -> list[HealthRow]:
        """The engines' counters at a phase's start or end: scraped here, or through a proxy by the
        proxy (POST /specproxy/scrape), which records them in its store under the same phase, and
        the level-round's health there too: its rows come back at the end (none otherwise)."""
        if not self.s.through_proxy:
            await self.scraper.scrape_once(phase)
            return []
        proxy = self.s.arms[0].url
        body = {"phase": phase, "level": key.level, "round": key.round, "offered_rate": key.offered_rate}
        note = self.recorder.note
        try:
            # (at a level's end the proxy first waits up to a minute for its shadow copies)
            async with self.session.post(
                f"{proxy}/specproxy/scrape", json=body, timeout=aiohttp.ClientTimeout(total=120)
            ) as resp:
                if resp.status != 200:
                    problem = f"HTTP {resp.status}: {(await resp.text(errors='replace'))[:200]}"
                else:
                    answer = await resp.json()
                    for arm, got in answer.get("arms", {}).items():
                        if not got.get("ok"):
                            note(f"the proxy could not scrape arm {arm}'s /metrics: {got.get('error')}")
                    if answer.get("copies_running"):
                        note(
                            f"{answer['copies_running']} shadow copies were still running when the proxy "
                            f"scraped at {phase}: their engine counters fall in the next level's window"
                        )
                    return self.recorder.proxy_health(key, answer.get("health") or [])
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            problem = f"{exc.__class__.__name__} {exc}".strip()
        note(
            f"the proxy at {proxy} did not scrape its arms at the levels' boundaries ({problem}): the "
            "engines' counters are not split by level (the spans' own acceptance figures remain)"
        )
        return []

    async def _scrape_during(self) -> None:
        await asyncio.sleep(SCRAPE_DURING_PHASE_S / 2)
        while True:
            await self.scraper.scrape_engine_load()
            if self.pool is not None:
                self.pool.push_engine_load(self.scraper.engine_load)
            await asyncio.sleep(SCRAPE_DURING_PHASE_S)

    async def warm_level(self, items: Sequence[ReplayItem], n_warm: int, slots: int) -> None:
        """``n_warm`` unrecorded calls per arm, ``slots`` at a time, before a level is measured; with
        ``warm_fresh_prompts`` also each of the level's prompts the arms have not been sent yet (an
        engine's prefix cache would otherwise serve those cold in the level's first round only, a
        TTFT tail its later rounds do not have)."""
        warm_items = [items[i % len(items)] for i in range(n_warm)] if n_warm > 0 and items else []
        if self.s.load.warm_fresh_prompts:
            seen = self._warmed | {id(it) for it in warm_items}
            fresh = list({id(it): it for it in items if id(it) not in seen}.values())
            warm_items += fresh
            slots = max(slots, min(len(fresh), FRESH_WARMUP_SLOTS))
        self._warmed.update(id(it) for it in warm_items)
        if not warm_items:
            return
        await asyncio.gather(
            *(
                closed_loop(warm_items, slots, functools.partial(self._warm, arm), stop=self.stop)
                for arm in self.s.arms
            )
        )
