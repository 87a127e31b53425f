"""The verdict table as text: aligned table, Markdown, CSV, JSON.

Printed precision (the tests check every printed digit against an independent computation): tok/s
one decimal, TTFT in milliseconds one decimal, acceptance rate in percent one decimal, acceptance
length two decimals, speedups two decimals. CSV and JSON carry full precision.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Collection, Sequence
from dataclasses import asdict
from datetime import datetime
from typing import Any

from specproxy.analysis.figures.provenance import TEXT_ESTIMATE_ERROR
from specproxy.analysis.render import slo_table as render_slo
from specproxy.analysis.render.columns import (
    ALL_KEYS,
    DASH,
    ESTIMATED,
    HEADERS,
    chosen_columns,
    fmt_interval,
    fmt_level,
    row_cells,
    slowed_note,
    table_cells,
)
from specproxy.analysis.render.latency_table import (
    LATENCY_CSV_FIELDS,
    LATENCY_HEADERS,
    LATENCY_TITLE,
    latency_cells,
    latency_csv,
    latency_notes,
)
from specproxy.analysis.verdicts.evaluation import (
    CategoryRow,
    RunEvaluation,
    Settings,
    level_sort_key,
)

FORMATS = ("table", "markdown", "json", "csv")
# Names other modules read here, defined in .columns.
__all__ = ["FORMATS", "HEADERS", "fmt_interval", "fmt_level", "render", "row_cells"]


def _aligned(headers: Sequence[str], rows: list[list[str]], left: set[int] | None = None) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    left = {0, 1, len(headers) - 1} if left is None else left

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in pairs)

    rule = "  ".join("-" * w for w in widths)
    return "\n".join(x.rstrip() for x in [line(headers), rule, *(line(r) for r in rows)])


def _markdown(headers: Sequence[str], rows: list[list[str]]) -> str:
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def run_title(ev: RunEvaluation) -> str:
    bits = [f"run {ev.name}"]
    if ev.name != ev.run_id:
        bits[0] += f" ({ev.run_id})"
    if ev.mode:
        bits.append(str(ev.mode))
    bits.append(f"baseline: {ev.baseline}")
    bits.append(f"peak level: {fmt_level(ev.peak_level)}")
    if ev.operating_point:
        bits.append(ev.operating_point)
    return " · ".join(bits)


VERDICT_SHORT = {
    "WIN": "WIN",
    "LOSS": "LOSS",
    "NO CLEAR GAIN": "NCG",
    "UNRELIABLE": "UNREL",
    "FAILED": "FAILED",
}


def category_levels(ev: RunEvaluation) -> list[str]:
    return sorted({c.level for c in ev.categories}, key=level_sort_key)


# After a category cell whose verdict the level's throughput set (CategoryRow.set_by_level).
SET_BY_LEVEL = "†"


def category_cell(cat: CategoryRow | None) -> str:
    """A cell of the category matrix: P50 decode speedup and the verdict, short."""
    if cat is None:
        return DASH
    speed = DASH if cat.decode_speedup is None else f"{cat.decode_speedup.point:.2f}x"
    mark = SET_BY_LEVEL if cat.set_by_level else ""
    return f"{speed} {VERDICT_SHORT.get(cat.verdict or '', DASH)}{mark}"


CATEGORY_TITLE = (
    "by category: P50 decode speedup of that category's requests and its verdict (same rule, against the "
    f"level's aggregate throughput ratio; NCG = no clear gain; {SET_BY_LEVEL} = the level's throughput set "
    "the verdict, the category's own speed and identity alone would read otherwise)"
)


def category_matrix(ev: RunEvaluation) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): one row per candidate arm and category, one column per level."""
    levels = category_levels(ev)
    by_key = {(c.arm, c.category, c.level): c for c in ev.categories}
    keys = sorted({(c.arm, c.category) for c in ev.categories})
    rows = [[arm, cat, *(category_cell(by_key.get((arm, cat, lv))) for lv in levels)] for arm, cat in keys]
    return ["arm", "category", *(fmt_level(lv) for lv in levels)], rows


def deploy_lines(ev: RunEvaluation, indent: str = "    ") -> list[str]:
    """Each arm's overall verdict at the operating point, peak throughput included, in at most two
    lines: the verdict and what to do (with an SLO, its capacity there first), then the per-level
    verdicts and the two points it rests on, and what is at the margin, ``indent`` deeper. What was
    assumed is in the title."""
    lines = []
    for a in ev.arms:
        capacity = render_slo.headline(ev, a.arm)
        d = a.deploy
        first = f"{d.verdict} — {d.action or d.text}" if d is not None else ""
        if capacity:
            lines.append(f"{capacity}. {first}" if first else capacity)
        elif first:
            lines.append(f"{a.arm}: {first}")
        second = "; ".join(x for x in (d.summary, d.margin_sentence()) if x) if d is not None else ""
        if second:
            lines[-1] += f"\n{indent}{second}"
    return lines


def _assumed(ev: RunEvaluation) -> str:
    """What the deploy verdicts assumed (the same for every arm of a run), to say once."""
    assumed = sorted({a.deploy.assumed for a in ev.arms if a.deploy is not None and a.deploy.assumed})
    return f"; assumed: {'; '.join(assumed)}" if assumed else ""


def deploy_title(ev: RunEvaluation) -> str:
    """The deploy verdicts' title: what they assumed, and where the peak was moved to and why (the
    lab's label, when it could not measure its top level soundly)."""
    said = _assumed(ev) + (f"; {ev.peak_label}" if ev.peak_label else "")
    if ev.slo is None:
        return f"deploy verdict (at the operating point, peak throughput included{said})"
    return (
        f"deploy verdict at your SLO: {ev.slo.slo.describe()} (capacity at the SLO, then the verdict at "
        f"the operating point, peak throughput included{said})"
    )


def slo_block(ev: RunEvaluation, markdown: bool) -> str:
    """Goodput per level, capacity per arm and the fleet at the peak, when an SLO was given."""
    s = ev.slo
    if s is None:
        return ""
    headers, rows = render_slo.level_table(s)
    notes = render_slo.capacity_lines(s)
    fleet_headers, fleet_rows = render_slo.fleet_table(s)
    if markdown:
        text = f"\n\n{render_slo.title(s)}:\n\n{_markdown(headers, rows)}\n\n"
        text += "\n".join(f"- {n}" for n in notes)
        return text + (f"\n\n{_markdown(fleet_headers, fleet_rows)}" if fleet_rows else "")
    text = f"\n\n{render_slo.title(s)}\n{_aligned(headers, rows)}\n" + "\n".join(f"  {n}" for n in notes)
    return text + (f"\n{_aligned(fleet_headers, fleet_rows, left={0})}" if fleet_rows else "")


def run_notes(
    ev: RunEvaluation, settings: Settings, all_reasons: bool = True, shown: Collection[str] | None = None
) -> list[str]:
    """Crossover, identity triage and verdict reasons, one line each (``all_reasons=False``: the
    reasons of WIN rows, which only restate the rule, are left out; ``shown``: the keys of the columns
    printed, whose notes are kept; None: every column)."""
    lines: list[str] = list(ev.failed_arms)
    floor = ev.noise_floor
    floor_text = (
        f"noise floor (baseline vs baseline): {ev.noise_mismatched}/{ev.noise_compared} mismatched "
        f"({floor:.1%})"
        if floor is not None
        else "noise floor: n/a (no baseline replica or repeated call)"
    )
    for arm in ev.arms:
        if arm.kind == "baseline":
            continue
        lines.append(f"crossover {arm.arm}: {arm.crossover_text}")
    lines += _identity_notes(ev, settings, floor)
    lines.append(floor_text)
    lines += _interval_notes(ev, settings, ALL_KEYS if shown is None else shown)
    for row in ev.rows:
        if row.verdict and (all_reasons or row.verdict != "WIN"):
            # the margin's source is said once, in the margin note
            reason = (
                row.reason.replace(f" (margin {row.margin_source})", "") if row.margin_source else row.reason
            )
            lines.append(f"{row.arm} {fmt_level(row.level)}: {row.verdict}: {reason}")
    return lines + ev.notes


def _identity_notes(ev: RunEvaluation, settings: Settings, floor: float | None) -> list[str]:
    """Each candidate's mismatches and their triage; one line when none mismatched."""
    checked = [a for a in ev.arms if a.compared and a.kind != "baseline"]
    if len(checked) > 1 and not any(a.mismatched for a in checked):
        counts = ", ".join(f"{a.arm} 0/{a.compared}" for a in checked)
        return [f"identity: no candidate output differs from the baseline's ({counts} mismatched)"]
    lines = []
    for arm in checked:
        rate = arm.mismatched / arm.compared
        vs = f", {rate / floor:.1f}x the noise floor" if floor else ""
        unknown = arm.mismatched - arm.near_tie - arm.gross
        lines.append(
            f"identity {arm.arm}: {arm.mismatched}/{arm.compared} mismatched ({rate:.1%}{vs}): "
            f"{arm.near_tie} near-tie (margin ≤ {settings.near_tie_margin:g}), {arm.gross} gross, "
            f"{unknown} without margin"
        )
    return lines


def _interval_notes(ev: RunEvaluation, settings: Settings, shown: Collection[str]) -> list[str]:
    """What the intervals and margins are, once per run."""
    lines = []
    per_arm = sorted({(r.arm, r.confidence) for r in ev.rows if r.confidence is not None})
    if per_arm:
        confs = {conf for _, conf in per_arm}
        each = (
            f"{confs.pop():.2%} each"
            if len(confs) == 1
            else "each interval at: " + ", ".join(f"{arm} {conf:.2%}" for arm, conf in per_arm)
        )
        lines.append(
            f"intervals: {settings.confidence:.0%} jointly over the levels each arm's deploy verdict reads "
            f"(operating point and peak; Bonferroni, {each}), widened by the spread between rounds "
            "(or time blocks)"
        )
    # The margin is often run-wide (the replicas' median deviation over the levels): said once for the
    # levels that share it, then for each level whose own replica interval set another.
    margins = {r.level: r.margin_source for r in ev.rows if r.margin_source}
    shared: dict[str, list[str]] = {}
    for level, source in sorted(margins.items(), key=lambda x: level_sort_key(x[0])):
        shared.setdefault(source, []).append(level)
    for source, sharing in shared.items():
        named = ", ".join(fmt_level(lv) for lv in sharing)
        where = "every level" if len(sharing) == len(margins) > 1 else named
        lines.append(f"margin {where}: {source}")
    if any(r.drift_note for r in ev.rows) and "rounds" in shown:
        lines.append("rounds: * = 1 round: cannot see between-run drift")
    return lines + _source_notes(ev, shown)


def _source_notes(ev: RunEvaluation, shown: Collection[str]) -> list[str]:
    """Where the token counts and acceptance figures came from, where that is not plain measurement
    (the acceptance columns' source only when they are ``shown``)."""
    lines = []
    if any(r.tokens_estimated for r in ev.rows):
        lines.append(
            f"{ESTIMATED} = built on token counts estimated from the text (text_estimate, stated error "
            f"±{TEXT_ESTIMATE_ERROR:.0%}, which nine outputs in ten stay within): no WIN or LOSS on them. "
            "usage and tokenizer counts are exact; chunk counts are used only for arms whose chunks "
            "were seen to hold one token"
        )
    accept = {"accept_rate", "accept_len", "req_accept_len"} & set(shown)
    if accept and any(r.acceptance_length is not None or r.req_acceptance_source for r in ev.rows):
        lines.append(
            "accept rate, accept len: the engines' own /metrics counters; req accept len: the per-request "
            "figures the engine reported, 'est' where estimated from the stream shape"
        )
    for r in ev.rows if "req_accept_len" in shown else ():
        where = f"{r.arm} {fmt_level(r.level)}"
        if r.req_acceptance_source and "estimated" in r.req_acceptance_source:
            lines.append(f"req accept len {where}: {r.req_acceptance_source}, not reported by the engine")
        if r.req_acceptance_not_measured:
            lines.append(f"req accept len {where}: not measured for {r.req_acceptance_not_measured}")
    return lines


def render_table(evals: Sequence[RunEvaluation], settings: Settings, markdown: bool = False) -> str:
    return "\n\n".join(_run_block(ev, settings, markdown) for ev in evals) + "\n"


def _run_block(ev: RunEvaluation, settings: Settings, markdown: bool) -> str:
    """One run's table, its notes and the tables under it, as Markdown or as aligned text. The text
    form leaves out the reasons of WIN rows, which only restate the rule."""
    bullet = "- " if markdown else "  "
    columns = chosen_columns(settings.columns, ev.rows)
    headers = [c.header for c in columns]
    rows = [table_cells(columns, r, ev.time_scales.get(r.level)) for r in ev.rows]
    marked = slowed_note(columns, ev.time_scales)
    notes = "\n".join(
        bullet + n
        for n in ([marked] if marked else []) + run_notes(ev, settings, markdown, [c.key for c in columns])
    )
    if markdown:
        block = f"### {run_title(ev)}\n\n{_markdown(headers, rows)}\n\n{notes}"
    else:
        block = f"{run_title(ev)}\n{_aligned(headers, rows)}\n{notes}"
    cat_headers, cat_rows = category_matrix(ev)
    if cat_rows:
        block += _titled(CATEGORY_TITLE, _table(cat_headers, cat_rows, markdown), markdown)
    block += slo_block(ev, markdown=markdown)
    if any(a.deploy is not None or render_slo.headline(ev, a.arm) for a in ev.arms):
        lines = deploy_lines(ev, indent="  " if markdown else "    ")
        block += _titled(deploy_title(ev), "\n".join(bullet + d for d in lines), markdown)
    if settings.latency_table:
        lat_rows = [latency_cells(r) for r in ev.rows]
        block += _titled(LATENCY_TITLE, _table(LATENCY_HEADERS, lat_rows, markdown), markdown)
        block += "".join(f"\n{bullet}{n}" for n in latency_notes(ev.rows))
    return block


def _table(headers: Sequence[str], rows: list[list[str]], markdown: bool) -> str:
    """A table under a run's main one: Markdown, or aligned text with its two key columns on the left."""
    return _markdown(headers, rows) if markdown else _aligned(headers, rows, left={0, 1})


def _titled(title: str, body: str, markdown: bool) -> str:
    return f"\n\n{title}:\n\n{body}" if markdown else f"\n\n{title}\n{body}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def as_dicts(evals: Sequence[RunEvaluation]) -> list[dict[str, Any]]:
    out = []
    for ev in evals:
        d = asdict(ev)
        d["noise_floor"] = ev.noise_floor
        for row, rd in zip(ev.rows, d["rows"], strict=True):
            rd["identical_rate"] = row.identical_rate
        out.append(d)
    return out


def render_json(evals: Sequence[RunEvaluation], settings: Settings, skipped: Sequence[str] = ()) -> str:
    doc = {"settings": asdict(settings), "runs": as_dicts(evals), "skipped": list(skipped)}
    return json.dumps(doc, indent=2, default=_jsonable, ensure_ascii=False) + "\n"


CSV_FIELDS = (
    "run_id",
    "run_name",
    "level",
    "concurrency_level",
    "offered_rate",
    "arm",
    "category",
    "role",
    "spec_method",
    "calls",
    "ok",
    "completion_tokens",
    "wall_s",
    "agg_tok_s",
    "p50_decode_tok_s",
    "p50_ttft_s",
    "p95_ttft_s",
    "acceptance_rate",
    "acceptance_length",
    "req_acceptance_rate",
    "req_acceptance_length",
    "compared",
    "identical",
    "near_tie",
    "gross",
    "margin_unknown",
    "paired",
    "pairs",
    "decode_speedup",
    "decode_speedup_low",
    "decode_speedup_high",
    "throughput_ratio",
    "throughput_ratio_low",
    "throughput_ratio_high",
    "throughput_basis",
    "verdict",
    "reason",
    "baseline_p50_decode_tok_s",
    "rounds",
    "rounds_measured",
    "rounds_used",
    "rounds_dropped",
    "blocks",
    "drift_note",
    "confidence",
    "decode_margin",
    "throughput_margin",
    "margin_source",
    "reliable",
    "health",
    "load_basis",
    "load_p50",
    "baseline_load_p50",
    "matched_load_share",
    "unmatched_decode_speedup",
    "unmatched_throughput_ratio",
    "tokens_source",
    "own_tokens_estimated",
    "tokens_estimated",
    "estimate_note",
    "req_acceptance_source",
    "req_acceptance_not_measured",
    *render_slo.CSV_FIELDS,
    *LATENCY_CSV_FIELDS,
)


def render_csv(evals: Sequence[RunEvaluation]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_FIELDS)
    for ev in evals:
        for r in ev.rows:
            d = asdict(r)
            d.update(run_id=ev.run_id, run_name=ev.name)
            d.update(
                rounds_used=" ".join(str(n) for n in r.rounds_used) or None,
                rounds_dropped="; ".join(x.describe() for x in r.rounds_dropped) or None,
            )
            d.update(render_slo.csv_cells(ev, r))
            d.update(latency_csv(r))
            load = r.load
            d.update(
                load_basis=load.basis if load else None,
                load_p50=load.p50 if load else None,
                baseline_load_p50=load.baseline_p50 if load else None,
                matched_load_share=load.matched_share if load else None,
                unmatched_decode_speedup=r.unmatched_decode_speedup.point
                if r.unmatched_decode_speedup
                else None,
                unmatched_throughput_ratio=(
                    r.unmatched_throughput_speedup.point if r.unmatched_throughput_speedup else None
                ),
            )
            for key, iv in (("decode_speedup", r.decode_speedup), ("throughput_ratio", r.throughput_speedup)):
                d[key] = iv.point if iv else None
                d[f"{key}_low"] = iv.low if iv else None
                d[f"{key}_high"] = iv.high if iv else None
            writer.writerow(["" if d.get(f) is None else _jsonable(d.get(f)) for f in CSV_FIELDS])
        # the category rows: the same columns where they apply, `category` set
        for c in ev.categories:
            d = asdict(c)
            d.update(run_id=ev.run_id, run_name=ev.name, ok=None)
            for key, iv in (("decode_speedup", c.decode_speedup), ("throughput_ratio", c.throughput_speedup)):
                d[key] = iv.point if iv else None
                d[f"{key}_low"] = iv.low if iv else None
                d[f"{key}_high"] = iv.high if iv else None
            writer.writerow(["" if d.get(f) is None else _jsonable(d.get(f)) for f in CSV_FIELDS])
    return buf.getvalue()


def render(evals: Sequence[RunEvaluation], settings: Settings, fmt: str, skipped: Sequence[str] = ()) -> str:
    """The evaluations in one of :data:`FORMATS`; ``skipped`` runs are listed after the tables (table,
    markdown) or under "skipped" (json); CSV has rows only."""
    if fmt == "table":
        return render_table(evals, settings) + "".join(f"\n{s}\n" for s in skipped)
    if fmt == "markdown":
        return render_table(evals, settings, markdown=True) + "".join(f"\n- {s}\n" for s in skipped)
    if fmt == "json":
        return render_json(evals, settings, skipped)
    if fmt == "csv":
        return render_csv(evals)
    raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
