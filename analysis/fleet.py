"""Fleet and cost at the peak: how many replicas of each arm hold the SLO at the user's peak load,
the GPUs and dollars that takes, and what the candidate saves against the baseline.

Each replica takes an equal share of the peak, so an arm needs ceil(peak / capacity) replicas of
its GPUs (its capacity at the SLO per replica, :mod:`.capacity`). The output tokens the fleet serves
at the peak are its replicas times the arm's goodput tokens/s at the per-replica load, linear between
the tested loads (through zero below the lowest); cost per million output tokens is the fleet's cost
per hour over them. The saving is 1 − candidate GPUs / baseline GPUs (the same as the cost saving at
one price per GPU-hour), with an interval from the capacity replicates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specproxy.analysis.stats import FloatArray, Interval


@dataclass(frozen=True)
class Peak:
    """The peak load (on the load axis of the sweep) and where it came from."""

    load: float
    axis: str  # "concurrency" or "rate"
    source: str

    def describe(self) -> str:
        return f"c={self.load:g}" if self.axis == "concurrency" else f"{self.load:g} req/s"


@dataclass(frozen=True)
class ArmFleet:
    """One arm at the peak. ``replicas`` None: the arm holds the SLO at no tested load; ``at_most``:
    it held at every tested load, so its capacity (and the replica count) is a bound."""

    arm: str
    gpus_per_replica: int
    gpus_source: str
    replicas: int | None
    at_most: bool
    gpus: int | None
    cost_per_hour: float | None
    tokens_per_s: float | None
    cost_per_million_tokens: float | None
    saving: Interval | None = None  # share of the baseline's GPUs (and cost) saved; None for the baseline
    note: str = ""


def replicas_needed(peak: float, capacity: float) -> int:
    """ceil(peak / capacity), at least one (a hair of float error does not add a replica).

    >>> replicas_needed(100, 40), replicas_needed(80, 40)
    (3, 2)
    """
    return max(1, math.ceil(peak / capacity - 1e-9))


def interpolate(points: Sequence[tuple[float, float]], load: float) -> float:
    """Linear between the points, through (0, 0) below the lowest, flat above the highest."""
    pts = [(0.0, 0.0), *sorted(points)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return float(np.interp(load, xs, ys))


def arm_fleet(
    arm: str,
    peak: Peak,
    capacity: float | None,
    at_most: bool,
    goodput_tokens: Sequence[tuple[float, float]],
    gpus: tuple[int, str],
    gpu_hour_usd: float | None,
) -> ArmFleet:
    """One arm's fleet at the peak (the baseline's; a candidate's saving is :func:`candidate_fleet`)."""
    per_replica, source = gpus
    if capacity is None or capacity <= 0:
        return ArmFleet(
            arm,
            per_replica,
            source,
            None,
            False,
            None,
            None,
            None,
            None,
            note="holds the SLO at no tested load",
        )
    n = replicas_needed(peak.load, capacity)
    tokens = n * interpolate(goodput_tokens, peak.load / n)
    cost = n * per_replica * gpu_hour_usd if gpu_hour_usd is not None else None
    per_million = cost / (tokens * 3600 / 1e6) if cost is not None and tokens > 0 else None
    return ArmFleet(arm, per_replica, source, n, at_most, n * per_replica, cost, tokens, per_million)


def candidate_fleet(
    own: ArmFleet,
    base: ArmFleet,
    peak: float,
    reps: tuple[FloatArray | None, FloatArray | None],
    confidence: float,
) -> ArmFleet:
    """A candidate's fleet with its saving against the baseline's."""
    return dataclasses.replace(own, saving=gpu_saving(peak, own, base, *reps, confidence))


def gpu_saving(
    peak: float,
    cand: ArmFleet,
    base: ArmFleet,
    cand_reps: FloatArray | None,
    base_reps: FloatArray | None,
    confidence: float,
) -> Interval | None:
    """1 − candidate GPUs / baseline GPUs at the peak, with an interval from the capacity replicates
    (a replicate that holds at no load needs no finite fleet: left out)."""
    if cand.gpus is None or base.gpus is None:
        return None
    point = 1.0 - cand.gpus / base.gpus
    if cand_reps is None or base_reps is None:
        return Interval(point, None, None)
    ok = (cand_reps > 0) & (base_reps > 0)
    if ok.mean() < 0.9:
        return Interval(point, None, None)
    c = np.maximum(1, np.ceil(peak / cand_reps[ok] - 1e-9)) * cand.gpus_per_replica
    b = np.maximum(1, np.ceil(peak / base_reps[ok] - 1e-9)) * base.gpus_per_replica
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(1.0 - c / b, [alpha, 1 - alpha])
    return Interval(point, float(lo), float(hi))
