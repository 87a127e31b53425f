"""The verdict rules, the crossover and the deploy verdict, as pure functions of the measured figures.

Per arm and level (a concurrency, or an offered rate in an open-loop sweep), each level judged on its
own figures, against a margin:

- WIN: the decode speedup's lower bound is above 1 + margin, throughput is surely not lower beyond the
  margin (its lower bound ≥ 1 − margin) and identity does not fail;
- LOSS: a bound beyond the margin on the losing side: the decode speedup's or the throughput ratio's
  upper bound below 1 − margin, or identity fails;
- NO CLEAR GAIN otherwise (including when an interval cannot be estimated). WIN and LOSS each need
  evidence: a throughput interval that reaches across 1 − margin gives neither, so a true ratio near
  the margin gives NO CLEAR GAIN and one of the two, never WIN in one run and LOSS in the next;
- UNRELIABLE: the level failed a health check of the measurement (:mod:`.validity`): no verdict;
- FAILED: every call of the arm at the level failed: nothing to judge (an arm that failed at every
  level has the deploy verdict FAILED, with its first error).

The margin is per level and per figure (:func:`noise_floor`): the largest of ``min_margin`` (3 %), the
median of the replica arms' (plain copies of the baseline) deviations from 1x over the run's reliable
levels, and how far a replica's interval at the level lies from 1x. The first is the smallest
difference worth a verdict; the second what two identical deployments differ by, pooled over the
levels so that one noisy level does not move it; the third keeps a replica itself at NO CLEAR GAIN.
Sampling noise is the intervals' business, not the margin's: the candidate's own interval carries it.
The rule is symmetric, so an arm identical to the baseline comes out NO CLEAR GAIN unless its
intervals leave the margin, which the intervals' confidence makes rare; the intervals are
simultaneous over the levels the arm's deploy verdict reads (the operating point's and the peak's;
Bonferroni, in :mod:`.evaluation`), so more levels do not mean more false deploy WINs or LOSSes.

Token counts estimated from the text (``estimated``: the arm's or the baseline's, :mod:`.provenance`)
carry an error the intervals do not see: such a level gets no WIN or LOSS from its speeds, only NO
CLEAR GAIN with the reason; an identity failure is still a LOSS (it does not depend on counts).

Identity fails when Wilson's interval on the mismatch rate lies wholly above ``1 − identity_min``: 2
mismatches in 149 is no evidence of a rate above 1 %, 9 in 149 is.

The deploy verdict answers at the user's operating point and peak (:class:`OperatingPoint`): WIN
when the arm wins at the operating point, its throughput at the peak is surely not lower beyond the
margin (the interval's lower bound), it loses at no level between the two and identity holds; LOSS
when it loses at the operating point, peak throughput is surely lower beyond the margin (the upper
bound), or identity fails; NO CLEAR GAIN otherwise. A point between
tested levels is judged at the two levels around it (the less favourable verdict); outside the tested
range, at the nearest tested level. Not given, the operating point is the lowest tested level and the
peak the highest, whatever their health, so that the question asked does not change with how well the
machine kept up. A point judged at an UNRELIABLE level makes the deploy verdict UNRELIABLE (its reason
names the level and the option that judges at a level measured soundly), unless the other point
already decides it: a LOSS at the operating point, or peak throughput surely lower, is a LOSS; and a
WIN needs every level between the two measured soundly (a loss there would not show). A level whose
token counts are estimated gives no WIN there and no LOSS on its throughput.

Shadow traffic (``shadow``: the arm's calls were copies of the baseline's, sent when the baseline got
them) measures per-call speed, acceptance and identity, never capacity: its throughput is the
baseline's by construction. A shadow level's WIN rests on the decode speedup and identity alone
(:data:`SHADOW_THROUGHPUT`); the deploy verdict reads no throughput at its peak, so a shadow arm that
wins at the operating point is NO CLEAR GAIN with the capacity question open (:data:`CAPACITY_OPEN`),
and one that loses anywhere up to the peak, or whose outputs differ, still gets no WIN or a LOSS.

Levels are loads on one axis, ``unit`` 'c' (concurrency) or 'r' (offered requests/s): the crossover
and the deploy verdict read them the same way and name them ``c=16`` or ``r=2``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from specproxy.analysis.levels import load_name
from specproxy.analysis.stats import Interval, wilson_interval

WIN = "WIN"
LOSS = "LOSS"
NO_CLEAR_GAIN = "NO CLEAR GAIN"
UNRELIABLE = "UNRELIABLE"
FAILED = "FAILED"  # every call of the arm (at a level, or in the run) failed: nothing to judge
_RANK = {LOSS: 0, NO_CLEAR_GAIN: 1, WIN: 2}
SHADOW_BASIS = "shadow"  # a row's throughput basis where its arm got shadow copies: no ratio shown
SHADOW_THROUGHPUT = (
    "throughput not compared: shadow copies reach it at the baseline's pace, so its throughput is the "
    "baseline's by construction"
)
CAPACITY_OPEN = (
    "capacity at the peak is open: shadow traffic cannot show it (copies reach the arm at the "
    "baseline's pace); answer it with a replay sweep or `specproxy lab` against the same arms, or a split"
)


@dataclass(frozen=True)
class Thresholds:
    min_margin: float = 0.03
    identity_min: float = 0.99


@dataclass(frozen=True)
class Margin:
    """How far from 1 a bound must be to count, per figure, and where that came from."""

    decode: float
    throughput: float
    source: str

    @staticmethod
    def default(thresholds: Thresholds) -> Margin:
        return Margin(thresholds.min_margin, thresholds.min_margin, f"default {thresholds.min_margin:.0%}")


@dataclass(frozen=True)
class ReplicaLevel:
    """A replica arm at one reliable level, as the noise floor sees it."""

    level: str
    decode: Interval | None
    throughput: Interval | None


@dataclass(frozen=True)
class FigureFloor:
    """One figure's margin at a level, what set it, and the replicas' median deviation |ratio − 1| (over
    their finite points) that the margin was weighed against."""

    margin: float
    why: str
    median: float


def _figure_floor(figures: Sequence[tuple[str, Interval]], level: str, minimum: float) -> FigureFloor:
    """One figure's margin at ``level`` from the replicas' (level, interval) pairs (module docstring)."""
    deviations = [abs(iv.point - 1.0) for _, iv in figures if math.isfinite(iv.point)]
    gap = max(
        (
            max(iv.low - 1.0, 1.0 - iv.high)
            for lv, iv in figures
            if lv == level and iv.low is not None and iv.high is not None
        ),
        default=0.0,
    )
    median = statistics.median(deviations) if deviations else 0.0
    if gap > max(minimum, median):
        return FigureFloor(gap, "a replica's interval here lies this far from 1x", median)
    if median > minimum:
        n = len({lv for lv, _ in figures})  # several replica arms: their points at a level all count
        why = f"median of the replicas' |ratio − 1| over {n} reliable level{'s' * (n != 1)}"
        return FigureFloor(median, why, median)
    return FigureFloor(minimum, "default", median)


def noise_floor(replicas: Sequence[ReplicaLevel], level: str, thresholds: Thresholds) -> Margin:
    """The margin at ``level``, per figure, from the run's replica arms at its reliable levels (module
    docstring): the largest of the default, the median of the replicas' deviations |ratio − 1| over the
    levels, and how far a replica's interval at ``level`` lies from 1x.

    The median of the points counts each level's sampling error once, in its point, where the farthest
    interval bound counted it 2.5-6 times (a t quantile times the standard error) and swung with one
    level's rounds; a systematic difference between two identical deployments shows in every level's
    point, and the median keeps it, while one level whose rounds were noisy, or whose replica missed 1x
    by far, does not move every level's margin (that level gets its own, from the third term). The
    points' sampling variance is not subtracted: after the rounds' t widening an interval no longer
    says what it is (read back with the normal quantile it is overstated up to six times at 2 degrees
    of freedom, and the difference would be zero nearly always), so the floor errs on the side of a
    larger margin.

    >>> replicas = [ReplicaLevel("1", Interval(1.01, 0.99, 1.03), Interval(0.93, 0.92, 0.94)),
    ...             ReplicaLevel("4", Interval(1.0, 0.98, 1.02), Interval(0.96, 0.90, 1.02))]
    >>> m = noise_floor(replicas, "4", Thresholds())
    >>> round(m.decode, 3), round(m.throughput, 3)
    (0.03, 0.055)
    >>> round(noise_floor(replicas, "1", Thresholds()).throughput, 3)
    0.06
    """
    minimum = thresholds.min_margin
    decodes = [(r.level, r.decode) for r in replicas if r.decode is not None]
    throughputs = [(r.level, r.throughput) for r in replicas if r.throughput is not None]
    if not decodes and not throughputs:
        why = "no replica" if not replicas else "no replica ratio at a reliable level"
        return Margin(minimum, minimum, f"default {minimum:.0%}, {why}")
    d, t = _figure_floor(decodes, level, minimum), _figure_floor(throughputs, level, minimum)
    if d.why == t.why == "default":
        n = len({r.level for r in replicas})
        measured = ", ".join(
            f"{name} {floor.median:.1%}"
            for name, figs, floor in (("decode", decodes, d), ("throughput", throughputs, t))
            if figs
        )
        return Margin(
            minimum,
            minimum,
            f"default {minimum:.0%}, above the replica noise floor (median of the replicas' |ratio − 1| "
            f"over {n} reliable level{'s' * (n != 1)}: {measured})",
        )
    return Margin(
        d.margin,
        t.margin,
        f"replica noise floor: decode {d.margin:.1%} ({d.why}), throughput {t.margin:.1%} ({t.why})",
    )


@dataclass(frozen=True)
class IdentityCheck:
    """Identity at one level (or over an arm's levels): counts and Wilson's interval on the mismatch rate."""

    compared: int
    identical: int
    mismatch: Interval | None
    fails: bool
    text: str


def check_identity(identical: int, compared: int, confidence: float, thresholds: Thresholds) -> IdentityCheck:
    allowed = 1.0 - thresholds.identity_min
    mismatch = wilson_interval(compared - identical, compared, confidence)
    if mismatch is None or mismatch.low is None:
        return IdentityCheck(compared, identical, None, False, "identity not checked: no greedy pairs")
    fails = mismatch.low > allowed
    text = (
        f"mismatched {compared - identical}/{compared} = {mismatch.point:.2%} "
        f"[{mismatch.low:.2%}, {mismatch.high:.2%}] {'>' if fails else 'not above'} {allowed:.0%}"
    )
    return IdentityCheck(compared, identical, mismatch, fails, text)


def fmt_ratio(iv: Interval) -> str:
    if iv.low is None or iv.high is None:
        return f"{iv.point:.2f}x"
    return f"{iv.point:.2f}x [{iv.low:.2f}, {iv.high:.2f}]"


def level_verdict(
    decode: Interval | None,
    throughput: Interval | None,
    identity: IdentityCheck,
    margin: Margin,
    estimated: str = "",
    *,
    shadow: bool = False,
) -> tuple[str, str]:
    """(verdict, reason) for one arm at one level (or one category at one level); ``estimated``: why the
    speeds rest on estimated token counts ("" when they do not); ``shadow``: the arm got shadow copies
    at the baseline's pace, so ``throughput`` is no comparison and is not read (:data:`SHADOW_THROUGHPUT`):
    the verdict rests on the per-call decode speed and identity."""
    if estimated:
        if identity.fails:
            return LOSS, identity.text
        return NO_CLEAR_GAIN, f"{estimated}: no WIN or LOSS on estimated token counts"
    if shadow:
        throughput = None
    floor_d, floor_t = 1.0 - margin.decode, 1.0 - margin.throughput
    losses: list[str] = []
    if decode is not None and decode.high is not None and decode.high < floor_d:
        losses.append(f"decode speedup CI upper {decode.high:.3f} < {floor_d:.3f} (margin {margin.source})")
    if throughput is not None and throughput.high is not None and throughput.high < floor_t:
        losses.append(f"throughput CI upper {throughput.high:.3f} < {floor_t:.3f} (margin {margin.source})")
    if identity.fails:
        losses.append(identity.text)
    if losses:
        return LOSS, "; ".join(losses)
    if decode is None or decode.low is None:
        return NO_CLEAR_GAIN, "no decode speedup interval (too few calls)"
    if decode.low <= 1.0 + margin.decode:
        return NO_CLEAR_GAIN, (
            f"decode speedup CI lower {decode.low:.3f} ≤ {1 + margin.decode:.3f} (margin {margin.source})"
        )
    note = f" ({identity.text})" if identity.mismatch is None else ""
    if shadow:
        return WIN, (
            f"decode speedup CI lower {decode.low:.3f} > {1 + margin.decode:.3f} (margin {margin.source}), "
            f"per call; {SHADOW_THROUGHPUT}" + note
        )
    if throughput is None or throughput.low is None:
        return NO_CLEAR_GAIN, "no throughput interval"
    if throughput.low < floor_t:
        return NO_CLEAR_GAIN, (
            f"decode speedup CI lower {decode.low:.3f} > {1 + margin.decode:.3f}, but throughput CI "
            f"lower {throughput.low:.3f} < {floor_t:.3f}: it may be lower beyond the margin (margin "
            f"{margin.source})"
        )
    return WIN, (
        f"decode speedup CI lower {decode.low:.3f} > {1 + margin.decode:.3f}, throughput CI lower "
        f"{throughput.low:.3f} ≥ {floor_t:.3f} (margin {margin.source})" + note
    )


@dataclass(frozen=True)
class Crossover:
    """Where an arm stops paying, by the per-level verdicts of its reliable levels.

    ``pays_up_to``: the highest level of the unbroken run of WINs from the lowest tested level (None:
    it does not win at the lowest level). ``first_not_paying``: the first level above that whose
    verdict is not WIN (None: it wins at every level), and ``verdict_there`` that level's verdict.
    """

    pays_up_to: float | None
    first_not_paying: float | None
    verdict_there: str | None

    def describe(self, levels: Sequence[float], unit: str = "c") -> str:
        if not levels:
            return "n/a (no reliable levels)"
        if self.first_not_paying is None:
            return f"WIN at every tested level (up to {load_name(max(levels), unit)})"
        if self.pays_up_to is None:
            return f"no WIN from the lowest level ({load_name(min(levels), unit)}: {self.verdict_there})"
        up_to, not_from = load_name(self.pays_up_to, unit), load_name(self.first_not_paying, unit)
        return f"WIN up to {up_to}; not from {not_from} ({self.verdict_there})"


def crossover(verdicts: Sequence[tuple[float, str]]) -> Crossover:
    """The crossover from (level, verdict) points, any order; UNRELIABLE levels are left out."""
    pays_up_to: float | None = None
    for level, verdict in sorted(v for v in verdicts if v[1] != UNRELIABLE):
        if verdict == WIN:
            pays_up_to = level
            continue
        return Crossover(pays_up_to, level, verdict)
    return Crossover(pays_up_to, None, None)


def verdict_runs(verdicts: Sequence[tuple[float, str]], unit: str = "c") -> str:
    """Consecutive equal verdicts merged: "WIN up to c=16, NO CLEAR GAIN at c=64, LOSS from c=256"."""
    points = sorted(verdicts)
    runs: list[tuple[str, float, float]] = []
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
            parts.append(f"{verdict} at {load_name(lo, unit)}")
        elif i == 0:
            parts.append(f"{verdict} up to {load_name(hi, unit)}")
        elif i == len(runs) - 1:
            parts.append(f"{verdict} from {load_name(lo, unit)}")
        else:
            parts.append(f"{verdict} at {load_name(lo, unit)}–{load_name(hi, unit).split('=')[1]}")
    return ", ".join(parts)


@dataclass(frozen=True)
class OperatingPoint:
    """Where the user runs (``at``) and their peak, as loads in ``unit`` ('c' concurrency, 'r' offered
    requests/s); None: not given (the deploy verdict assumes the lowest and the highest tested level,
    and says so)."""

    at: float | None = None
    peak: float | None = None
    unit: str = "c"

    def resolved(self, tested: Sequence[float]) -> tuple[float, float]:
        """(operating point, peak) with the assumed ones filled in: the lowest and the highest of the
        ``tested`` levels (sorted, not empty)."""
        at = self.at if self.at is not None else tested[0]
        return at, self.peak if self.peak is not None else tested[-1]


@dataclass(frozen=True)
class LevelJudgement:
    """One level of an arm, as the deploy verdict sees it (``level``: its load)."""

    level: float
    verdict: str
    throughput: Interval | None
    throughput_margin: float
    estimated: bool = False
    health: str = ""  # why the level is UNRELIABLE: the checks it failed
    one_round: bool = False  # measured once: its interval cannot see the drift between runs
    shadow: bool = False  # shadow copies at the baseline's pace: its throughput (capacity) is not measured


@dataclass(frozen=True)
class DeployVerdict:
    """The arm's overall verdict at the operating point and peak, and the sentence that explains it."""

    verdict: str
    text: str
    at_concurrency: int | None = None
    peak_concurrency: int | None = None
    assumed: str = ""
    # the operating point and peak of an open-loop sweep (req/s), instead of the concurrencies
    at_rate: float | None = None
    peak_rate: float | None = None
    # ``text`` in two parts, the assumption left out (said once for all arms): what to do, and the
    # per-level verdicts and the two points it rests on
    action: str = ""
    summary: str = ""
    # The figures it reads whose interval reaches across a margin line (:mod:`.margin`): where more
    # rounds could still move the verdict, said beside it.
    at_margin: tuple[str, ...] = ()

    def margin_sentence(self) -> str:
        """``at the margin: eagle3's decode speedup 1.04x [1.02, 1.06] reaches across 1.030 (more rounds
        there would settle it)``; empty where nothing is."""
        if not self.at_margin:
            return ""
        return f"at the margin: {'; '.join(self.at_margin)} (more rounds there would settle it)"


def shadow_note(arm: str) -> str:
    """The note under the table for an arm that got shadow copies."""
    return f"{arm}: shadow traffic: throughput ratio — ({SHADOW_THROUGHPUT}); deploy: {CAPACITY_OPEN}"


def live_deploy_verdict(verdict: str, reason: str, *, shadow: bool) -> DeployVerdict:
    """The deploy verdict of live traffic (one level, no load axis): its level's verdict, except that a
    shadow arm's WIN rests on its per-call speed alone, and its capacity is open: NO CLEAR GAIN."""
    if shadow and verdict == WIN:
        return DeployVerdict(NO_CLEAR_GAIN, f"WIN per call on live traffic ({reason}); {CAPACITY_OPEN}")
    return DeployVerdict(verdict, f"{verdict} on live traffic ({reason})")


def tested_around(target: float, tested: Sequence[float]) -> list[float]:
    """The tested level(s) a load is judged at: itself if tested, else the two around it, else the
    nearest (below the lowest, or above the highest tested level).

    >>> tested_around(16, [1, 4, 16, 64]), tested_around(32, [1, 4, 16, 64]), tested_around(256, [1, 64])
    ([16], [16, 64], [64])
    """
    ordered = sorted(set(tested))
    if target in ordered:
        return [target]
    below = [lv for lv in ordered if lv < target]
    above = [lv for lv in ordered if lv > target]
    if below and above:
        return [below[-1], above[0]]
    return [above[0]] if above else [below[-1]]


def _around(target: float, levels: Sequence[LevelJudgement], unit: str) -> tuple[list[LevelJudgement], str]:
    """The tested level(s) a load is judged at, and how that was chosen."""

    def name(load: float) -> str:
        return load_name(load, unit)

    around = tested_around(target, [j.level for j in levels])
    chosen = sorted((j for j in levels if j.level in around), key=lambda j: j.level)
    if around == [target]:
        return chosen, name(target)
    if len(around) == 2:
        lo, hi = around
        return chosen, f"{name(target)}, between tested {name(lo)} and {name(hi)}: the less favourable"
    if around[0] > target:
        return chosen, f"{name(target)}, below the lowest tested level: judged at {name(around[0])}"
    return chosen, f"{name(target)}, above the highest tested level: judged at {name(around[0])}"


def _worst_throughput(levels: Sequence[LevelJudgement]) -> LevelJudgement:
    def key(j: LevelJudgement) -> float:
        high = j.throughput.high if j.throughput is not None else None
        return float("inf") if high is None else high + j.throughput_margin

    return min(levels, key=key)


def _sound_choice(target: float, role: str, sound: Sequence[float], unit: str) -> str:
    """What to give instead of an operating point or peak that failed its health checks: the sound
    level nearest it on the safe side (below a peak, above an operating point), else the nearest."""
    if role == "peak":
        below = [lv for lv in sound if lv <= target]
        choice = max(below) if below else min(sound)
        which = "the highest level measured soundly" if choice == max(sound) else "a level measured soundly"
    else:
        above = [lv for lv in sound if lv >= target]
        choice = min(above) if above else max(sound)
        which = "the lowest level measured soundly" if choice == min(sound) else "a level measured soundly"
    option = {("c", "peak"): "--peak-concurrency", ("c", "at"): "--at-concurrency"}.get(
        (unit, role), "--peak-rate" if role == "peak" else "--at-rate"
    )
    return f"give {option} {choice:g} to judge at {which}, or rerun slower"


def _unsound_point(
    role: str, target: float, around: Sequence[LevelJudgement], sound: Sequence[float], unit: str
) -> str:
    """Why a point the verdict needs cannot be judged: its tested level(s) failed the health checks."""
    failed = [j for j in around if j.verdict == UNRELIABLE]
    why = "; ".join(
        f"{load_name(j.level, unit)} failed its health checks" + (f" ({j.health})" if j.health else "")
        for j in failed
    )
    name = "operating point" if role == "at" else "peak"
    exact = len(around) == 1 and around[0].level == target
    where = f"{name} {why}" if exact else f"{name} {load_name(target, unit)}: tested {why}"
    return f"{where}; {_sound_choice(target, role, sound, unit)}"


@dataclass(frozen=True)
class _Point:
    """Where a deploy verdict reads one of its points: the tested level(s) (``text``: how they were
    chosen), those of them that passed the health checks, and whether any did not."""

    load: float
    levels: tuple[LevelJudgement, ...]
    text: str
    sound: tuple[LevelJudgement, ...]

    @property
    def failed(self) -> bool:
        return len(self.sound) < len(self.levels)


def _point(target: float, levels: Sequence[LevelJudgement], unit: str) -> _Point:
    chosen, text = _around(target, levels, unit)
    return _Point(target, tuple(chosen), text, tuple(j for j in chosen if j.verdict != UNRELIABLE))


def _at_verdict(at: _Point) -> str:
    """The least favourable sound verdict at the operating point; UNRELIABLE where one of its levels
    failed the health checks, unless a sound one already loses."""
    worst = min((j.verdict for j in at.sound), key=lambda v: _RANK.get(v, 1), default=UNRELIABLE)
    return UNRELIABLE if at.failed and worst != LOSS else worst


def _peak_text(peak_j: LevelJudgement | None) -> str:
    thr = peak_j.throughput if peak_j is not None else None
    if peak_j is None:
        return UNRELIABLE
    if peak_j.shadow:
        return "not measured (shadow)"
    text = "not estimable" if thr is None or thr.high is None else fmt_ratio(thr)
    if peak_j.estimated and thr is not None:
        return text + " (estimated token counts)"
    if peak_j.one_round and thr is not None:
        return text + " (1 round)"
    return text


def _assumed(point: OperatingPoint, at: float, peak: float) -> list[str]:
    out = []
    if point.at is None:
        out.append(f"operating point = lowest tested level {load_name(at, point.unit)}")
    if point.peak is None:
        out.append(f"peak = highest tested level {load_name(peak, point.unit)}")
    return out


def deploy_verdict(
    levels: Sequence[LevelJudgement], point: OperatingPoint, identity: IdentityCheck
) -> DeployVerdict:
    """The arm's verdict at the operating point and the peak (module docstring).

    Without a given point, the operating point is the lowest tested level and the peak the highest,
    whatever their health: the question does not change with how well the machine kept up. A point
    whose level failed the health checks makes the verdict UNRELIABLE, unless the other already
    decides it (a LOSS at the operating point, or peak throughput surely lower, is a LOSS).
    """
    unit = point.unit
    per_level = (
        verdict_runs([(j.level, j.verdict) for j in levels], unit) if levels else "no per-level verdicts"
    )
    if all(j.verdict == UNRELIABLE for j in levels):
        return DeployVerdict(UNRELIABLE, f"{per_level}: no level passed the measurement's health checks")
    at_load, peak_load = point.resolved(sorted(j.level for j in levels))
    at, peak = _point(at_load, levels, unit), _point(peak_load, levels, unit)
    peak_j = _worst_throughput(peak.sound) if peak.sound else None
    assumed = _assumed(point, at_load, peak_load)
    assumption = f" (assumed: {', '.join(assumed)})" if assumed else ""
    head = (
        f"{per_level}; at the operating point ({at.text}) {_at_verdict(at)}; at peak ({peak.text}) "
        f"throughput {_peak_text(peak_j)}"
    )
    v, why = _deploy_rule(levels, at, peak, peak_j, identity, unit)
    text = f"{head}{assumption}: {why}"
    if unit == "r":
        return DeployVerdict(
            v,
            text,
            assumed=", ".join(assumed),
            at_rate=at_load,
            peak_rate=peak_load,
            action=why,
            summary=head,
        )
    return DeployVerdict(v, text, int(at_load), int(peak_load), ", ".join(assumed), action=why, summary=head)


def _deploy_rule(
    levels: Sequence[LevelJudgement],
    at: _Point,
    peak: _Point,
    peak_j: LevelJudgement | None,
    identity: IdentityCheck,
    unit: str,
) -> tuple[str, str]:
    """The deploy verdict and why: losses first (identity, peak throughput, the operating point),
    then unsound points, then a WIN's conditions, else no clear gain."""
    at_verdict = _at_verdict(at)
    thr = peak_j.throughput if peak_j is not None else None
    if identity.fails:
        return LOSS, f"{identity.text}: do not enable"
    if peak_j is not None and (peak_j.estimated or peak_j.one_round or peak_j.shadow):
        # an interval on estimated token counts, blind to drift, or of shadow copies paced by the
        # baseline's traffic is not evidence either way
        thr = None
    if thr is not None and thr.high is not None and peak_j is not None:
        if thr.high < 1.0 - peak_j.throughput_margin:
            return LOSS, "do not enable for peak load (throughput lower beyond the margin)"
    if at_verdict == LOSS:
        return LOSS, "do not enable: it loses at the operating point"
    sound = sorted(j.level for j in levels if j.verdict != UNRELIABLE)
    failed = [
        _unsound_point(role, p.load, p.levels, sound, unit)
        for role, p in (("at", at), ("peak", peak))
        if p.failed
    ]
    if failed or peak_j is None:
        return UNRELIABLE, "; ".join(failed)
    if at_verdict == WIN:
        return _win_rule(levels, at, peak, peak_j, thr, unit)
    return _no_gain(at, peak_j, at_wins=False)


def _no_gain(at: _Point, peak_j: LevelJudgement, *, at_wins: bool) -> tuple[str, str]:
    """Why there is no clear gain: what the figures could not show, else no gain at the point."""
    if peak_j.shadow:
        lead = (
            "it wins per call at the operating point" if at_wins else "no clear gain at the operating point"
        )
        return NO_CLEAR_GAIN, f"{lead}; {CAPACITY_OPEN}"
    if any(j.estimated for j in at.levels):
        return NO_CLEAR_GAIN, "token counts at the operating point are estimated: no WIN or LOSS"
    if at_wins and peak_j.estimated:
        return NO_CLEAR_GAIN, "it wins at the operating point; peak throughput is estimated"
    if at_wins and peak_j.one_round:
        return NO_CLEAR_GAIN, "it wins at the operating point; peak throughput was measured in one round"
    if any(j.one_round for j in at.levels):
        return NO_CLEAR_GAIN, "the operating point was measured in one round: no WIN or LOSS on speed"
    return NO_CLEAR_GAIN, "no clear gain at the operating point"


def _win_rule(
    levels: Sequence[LevelJudgement],
    at: _Point,
    peak: _Point,
    peak_j: LevelJudgement,
    thr: Interval | None,
    unit: str,
) -> tuple[str, str]:
    """An arm that wins at the operating point: WIN when nothing up to the peak loses and peak
    throughput is shown not lower beyond the margin."""
    lo, hi = min(at.load, peak.load), max(at.load, peak.load)
    losing = [j.level for j in levels if lo <= j.level <= hi and j.verdict == LOSS]
    if losing:
        where = ", ".join(load_name(lv, unit) for lv in losing)
        return NO_CLEAR_GAIN, f"it wins at the operating point but loses at {where}, up to the peak"
    if thr is None or thr.low is None:
        return _no_gain(at, peak_j, at_wins=True)
    if thr.low < 1.0 - peak_j.throughput_margin:
        return (
            NO_CLEAR_GAIN,
            "it wins at the operating point; peak throughput may be lower beyond the margin (its "
            "interval reaches below it)",
        )
    between = [j for j in levels if lo < j.level < hi and j.verdict == UNRELIABLE]
    if between:
        return (
            UNRELIABLE,
            "it wins at the operating point and peak throughput is not lower, but "
            + ", ".join(load_name(j.level, unit) for j in between)
            + ", between them, failed its health checks (a loss there would not show); rerun slower",
        )
    return WIN, "enable: it wins at the operating point and peak throughput is not lower"
