"""Open questions: a figure the deploy verdict reads whose interval reaches across a margin line.

A true ratio near a margin line gives an interval that lands on one side of it in one run and reaches
across it in the next. Such a figure is an *open question* (one arm's figure at one level):

- where the deploy verdict reads the peak: the throughput ratio across 1 − margin (LOSS below it, and
  a WIN needs the lower bound at or above it);
- where it reads the operating point: also the decode speedup across 1 + margin (WIN above it) or
  across 1 − margin (LOSS below it).

Not asked: the baseline, replica arms (their margin keeps them at NO CLEAR GAIN whatever their
interval), arms whose identity fails (a LOSS whatever the speeds), rows on estimated token counts
(NO CLEAR GAIN whatever the speeds) and levels that are UNRELIABLE or FAILED.

Replay asks them to place deciding rounds (:mod:`.settled`); the evaluation keeps the ones still
open on each arm's deploy verdict (``DeployVerdict.at_margin``), so the verdict says it is at the
margin wherever more rounds could still move it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specproxy.analysis.levels import level_load, level_unit
from specproxy.analysis.stats import Interval
from specproxy.analysis.verdicts.rows import ArmOutcome, LevelRow, RunEvaluation, Settings
from specproxy.analysis.verdicts.rules import FAILED, UNRELIABLE, check_identity, fmt_ratio, tested_around


@dataclass(frozen=True)
class OpenQuestion:
    """One arm's figure at a level whose interval reaches across a margin line."""

    arm: str
    figure: str  # "throughput" or "decode speedup"
    interval: Interval
    line: float

    def sentence(self) -> str:
        """``draft_model's throughput 0.96x [0.95, 0.98] reaches across 0.970``"""
        return f"{self.arm}'s {self.figure} {fmt_ratio(self.interval)} reaches across {self.line:.3f}"


def _across(iv: Interval | None, line: float) -> bool:
    if iv is None or iv.low is None or iv.high is None:
        return False
    return iv.low < line <= iv.high or iv.low <= line < iv.high


def _reads(arm: ArmOutcome, load: float, unit: str, tested: list[float]) -> tuple[bool, bool]:
    """Does the arm's deploy verdict read ``load`` as its (operating point, peak)?"""
    d = arm.deploy
    if d is None:
        return False, False
    at, peak = (d.at_concurrency, d.peak_concurrency) if unit == "c" else (d.at_rate, d.peak_rate)
    reads_at = at is not None and load in tested_around(float(at), tested)
    reads_peak = peak is not None and load in tested_around(float(peak), tested)
    return reads_at, reads_peak


def _asked(arm: ArmOutcome, row: LevelRow, settings: Settings) -> bool:
    if arm.kind != "candidate" or row.verdict in (None, UNRELIABLE, FAILED) or row.tokens_estimated:
        return False
    identity = check_identity(
        arm.compared - arm.mismatched,
        arm.compared,
        row.confidence or settings.confidence,
        settings.thresholds,
    )
    return not identity.fails


def open_questions(
    evaluation: RunEvaluation, level: str, settings: Settings | None = None
) -> list[OpenQuestion]:
    """The open questions at ``level`` (a row's level: ``'256'``, ``'r=2'``; module docstring)."""
    settings = settings or Settings()
    load, unit = level_load(level), level_unit(level)
    if load is None or unit is None:
        return []
    tested = sorted(
        {x for r in evaluation.rows if level_unit(r.level) == unit and (x := level_load(r.level))}
    )
    rows = {r.arm: r for r in evaluation.rows if r.level == level}
    minimum = settings.thresholds.min_margin
    out: list[OpenQuestion] = []
    for arm in evaluation.arms:
        row = rows.get(arm.arm)
        if row is None or not _asked(arm, row, settings):
            continue
        reads_at, reads_peak = _reads(arm, load, unit, tested)
        lines: list[tuple[str, Interval | None, float]] = []
        if reads_at or reads_peak:
            lines.append(("throughput", row.throughput_speedup, 1.0 - (row.throughput_margin or minimum)))
        if reads_at:
            m = row.decode_margin or minimum
            lines += [
                ("decode speedup", row.decode_speedup, 1.0 + m),
                ("decode speedup", row.decode_speedup, 1.0 - m),
            ]
        out += [OpenQuestion(arm.arm, name, iv, line) for name, iv, line in lines if iv and _across(iv, line)]
    return out


def open_questions_by_level(
    evaluation: RunEvaluation, settings: Settings | None = None
) -> dict[str, list[OpenQuestion]]:
    """Every level's open questions (levels without any left out), keyed by the rows' level."""
    levels = dict.fromkeys(r.level for r in evaluation.rows)
    found = {level: open_questions(evaluation, level, settings) for level in levels}
    return {level: questions for level, questions in found.items() if questions}


def with_margins(evaluation: RunEvaluation, settings: Settings | None = None) -> RunEvaluation:
    """``evaluation`` with each arm's deploy verdict carrying its open questions (``at_margin``)."""
    found: dict[str, list[str]] = {}
    for questions in open_questions_by_level(evaluation, settings).values():
        for q in questions:
            found.setdefault(q.arm, []).append(q.sentence())
    if not found:
        return evaluation
    arms = [
        dataclasses.replace(a, deploy=dataclasses.replace(a.deploy, at_margin=tuple(found[a.arm])))
        if a.deploy is not None and a.arm in found
        else a
        for a in evaluation.arms
    ]
    return dataclasses.replace(evaluation, arms=arms)
