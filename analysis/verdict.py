"""The verdict rules and the crossover, as pure functions of the measured figures.

Per candidate arm and concurrency level (issue 4):
- WIN: P50 decode speedup's CI lower bound > ``win_threshold`` (1.05), the aggregate throughput ratio
  at the run's peak level has CI upper bound ≥ 1.0, and identical outputs ≥ ``identity_min`` (99 %);
- LOSS: the decode speedup's CI upper bound < 1.0, or the peak throughput ratio's CI upper bound < 1.0,
  or identity < ``identity_min``;
- NO CLEAR GAIN otherwise (including when a CI cannot be estimated).
Identity is "checked" only where greedy outputs were compared; with none compared it does not block a
WIN, and the reason says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specproxy.analysis.stats import Interval

WIN = "WIN"
LOSS = "LOSS"
NO_CLEAR_GAIN = "NO CLEAR GAIN"


@dataclass(frozen=True)
class Thresholds:
    win_threshold: float = 1.05
    identity_min: float = 0.99


def level_verdict(
    decode: Interval | None,
    peak_throughput: Interval | None,
    identical: int,
    compared: int,
    thresholds: Thresholds,
) -> tuple[str, str]:
    """(verdict, reason) for one candidate arm at one level."""
    identity_rate = identical / compared if compared else None
    losses: list[str] = []
    if decode is not None and decode.high is not None and decode.high < 1.0:
        losses.append(f"decode speedup CI upper {decode.high:.3f} < 1")
    if peak_throughput is not None and peak_throughput.high is not None and peak_throughput.high < 1.0:
        losses.append(f"peak throughput CI upper {peak_throughput.high:.3f} < 1")
    if identity_rate is not None and identity_rate < thresholds.identity_min:
        losses.append(
            f"identical {identical}/{compared} = {identity_rate:.2%} < {thresholds.identity_min:.2%}"
        )
    if losses:
        return LOSS, "; ".join(losses)
    if decode is None or decode.low is None:
        return NO_CLEAR_GAIN, "no decode speedup interval (too few calls)"
    if decode.low <= thresholds.win_threshold:
        return NO_CLEAR_GAIN, f"decode speedup CI lower {decode.low:.3f} ≤ {thresholds.win_threshold:g}"
    if peak_throughput is None or peak_throughput.high is None:
        return NO_CLEAR_GAIN, "no peak throughput interval"
    note = "" if identity_rate is not None else " (identity not checked: no greedy pairs)"
    return WIN, (
        f"decode speedup CI lower {decode.low:.3f} > {thresholds.win_threshold:g}, peak throughput CI upper "
        f"{peak_throughput.high:.3f} ≥ 1" + note
    )


@dataclass(frozen=True)
class Crossover:
    """Where an arm stops paying: its decode speedup (point estimate) falls to 1.0 or below.

    ``pays_up_to``: the highest tested level up to which every level paid (None: not even the lowest).
    ``estimate``: the concurrency where the speedup crosses 1.0, interpolated linearly in log2(level)
    between the last level that paid and the first that did not (None when it does not cross).
    """

    pays_up_to: int | None
    first_not_paying: int | None
    estimate: float | None

    def describe(self, levels: Sequence[int]) -> str:
        if not levels:
            return "n/a (no concurrency levels)"
        if self.first_not_paying is None:
            return f"pays at every tested level (up to c={max(levels)})"
        if self.pays_up_to is None:
            return f"does not pay at any tested level (from c={min(levels)})"
        est = f"≈ c={self.estimate:.0f}; " if self.estimate is not None else ""
        return f"{est}pays at c={self.pays_up_to}, not at c={self.first_not_paying}"


def crossover(speedups: Sequence[tuple[int, float]]) -> Crossover:
    """The crossover from (level, decode speedup) points, any order."""
    points = sorted(speedups)
    pays_up_to: int | None = None
    for i, (level, s) in enumerate(points):
        if s > 1.0:
            pays_up_to = level
            continue
        if pays_up_to is None:
            return Crossover(None, level, None)
        prev_level, prev_s = points[i - 1]
        frac = (prev_s - 1.0) / (prev_s - s)
        log_c = math.log2(prev_level) + frac * (math.log2(level) - math.log2(prev_level))
        return Crossover(pays_up_to, level, 2.0**log_c)
    return Crossover(pays_up_to, None, None)
