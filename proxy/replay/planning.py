"""What a replay sends, before anything is sent: the run's settings and load plan, and each round's
calls (their request ids, bodies and order) and schedule. Pure: nothing here talks to an arm.

    planner = CallPlanner(settings, run_id, items)
    calls = planner.calls("c16", planner.round_order(items, phase), phase)
"""

from __future__ import annotations

import random
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from specproxy.config import Arm, Experiment
from specproxy.proxy.replay.extra_rounds import LevelRounds
from specproxy.proxy.replay.formats import ReplayItem
from specproxy.proxy.replay.loadgen import poisson_offsets
from specproxy.proxy.spans.sink import HealthRow
from specproxy.proxy.upstream.calls import UpstreamTimeout, upstream_request_id
from specproxy.schema import rate_label

ReplayMode = Literal["paired", "split"]
WARMUP_MAX_TOKENS = 16


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
    # Closed loop and rates: at most this many rounds added after the sweep, in all, to the levels where
    # the ``decider`` finds a verdict the deploy verdict reads unsettled
    # (:mod:`specproxy.analysis.verdicts.settled`; :mod:`.rounds` says which level gets each).
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


# (a snapshot of the span store, the run id, the concurrency the peak is judged at where the store does
# not say it: None) → per level as labelled ('c=256'), the verdicts read there that more rounds could
# still settle, as sentences (a level left out, or with none: settled)
Decider = Callable[[Path, str, int | None], Mapping[str, Sequence[str]]]
# The level the peak is judged at when it is not the sweep's top one (the lab's, when this machine could
# not measure its top level soundly), from the levels' rounds as they went; None: the top one.
PeakJudge = Callable[[Sequence[LevelRounds]], int | None]


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

    async def resume(self, level: int) -> Mapping[str, float]:
        """Called before a deciding round at ``level`` after the sweep moved on: back to the pace its
        rounds ran at. Returns the figures to record with the round, as :meth:`settle` does."""
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
    # Asked after the sweep, and after each deciding round, where to add one (``LoadPlan.deciding_rounds``).
    decider: Decider | None = None
    # Where the decider reads the peak when the sweep's top level could not be judged (closed loop).
    judged_peak: PeakJudge | None = None
    # The one arm is a `specproxy serve` (replay --target): the engines behind it are scraped by it, at
    # each phase's start and end on replay's request, into its own span store.
    through_proxy: bool = False
    # Client processes a closed-loop round's slots are spread over (:mod:`.clients`); 1: this one.
    client_processes: int = 1


def check_settings(settings: ReplaySettings, items: Sequence[ReplayItem]) -> None:
    """ReplayError with a sentence when ``settings`` and ``items`` cannot make a run."""
    if not settings.arms:
        raise ReplayError("no arms to replay against")
    if not items:
        raise ReplayError("no items to replay")
    load = settings.load
    fewest = min([load.rounds, *map(load.level_rounds, load.levels)])
    if fewest < 1:
        raise ReplayError(f"rounds must be ≥ 1, got {fewest}")
    if load.extra_rounds < 0:
        raise ReplayError(f"extra rounds must be ≥ 0, got {load.extra_rounds}")
    if settings.client_processes < 1:
        raise ReplayError(f"client processes must be ≥ 1, got {settings.client_processes}")
    if load.deciding_rounds < 0:
        raise ReplayError(f"deciding rounds must be ≥ 0, got {load.deciding_rounds}")
    has_baseline = any(a.role == "baseline" for a in settings.arms)
    if settings.mode == "paired" and len(settings.arms) > 1 and not has_baseline:
        raise ReplayError('paired mode needs a baseline arm (role = "baseline")')


@dataclass(slots=True)
class ReplayCall:
    """One item of one phase, ready to send: the request id and the body every arm gets."""

    request_id: str
    item: ReplayItem
    body: dict[str, Any]
    concurrency_level: int | None
    round: int
    offered_rate: float | None = None


@dataclass(frozen=True, slots=True)
class Phase:
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


# The round part of a phase label, as phase_label writes it: " r2/3", " r4 extra".
_ROUND_SUFFIX = re.compile(r" r(\d+)(?:/(\d+)| extra)$")


def parse_phase_label(label: str) -> tuple[str, int, int | None]:
    """phase_label's inverse: the base, the round and the planned rounds (None for an extra round)."""
    found = _ROUND_SUFFIX.search(label)
    if found is None:
        return label, 1, 1
    planned = found.group(2)
    return label[: found.start()], int(found.group(1)), int(planned) if planned else None


def rotated(seq: Sequence[Arm], round_: int) -> list[Arm]:
    """The arms in the order of round ``round_`` (1-based): round k starts with the k-th arm."""
    k = (round_ - 1) % len(seq)
    return [*seq[k:], *seq[:k]]


_SAFE_ID = re.compile(r"[^A-Za-z0-9_.:-]+")


class CallPlanner:
    """A run's calls: each level's items, each round's order, bodies and request ids, and a rate
    level's arrival schedule."""

    def __init__(self, settings: ReplaySettings, run_id: str, items: Sequence[ReplayItem]) -> None:
        self.s = settings
        self.run_id = run_id
        self.items = list(items)

    def body(self, item: ReplayItem, warmup: bool) -> dict[str, Any]:
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

    def calls(self, tag: str, items: Sequence[ReplayItem], phase: Phase) -> list[ReplayCall]:
        short = self.run_id.removeprefix("replay-")[:6]
        rounds = self.s.load.rounds if phase.level is None else self.s.load.level_rounds(phase.level)
        if rounds > 1 or phase.round > 1:
            tag = f"{tag}r{phase.round}"
        # Request ids are UUIDs, as some servers require: sent as they are, so a --target proxy stores
        # the same request_id in its spans (the join between its spans and replay's).
        return [
            ReplayCall(
                upstream_request_id(f"{short}-{tag}-{i:05d}-{_SAFE_ID.sub('_', it.item_id)[:48]}"),
                it,
                self.body(it, warmup=False),
                phase.level,
                phase.round,
                phase.offered_rate,
            )
            for i, it in enumerate(items)
        ]

    def round_order(self, items: Sequence[ReplayItem], phase: Phase) -> list[ReplayItem]:
        """The items in the order of this round: as given in the first, shuffled with the seed after."""
        ordered = list(items)
        if phase.round > 1:
            level = phase.level if phase.offered_rate is None else rate_label(phase.offered_rate)
            random.Random(f"{self.s.seed}:{level}:{phase.round}").shuffle(ordered)
        return ordered

    def level_items(self, level: int) -> list[ReplayItem]:
        plan = self.s.load
        n = plan.items_per_level(level) if plan.items_per_level is not None else len(self.items)
        return [self.items[i % len(self.items)] for i in range(n)]

    def rate_schedule(self, rate: float) -> tuple[list[ReplayItem], list[float]]:
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

    def timed_items(self) -> list[ReplayItem]:
        """The items in the order of their recorded arrival; ReplayError when one has none."""
        missing = next((it for it in self.items if it.arrival_s is None), None)
        if missing is not None:
            raise ReplayError(f"{missing.where}: --timed needs arrival times, and this record has none")
        return sorted(self.items, key=lambda it: it.arrival_s or 0.0)
