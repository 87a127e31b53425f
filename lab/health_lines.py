"""What the lab says on stderr, after its sweep, about how the machine kept up: one line for the pace
of every level, one per level with a round over a health limit (and what became of that level), one
for the simulators' clock lag. A busy machine fails many rounds; a person reads a line per level, and
the span store keeps every figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from specproxy.lab.pacing import SimPacer
from specproxy.proxy.health import ENGINE_CLOCK_LAG, THRESHOLDS, over_threshold
from specproxy.proxy.replay.console import Console
from specproxy.proxy.replay.extra_rounds import LevelRounds, judged
from specproxy.proxy.spans.sink import HealthRow
from specproxy.schema import MIN_HEALTHY_ROUNDS, over_limit, rate_label

# Above this share of busy time behind its clock, a simulator's figures are stretched by the machine.
MAX_CLOCK_LAG = THRESHOLDS[ENGINE_CLOCK_LAG] or 0.02


def _levels(levels: Sequence[int]) -> str:
    """``c=1–64`` for a run of levels, ``c=256`` for one."""
    return f"c={levels[0]}" if len(levels) == 1 else f"c={levels[0]}–{levels[-1]}"


def print_pace(pacer: SimPacer, profile: str, console: Console) -> None:
    """The time scale each level ran at, in one line (the waves that slowed it were said as they ran),
    and how to read the absolute figures of a slowed level."""
    scales = pacer.scales()
    if not scales:
        return
    runs = [(scale, [lv for lv, _ in group]) for scale, group in groupby(scales.items(), key=lambda x: x[1])]
    cells = ", ".join(f"{_levels(levels)} at {scale:g}" for scale, levels in runs)
    short = [p.level for p in pacer.paces if not p.kept_up()]
    tail = (
        f"; still short of room to spare at the slowest scale at {', '.join(f'c={lv}' for lv in short)}"
        + (f" (rounds cut to {MIN_HEALTHY_ROUNDS})" if pacer.shortened else "")
        if short
        else ""
    )
    slowed = any(scale != 1 for scale in scales.values())
    how = (
        f": a slowed level's tok/s are that share of the {profile} clock's and its times that many times "
        "longer; ratios are unaffected"
        if slowed
        else ""
    )
    console.print(f"pace: time scale {cells}{tail}{how}")


def print_given_scale(time_scale: float, profile: str, rates: bool, console: Console) -> None:
    """How to read the absolute figures of simulators run at a given ``--time-scale``."""
    console.print(
        f"note: the simulated arms ran {time_scale:g}x as fast as the {profile} clock: "
        f"divide tok/s by {time_scale:g} and multiply times by it; ratios are unaffected",
    )
    if rates:
        # An open loop's load is relative to the engine's speed: a slower clock serves fewer req/s.
        console.print(
            f"note: a rate level r=R loaded the simulators as R / {time_scale:g} req/s would on "
            f"the {profile} clock",
        )


def _level_of(row: HealthRow) -> str:
    if row.concurrency_level is not None:
        return f"c={row.concurrency_level}"
    return rate_label(row.offered_rate) if row.offered_rate is not None else "the open loop"


def print_health(health: Sequence[HealthRow], levels: Sequence[LevelRounds], console: Console) -> None:
    """One line per level with a round over a health limit: each such round's failures, and what
    became of the level (its other rounds judged, or UNRELIABLE: the analysis's own rule,
    :func:`~specproxy.proxy.replay.extra_rounds.judged`)."""
    by_level: dict[str, dict[int, list[str]]] = {}
    order = {"c": 0, "r": 1}
    rows = sorted(
        over_threshold(health),
        key=lambda r: (
            order.get(_level_of(r)[0], 2),
            r.concurrency_level or r.offered_rate or 0,
            r.round or 0,
        ),
    )
    for row in rows:
        who = f" ({row.arm})" if row.arm else ""
        failure = f"{row.check_name} {over_limit(row.check_name, row.value, row.threshold)}{who}"
        by_level.setdefault(_level_of(row), {}).setdefault(row.round or 0, []).append(failure)
    by_name = {lv.level: lv for lv in levels}
    for level, rounds in by_level.items():
        said = "; ".join(
            f"r{r} " + ", ".join(fails) if r else ", ".join(fails) for r, fails in rounds.items()
        )
        lv = by_name.get(level)
        if lv is None:
            fate = ""
        elif judged(lv.ran, lv.healthy):
            fate = f": dropped, for every arm; judged on the {lv.healthy} of {lv.ran} rounds that passed"
        else:
            fate = (
                f": {lv.healthy} of {lv.ran} rounds passed, too few: UNRELIABLE (rerun on a quieter machine "
                "or with a smaller --time-scale)"
            )
        console.print(f"health: {level}: {said}{fate}", warning=True)


def clock_lag_by_level(health: Sequence[HealthRow]) -> dict[str, dict[int, tuple[float, str]]]:
    """level ('c=16', 'r=2') → round → the worst engine clock lag over the arms in that round, and that
    arm (round 0: calls recorded without one); concurrency levels first, then rates, each by load."""
    worst: dict[tuple[int, float], dict[int, tuple[float, str]]] = {}
    for row in health:
        if row.check_name != ENGINE_CLOCK_LAG or row.value is None:
            continue
        if row.concurrency_level is not None:
            key = (0, float(row.concurrency_level))
        elif row.offered_rate is not None:
            key = (1, row.offered_rate)
        else:
            continue
        rounds = worst.setdefault(key, {})
        r = row.round or 0
        if r not in rounds or row.value > rounds[r][0]:
            rounds[r] = (row.value, row.arm or "?")
    return {
        (f"c={int(load)}" if kind == 0 else rate_label(load)): rounds
        for (kind, load), rounds in sorted(worst.items())
    }


def print_clock_lag(lag: dict[str, dict[int, tuple[float, str]]], console: Console) -> None:
    """Each level's worst clock lag, in one line (a level's rounds over the limit are on its health
    line)."""
    if not lag:
        return
    cells = [
        f"{level} {value:.1%} ({arm})"
        for level, rounds in lag.items()
        for value, arm in [max(rounds.values())]
    ]
    console.print(
        "simulator clock lag by level (worst arm and round; share of busy time behind the profile's "
        f"clock, limit {MAX_CLOCK_LAG:.0%}): " + ", ".join(cells),
    )
