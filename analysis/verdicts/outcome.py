"""The operating point a run is judged at, and each arm's outcome there: its deploy verdict, its
crossover and what it rests on."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specproxy.analysis.levels import level_unit, load_name
from specproxy.analysis.verdicts import rules
from specproxy.analysis.verdicts.measured import (
    RunFigures,
    arm_kind,
)
from specproxy.analysis.verdicts.rows import ArmOutcome, LevelRow, Settings
from specproxy.analysis.verdicts.rules import (
    FAILED,
    NO_CLEAR_GAIN,
    UNRELIABLE,
    Crossover,
    DeployVerdict,
    LevelJudgement,
    OperatingPoint,
    check_identity,
    crossover,
    deploy_verdict,
)
from specproxy.schema import JUDGED_PEAK_KEY


@dataclass(frozen=True)
class JudgedPeak:
    """Where the lab judged the peak of a run whose top level it could not measure soundly, as it
    recorded it (:data:`~specproxy.schema.JUDGED_PEAK_KEY`)."""

    concurrency: int
    label: str  # judged at c=64: c=256 could not be measured on this machine
    why: str  # what each level above it showed

    def note(self) -> str:
        return (
            f"{self.label} ({self.why}): the lab moved the peak there and recorded it with the run; "
            "--peak-concurrency N judges it at another level"
        )


def judged_peak(experiment: dict[str, Any]) -> JudgedPeak | None:
    """The lab's record of a moved peak in the run's recorded experiment; None without one."""
    record = experiment.get(JUDGED_PEAK_KEY)
    if not isinstance(record, dict):
        return None
    level, label, why = (record.get(k) for k in ("concurrency", "label", "why"))
    if not (isinstance(level, int) and level > 0 and isinstance(label, str) and isinstance(why, str)):
        return None
    return JudgedPeak(level, label, why)


def operating_point(
    settings: Settings, info: dict[str, Any], unit: str
) -> tuple[OperatingPoint, str, JudgedPeak | None]:
    """The user's operating point on the run's load axis (``unit``): the command line's, else the
    experiment file's, else none (the deploy verdict then says what it assumed). A peak concurrency
    that neither gives is the lab's recorded one where it moved it (returned too), else none."""
    try:
        experiment = json.loads(info.get("config_json") or "{}")
    except ValueError:
        experiment = {}
    if not isinstance(experiment, dict):
        experiment = {}
    moved = judged_peak(experiment) if unit == "c" else None

    def pick(given: float | None, key: str) -> tuple[float | None, str]:
        if given is not None:
            return given, settings.peak_source if key.startswith("peak") else "command line"
        value = experiment.get(key)
        wanted = int if unit == "c" else (int, float)
        if isinstance(value, wanted) and not isinstance(value, bool) and value > 0:
            return float(value), "experiment file"
        return None, "assumed"

    if unit == "r":
        at, at_from = pick(settings.at_rate, "at_rate")
        peak, peak_from = pick(settings.peak_rate, "peak_rate")
    else:
        at, at_from = pick(settings.at_concurrency, "at_concurrency")
        peak, peak_from = pick(settings.peak_concurrency, "peak_concurrency")
        if peak_from != "assumed" or moved is None:
            moved = None
        else:
            peak, peak_from = float(moved.concurrency), moved.label
    parts = [
        f"operating point {load_name(at, unit)} ({at_from})" if at else "operating point: not given",
        f"peak {load_name(peak, unit)} ({peak_from})" if peak else "peak: not given",
    ]
    other = (
        (settings.at_concurrency, settings.peak_concurrency)
        if unit == "r"
        else (settings.at_rate, settings.peak_rate)
    )
    if any(v is not None for v in other):
        given = "--at-concurrency/--peak-concurrency" if unit == "r" else "--at-rate/--peak-rate"
        swept = "request rates" if unit == "r" else "concurrency levels"
        parts.append(f"{given} ignored: this run's levels are {swept}")
    return OperatingPoint(at, peak, unit), "; ".join(parts), moved


def arm_outcome(
    run: RunFigures,
    arm: str,
    rows: Sequence[LevelRow],
    point: OperatingPoint,
    confidence: dict[str, float],
    settings: Settings,
    failed: dict[str, str],
) -> ArmOutcome:
    arm_rows = [r for r in rows if r.arm == arm]
    first = arm_rows[0]
    kind = arm_kind(run, arm)
    reliable_rows = [r for r in arm_rows if r.reliable]
    compared = sum(r.compared for r in reliable_rows)
    identical = sum(r.identical for r in reliable_rows)
    cross: Crossover | None = None
    deploy: DeployVerdict | None = None
    text = "—" if kind == "baseline" else "n/a"
    judged = [r for r in arm_rows if r.verdict not in (None, FAILED)]
    if arm in failed:
        text = "n/a (every call failed)"
        deploy = DeployVerdict(FAILED, failed[arm]) if kind != "baseline" else None
    elif kind != "baseline" and judged:
        levels = [
            LevelJudgement(
                r.level_load,
                r.verdict or NO_CLEAR_GAIN,
                r.throughput_speedup,
                r.throughput_margin or 0.0,
                r.tokens_estimated,
                # the worst failure only: the note under the table lists the rest
                run.health[r.level].describe(limit=1) if r.level in run.health else "",
                r.rounds == 1,
                r.shadow,
            )
            for r in judged
            if r.level_load is not None and level_unit(r.level) == point.unit
        ]
        check = check_identity(identical, compared, confidence[arm], settings.thresholds)
        if levels:
            cross = crossover([(j.level, j.verdict) for j in levels])
            text = cross.describe([j.level for j in levels if j.verdict != UNRELIABLE], point.unit)
            deploy = deploy_verdict(levels, point, check)
        else:
            live = judged[0]
            deploy = rules.live_deploy_verdict(live.verdict or NO_CLEAR_GAIN, live.reason, shadow=live.shadow)
    return ArmOutcome(
        arm=arm,
        role=first.role,
        spec_method=first.spec_method,
        kind=kind,
        crossover=cross,
        crossover_text=text,
        deploy=deploy,
        compared=compared,
        mismatched=compared - identical,
        near_tie=sum(r.near_tie for r in reliable_rows),
        gross=sum(r.gross for r in reliable_rows),
    )
