"""The figures at the user's SLO as text: goodput per level, capacity per arm, the fleet at the peak;
and the CSV columns that carry them. Shared by :mod:`.render` and :mod:`.report`."""

from __future__ import annotations

from typing import Any

from specproxy.analysis.slo.answer import SloEvaluation, SloLevelRow, TargetFigure
from specproxy.analysis.slo.fleet import ArmFleet, CountRange
from specproxy.analysis.slo.goodput import FAILED_FACTOR
from specproxy.analysis.stats import Interval
from specproxy.analysis.verdicts.rows import LevelRow, RunEvaluation

DASH = "—"


def _level_name(r: SloLevelRow) -> str:
    """A level as the verdict table names it: c=4, r=2."""
    return f"c={r.level}" if r.level.isdigit() else r.level


def fmt_band(iv: Interval | None, digits: int, scale: float = 1.0) -> str:
    if iv is None:
        return DASH
    text = f"{iv.point * scale:.{digits}f}"
    if iv.low is None or iv.high is None:
        return text
    return f"{text} [{iv.low * scale:.{digits}f}, {iv.high * scale:.{digits}f}]"


def fmt_target(t: TargetFigure) -> str:
    """A target's percentile in ms with its interval, and ✓/✗ against the threshold."""
    if t.value is None:
        return "not checked" if t.missing else DASH
    if t.value.point >= t.threshold_s * FAILED_FACTOR:
        return "✗ failed calls"
    return f"{'✓' if t.holds else '✗'} {fmt_band(t.value, 0 if t.value.point >= 1 else 1, 1000.0)}"


def fmt_holds(row: SloLevelRow) -> str:
    verdict = "not checked" if row.holds is None else "holds" if row.holds else "fails"
    return verdict if row.reliable else f"{verdict} (UNRELIABLE)"


def level_table(s: SloEvaluation) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): one row per arm and level."""
    headers = [
        "level",
        "arm",
        "met/calls",
        "met share [95% CI]",
        "goodput req/s [95% CI]",
        "goodput tok/s [95% CI]",
        *(f"{t.name} ms [95% CI]" for t in s.slo.targets),
        "SLO",
    ]
    rows = []
    for r in s.levels:
        rows.append(
            [
                _level_name(r),
                r.arm,
                f"{r.met}/{r.calls}",
                fmt_band(r.share, 1, 100.0),
                fmt_band(r.requests_per_s, 2),
                fmt_band(r.tokens_per_s, 1),
                *(fmt_target(t) for t in r.targets),
                fmt_holds(r),
            ]
        )
    return headers, rows


def fmt_money(value: float | None, digits: int = 2) -> str:
    return DASH if value is None else f"${value:,.{digits}f}"


def fleet_table(s: SloEvaluation) -> tuple[list[str], list[list[str]]]:
    headers = [
        "arm",
        "GPUs per replica",
        "replicas [95% CI]",
        "GPUs [95% CI]",
        "$ per hour",
        "goodput tok/s at peak",
        "$ per M output tokens",
        "GPUs saved [95% CI]",
    ]
    return headers, [fleet_cells(f) for f in s.fleet]


def fmt_count(point: int | None, at_most: bool, span: CountRange | None) -> str:
    """ "5 [≤4, 13]": the count at the capacity, and the counts at its interval's ends (≤ where the
    capacity may lie above the top tested load, ≥ where it may lie below the lowest)."""
    if point is None:
        return DASH
    text = f"{'≤' if at_most else ''}{point}"
    if span is None:
        return text
    low = f"{'≤' if span.low_open else ''}{span.low}"
    high = f"{'≥' if span.high_open else ''}{span.high}"
    return f"{text} [{low}, {high}]"


def fleet_cells(f: ArmFleet) -> list[str]:
    return [
        f.arm,
        str(f.gpus_per_replica),
        fmt_count(f.replicas, f.at_most, f.replicas_range),
        fmt_count(f.gpus, f.at_most, f.gpus_range),
        fmt_money(f.cost_per_hour),
        DASH if f.tokens_per_s is None else f"{f.tokens_per_s:.1f}",
        fmt_money(f.cost_per_million_tokens, 3),
        fmt_percent(f.saving, f.saving_open),
    ]


def fmt_percent(iv: Interval | None, open_ends: tuple[bool, bool] = (False, False)) -> str:
    """ "20% [≤-75%, 69%]": ≤ (≥) where the saving may lie below (above) that end."""
    if iv is None:
        return DASH
    if iv.low is None or iv.high is None:
        return f"{iv.point:.0%}"
    low, high = f"{'≤' if open_ends[0] else ''}{iv.low:.0%}", f"{'≥' if open_ends[1] else ''}{iv.high:.0%}"
    return f"{iv.point:.0%} [{low}, {high}]"


def title(s: SloEvaluation) -> str:
    return f"at your SLO ({s.slo.describe()}; from the {s.source})"


def capacity_lines(s: SloEvaluation) -> list[str]:
    """Each arm's capacity sentence, then what was left out and how the fleet was sized."""
    lines = [a.headline for a in s.arms]
    for a in s.arms:
        if a.left_out:
            lines.append(f"capacity {a.arm}: left out {', '.join(a.left_out)}")
    if s.peak is not None:
        price = (
            f", {fmt_money(s.gpu_hour_usd)} per GPU-hour"
            if s.gpu_hour_usd
            else ", no --gpu-hour-usd: GPUs only"
        )
        lines.append(f"fleet at peak {s.peak.describe()} ({s.peak.source}){price}:")
    lines += [f"GPUs per replica {f.arm}: {f.gpus_per_replica} ({f.gpus_source})" for f in s.fleet]
    lines += [f"fleet {f.arm}: {f.note}" for f in s.fleet if f.note]
    lines += [
        f"fleet {f.arm}: held the SLO at every tested level, so ≤ replicas" for f in s.fleet if f.at_most
    ]
    lines += [f"{r.arm} {_level_name(r)}: {r.note}" for r in s.levels if r.note]
    return lines + s.notes


def headline(ev: RunEvaluation, arm: str) -> str:
    """The arm's capacity sentence, when an SLO was given ("" otherwise)."""
    if ev.slo is None:
        return ""
    return next((a.headline for a in ev.slo.arms if a.arm == arm), "")


CSV_FIELDS = (
    "slo",
    "slo_met",
    "slo_share",
    "slo_share_low",
    "slo_share_high",
    "goodput_req_s",
    "goodput_req_s_low",
    "goodput_req_s_high",
    "goodput_tok_s",
    "goodput_tok_s_low",
    "goodput_tok_s_high",
    "slo_percentiles_s",
    "slo_holds",
    "capacity_at_slo",
    "capacity_at_slo_low",
    "capacity_at_slo_high",
    "capacity_state",
    "capacity_ratio",
    "capacity_ratio_low",
    "capacity_ratio_high",
)


def _spread(key: str, iv: Interval | None) -> dict[str, Any]:
    return {
        key: iv.point if iv else None,
        f"{key}_low": iv.low if iv else None,
        f"{key}_high": iv.high if iv else None,
    }


def csv_cells(ev: RunEvaluation, row: LevelRow) -> dict[str, Any]:
    """The SLO columns of one verdict-table row (the arm's capacity repeated on each of its rows)."""
    s = ev.slo
    if s is None:
        return {}
    lv = next((r for r in s.levels if r.arm == row.arm and r.level == row.level), None)
    arm = next((a for a in s.arms if a.arm == row.arm), None)
    out: dict[str, Any] = {"slo": s.slo.describe()}
    if lv is not None:
        out.update(slo_met=lv.met, slo_holds=lv.holds)
        out.update(_spread("slo_share", lv.share) | _spread("goodput_req_s", lv.requests_per_s))
        out.update(_spread("goodput_tok_s", lv.tokens_per_s))
        out["slo_percentiles_s"] = ";".join(
            f"{t.name}={t.value.point:.6g}" if t.value else f"{t.name}=" for t in lv.targets
        )
    if arm is not None and arm.capacity is not None:
        c = arm.capacity
        out.update(
            capacity_at_slo=c.crossing.load,
            capacity_at_slo_low=c.low,
            capacity_at_slo_high=c.high,
            capacity_state=c.crossing.state,
        )
    if arm is not None and arm.ratio is not None:
        r = arm.ratio
        out.update(capacity_ratio=r.point, capacity_ratio_low=r.low, capacity_ratio_high=r.high)
    return out
