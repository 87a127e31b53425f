"""Stage 1's output for one run (:class:`RunFigures`: everything measured, nothing judged) and the
facts read straight off it: each arm's kind, their order, a level's rounds; and what every stage
after it does to a comparison of it (the bootstrap on threads, the simulators' clock-lag bounds, the
one-round rule)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from specproxy.analysis.figures import matched
from specproxy.analysis.figures.run_figures import (
    CallGroup,
    LatencyFigures,
    LevelSummary,
    PairGroup,
    RoundFigures,
)
from specproxy.analysis.figures.validity import LevelHealth
from specproxy.analysis.stats import parallel_map
from specproxy.analysis.verdicts import comparison
from specproxy.analysis.verdicts.comparison import Comparison
from specproxy.analysis.verdicts.rows import Settings
from specproxy.analysis.verdicts.rules import LOSS, NO_CLEAR_GAIN, WIN, IdentityCheck


@dataclass(frozen=True)
class RunFigures:
    """Stage 1's output for one run: everything measured, nothing judged yet."""

    run_id: str
    baseline: str
    summaries: list[LevelSummary]
    rounds: dict[tuple[str, str], RoundFigures]
    health: dict[str, LevelHealth]
    pairs: list[PairGroup]
    calls: dict[tuple[str, str, str | None], CallGroup]
    loads: dict[tuple[str, str], matched.LoadBands]
    lags: dict[tuple[str, str], dict[int, float]]  # (arm, level) → round → its simulator's clock lag
    latency: dict[tuple[str, str], LatencyFigures] = field(default_factory=dict)

    def summary(self, arm: str, level: str) -> LevelSummary | None:
        return next((s for s in self.summaries if s.arm == arm and s.level == level), None)

    def reliable(self, level: str) -> bool:
        h = self.health.get(level)
        return h is None or h.reliable


def arm_kind(run: RunFigures, arm: str) -> str:
    if arm == run.baseline:
        return "baseline"
    # Only the role sets the noise floor: a plain candidate (an engine upgrade, a new GPU) is what is
    # being judged, and its real difference must not widen everyone's margin.
    first = next(s for s in run.summaries if s.arm == arm)
    return "replica" if first.role in ("replica", "baseline") else "candidate"


def arm_order(run: RunFigures) -> list[str]:
    return sorted({s.arm for s in run.summaries}, key=lambda a: (a != run.baseline, a))


def round_count(run: RunFigures, arm: str, level: str) -> int | None:
    s = run.summary(arm, level)
    if s is None or s.level_load is None:
        return None
    r = run.rounds.get((arm, level))
    return len(r.rounds) if r is not None else 1


def rounds_of(run: RunFigures, s: LevelSummary) -> tuple[int, ...]:
    """The replay rounds of the arm's calls at the level, dropped ones left out (older calls: one)."""
    if s.level_load is None:
        return ()
    r = run.rounds.get((s.arm, s.level))
    return r.rounds if r is not None else (1,)


def block_kind(run: RunFigures, arm: str, level: str, settings: Settings) -> str:
    n = round_count(run, arm, level)
    return f"{n} rounds" if n is not None and n >= 2 else f"{settings.time_blocks} time blocks"


ONE_ROUND = "1 round: cannot see between-run drift"
_Key = TypeVar("_Key", tuple[str, str], tuple[str, str, str])


def bootstrapped(jobs: Mapping[_Key, Callable[[], Comparison]]) -> dict[_Key, Comparison]:
    """Each comparison's bootstrap, on a thread per core (each draws from its own generator)."""
    return dict(zip(jobs, parallel_map(lambda job: job(), list(jobs.values())), strict=True))


def lag_bounded(run: RunFigures, comp: Comparison, arm: str, level: str) -> Comparison:
    """``comp`` with the bounds of how far the arm's and the baseline's simulators fell behind their
    clocks at the level (:func:`~specproxy.analysis.verdicts.comparison.lag_bounded`)."""

    def bounds(of: str) -> comparison.LagBounds:
        rounds = run.rounds.get((of, level))
        walls = dict(zip(rounds.rounds, rounds.wall_s, strict=True)) if rounds is not None else {}
        return comparison.LagBounds.of_rounds(run.lags.get((of, level), {}), walls)

    return comparison.lag_bounded(comp, bounds(arm), bounds(run.baseline))


def one_round(verdict: str, reason: str, identity: IdentityCheck) -> tuple[str, str]:
    """A level measured once has an interval blind to the drift between runs (a slow minute of one
    arm's engine is shared by all its calls, and measured 1-9x the within-run error), so its speed
    figures give no WIN or LOSS; outputs that differ still lose."""
    if verdict not in (WIN, LOSS) or identity.fails:
        return verdict, f"{reason}; {ONE_ROUND}"
    return NO_CLEAR_GAIN, f"{ONE_ROUND}, so no {verdict} on speed ({reason}); measure with --rounds 3 or more"
