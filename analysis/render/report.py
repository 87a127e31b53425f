"""The self-contained HTML report: verdict table, plots (inline SVG), mismatches, each arm's stack.

Everything is in one file (CSS inline, no scripts, no fonts or images fetched), so it opens offline
and can be attached to a ticket.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any

from specproxy import __version__
from specproxy.analysis.figures.provenance import MEASURED_SPEC_SOURCES
from specproxy.analysis.figures.run_figures import CDF_QUANTILES, itl_cdf
from specproxy.analysis.figures.validity import MIN_HEALTHY_ROUNDS
from specproxy.analysis.levels import AXIS_LABEL, LEVEL_SQL, level_unit, run_unit
from specproxy.analysis.render.latency_table import (
    LATENCY_HEADERS,
    LATENCY_TITLE,
    latency_cells,
    latency_notes,
)
from specproxy.analysis.render.report_slo import slo_section
from specproxy.analysis.render.slo_table import headline
from specproxy.analysis.render.svg import PALETTE, Series, bar_chart, cdf_chart, line_chart
from specproxy.analysis.render.table import (
    CATEGORY_TITLE,
    HEADERS,
    VERDICT_SHORT,
    category_cell,
    category_levels,
    fmt_interval,
    fmt_level,
    row_cells,
    run_notes,
    run_title,
)
from specproxy.analysis.stats import Interval
from specproxy.analysis.store import SpanStore
from specproxy.analysis.verdicts.evaluation import CategoryRow, RunEvaluation, Settings, level_sort_key
from specproxy.analysis.verdicts.rules import DeployVerdict
from specproxy.schema import level_sql

MAX_MISMATCH_ROWS = 100
VERDICT_CSS = {"WIN": "WIN", "LOSS": "LOSS", "NO CLEAR GAIN": "NCG", "UNRELIABLE": "UNREL", "FAILED": "LOSS"}
MAX_CDF_LEVELS = 6
SNIPPET = 40

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px 32px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin-top: 22px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 12px; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: right; white-space: nowrap; }
th { background: #f4f4f4; white-space: normal; max-width: 110px; vertical-align: bottom; }
td.l, th.l { text-align: left; }
td.WIN { background: #d9f2d9; font-weight: 600; } td.LOSS { background: #f8d7d7; font-weight: 600; }
td.NCG { background: #fff3cd; } td.UNREL { background: #e2e3e5; color: #555; font-style: italic; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
.charts.small svg { width: 420px; height: auto; }
td.wrap { white-space: normal; max-width: 900px; }
svg { background: #fff; border: 1px solid #eee; }
svg .title { font-size: 13px; font-weight: 600; } svg .tick { font-size: 11px; fill: #444; }
svg .label { font-size: 12px; fill: #333; } svg .grid { stroke: #eee; } svg .axis { stroke: #888; }
svg .ref { stroke: #555; stroke-dasharray: 4 3; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 12px; max-width: 1300px; }
ul.notes li { margin: 2px 0; } .muted { color: #777; } code, .mono { font-family: ui-monospace, monospace; }
td.snip { text-align: left; white-space: pre-wrap; max-width: 520px; font-family: ui-monospace, monospace;
          font-size: 11.5px; }
mark { background: #ffd6d6; }
"""


def _colors(evals: Sequence[RunEvaluation]) -> dict[str, str]:
    """One color per arm name for the whole report (every run, every plot): baselines first, then the
    other arms by name, so an arm keeps its color whatever a plot or run happens to contain."""
    baselines = sorted({a.arm for ev in evals for a in ev.arms if a.kind == "baseline"})
    others = sorted({a.arm for ev in evals for a in ev.arms} - set(baselines))
    return {arm: PALETTE[i % len(PALETTE)] for i, arm in enumerate(baselines + others)}


def _arm_order(colors: dict[str, str]) -> dict[str, int]:
    """Legend order: the order of the color assignment (stable across plots)."""
    return {arm: i for i, arm in enumerate(colors)}


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], left: set[int], css: Sequence[str] = ()
) -> str:
    head = "".join(f'<th class="{"l" if i in left else ""}">{escape(h)}</th>' for i, h in enumerate(headers))
    body = []
    for r_i, row in enumerate(rows):
        cells = []
        for i, c in enumerate(row):
            cls = ("l " if i in left else "") + (css[r_i] if css and i == len(row) - 1 else "")
            cells.append(f'<td class="{cls.strip()}">{escape(c)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _verdict_table(ev: RunEvaluation) -> str:
    rows = [row_cells(r) for r in ev.rows]
    css = [VERDICT_CSS.get(r.verdict or "", "") for r in ev.rows]
    return _table(HEADERS, rows, {0, 1, len(HEADERS) - 1}, css)


def _level_charts(ev: RunEvaluation, colors: dict[str, str]) -> str:
    unit = run_unit(r.level for r in ev.rows)
    numeric = [r for r in ev.rows if r.level_load is not None and level_unit(r.level) == unit]
    if not numeric:
        return '<p class="muted">No replay levels (live traffic): see the "live" row of the table.</p>'
    x_label = AXIS_LABEL[unit]
    order = _arm_order(colors)
    arms = sorted(dict.fromkeys(r.arm for r in numeric), key=lambda a: order.get(a, len(order)))
    speed: list[Series] = []
    thr: list[Series] = []
    decode: list[Series] = []
    agg: list[Series] = []
    for arm in arms:
        # an UNRELIABLE level's figures are no evidence: plotted beside the others they would read as some
        rows = [r for r in numeric if r.arm == arm and r.reliable]
        color = colors[arm]
        decode.append(
            Series(
                arm,
                [
                    (r.level_load, r.p50_decode_tok_s)
                    for r in rows
                    if r.level_load and r.p50_decode_tok_s is not None
                ],
                color=color,
            )
        )
        agg.append(
            Series(
                arm,
                [(r.level_load, r.agg_tok_s) for r in rows if r.level_load and r.agg_tok_s is not None],
                color=color,
            )
        )
        if arm == ev.baseline:
            continue
        for target, attr in ((speed, "decode_speedup"), (thr, "throughput_speedup")):
            ivs = [(r.level_load, getattr(r, attr)) for r in rows if r.level_load]
            ivs = [(c, iv) for c, iv in ivs if iv is not None]
            target.append(_interval_series(arm, ivs, color))
    charts = [
        line_chart(
            speed,
            title="P50 decode speedup vs baseline (95% CI; UNRELIABLE levels left out)",
            x_label=x_label,
            y_label="speedup (x)",
            reference_y=1.0,
            y_from_zero=False,
        ),
        line_chart(
            thr,
            title="Aggregate throughput ratio vs baseline (95% CI; UNRELIABLE levels left out)",
            x_label=x_label,
            y_label="ratio (x)",
            reference_y=1.0,
            y_from_zero=False,
        ),
        line_chart(
            decode,
            title="P50 decode tok/s per request (UNRELIABLE levels left out)",
            x_label=x_label,
            y_label="tok/s",
        ),
        line_chart(
            agg,
            title="Aggregate tok/s over the time at each level (UNRELIABLE levels left out)",
            x_label=x_label,
            y_label="tok/s",
        ),
    ]
    return '<div class="charts">' + "".join(charts) + "</div>"


def _interval_series(arm: str, ivs: Sequence[tuple[float, Interval]], color: str) -> Series:
    """A line through the intervals' points at each load, shaded between their bounds where known."""
    return Series(
        arm,
        [(x, iv.point) for x, iv in ivs],
        band=[(x, iv.low, iv.high) for x, iv in ivs if iv.low is not None and iv.high is not None],
        color=color,
    )


def _ttft_charts(store: SpanStore, ev: RunEvaluation, colors: dict[str, str]) -> str:
    rows = store.query(
        f"""
        SELECT arm, {LEVEL_SQL} AS level,
               quantile_cont(ttft_s, [i / 100 for i in range(101)]) AS q
        FROM requests WHERE run_id = ? AND status = 'ok' AND ttft_s IS NOT NULL
        GROUP BY ALL
    """,
        [ev.run_id],
    )
    order = _arm_order(colors)
    # an UNRELIABLE level's latencies show the machine, not the arms
    levels = sorted({r["level"] for r in rows} - set(ev.unreliable_levels), key=level_sort_key)
    if not levels:
        why = "every level with one was UNRELIABLE" if rows else "no streamed calls"
        return f'<p class="muted">No TTFT chart ({why}).</p>'
    shown = (
        levels
        if len(levels) <= MAX_CDF_LEVELS
        else [levels[round(i * (len(levels) - 1) / (MAX_CDF_LEVELS - 1))] for i in range(MAX_CDF_LEVELS)]
    )
    charts = []
    for level in dict.fromkeys(shown):
        series = [
            Series(
                r["arm"],
                [(q * 1000.0, i / 100) for i, q in enumerate(r["q"])],
                color=colors.get(r["arm"], "#000"),
            )
            for r in sorted(rows, key=lambda r: (order.get(r["arm"], len(order)), r["arm"]))
            if r["level"] == level
        ]
        charts.append(cdf_chart(series, title=f"TTFT CDF at {fmt_level(level)}", x_label="TTFT (ms)"))
    note = (
        ""
        if len(shown) == len(levels)
        else f'<p class="muted">{len(shown)} of {len(levels)} levels shown.</p>'
    )
    return note + '<div class="charts">' + "".join(charts) + "</div>"


def operating_level(ev: RunEvaluation) -> tuple[str, str] | None:
    """The level the report's operating-point charts show, and why: the tested level nearest the
    operating point, else the lowest reliable level (the deploy verdict assumes the lowest tested one,
    but a chart of a level that failed its health checks would show the machine, not the arms), else
    live."""
    numeric = sorted({r.concurrency_level for r in ev.rows if r.concurrency_level is not None})
    if ev.at_concurrency is not None and numeric:
        at = ev.at_concurrency
        nearest = min(numeric, key=lambda c: (abs(c - at), c))
        if nearest == at:
            return str(at), f"c={at}, the operating point"
        return str(nearest), f"c={nearest}, the tested level nearest the operating point c={at}"
    reliable = sorted({c for c in numeric if all(r.reliable for r in ev.rows if r.concurrency_level == c)})
    if reliable:
        return str(reliable[0]), f"c={reliable[0]}: no operating point given, the lowest reliable level"
    if any(r.level == "live" for r in ev.rows):
        return "live", "live traffic"
    return None


def _latency(store: SpanStore, ev: RunEvaluation, colors: dict[str, str]) -> str:
    """The latency table, and the inter-token latency CDF per arm at the operating point."""
    table = f'<p class="muted">{escape(LATENCY_TITLE)}</p>' + _table(
        LATENCY_HEADERS, [latency_cells(r) for r in ev.rows], {0, 1}
    )
    table += "".join(f'<p class="muted">{escape(n)}</p>' for n in latency_notes(ev.rows))
    point = operating_level(ev)
    cdfs = itl_cdf(store, ev.run_id, point[0]) if point is not None else {}
    if point is None or not cdfs:
        return table + '<p class="muted">No inter-token latency measured (no stream of two chunks).</p>'
    level, why = point
    order = _arm_order(colors)
    arms = sorted(cdfs, key=lambda a: (order.get(a, len(order)), a))
    series = [
        Series(
            arm,
            [(q * 1000.0, f) for q, f in zip(cdfs[arm], CDF_QUANTILES, strict=True)],
            color=colors.get(arm, "#000"),
        )
        for arm in arms
    ]
    stalls = {
        r.arm: f", largest stall {r.latency.max_stall_s * 1000:.1f} ms"
        for r in ev.rows
        if r.level == level and r.latency is not None and r.latency.max_stall_s is not None
    }
    caption = "; ".join(
        f"{arm}: P50 {cdfs[arm][50] * 1000:.1f} ms, P99 {cdfs[arm][99] * 1000:.1f} ms{stalls.get(arm, '')}"
        for arm in arms
    )
    chart = cdf_chart(
        series,
        title=f"Inter-token latency CDF at {fmt_level(level)}",
        x_label="gap between content chunks (ms)",
        y_label="fraction of gaps",
    )
    return (
        table
        + f'<p class="muted">At {escape(why)}: every gap between content chunks of the level\'s ok calls, '
        f"up to the 99.9th percentile ({escape(caption)}).</p>" + f'<div class="charts">{chart}</div>'
    )


def _acceptance_by_category(store: SpanStore, ev: RunEvaluation, colors: dict[str, str]) -> str:
    # only measured figures: the engine's report, or a stream-shape estimate whose conditions held
    rows = store.query(
        """
        SELECT arm, coalesce(category, '(none)') AS category,
               coalesce(1 + sum(accepted_tokens) / nullif(sum(num_drafts), 0), avg(acceptance_length)) AS len,
               count(*) AS n, count(*) FILTER (WHERE spec_source = 'stream_shape') AS estimated
        FROM requests
        WHERE run_id = $run AND status = 'ok' AND list_contains($measured, spec_source)
          AND (accepted_tokens IS NOT NULL OR acceptance_length IS NOT NULL)
        GROUP BY ALL
    """,
        {"run": ev.run_id, "measured": list(MEASURED_SPEC_SOURCES)},
    )
    rows = [r for r in rows if r["len"] is not None]
    if not rows:
        return (
            '<p class="muted">No per-request acceptance figures (the backends did not report them; see '
            "the /metrics-based columns of the table).</p>"
        )
    groups = sorted({r["category"] for r in rows})
    order = _arm_order(colors)
    arms = sorted({r["arm"] for r in rows}, key=lambda a: (order.get(a, len(order)), a))
    series = [
        Series(
            arm,
            [(groups.index(r["category"]), r["len"]) for r in rows if r["arm"] == arm],
            color=colors.get(arm, "#000"),
        )
        for arm in arms
    ]
    # arm × category matrix: "3.11 (144)" = mean acceptance length over 144 calls
    cells = {
        (r["arm"], r["category"]): f"{r['len']:.2f} ({r['n']}{', est' if r['estimated'] else ''})"
        for r in rows
    }
    table = _table(
        ["arm", *groups],
        [[arm, *(cells.get((arm, g), "—") for g in groups)] for arm in arms],
        {0},
    )
    chart = bar_chart(
        groups, series, title="Mean acceptance length by category", y_label="tokens per step", reference_y=1.0
    )
    note = (
        '<p class="muted">Cells: mean acceptance length (calls), from the per-request figures the engines '
        'reported; "est": some were estimated from the stream shape. Calls whose stream-shape estimate '
        "was unreliable, or whose acceptance is unknown, are left out: not measured.</p>"
    )
    return f'<div class="charts">{chart}<div>{table}{note}</div></div>'


def _deploy(ev: RunEvaluation) -> str:
    items = []
    for a in ev.arms:
        if a.deploy is None:
            continue
        cls = VERDICT_CSS.get(a.deploy.verdict, "")
        items.append(
            f'<tr><td class="l"><b>{escape(a.arm)}</b></td>'
            f'<td class="l {cls}">{escape(a.deploy.verdict)}</td>'
            f'<td class="l wrap">{escape(_deploy_text(ev, a.arm, a.deploy))}</td></tr>'
        )
    if not items:
        return ""
    return (
        '<table class="deploy"><thead><tr><th class="l">arm</th><th class="l">deploy verdict</th>'
        '<th class="l">per level, at the operating point and at the peak</th></tr></thead><tbody>'
        + "".join(items)
        + "</tbody></table>"
    )


def _deploy_text(ev: RunEvaluation, arm: str, deploy: DeployVerdict) -> str:
    """The deploy verdict's sentence, led by the arm's capacity at the SLO when one was given, and
    what is at the margin after it."""
    capacity = headline(ev, arm)
    text = f"{deploy.text}; {deploy.margin_sentence()}" if deploy.at_margin else deploy.text
    return f"{capacity}. {text}" if capacity else text


def _deploy_heading(ev: RunEvaluation) -> str:
    return f"Deploy verdict at your SLO: {ev.slo.slo.describe()}" if ev.slo is not None else "Deploy verdict"


def _category_title(c: CategoryRow) -> str:
    """The cell's tooltip: the figures behind it."""
    return (
        f"{c.arm} · {c.category} · {fmt_level(c.level)}: decode speedup {fmt_interval(c.decode_speedup)}, "
        f"per-call throughput ratio {fmt_interval(c.throughput_speedup)}, "
        f"identical {c.identical}/{c.compared}, "
        f"{c.calls} calls{'' if c.paired else ' (unpaired)'} — {c.verdict}: {c.reason}"
    )


def _categories(ev: RunEvaluation, colors: dict[str, str]) -> str:
    if not ev.categories:
        return '<p class="muted">No per-category figures (the spans carry no category, or no baseline).</p>'
    levels = category_levels(ev)
    by_key = {(c.arm, c.category, c.level): c for c in ev.categories}
    keys = sorted({(c.arm, c.category) for c in ev.categories})
    head = '<th class="l">arm</th><th class="l">category</th>' + "".join(
        f"<th>{escape(fmt_level(lv))}</th>" for lv in levels
    )
    body = []
    for arm, cat in keys:
        cells = [f'<td class="l">{escape(arm)}</td><td class="l">{escape(cat)}</td>']
        for lv in levels:
            c = by_key.get((arm, cat, lv))
            cls = VERDICT_SHORT.get(c.verdict or "", "") if c else ""
            title = escape(_category_title(c)) if c else ""
            cells.append(f'<td class="{cls}" title="{title}">{escape(category_cell(c))}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    # small multiples: one chart per category, decode speedup vs load per arm with its CI band
    order = _arm_order(colors)
    arms = sorted({c.arm for c in ev.categories}, key=lambda a: (order.get(a, len(order)), a))
    # one y axis for every category, so the panels compare at a glance; UNRELIABLE levels left out, as
    # in the level charts (their intervals are no evidence, and would set the axis)
    judged = [c for c in ev.categories if c.verdict != "UNRELIABLE"]
    extent = [
        v
        for c in judged
        if c.level_load and c.decode_speedup is not None
        for v in (c.decode_speedup.point, c.decode_speedup.low, c.decode_speedup.high)
        if v is not None
    ]
    y_extent = (min(extent), max(extent)) if extent else ()
    charts = []
    for cat in sorted({c.category for c in ev.categories}):
        series = []
        for arm in arms:
            ivs = [
                (c.level_load, c.decode_speedup)
                for c in judged
                if c.arm == arm and c.category == cat and c.level_load and c.decode_speedup is not None
            ]
            series.append(_interval_series(arm, ivs, colors.get(arm, "#000")))
        if any(s.points for s in series):
            charts.append(
                line_chart(
                    series,
                    title=f"{cat}: P50 decode speedup (95% CI; UNRELIABLE levels left out)",
                    x_label=AXIS_LABEL[run_unit(c.level for c in ev.categories)],
                    y_label="speedup (x)",
                    reference_y=1.0,
                    y_from_zero=False,
                    y_extent=y_extent,
                )
            )
    small = f'<div class="charts small">{"".join(charts)}</div>' if charts else ""
    intro = escape(CATEGORY_TITLE[0].upper() + CATEGORY_TITLE[1:])
    return f"<p>{intro}. Hover a cell for its figures.</p>{table}{small}"


def _snippets(cand: str | None, base: str | None) -> tuple[str, str]:
    """±SNIPPET characters around the first differing character of the two texts (HTML, marked)."""
    if cand is None or base is None:
        return "", ""
    i = next(
        (k for k, (a, b) in enumerate(zip(cand, base, strict=False)) if a != b), min(len(cand), len(base))
    )
    lo = max(0, i - SNIPPET)

    def cut(text: str) -> str:
        pre = ("…" if lo else "") + escape(text[lo:i])
        post = text[i : i + SNIPPET]
        return (
            pre
            + "<mark>"
            + escape(post[:1])
            + "</mark>"
            + escape(post[1:])
            + ("…" if len(text) > i + SNIPPET else "")
        )

    return cut(cand), cut(base)


def _mismatch_rows(store: SpanStore, run_id: str, wanted: int) -> list[dict[str, Any]]:
    """Up to ``wanted`` mismatches, gross ones first.

    Candidate spans the proxy marked ``identical = false`` are found by a scan of ``requests`` (the
    baseline's text fetched for just those); only when that finds fewer (mismatches seen by comparing
    output hashes, baseline repeats) does it take the full pass over ``pairs``.
    """
    kind = "CASE WHEN coalesce(c.spec_method, 'none') IN ('none', '') THEN 'replica' ELSE 'candidate' END"
    rows = store.query(
        f"""
        WITH c AS (
            SELECT * FROM requests
            WHERE run_id = $run AND arm_role <> 'baseline' AND identical = false
            ORDER BY abs(divergence_margin) DESC NULLS LAST, arm, request_id
            LIMIT {int(wanted)}
        ), b AS (
            SELECT request_id, arg_min(output_text, (status <> 'ok', t_start)) AS text
            FROM requests
            WHERE run_id = $run AND arm_role = 'baseline' AND request_id IN (SELECT request_id FROM c)
            GROUP BY request_id
        )
        SELECT c.arm, {kind} AS kind, {level_sql("c")} AS level,
               c.request_id, c.category, c.first_divergence, abs(c.divergence_margin) AS divergence_margin,
               c.output_text, b.text AS baseline_output_text
        FROM c LEFT JOIN b USING (request_id)
        ORDER BY kind, c.arm, c.concurrency_level NULLS LAST, c.offered_rate NULLS LAST,
                 divergence_margin DESC NULLS LAST, c.request_id
        """,
        {"run": run_id},
    )
    if len(rows) >= wanted:
        return rows
    return store.query(
        f"""
        SELECT arm, kind, level, request_id, category, first_divergence, divergence_margin,
               output_text, baseline_output_text
        FROM pairs WHERE run_id = ? AND NOT identical
        ORDER BY kind, arm, concurrency_level NULLS LAST, offered_rate NULLS LAST,
                 divergence_margin DESC NULLS LAST, request_id
        LIMIT {int(wanted)}
        """,
        [run_id],
    )


def _mismatches(store: SpanStore, ev: RunEvaluation, settings: Settings) -> str:
    # totals from the evaluation (every comparison of the run, baseline repeats included): no extra pass
    compared = sum(r.compared for r in ev.rows)
    total = compared - sum(r.identical for r in ev.rows)
    if not total:
        return f"<p>No mismatches among {compared} compared outputs.</p>"
    rows = _mismatch_rows(store, ev.run_id, min(total, MAX_MISMATCH_ROWS))
    head = [
        "arm",
        "kind",
        "level",
        "request_id",
        "category",
        "first divergence",
        "margin",
        "triage",
        "candidate text",
        "baseline text",
    ]
    body = []
    for r in rows:
        margin = r["divergence_margin"]
        triage = (
            "unknown" if margin is None else ("near-tie" if margin <= settings.near_tie_margin else "gross")
        )
        cand, base = _snippets(r["output_text"], r["baseline_output_text"])
        cells = [
            r["arm"],
            r["kind"],
            fmt_level(r["level"]),
            r["request_id"],
            r["category"] or "",
            "" if r["first_divergence"] is None else str(r["first_divergence"]),
            "" if margin is None else f"{margin:.3f}",
            triage,
        ]
        body.append(
            "<tr>"
            + "".join(f'<td class="l">{escape(c)}</td>' for c in cells)
            + f'<td class="snip">{cand}</td><td class="snip">{base}</td></tr>'
        )
    more = f'<p class="muted">First {len(rows)} of {total} mismatches.</p>' if total > len(rows) else ""
    heads = "".join(f'<th class="l">{escape(h)}</th>' for h in head)
    return f"{more}<table><thead><tr>{heads}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _stack_facts(stack: Any) -> list[tuple[str, str]]:
    """The few facts of an arm's stack worth a glance: version, role, url, models, speculation."""
    if not isinstance(stack, dict):
        return []
    facts: list[tuple[str, str]] = []
    for key in ("version", "role", "url", "description"):
        if stack.get(key):
            facts.append((key, str(stack[key])))
    models = stack.get("models")
    if isinstance(models, dict) and isinstance(models.get("data"), list):
        ids = [str(m.get("id")) for m in models["data"] if isinstance(m, dict)]
        facts.append(("models", ", ".join(ids)))
    if stack.get("speculative"):
        facts.append(("speculative", json.dumps(stack["speculative"], sort_keys=True)))
    if stack.get("engine"):
        facts.append(("engine", json.dumps(stack["engine"], sort_keys=True, default=str)))
    if stack.get("errors"):
        facts.append(("errors", json.dumps(stack["errors"], sort_keys=True, default=str)))
    return facts


def _stacks(ev: RunEvaluation) -> str:
    if not ev.stacks:
        return '<p class="muted">No stack recorded for this run (runs.stacks_json is empty).</p>'
    rows = []
    for arm, stack in ev.stacks.items():
        facts = "".join(f"<li><b>{escape(k)}</b>: {escape(v)}</li>" for k, v in _stack_facts(stack))
        full = escape(json.dumps(stack, indent=2, default=str))
        rows.append(
            f'<h4>{escape(str(arm))}</h4><ul class="notes">{facts}</ul>'
            f"<details><summary>everything recorded</summary><pre>{full}</pre></details>"
        )
    return "".join(rows)


def _rules_text(settings: Settings) -> str:
    """The verdict rules, in one paragraph at the top of the report."""
    t = settings.thresholds
    return (
        f"Per arm and level: WIN when the decode speedup's lower bound is above 1 + margin, the throughput "
        f"ratio's lower bound is not below 1 − margin and identity holds; LOSS when the decode speedup's or "
        f"the throughput ratio's upper bound is below 1 − margin, or the mismatch rate is surely above "
        f"{1 - t.identity_min:.0%} (Wilson interval); NO CLEAR GAIN otherwise; UNRELIABLE when the level "
        f"failed the measurement's health checks (no verdict, left out of crossovers; a level with a round "
        f"that failed is judged on the rounds that passed when at least {MIN_HEALTHY_ROUNDS} did and no "
        f"check of the whole level failed). A level whose token counts (the arm's or the baseline's) were "
        f"estimated from the text gets no WIN or LOSS on its speeds (marked ~); FAILED when every call of "
        f"the arm failed (its first error is listed). The margin is {t.min_margin:.0%}, or when larger the "
        f"replica arms' measured noise floor: the median of their deviations from 1x over the run's reliable "
        f"levels, or how far a replica's interval at the level lies from 1x. The deploy verdict answers at "
        f"the operating point, with aggregate throughput at the peak surely not lower beyond the margin "
        f"(WIN) or surely lower (LOSS); not given, they are the lowest and the highest tested level, and a "
        f"point at a level that failed its health checks makes it UNRELIABLE unless the other already gives "
        f"a LOSS. Shadow traffic (a candidate's copies reach it at the baseline's pace, so its throughput "
        f"is the baseline's by construction) shows no throughput ratio: its WIN rests on the decode "
        f"speedup and identity, and its deploy verdict never passes the peak throughput test (capacity "
        f"stays open: a replay sweep, the lab or a split answers it). Aggregate tok/s is the tokens over "
        f"the time the arm spent at the level, summed over its visits. Intervals: "
        f"{settings.confidence:.0%} jointly over the levels each arm's deploy verdict "
        f"reads, the operating point's and the peak's (Bonferroni), "
        f"bootstrap ({settings.bootstrap_iterations} resamples, seed {settings.bootstrap_seed}) widened by "
        f"the spread between replay rounds (or time blocks of a one-round level)."
    )


def build_report(
    store: SpanStore, evals: Sequence[RunEvaluation], settings: Settings, skipped: Sequence[str] = ()
) -> str:
    """The whole HTML document for the evaluated runs."""
    sections = []
    colors = _colors(evals)
    for ev in evals:
        reasons = [n for n in run_notes(ev, settings) if n not in run_notes(ev, settings, all_reasons=False)]
        notes = "".join(f"<li>{escape(n)}</li>" for n in run_notes(ev, settings, all_reasons=False))
        if reasons:
            why = "".join(f"<li>{escape(n)}</li>" for n in reasons)
            notes += (
                f'<li><details><summary>why each WIN</summary><ul class="notes">{why}</ul></details></li>'
            )

        started = (
            ev.started_at.isoformat() if isinstance(ev.started_at, datetime) else str(ev.started_at or "")
        )
        sections.append(f"""
<section>
<h2>{escape(run_title(ev))}</h2>
<p class="muted">run_id <span class="mono">{escape(ev.run_id)}</span> · source {escape(str(ev.source))}
 · started {escape(started)}</p>
<h3>{escape(_deploy_heading(ev))}</h3>
{_deploy(ev)}
{slo_section(ev.slo)}
<h3>Verdicts per level</h3>
{_verdict_table(ev)}
<ul class="notes">{notes}</ul>
<h3>Verdicts by workload category</h3>
{_categories(ev, colors)}
<h3>Speed and throughput vs load</h3>
{_level_charts(ev, colors)}
<h3>Time to first token</h3>
{_ttft_charts(store, ev, colors)}
<h3>Latency: TPOT, inter-token latency, E2E, tokens per chunk</h3>
{_latency(store, ev, colors)}
<h3>Acceptance length by category</h3>
{_acceptance_by_category(store, ev, colors)}
<h3>Mismatches (first divergence)</h3>
{_mismatches(store, ev, settings)}
<h3>Stacks</h3>
{_stacks(ev)}
</section>""")
    rules = _rules_text(settings)
    files = ", ".join(escape(str(p)) for p in store.paths)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>specproxy report</title>
<style>{CSS}</style></head>
<body>
<h1>specproxy: does speculative decoding pay?</h1>
<p class="muted">From {files} · generated {generated} by specproxy {__version__}</p>
<p>{rules}</p>
{"".join(f'<p class="muted">{escape(s)}</p>' for s in skipped)}
{"".join(sections)}
</body></html>
"""
