"""The verdict rules, the crossover and the deploy verdict, as pure functions of the measured figures.

Per candidate arm and concurrency level, each level judged on its own figures:
- WIN: that level's P50 decode speedup has CI lower bound > ``win_threshold`` (1.05), that level's
  aggregate throughput ratio has CI upper bound ≥ 1.0, and identical outputs ≥ ``identity_min`` (99 %);
- LOSS: the decode speedup's CI upper bound < 1.0, or that level's throughput ratio's CI upper bound
  < 1.0, or identity < ``identity_min``;
- NO CLEAR GAIN otherwise (including when a CI cannot be estimated).
Identity is "checked" only where greedy outputs were compared; with none compared it does not block a
WIN, and the reason says so.

Per arm, the deploy verdict adds the peak rule: the arm must WIN at some level (and
lose at none), and aggregate throughput at the run's PEAK level must not be lower (CI upper ≥ 1);
LOSS when peak throughput is lower beyond the CI, identity fails, or no level wins and some level
loses. Its sentence also says up to which level the arm pays, so "enable below c=X only" is visible.
"""

from __future__ import annotations

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


def fmt_ratio(iv: Interval) -> str:
    if iv.low is None or iv.high is None:
        return f"{iv.point:.2f}x"
    return f"{iv.point:.2f}x [{iv.low:.2f}, {iv.high:.2f}]"


def level_verdict(
    decode: Interval | None,
    throughput: Interval | None,
    identical: int,
    compared: int,
    thresholds: Thresholds,
) -> tuple[str, str]:
    """(verdict, reason) for one candidate arm at one level (or one category at one level), from that
    level's own decode speedup and throughput ratio intervals."""
    identity_rate = identical / compared if compared else None
    losses: list[str] = []
    if decode is not None and decode.high is not None and decode.high < 1.0:
        losses.append(f"decode speedup CI upper {decode.high:.3f} < 1")
    if throughput is not None and throughput.high is not None and throughput.high < 1.0:
        losses.append(f"throughput CI upper {throughput.high:.3f} < 1")
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
    if throughput is None or throughput.high is None:
        return NO_CLEAR_GAIN, "no throughput interval"
    note = "" if identity_rate is not None else " (identity not checked: no greedy pairs)"
    return WIN, (
        f"decode speedup CI lower {decode.low:.3f} > {thresholds.win_threshold:g}, throughput CI upper "
        f"{throughput.high:.3f} ≥ 1" + note
    )


@dataclass(frozen=True)
class Crossover:
    """Where an arm stops paying, by the per-level verdicts.

    ``pays_up_to``: the highest level of the unbroken run of WINs from the lowest tested level (None:
    it does not win at the lowest level). ``first_not_paying``: the first level above that whose
    verdict is not WIN (None: it wins at every level), and ``verdict_there`` that level's verdict.
    """

    pays_up_to: int | None
    first_not_paying: int | None
    verdict_there: str | None

    def describe(self, levels: Sequence[int]) -> str:
        if not levels:
            return "n/a (no concurrency levels)"
        if self.first_not_paying is None:
            return f"WIN at every tested level (up to c={max(levels)})"
        if self.pays_up_to is None:
            return f"no WIN from the lowest level (c={min(levels)}: {self.verdict_there})"
        return f"WIN up to c={self.pays_up_to}; not from c={self.first_not_paying} ({self.verdict_there})"


def crossover(verdicts: Sequence[tuple[int, str]]) -> Crossover:
    """The crossover from (level, verdict) points, any order."""
    pays_up_to: int | None = None
    for level, verdict in sorted(verdicts):
        if verdict == WIN:
            pays_up_to = level
            continue
        return Crossover(pays_up_to, level, verdict)
    return Crossover(pays_up_to, None, None)


def verdict_runs(verdicts: Sequence[tuple[int, str]]) -> str:
    """Consecutive equal verdicts merged: "WIN up to c=16, NO CLEAR GAIN at c=64, LOSS from c=256"."""
    points = sorted(verdicts)
    runs: list[tuple[str, int, int]] = []
    for level, verdict in points:
        if runs and runs[-1][0] == verdict:
            runs[-1] = (verdict, runs[-1][1], level)
        else:
            runs.append((verdict, level, level))
    if len(runs) == 1:
        return f"{runs[0][0]} at every tested level"
    parts = []
    for i, (verdict, lo, hi) in enumerate(runs):
        if lo == hi:
            parts.append(f"{verdict} at c={lo}")
        elif i == 0:
            parts.append(f"{verdict} up to c={hi}")
        elif i == len(runs) - 1:
            parts.append(f"{verdict} from c={lo}")
        else:
            parts.append(f"{verdict} at c={lo}–{hi}")
    return ", ".join(parts)


@dataclass(frozen=True)
class DeployVerdict:
    """The arm's overall verdict under the deploy rule, and the sentence that explains it."""

    verdict: str
    text: str


def deploy_verdict(
    verdicts: Sequence[tuple[int, str]],
    peak_level: str,
    peak_throughput: Interval | None,
    identical: int,
    compared: int,
    thresholds: Thresholds,
) -> DeployVerdict:
    """WIN when the arm wins at some level, loses at none, peak-level throughput is not lower (CI upper
    ≥ 1) and identity holds; LOSS when peak throughput is lower beyond the CI, identity fails, or it
    wins nowhere and loses somewhere; NO CLEAR GAIN otherwise (a WIN at some levels and a LOSS at others
    below the peak included: the sentence names both)."""
    peak = f"c={peak_level}" if peak_level.isdigit() else peak_level
    per_level = verdict_runs(verdicts) if verdicts else "no per-level verdicts"
    wins = [lv for lv, v in verdicts if v == WIN]
    cross = crossover(verdicts)
    rate = identical / compared if compared else None
    if peak_throughput is None or peak_throughput.high is None:
        peak_text = f"at peak ({peak}) throughput not estimable"
    else:
        peak_text = f"at peak ({peak}) throughput {fmt_ratio(peak_throughput)}"
    head = f"{per_level}; {peak_text}"
    if rate is not None and rate < thresholds.identity_min:
        return DeployVerdict(
            LOSS, f"{head}; identical {rate:.2%} < {thresholds.identity_min:.0%}: do not enable"
        )
    peak_lower = (
        peak_throughput is not None and peak_throughput.high is not None and peak_throughput.high < 1.0
    )
    if peak_lower:
        below = (
            f"; it pays below that only up to c={cross.pays_up_to}" if cross.pays_up_to is not None else ""
        )
        return DeployVerdict(LOSS, f"{head}: do not enable for peak load{below}")
    losses = [lv for lv, v in verdicts if v == LOSS]
    if wins and losses:
        # it pays at some loads and costs at others: no blanket answer
        return DeployVerdict(
            NO_CLEAR_GAIN,
            f"{head}: it loses at c={', c='.join(map(str, losses))}; enable only where the load matches the "
            f"levels it wins at (c={', c='.join(map(str, wins))})",
        )
    if wins and peak_throughput is not None and peak_throughput.high is not None:
        if cross.first_not_paying is None:
            return DeployVerdict(WIN, f"{head}: enable, it pays at every tested level")
        return DeployVerdict(
            WIN, f"{head}: enable; peak throughput is not lower, the decode gain is clear up to c={max(wins)}"
        )
    if not wins and any(v == LOSS for _, v in verdicts):
        return DeployVerdict(LOSS, f"{head}: do not enable")
    return DeployVerdict(NO_CLEAR_GAIN, f"{head}: no clear gain")
