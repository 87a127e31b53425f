"""Fleet and cost at the peak: how many replicas of each arm hold the SLO at the user's peak load,
the GPUs and dollars that takes, and what the candidate saves against the baseline.

Each replica takes an equal share of the peak, so an arm needs ceil(peak / capacity) replicas of
its GPUs (its capacity at the SLO per replica, :mod:`.capacity`). The output tokens the fleet serves
at the peak are its replicas times the arm's goodput tokens/s at the per-replica load, linear between
the tested loads (through zero below the lowest); cost per million output tokens is the fleet's cost
per hour over them. The saving is 1 − candidate GPUs / baseline GPUs (the same as the cost saving at
one price per GPU-hour).

The intervals follow from the capacity's reported interval, so the fleet says no more than the
capacity does: its high end gives the fewest replicas, its low end the most. Where the capacity's
interval is open (it reaches the top tested load, or below the lowest), so is the matching end of the
replicas: the fleet may be smaller (larger) still. The saving's ends pair the candidate's most with
the baseline's fewest and the reverse.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specproxy.analysis.slo import capacity as cap
from specproxy.analysis.stats import Interval


@dataclass(frozen=True)
class Peak:
    """The peak load (on the load axis of the sweep) and where it came from."""

    load: float
    axis: str  # "concurrency" or "rate"
    source: str

    def describe(self) -> str:
        return f"c={self.load:g}" if self.axis == "concurrency" else f"{self.load:g} req/s"


@dataclass(frozen=True)
class CountRange:
    """How many replicas (or GPUs) the capacity's interval allows, ``low`` to ``high``. ``low_open``:
    the capacity may lie above the top tested load, so fewer may do; ``high_open``: it may lie below
    the lowest, so more may be needed."""

    low: int
    high: int
    low_open: bool
    high_open: bool

    def times(self, k: int) -> CountRange:
        return dataclasses.replace(self, low=self.low * k, high=self.high * k)


@dataclass(frozen=True)
class ArmFleet:
    """One arm at the peak. ``replicas`` None: the arm holds the SLO at no tested load; ``at_most``:
    it held at every tested load, so its capacity (and the replica count) is a bound. The ranges: what
    the capacity's interval allows (None without one). ``saving``: the share of the baseline's GPUs
    (and cost) saved, None for the baseline; where ``saving_open`` says so, its low (high) end is a
    bound the saving may lie below (above)."""

    arm: str
    gpus_per_replica: int
    gpus_source: str
    replicas: int | None
    at_most: bool
    gpus: int | None
    cost_per_hour: float | None
    tokens_per_s: float | None
    cost_per_million_tokens: float | None
    replicas_range: CountRange | None = None
    gpus_range: CountRange | None = None
    saving: Interval | None = None
    saving_open: tuple[bool, bool] = (False, False)
    note: str = ""


def replicas_needed(peak: float, capacity: float) -> int:
    """ceil(peak / capacity), at least one (a hair of float error does not add a replica).

    >>> replicas_needed(100, 40), replicas_needed(80, 40)
    (3, 2)
    """
    return max(1, math.ceil(peak / capacity - 1e-9))


def replica_range(peak: float, c: cap.Capacity, point: int) -> CountRange | None:
    """The replicas at the ends of the capacity's interval: its high end needs the fewest, its low end
    the most (a low end below the lowest tested load: at least what the lowest needs, open).

    >>> c = cap.Capacity(cap.Crossing(cap.BETWEEN, 30.0, 16.0, 64.0), 16.0, 64.0, False, (1, 16, 64))
    >>> replica_range(200, c, 7)
    CountRange(low=4, high=13, low_open=False, high_open=False)
    """
    if c.high is None or not c.loads:
        return None
    low_end = c.low if c.low is not None else min(c.loads)
    fewest, most = replicas_needed(peak, c.high), replicas_needed(peak, low_end)
    return CountRange(min(fewest, point), max(most, point), c.high_open, c.low is None)


def interpolate(points: Sequence[tuple[float, float]], load: float) -> float:
    """Linear between the points, through (0, 0) below the lowest, flat above the highest."""
    pts = [(0.0, 0.0), *sorted(points)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return float(np.interp(load, xs, ys))


def arm_fleet(
    arm: str,
    peak: Peak,
    capacity: cap.Capacity | None,
    goodput_tokens: Sequence[tuple[float, float]],
    gpus: tuple[int, str],
    gpu_hour_usd: float | None,
) -> ArmFleet:
    """One arm's fleet at the peak (the baseline's; a candidate's saving is :func:`candidate_fleet`)."""
    per_replica, source = gpus
    load = capacity.crossing.load if capacity is not None else None
    if capacity is None or load is None or load <= 0:
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
    n = replicas_needed(peak.load, load)
    tokens = n * interpolate(goodput_tokens, peak.load / n)
    cost = n * per_replica * gpu_hour_usd if gpu_hour_usd is not None else None
    per_million = cost / (tokens * 3600 / 1e6) if cost is not None and tokens > 0 else None
    at_most = capacity.crossing.state == cap.EVERY
    span = replica_range(peak.load, capacity, n)
    return ArmFleet(
        arm,
        per_replica,
        source,
        n,
        at_most,
        n * per_replica,
        cost,
        tokens,
        per_million,
        replicas_range=span,
        gpus_range=span.times(per_replica) if span is not None else None,
    )


def candidate_fleet(own: ArmFleet, base: ArmFleet) -> ArmFleet:
    """A candidate's fleet with its saving against the baseline's: 1 − its GPUs / the baseline's, the
    low end from its most GPUs over the baseline's fewest, the high end the reverse."""
    if own.gpus is None or base.gpus is None:
        return own
    point = 1.0 - own.gpus / base.gpus
    c, b = own.gpus_range, base.gpus_range
    if c is None or b is None:
        return dataclasses.replace(own, saving=Interval(point, None, None))
    saving = Interval(point, 1.0 - c.high / b.low, 1.0 - c.low / b.high)
    open_ends = (c.high_open or b.low_open, c.low_open or b.high_open)
    return dataclasses.replace(own, saving=saving, saving_open=open_ends)
