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
``decider``, the sweep's top level then gets up to ``deciding_rounds`` more, labelled the same way,
while a verdict the deploy verdict reads there is unsettled on a copy of the store as written so far
(:mod:`specproxy.analysis.verdicts.settled`).
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
import json
import random
import re
import secrets
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import aiohttp

from specproxy.config import Arm, Experiment, experiment_json
from specproxy.proxy.health import (
    LoopLagSampler,
    clock_lag,
    health_rows,
    loop_lag_share,
    p99,
    read_sim_clocks,
    write_delay_p99,
)
from specproxy.proxy.identity import NOT_COMPARABLE, compare, is_comparable
from specproxy.proxy.replay.extra_rounds import LevelRounds, extra_round_due, failed_rounds, why_extra
from specproxy.proxy.replay.formats import ItemSet, ReplayItem
from specproxy.proxy.replay.loadgen import LoadStats, closed_loop, open_loop, poisson_offsets, timed_offsets
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.spans.sink import HealthRow, SpanSink
from specproxy.proxy.upstream.calls import (
    CallResult,
    UpstreamState,
    UpstreamTimeout,
    call_arm,
    new_record,
    phase_headers,
    upstream_request_id,
)
from specproxy.proxy.upstream.scrape import MetricsScraper
from specproxy.proxy.upstream.stacks import arm_stacks
from specproxy.proxy.upstream.wire import UpstreamClient
from specproxy.record import RoutedAs, SpanRecord
from specproxy.schema import rate_label

ReplayMode = Literal["paired", "split"]
WARMUP_MAX_TOKENS = 16
# Calls in flight while a level's prompts the arms have not seen yet are warmed.
FRESH_WARMUP_SLOTS = 16
# While a phase runs, each arm's running/waiting gauges are read from its /metrics this often (the first
# time half as soon), so that every call's span carries the engine's load from a recent scrape. Calls
# before the first have none: the scrape before the phase saw the engine idle, which says nothing about
# the load the call meets.
SCRAPE_DURING_PHASE_S = 1.0


class ReplayError(Exception):
    """A replay that cannot start or go on; the message is meant for the user."""


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """How items are sent. ``kind``: closed (a sweep over ``levels``), rate (a sweep over Poisson
    ``rates``, requests/s) or timed."""

    kind: Literal["closed", "rate", "timed"] = "closed"
    levels: tuple[int, ...] = (1, 4, 16, 64)
    rates: tuple[float, ...] = ()
    speedup: float = 1.0
    # Closed loop and rates: per level (a rate level sends arrivals for that long, cycling the items);
    # timed: the whole run. None: until the items run out.
    duration_s: float | None = None
    # Calls per arm before each level that are not recorded; None = one per slot (closed loop), one
    # (rates).
    warmup: int | None = None
    # Also warm each of a level's prompts the arms have not been sent yet (one short call each), so
    # that an engine's prefix cache serves every round alike: without it round 1 alone sees them cold.
    warm_fresh_prompts: bool = False
    # Closed loop: how many items each round of a level sends (cycling the list); None = every item once.
    items_per_level: Callable[[int], int] | None = None
    # Rates: how many arrivals each round of a rate level sends (cycling the list), instead of a duration.
    items_per_rate: Callable[[float], int] | None = None
    # Each level (or the open loop) is measured this many times, the arms' order rotated each round.
    rounds: int = 1
    # Closed loop: a level's own number of rounds where it differs from ``rounds`` (a level whose
    # interval must be narrower, e.g. the one the peak throughput is read at); None = ``rounds`` each.
    rounds_per_level: Callable[[int], int] | None = None
    # Closed loop and rates: at most this many rounds added to a level with a failed round and fewer
    # than MIN_HEALTHY_ROUNDS that passed every health check (:mod:`.extra_rounds`).
    extra_rounds: int = 0
    # Closed loop and rates: at most this many rounds added to the sweep's top level while the
    # ``decider`` finds a verdict read there unsettled (:mod:`specproxy.analysis.verdicts.settled`).
    deciding_rounds: int = 0
    # No extra or deciding round starts that would end after this time (``time.monotonic()``; None: no
    # limit), a caller's time budget (the quick lab's); a round is expected to last as long as the last
    # one measured.
    added_until: float | None = None

    def level_rounds(self, level: int) -> int:
        return self.rounds if self.rounds_per_level is None else self.rounds_per_level(level)


@dataclass(frozen=True, slots=True)
class LevelTrial:
    """One unrecorded wave at a level: each simulator's clock lag over it and the client loop's lag as a
    share of the wave's median decode time (None when nothing decoded)."""

    engine_lag: Mapping[str, float]
    loop_lag_share: float | None
    # CPU time of the event loop's thread over the wave's wall time: how close the client came to
    # saturating its loop, past which the lag does not grow gently but piles up behind it
    loop_busy_share: float | None = None

    @property
    def worst_engine_lag(self) -> float:
        return max(self.engine_lag.values(), default=0.0)


# (a snapshot of the span store, the run id, the level as labelled: 'c=256') → the verdicts read at
# that level that more rounds could still settle, as sentences (none: settled)
Decider = Callable[[Path, str, str], Sequence[str]]


class LevelPacer(Protocol):
    """Sets the pace of a closed-loop level before it is measured (the lab slows its simulators down)."""

    async def settle(self, level: int, trial: Callable[[], Awaitable[LevelTrial]]) -> Mapping[str, float]:
        """Called before ``level``'s rounds instead of its warm-up; ``trial()`` sends one unrecorded wave
        of full-length calls (``level`` per arm) and says how the machine kept up. Returns figures to
        record with each of the level's rounds (health rows that never gate)."""
        ...

    def measured(self, level: int, health: Sequence[HealthRow]) -> None:
        """Called after ``level``'s rounds with their health rows (to pace the next level by them)."""
        ...


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    arms: tuple[Arm, ...]
    db_path: Path
    run_name: str = "replay"
    mode: ReplayMode = "paired"
    load: LoadPlan = LoadPlan()
    temperature: float | None = 0.0  # None: as recorded
    max_tokens: int | None = None  # None: as recorded, else DEFAULT_MAX_TOKENS
    default_max_tokens: int = 256
    seed: int = 0
    model: str | None = None
    experiment: Experiment | None = None
    timeout: UpstreamTimeout = UpstreamTimeout()
    capture_output: bool = False
    show_progress: bool = True
    pacer: LevelPacer | None = None
    # Asked after the top level's rounds whether to add deciding rounds (``LoadPlan.deciding_rounds``).
    decider: Decider | None = None
    # The one arm is a `specproxy serve` (replay --target): the engines behind it are scraped by it, at
    # each phase's start and end on replay's request, into its own span store.
    through_proxy: bool = False


@dataclass(slots=True)
class ArmTotals:
    ok: int = 0
    errors: int = 0
    completion_tokens: int = 0
    mismatches: int = 0
    compared: int = 0


@dataclass(slots=True)
class ReplayResult:
    run_id: str
    db_path: Path
    phases: list[str] = field(default_factory=list)
    per_arm: dict[str, ArmTotals] = field(default_factory=dict)
    spans_written: int = 0
    spans_dropped: int = 0
    interrupted: bool = False
    lag_p99_s: float | None = None  # open loops: the calls' start lag behind schedule, over all rounds
    health: list[HealthRow] = field(default_factory=list)
    levels: list[LevelRounds] = field(default_factory=list)  # per level: rounds run and how many passed
    notes: list[str] = field(default_factory=list)  # what the user should know about the figures


# -- stack and reachability ----------------------------------------------------------------------


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


# -- paired identity -----------------------------------------------------------------------------


class PairJoiner:
    """Holds candidates' spans until the baseline of the same request_id has answered, then compares.

    A baseline output is kept only until every arm of its request has reported, so memory stays
    proportional to the calls in flight, not to the run.
    """

    def __init__(self, n_arms: int, emit: Callable[[SpanRecord], None]) -> None:
        self.n_arms = n_arms
        self.emit = emit
        self._baseline: dict[str, CallResult | None] = {}
        self._waiting: dict[str, list[CallResult]] = {}
        self._reported: dict[str, int] = {}

    def add(self, result: CallResult, comparable: bool) -> None:
        rid = result.record.request_id
        self._reported[rid] = self._reported.get(rid, 0) + 1
        if result.record.arm_role == "baseline":
            self._baseline[rid] = result if comparable and result.ok else None
            self.emit(result.record)
            for cand in self._waiting.pop(rid, ()):
                self._finish(cand, self._baseline[rid])
        elif rid in self._baseline:
            self._finish(result, self._baseline[rid] if comparable else None)
        else:
            self._waiting.setdefault(rid, []).append(result)
        if self._reported[rid] >= self.n_arms:
            self._baseline.pop(rid, None)
            self._reported.pop(rid, None)

    def _finish(self, cand: CallResult, base: CallResult | None) -> None:
        ident = compare(base.tap, cand.tap) if base is not None and cand.ok else NOT_COMPARABLE
        cand.record.identical, cand.record.first_divergence, cand.record.divergence_margin = ident
        self.emit(cand.record)

    def flush(self) -> None:
        """Emit candidates whose baseline never reported (it was cancelled): not comparable."""
        for rid, cands in self._waiting.items():
            for cand in cands:
                self._finish(cand, None)
            self._reported.pop(rid, None)
        self._waiting.clear()


# -- the runner ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    """One item of one phase, ready to send: the request id and the body every arm gets."""

    request_id: str
    item: ReplayItem
    body: dict[str, Any]
    concurrency_level: int | None
    round: int
    offered_rate: float | None = None


@dataclass(frozen=True, slots=True)
class _Phase:
    """One measured round of one level (``level`` None for an open loop, ``offered_rate`` set for a
    rate level)."""

    label: str
    level: int | None
    round: int
    offered_rate: float | None = None


def phase_label(base: str, round_: int, rounds: int) -> str:
    """``c=16`` for a single round, ``c=16 r2/3`` for the second of three, ``c=16 r4 extra`` for a
    round added after three."""
    if round_ > rounds:
        return f"{base} r{round_} extra"
    return base if rounds == 1 else f"{base} r{round_}/{rounds}"


def rotated(seq: Sequence[Arm], round_: int) -> list[Arm]:
    """The arms in the order of round ``round_`` (1-based): round k starts with the k-th arm."""
    k = (round_ - 1) % len(seq)
    return [*seq[k:], *seq[:k]]


# Sends a round's calls (or (arm, call) pairs) through the given send function, closed or open loop.
Drive = Callable[[Sequence[Any], Callable[[Any], Awaitable[float | None]]], Awaitable[LoadStats]]

_SAFE_ID = re.compile(r"[^A-Za-z0-9_.:-]+")


class ReplayRunner:
    client: UpstreamClient  # the calls (the proxy's own HTTP client: the same measurement as serve's)
    session: aiohttp.ClientSession  # /v1/models, /metrics and /sim/stats
    scraper: MetricsScraper

    def __init__(
        self, settings: ReplaySettings, items: Sequence[ReplayItem], stop: asyncio.Event | None = None
    ) -> None:
        if not settings.arms:
            raise ReplayError("no arms to replay against")
        if not items:
            raise ReplayError("no items to replay")
        fewest = min([settings.load.rounds, *map(settings.load.level_rounds, settings.load.levels)])
        if fewest < 1:
            raise ReplayError(f"rounds must be ≥ 1, got {fewest}")
        if settings.load.extra_rounds < 0:
            raise ReplayError(f"extra rounds must be ≥ 0, got {settings.load.extra_rounds}")
        if settings.load.deciding_rounds < 0:
            raise ReplayError(f"deciding rounds must be ≥ 0, got {settings.load.deciding_rounds}")
        self.s = settings
        self.items = list(items)
        self.stop = stop or asyncio.Event()
        self.run_id = f"replay-{secrets.token_hex(6)}"
        self.result = ReplayResult(
            run_id=self.run_id, db_path=settings.db_path, per_arm={a.name: ArmTotals() for a in settings.arms}
        )
        self.state = UpstreamState()
        self.models: dict[str, str | None] = {}
        has_baseline = any(a.role == "baseline" for a in settings.arms)
        if settings.mode == "paired" and len(settings.arms) > 1 and not has_baseline:
            raise ReplayError('paired mode needs a baseline arm (role = "baseline")')
        self.progress = ReplayProgress([a.name for a in settings.arms], enabled=settings.show_progress)
        self._rng = random.Random(settings.seed)
        self._sink: SpanSink | None = None
        self._recording = True
        self._warmups = 0
        self._warmed: set[int] = set()  # ids of the items every arm has been sent at least once
        self._queue_s: list[float] = []  # this phase's calls: handed over → upstream request sent
        self._decode_s: list[float] = []  # this phase's calls: first → last token
        self._level_notes: Mapping[str, float] = {}
        self._round_s = 0.0  # how long the last measured round took (a deciding round's expected cost)

    # bodies and ids

    def _body(self, item: ReplayItem, warmup: bool) -> dict[str, Any]:
        body = dict(item.body)
        if self.s.temperature is not None:
            body["temperature"] = self.s.temperature
        if self.s.max_tokens is not None:
            body["max_tokens"] = self.s.max_tokens
            body.pop("max_completion_tokens", None)
        elif "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = self.s.default_max_tokens
        if warmup:
            body["max_tokens"] = min(int(body.get("max_tokens") or WARMUP_MAX_TOKENS), WARMUP_MAX_TOKENS)
            body.pop("max_completion_tokens", None)
        body["stream"] = True
        return body

    def _calls(self, tag: str, items: Sequence[ReplayItem], phase: _Phase) -> list[_Call]:
        short = self.run_id.removeprefix("replay-")[:6]
        rounds = self.s.load.rounds if phase.level is None else self.s.load.level_rounds(phase.level)
        if rounds > 1 or phase.round > 1:
            tag = f"{tag}r{phase.round}"
        # Request ids are UUIDs, as some servers require: sent as they are, so a --target proxy stores
        # the same request_id in its spans (the join between its spans and replay's).
        return [
            _Call(
                upstream_request_id(f"{short}-{tag}-{i:05d}-{_SAFE_ID.sub('_', it.item_id)[:48]}"),
                it,
                self._body(it, warmup=False),
                phase.level,
                phase.round,
                phase.offered_rate,
            )
            for i, it in enumerate(items)
        ]

    def _round_order(self, items: Sequence[ReplayItem], phase: _Phase) -> list[ReplayItem]:
        """The items in the order of this round: as given in the first, shuffled with the seed after."""
        ordered = list(items)
        if phase.round > 1:
            level = phase.level if phase.offered_rate is None else rate_label(phase.offered_rate)
            random.Random(f"{self.s.seed}:{level}:{phase.round}").shuffle(ordered)
        return ordered

    def _for_arm(self, arm: Arm, body: dict[str, Any]) -> dict[str, Any]:
        """The body as this arm gets it: with the model name it serves."""
        model = self.models.get(arm.name)
        return body if model is None else {**body, "model": model}

    # one call

    async def _send(
        self, arm: Arm, call: _Call, *, routed_as: RoutedAs, joiner: PairJoiner | None
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
            engine_load=self.scraper.engine_load.get(arm.name),
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
            if self._recording:
                self._emit(record)
            raise
        ended = result.t_send + (record.e2e_s or 0.0)
        if not self._recording:
            return ended
        self._queue_s.append(result.t_send - handed_over)
        if result.ok and record.ttft_s is not None and record.e2e_s is not None:
            self._decode_s.append(record.e2e_s - record.ttft_s)
        totals = self.result.per_arm[arm.name]
        if result.ok:
            totals.ok += 1
            totals.completion_tokens += record.completion_tokens or 0
        else:
            totals.errors += 1
        self.progress.record(arm.name, record.completion_tokens, result.ok)
        if joiner is not None:
            joiner.add(result, is_comparable(body))
        else:
            self._emit(record)
        return ended

    async def _send_split(self, assigned: tuple[Arm, _Call]) -> float | None:
        return await self._send(assigned[0], assigned[1], routed_as="split", joiner=None)

    async def _warm(self, arm: Arm, item: ReplayItem, decode_s: list[float] | None = None) -> None:
        """An unrecorded call: short (a warm-up), or at full length when ``decode_s`` collects its
        decode time (a pacer's trial)."""
        body = self._for_arm(arm, self._body(item, warmup=decode_s is None))
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

    async def _trial(self, level: int, items: Sequence[ReplayItem]) -> LevelTrial:
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

    def _emit(self, record: SpanRecord) -> None:
        assert self._sink is not None
        if record.identical is False:
            self.result.per_arm[record.arm].mismatches += 1
        if record.identical is not None:
            self.result.per_arm[record.arm].compared += 1
        if self._sink.emit(record):
            self.result.spans_written += 1
        else:
            self.result.spans_dropped += 1

    # phases

    def _split_arm(self) -> Arm:
        arms = [a for a in self.s.arms if a.weight > 0] or list(self.s.arms)
        return self._rng.choices(arms, weights=[a.weight or 1.0 for a in arms])[0]

    async def _phase(
        self,
        phase: _Phase,
        calls: list[_Call],
        drive: Drive,
    ) -> list[LoadStats]:
        """Run one measured round: scrape and read the clocks, send every call as ``drive`` schedules
        it (paired: to the arms in this round's order), scrape and read again, record the health."""
        label = phase.label
        await self._scrape_boundary(f"{label}:before", phase)
        self.scraper.engine_load.clear()
        clocks_before = await read_sim_clocks(self.session, self.s.arms)
        self.progress.begin_phase(label, len(calls) if self.s.mode == "paired" else None)
        self.result.phases.append(label)
        self._queue_s = []
        self._decode_s = []
        stats: list[LoadStats] = []
        loop_lag = LoopLagSampler()
        scraping = asyncio.ensure_future(self._scrape_during())
        try:
            async with loop_lag:
                if self.s.mode == "paired":
                    joiner = PairJoiner(len(self.s.arms), self._emit) if len(self.s.arms) > 1 else None
                    try:
                        stats = list(
                            await asyncio.gather(
                                *(
                                    drive(
                                        calls,
                                        functools.partial(self._send, arm, routed_as="replay", joiner=joiner),
                                    )
                                    for arm in rotated(self.s.arms, phase.round)
                                )
                            )
                        )
                    finally:
                        if joiner is not None:
                            joiner.flush()
                else:
                    assigned = [(self._split_arm(), c) for c in calls]
                    stats = [await drive(assigned, self._send_split)]
        finally:
            scraping.cancel()
            await asyncio.gather(scraping, return_exceptions=True)
            self.progress.end_phase()
            proxy_rows = await self._scrape_boundary(f"{label}:after", phase)
            clocks_after = await read_sim_clocks(self.session, self.s.arms)
            await self._record_health(
                phase,
                clock_lag(clocks_before, clocks_after),
                stats,
                loop_lag.lags_s,
                write_delay_p99(clocks_before, clocks_after),
                proxy_rows,
            )
        return stats

    async def _scrape_boundary(self, phase: str, key: _Phase) -> list[HealthRow]:
        """The engines' counters at a phase's start or end: scraped here, or through a proxy by the
        proxy (POST /specproxy/scrape), which records them in its store under the same phase, and
        the level-round's health there too: its rows come back at the end (none otherwise)."""
        if not self.s.through_proxy:
            await self.scraper.scrape_once(phase)
            return []
        proxy = self.s.arms[0].url
        body = {"phase": phase, "level": key.level, "round": key.round, "offered_rate": key.offered_rate}
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
                            self._note(f"the proxy could not scrape arm {arm}'s /metrics: {got.get('error')}")
                    if answer.get("copies_running"):
                        self._note(
                            f"{answer['copies_running']} shadow copies were still running when the proxy "
                            f"scraped at {phase}: their engine counters fall in the next level's window"
                        )
                    return self._proxy_health(key, answer.get("health") or [])
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            problem = f"{exc.__class__.__name__} {exc}".strip()
        self._note(
            f"the proxy at {proxy} did not scrape its arms at the levels' boundaries ({problem}): the "
            "engines' counters are not split by level (the spans' own acceptance figures remain)"
        )
        return []

    def _proxy_health(self, key: _Phase, rows: list[dict[str, Any]]) -> list[HealthRow]:
        """The proxy's health rows of a level-round (its loop as ``proxy <check>``, its arms'
        simulator clocks), as this run's: they gate the round here (extra rounds) as in its store."""
        at = datetime.now(UTC)

        def number(v: Any) -> float | None:
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

        out = []
        for r in rows:
            if not isinstance(r, dict) or not isinstance(r.get("check"), str):
                continue
            arm = r.get("arm") if isinstance(r.get("arm"), str) else None
            check = r["check"] if arm is not None else f"proxy {r['check']}"
            value, limit = number(r.get("value")), number(r.get("threshold"))
            out.append(
                HealthRow(self.run_id, arm, key.level, key.round, check, value, limit, at, key.offered_rate)
            )
        return out

    def _note(self, text: str) -> None:
        if text not in self.result.notes:
            self.result.notes.append(text)

    async def _scrape_during(self) -> None:
        await asyncio.sleep(SCRAPE_DURING_PHASE_S / 2)
        while True:
            await self.scraper.scrape_engine_load()
            await asyncio.sleep(SCRAPE_DURING_PHASE_S)

    async def _record_health(
        self,
        phase: _Phase,
        engine_lag: dict[str, float],
        stats: list[LoadStats],
        loop_lags: list[float],
        write_delay: dict[str, float],
        proxy_rows: Sequence[HealthRow] = (),
    ) -> None:
        start_lags = [lag for st in stats for lag in st.lag_s]
        rows = health_rows(
            self.run_id,
            phase.level,
            phase.round,
            engine_lag,
            start_lags,
            loop_lags,
            self._queue_s,
            self._decode_s,
            notes=self._level_notes,
            offered_rate=phase.offered_rate,
            rates=[(st.achieved_rate(), st.scheduled_rate()) for st in stats],
            write_delay=write_delay,
        )
        rows += proxy_rows
        self.result.health.extend(rows)
        assert self._sink is not None
        # A handful of rows, written off the event loop between rounds.
        await asyncio.to_thread(self._sink.write_health, rows)

    def _level_items(self, level: int) -> list[ReplayItem]:
        plan = self.s.load
        n = plan.items_per_level(level) if plan.items_per_level is not None else len(self.items)
        return [self.items[i % len(self.items)] for i in range(n)]

    async def _warm_level(self, items: Sequence[ReplayItem], n_warm: int, slots: int) -> None:
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

    async def _closed_sweep(self) -> None:
        plan = self.s.load
        for level in plan.levels:
            if self.stop.is_set():
                break
            items = self._level_items(level)
            n_warm = level if plan.warmup is None else plan.warmup
            if self.s.pacer is not None:
                self._level_notes = await self.s.pacer.settle(
                    level, functools.partial(self._trial, level, items)
                )
                if plan.level_rounds(level) == 0:  # the pacer found this level cannot be measured here
                    continue
                await self._warm_level(items, 0, level)  # prompts the trial's one wave did not send
            else:
                await self._warm_level(items, n_warm, level)

            def drive(
                seq: Sequence[Any], send: Callable[[Any], Awaitable[float | None]], level: int = level
            ) -> Awaitable[LoadStats]:
                return closed_loop(seq, level, send, deadline_s=plan.duration_s, stop=self.stop)

            async def measure(phase: _Phase, items: list[ReplayItem] = items, drive: Drive = drive) -> None:
                calls = self._calls(f"c{phase.level}", self._round_order(items, phase), phase)
                await self._phase(phase, calls, drive)

            await self._level_rounds(f"c={level}", plan.level_rounds(level), measure, level=level)
            if self.stop.is_set():
                return
            if self.s.pacer is not None:
                # Every round's health, the extra rounds' too: a level rescued by extra rounds still had
                # rounds this machine could not keep up with, so the next (heavier) level starts slower.
                self.s.pacer.measured(level, [r for r in self.result.health if r.concurrency_level == level])

    async def _level_rounds(
        self,
        base: str,
        planned: int,
        measure: Callable[[_Phase], Awaitable[None]],
        *,
        level: int | None = None,
        rate: float | None = None,
    ) -> None:
        """A level's planned rounds, then extra rounds while too few have passed every health check
        and the plan allows more (:func:`.extra_rounds.extra_round_due`), then at the sweep's top level
        deciding rounds while the decider finds a verdict read there unsettled; each at the level's
        pace. ``level``: a closed-loop level's concurrency, ``rate``: an open-loop level's offered rate."""

        def of_level(row: HealthRow) -> bool:
            return row.concurrency_level == level and row.offered_rate == rate

        ran = 0
        extra_out_of_time = False
        while not self.stop.is_set():
            if ran >= planned:
                failed = failed_rounds(row for row in self.result.health if of_level(row))
                if not extra_round_due(planned, ran, ran - len(failed), self.s.load.extra_rounds):
                    break
                if self._out_of_time():
                    extra_out_of_time = True
                    break
                self.progress.console.print(why_extra(base, failed, ran + 1), highlight=False)
            ran += 1
            await self._measure_round(measure, _Phase(phase_label(base, ran, planned), level, ran, rate))
        decided: tuple[int, tuple[str, ...], bool] = (0, (), False)
        if self._is_top(level, rate) and self.s.decider is not None and self.s.load.deciding_rounds > 0:
            decided = await self._deciding_rounds(base, planned, ran, measure, level, rate)
        deciding, unsettled, out_of_time = decided
        ran += deciding
        failed = failed_rounds(row for row in self.result.health if of_level(row))
        self.result.levels.append(
            LevelRounds(
                base,
                planned,
                ran,
                ran - len(failed),
                budget=self.s.load.extra_rounds,
                deciding=deciding,
                deciding_budget=self.s.load.deciding_rounds,
                unsettled=unsettled,
                out_of_time=out_of_time,
                extra_out_of_time=extra_out_of_time,
            )
        )

    async def _measure_round(self, measure: Callable[[_Phase], Awaitable[None]], phase: _Phase) -> None:
        """One round, its duration kept: a deciding round is started only if one more fits the budget."""
        began = time.monotonic()
        await measure(phase)
        self._round_s = time.monotonic() - began

    def _out_of_time(self) -> bool:
        """Would one more round, as long as the last, end after the plan's ``added_until``?"""
        until = self.s.load.added_until
        return until is not None and time.monotonic() + self._round_s > until

    def _is_top(self, level: int | None, rate: float | None) -> bool:
        """Is this the sweep's top level (the highest concurrency, or rate)?"""
        if level is not None:
            return level == max(self.s.load.levels)
        return rate is not None and rate == max(self.s.load.rates, default=rate)

    async def _deciding_rounds(
        self,
        base: str,
        planned: int,
        ran: int,
        measure: Callable[[_Phase], Awaitable[None]],
        level: int | None,
        rate: float | None,
    ) -> tuple[int, tuple[str, ...], bool]:
        """Rounds added to the top level while a verdict read there is unsettled, up to the plan's
        ``deciding_rounds`` and within its ``added_until``: (how many ran, what was still open when
        they stopped, whether the time budget stopped them)."""
        plan = self.s.load
        added = 0
        while not self.stop.is_set():
            open_ = tuple(await self._open_questions(base))
            out_of_time = self._out_of_time()
            if not open_ or added == plan.deciding_rounds or out_of_time:
                return added, open_, bool(open_) and out_of_time and added < plan.deciding_rounds
            added += 1
            k = ran + added
            self.progress.console.print(
                f"{base}: {'; '.join(open_)}; running deciding round {k} ({added} of {plan.deciding_rounds})",
                highlight=False,
            )
            await self._measure_round(measure, _Phase(phase_label(base, k, planned), level, k, rate))
        return added, (), False

    async def _open_questions(self, base: str) -> list[str]:
        """The decider's answer on a snapshot of the store as written so far; none when it cannot
        answer (said in the run's notes: the level then keeps the rounds it has)."""
        assert self.s.decider is not None and self._sink is not None
        with tempfile.TemporaryDirectory(prefix="specproxy-decide-") as tmp:
            snapshot = Path(tmp) / "snapshot.duckdb"
            try:
                await asyncio.to_thread(self._sink.snapshot, snapshot)
                return list(await asyncio.to_thread(self.s.decider, snapshot, self.run_id, base))
            except Exception as exc:  # an analysis that fails must not cost the rounds measured
                self._note(f"{base}: no deciding rounds: the verdicts could not be read mid-run ({exc})")
                return []

    def _rate_schedule(self, rate: float) -> tuple[list[ReplayItem], list[float]]:
        """A rate level's items and Poisson offsets: ``items_per_rate`` arrivals, else arrivals for the
        plan's duration (both cycling the items), else one per item. The same seed at every rate: the
        levels' gaps are one pattern scaled."""
        plan = self.s.load
        if plan.items_per_rate is not None:
            n = plan.items_per_rate(rate)
            return [self.items[i % len(self.items)] for i in range(n)], poisson_offsets(n, rate, self.s.seed)
        if plan.duration_s is None:
            return self.items, poisson_offsets(len(self.items), rate, self.s.seed)
        # Enough arrivals to pass the duration with near certainty (mean + 6 standard deviations).
        expected = rate * plan.duration_s
        n = int(expected + 6 * expected**0.5) + 2
        offsets = [t for t in poisson_offsets(n, rate, self.s.seed) if t < plan.duration_s]
        return [self.items[i % len(self.items)] for i in range(len(offsets))], offsets

    async def _rate_sweep(self) -> None:
        plan = self.s.load
        lags: list[float] = []
        for rate in plan.rates:
            if self.stop.is_set():
                break
            items, offsets = self._rate_schedule(rate)
            await self._warm_level(items, 1 if plan.warmup is None else plan.warmup, 1)
            label = rate_label(rate)

            async def measure(
                phase: _Phase,
                items: list[ReplayItem] = items,
                offsets: list[float] = offsets,
                tag: str = label,
            ) -> None:
                calls = self._calls(tag.replace("=", ""), self._round_order(items, phase), phase)
                lags.extend(await self._open_phase(phase, calls, offsets))

            await self._level_rounds(label, plan.rounds, measure, rate=rate)
        self.result.lag_p99_s = p99(lags)

    async def _timed(self) -> None:
        plan = self.s.load
        missing = next((it for it in self.items if it.arrival_s is None), None)
        if missing is not None:
            raise ReplayError(f"{missing.where}: --timed needs arrival times, and this record has none")
        items = sorted(self.items, key=lambda it: it.arrival_s or 0.0)
        offsets = timed_offsets([it.arrival_s or 0.0 for it in items], plan.speedup)
        label = f"timed x{plan.speedup:g}"
        lags: list[float] = []
        for round_ in range(1, plan.rounds + 1):
            if self.stop.is_set():
                break
            phase = _Phase(phase_label(label, round_, plan.rounds), None, round_)
            lags += await self._open_phase(phase, self._calls(plan.kind, items, phase), offsets)
        self.result.lag_p99_s = p99(lags)

    async def _open_phase(self, phase: _Phase, calls: list[_Call], offsets: Sequence[float]) -> list[float]:
        """One round of an open loop: call i leaves at offsets[i]; returns the calls' start lags."""
        plan = self.s.load
        # A timed run's duration is the whole run's; a rate level's schedule already ends there.
        deadline = plan.duration_s if phase.offered_rate is None else None
        schedule = dict(zip((c.request_id for c in calls), offsets, strict=True))

        def drive(seq: Sequence[Any], send: Callable[[Any], Awaitable[float | None]]) -> Awaitable[LoadStats]:
            def rid(x: Any) -> str:
                return str(x[1].request_id if isinstance(x, tuple) else x.request_id)

            return open_loop(seq, [schedule[rid(x)] for x in seq], send, deadline_s=deadline, stop=self.stop)

        stats = await self._phase(phase, calls, drive)
        return [lag for st in stats for lag in st.lag_s]

    async def run(self) -> ReplayResult:
        connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=False)
        async with aiohttp.ClientSession(connector=connector) as session, UpstreamClient() as client:
            self.client = client
            self.session = session
            exp = self.s.experiment or Experiment(name=self.s.run_name, arms=self.s.arms)
            stacks, served = await probe_arms(session, exp, self.state.engines)
            for arm in self.s.arms:
                self.models[arm.name] = self._pick_model(served[arm.name])
            sink = self._sink = SpanSink(self.s.db_path)
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
                self.scraper = MetricsScraper(self.s.arms, sink, session, run_id=self.run_id, interval_s=5.0)
                with self.progress, _startup_heap_frozen():
                    await self._run_until_stopped()
                self.result.interrupted = self.stop.is_set()
            finally:
                self._recording = False
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

    def _pick_model(self, served: list[str]) -> str | None:
        wanted = self.s.model or (self.s.experiment.model if self.s.experiment else None)
        if wanted and (not served or wanted in served):
            return wanted
        return served[0] if served else wanted


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
