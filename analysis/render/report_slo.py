"""The report's section at the user's SLO: a capacity chart per arm (each target's percentile against
the load, the SLO line, the crossing marked), the goodput table and the fleet at the peak."""

from __future__ import annotations

from html import escape

from specproxy.analysis.render.slo_table import capacity_lines, fleet_table, level_table, title
from specproxy.analysis.render.svg import PALETTE, Series, line_chart
from specproxy.analysis.slo import capacity as cap
from specproxy.analysis.slo.answer import ArmCapacity, SloEvaluation


def _target_series(s: SloEvaluation, arm: str, normalised: bool) -> list[Series]:
    """One line per target: its percentile (ms, or as a multiple of its threshold when several
    targets share the chart) at each reliable level on the load axis, with its interval as a band."""
    rows = sorted(
        (r for r in s.levels if r.arm == arm and r.reliable and r.load is not None),
        key=lambda r: r.load or 0.0,
    )
    series = []
    for i, target in enumerate(s.slo.targets):
        scale = 1 / target.threshold_s if normalised else 1000.0
        figs = [(r.load or 0.0, r.targets[i].value) for r in rows]
        series.append(
            Series(
                target.name,
                [(x, v.point * scale) for x, v in figs if v is not None],
                band=[(x, v.low * scale, v.high * scale) for x, v in figs if v and v.low and v.high],
                color=PALETTE[i % len(PALETTE)],
            )
        )
    return series


def _marker(a: ArmCapacity, axis: str) -> list[tuple[float, str]]:
    c = a.capacity
    if c is None or c.crossing.load is None:
        return []
    load = c.crossing.load
    unit = "" if axis == "concurrency" else " req/s"
    if c.crossing.state == cap.EVERY:
        return [(load, f"capacity ≥ {load:.3g}{unit}")]
    return [(load, f"capacity ≈ {load:.3g}{unit}")]


def capacity_chart(s: SloEvaluation, a: ArmCapacity) -> str:
    normalised = len(s.slo.targets) > 1
    reference = 1.0 if normalised else s.slo.targets[0].threshold_s * 1000.0
    y_label = "percentile / SLO threshold" if normalised else f"{s.slo.targets[0].name} (ms)"
    return line_chart(
        _target_series(s, a.arm, normalised),
        title=f"{a.arm}: capacity at the SLO",
        x_label="concurrency" if s.axis == "concurrency" else "offered rate (req/s)",
        y_label=y_label,
        log_x=s.axis == "concurrency",
        reference_y=reference,
        markers_x=_marker(a, s.axis),
    )


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f'<th class="{"l" if i < 2 else ""}">{escape(h)}</th>' for i, h in enumerate(headers))
    body = "".join(
        "<tr>"
        + "".join(f'<td class="{"l" if i < 2 else ""}">{escape(c)}</td>' for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def slo_section(s: SloEvaluation | None) -> str:
    """The whole section ("" without an SLO)."""
    if s is None:
        return ""
    charts = "".join(capacity_chart(s, a) for a in s.arms if a.capacity is not None)
    dashed = "the dashed horizontal line is the SLO, the dashed vertical one the capacity"
    lines = "".join(f"<li>{escape(n)}</li>" for n in capacity_lines(s))
    fleet = _table(*fleet_table(s)) if s.fleet else ""
    return (
        f"<h3>Capacity {escape(title(s))}</h3>"
        f'<p class="muted">Each target\'s percentile per reliable level with its 95% interval; {dashed}.</p>'
        f'<div class="charts">{charts}</div><ul class="notes">{lines}</ul>'
        f"<h4>Fleet and cost at the peak</h4>{fleet or '<p class=muted>No peak given.</p>'}"
        f"<h4>Goodput per level</h4>{_table(*level_table(s))}"
    )
