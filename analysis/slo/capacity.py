"""Capacity at an SLO: the highest load at which every target still holds, from a few tested loads.

The load axis is whatever the levels were swept over (concurrency, or the offered request rate of an
open-loop level): the functions here see only ``(load, value)`` points. A target holds at a load when
its percentile there is at most its threshold. Going up from the lowest load, the capacity lies
between the last load where it holds and the first where it does not, where the line through those
two points (percentile linear in load) crosses the threshold; a level that holds again above a failing
one does not count (the first failure is where it stops). With several targets the capacity is the
lowest of theirs. It can also hold at every tested load (the capacity is at least the top one) or at
none (below the lowest).

The interval comes from replicates of every level's percentiles (:mod:`.goodput`: calls resampled
within rounds, plus the rounds' spread): the crossing of each replicate, and its percentiles; then it
is widened to the two tested loads around the crossing. The straight line between them is a guess at
the percentile's shape there (a curve that bends crosses elsewhere, and nothing measured says where),
so the capacity is only known to lie between them: test loads closer together to narrow it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specproxy.analysis.stats import FloatArray

BETWEEN, EVERY, NONE = "between", "every", "none"


@dataclass(frozen=True)
class Crossing:
    """Where an SLO stops holding along the load axis.

    ``state``: BETWEEN (``load`` interpolated between the tested ``holds_at`` and ``fails_at``), EVERY
    (holds at every tested load; ``load`` is the top one, a lower bound) or NONE (fails at the lowest;
    ``load`` None). ``target``: the index of the target that stops first.
    """

    state: str
    load: float | None
    holds_at: float | None = None
    fails_at: float | None = None
    target: int | None = None


def crossing(points: Sequence[tuple[float, float]], threshold: float) -> Crossing:
    """One target's crossing from (load, value) points in any order; the target holds where
    value ≤ threshold.

    >>> crossing([(1, 100.0), (4, 300.0), (16, 900.0)], 500.0).load
    8.0
    """
    ordered = sorted(points)
    if not ordered:
        return Crossing(NONE, None)
    last: tuple[float, float] | None = None
    for load, value in ordered:
        if value > threshold:
            if last is None:
                return Crossing(NONE, None, None, load)
            (l0, v0), (l1, v1) = last, (load, value)
            at = l0 + (threshold - v0) / (v1 - v0) * (l1 - l0) if v1 > v0 else l0
            return Crossing(BETWEEN, min(max(at, l0), l1), l0, l1)
        last = (load, value)
    return Crossing(EVERY, ordered[-1][0], ordered[-1][0], None)


def combined(per_target: Sequence[Crossing]) -> Crossing:
    """Several targets: the SLO stops holding where the first of them does."""
    if not per_target:
        return Crossing(NONE, None)
    indexed = [(i, c) for i, c in enumerate(per_target)]
    failing = [(i, c) for i, c in indexed if c.state == NONE]
    if failing:
        i, c = failing[0]
        return Crossing(NONE, None, None, c.fails_at, i)
    i, c = min(indexed, key=lambda x: (x[1].load or 0.0, x[1].state == EVERY))
    return Crossing(c.state, c.load, c.holds_at, c.fails_at, i)


def slo_crossing(
    loads: Sequence[float], values: Sequence[Sequence[float]], thresholds: Sequence[float]
) -> Crossing:
    """The SLO's crossing: ``values[t][i]`` is target t's percentile at ``loads[i]``."""
    return combined(
        [crossing(list(zip(loads, vs, strict=True)), thr) for vs, thr in zip(values, thresholds, strict=True)]
    )


@dataclass(frozen=True)
class Capacity:
    """An arm's capacity at the SLO: the crossing, and its interval from the replicates. ``low`` None:
    the lower bound is below the lowest tested load; ``high_open``: the upper bound is the top tested
    load and the capacity may be higher."""

    crossing: Crossing
    low: float | None
    high: float | None
    high_open: bool
    loads: tuple[float, ...]


def replicate_loads(
    loads: Sequence[float], log_values: Sequence[Sequence[FloatArray]], thresholds: Sequence[float]
) -> FloatArray:
    """Each replicate's capacity (``log_values[t][i]``: target t's log-percentile replicates at load i);
    0 where it fails at the lowest load, the top load where it holds at every one."""
    n = len(log_values[0][0])
    out = np.empty(n)
    for j in range(n):
        values = [[math.exp(float(reps[j])) for reps in per_level] for per_level in log_values]
        c = slo_crossing(loads, values, thresholds)
        out[j] = 0.0 if c.load is None else c.load
    return out


def capacity(
    loads: Sequence[float],
    values: Sequence[Sequence[float]],
    replicates: FloatArray | None,
    thresholds: Sequence[float],
    confidence: float,
) -> Capacity:
    """The capacity and its interval from the replicates' capacities (:func:`replicate_loads`)."""
    point = slo_crossing(loads, values, thresholds)
    if not loads or replicates is None:
        return Capacity(point, None, None, False, tuple(loads))
    alpha = (1 - confidence) / 2
    lo, hi = (float(x) for x in np.quantile(replicates, [alpha, 1 - alpha], method="inverted_cdf"))
    # Open above only when the replicates held at the top load: widening to a top load where the SLO
    # failed bounds the capacity there.
    high_open = hi >= max(loads)
    if point.state == BETWEEN and point.holds_at is not None and point.fails_at is not None:
        lo, hi = min(lo, point.holds_at), max(hi, point.fails_at)
    return Capacity(point, lo if lo > 0 else None, hi if hi > 0 else None, high_open, tuple(loads))


@dataclass(frozen=True)
class CapacityRatio:
    """Candidate capacity / baseline capacity. ``bound``: "" (both crossed within the tested loads),
    "≥" (the candidate held at every load: the ratio is at least this), "≤" (the baseline did).

    When an arm fails the SLO at every tested load no capacity was measured and ``point`` is None; the
    ratio may still be bounded by the other arm's interval: ``bound`` "<" with ``high`` (the candidate
    failed everywhere: below its lowest load, or its interval's top, over the baseline's interval's
    bottom) or ">" with ``low`` (the baseline failed everywhere), None where that end is itself below
    the lowest tested load (nothing measured bounds the ratio)."""

    point: float | None
    low: float | None
    high: float | None
    bound: str
    note: str = ""


def _top_when_failing(c: Capacity) -> float | None:
    """Where the capacity of an arm that failed at every tested load lies below: its interval's top, or
    its lowest tested load."""
    return c.high if c.high is not None else (min(c.loads) if c.loads else None)


def _ratio_when_failing(cand: Capacity, base: Capacity) -> CapacityRatio:
    c, b = cand.crossing, base.crossing
    if c.load is None and b.load is None:
        return CapacityRatio(None, None, None, "", "both fail the SLO at every tested load")
    if b.load is None:
        top = _top_when_failing(base)
        above = cand.low / top if cand.low is not None and top else None
        return CapacityRatio(None, above, None, ">", "the baseline fails the SLO at every tested load")
    top = _top_when_failing(cand)
    below = top / base.low if top is not None and base.low is not None else None
    return CapacityRatio(None, None, below, "<", "the candidate fails the SLO at every tested load")


def capacity_ratio(
    cand: Capacity,
    base: Capacity,
    cand_reps: FloatArray | None,
    base_reps: FloatArray | None,
    confidence: float,
) -> CapacityRatio:
    """The ratio of two capacities, with an interval from their replicates (independent draws)."""
    c, b = cand.crossing, base.crossing
    if c.load is None or b.load is None:
        return _ratio_when_failing(cand, base)
    bound = (
        "≥" if c.state == EVERY and b.state != EVERY else "≤" if b.state == EVERY and c.state != EVERY else ""
    )
    if c.state == EVERY and b.state == EVERY:
        return CapacityRatio(
            None, None, None, "", "both hold the SLO at every tested load (test higher loads)"
        )
    if cand_reps is None or base_reps is None:
        return CapacityRatio(c.load / b.load, None, None, bound)
    valid = base_reps > 0
    if valid.mean() < 0.9:
        return CapacityRatio(c.load / b.load, None, None, bound, "the baseline's capacity is too uncertain")
    ratios = cand_reps[valid] / base_reps[valid]
    alpha = (1 - confidence) / 2
    lo, hi = (float(x) for x in np.quantile(ratios, [alpha, 1 - alpha]))
    # Each capacity may lie anywhere between its tested loads around the crossing: so may the ratio.
    if cand.low is not None and base.high is not None:
        lo = min(lo, cand.low / base.high)
    if cand.high is not None and base.low is not None:
        hi = max(hi, cand.high / base.low)
    return CapacityRatio(c.load / b.load, lo, hi, bound)
