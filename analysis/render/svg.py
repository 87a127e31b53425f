"""Small inline-SVG charts for the HTML report: lines with interval bands, CDFs, grouped bars.

No JavaScript and no library: each function returns one ``<svg>`` element as a string. Axes are
linear, or log2 for concurrency; ticks are the data's own levels or "nice" round numbers.

Text must stay inside its chart, with no font to measure it by: :func:`text_width` estimates a
string's width from per-character widths of a common sans-serif (on the wide side), a title too
wide for one line is split in two, and a label that would still not fit is given an SVG
``textLength`` (the browser squeezes it to that width). The report's test checks the result in a
real browser where one is installed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

# Font sizes (px) of the text classes, as the report's CSS sets them.
FONT_SIZE = {"title": 13.0, "tick": 11.0, "label": 12.0}
_NARROW, _SLIM, _WIDE = set("ijlI.,:;'|!"), set("frt()[] -"), set("mwMWOQGD@%")
TEXT_PAD = 6.0  # room kept between text and the chart's edge

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
WIDTH, HEIGHT = 560, 300
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 64, 150, 34, 46


@dataclass
class Series:
    """One line: points (x, y) and optionally a band (x, low, high)."""

    name: str
    points: list[tuple[float, float]]
    band: list[tuple[float, float, float]] = field(default_factory=list)
    color: str = PALETTE[0]


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round-numbered ticks covering [lo, hi]."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi - lo < 1e-9 * max(abs(lo), abs(hi), 1.0):
        # one value (say every ratio is 1.0): centre it in a band of ±10 %
        pad = 0.1 * (abs(lo) or 1.0)
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    t = start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 10))
    return ticks


def text_width(text: str, size: float, bold: bool = False) -> float:
    """An estimate of ``text``'s width in px at font ``size``, on the wide side for common sans-serif
    faces (DejaVu Sans, the widest of them, and Arial: narrow letters about 0.3 em, slim ones 0.42,
    capitals 0.76, wide ones 0.95, the rest 0.64; bold 12 % wider)."""

    def em(c: str) -> float:
        if c in _NARROW:
            return 0.3
        if c in _SLIM:
            return 0.42
        if c in _WIDE:
            return 0.95
        return 0.76 if c.isupper() else 0.64

    return sum(em(c) for c in text) * size * (1.12 if bold else 1.0)


def fitted_text(x: float, y: float, text: str, cls: str, room: float, anchor: str = "middle") -> str:
    """A ``<text>`` element; squeezed to ``room`` px (``textLength``) when its estimate is wider."""
    width = text_width(text, FONT_SIZE[cls], bold=cls == "title")
    fit = f' textLength="{room:.0f}" lengthAdjust="spacingAndGlyphs"' if width > room else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" class="{cls}"{fit}>{escape(text)}</text>'


def title_lines(title: str) -> list[str]:
    """The title in one line, or two when one would not fit the chart: split before its parenthesis,
    else at the space nearest the middle."""
    room = WIDTH - 2 * TEXT_PAD
    if text_width(title, FONT_SIZE["title"], bold=True) <= room or " " not in title:
        return [title]
    cut = title.find(" (")
    if cut < 0:
        spaces = [i for i, c in enumerate(title) if c == " "]
        cut = min(spaces, key=lambda i: abs(i - len(title) / 2))
    return [title[:cut], title[cut + 1 :]]


def _title(title: str) -> list[str]:
    """The title centred over the whole chart; a second line, smaller, under it."""
    room = WIDTH - 2 * TEXT_PAD
    lines = title_lines(title)
    out = [fitted_text(WIDTH / 2, 16 if len(lines) > 1 else 18, lines[0], "title", room)]
    if len(lines) > 1:
        out.append(fitted_text(WIDTH / 2, 29, lines[1], "tick", room))
    return out


def _fmt_tick(v: float) -> str:
    if v == int(v):
        return str(int(v))
    return f"{v:.3g}"


class _Frame:
    """Maps data to pixels for one chart."""

    def __init__(
        self,
        xs: Sequence[float],
        ys: Sequence[float],
        log_x: bool,
        y_from_zero: bool,
        x_ticks: Sequence[float] | None = None,
    ) -> None:
        self.log_x = log_x
        tx = [self._tx(x) for x in xs] or [0.0, 1.0]
        self.x0, self.x1 = min(tx), max(tx)
        if self.x1 == self.x0:
            self.x0, self.x1 = self.x0 - 1, self.x1 + 1
        y_lo = 0.0 if y_from_zero else min(ys or [0.0])
        self.y_ticks = nice_ticks(y_lo, max(ys or [1.0]))
        self.y0, self.y1 = self.y_ticks[0], self.y_ticks[-1]
        self.x_ticks = (
            list(x_ticks)
            if x_ticks is not None
            else (sorted(set(xs)) if log_x else nice_ticks(min(xs or [0.0]), max(xs or [1.0])))
        )
        if not log_x and self.x_ticks:
            self.x0, self.x1 = min(self.x0, self.x_ticks[0]), max(self.x1, self.x_ticks[-1])

    def _tx(self, x: float) -> float:
        return math.log2(x) if self.log_x else x

    def px(self, x: float) -> float:
        w = WIDTH - MARGIN_L - MARGIN_R
        return MARGIN_L + (self._tx(x) - self.x0) / (self.x1 - self.x0) * w

    def py(self, y: float) -> float:
        h = HEIGHT - MARGIN_T - MARGIN_B
        span = (self.y1 - self.y0) or 1.0
        return MARGIN_T + h - (y - self.y0) / span * h


def _axes(frame: _Frame, title: str, x_label: str, y_label: str, x_tick_fmt: str = "{}") -> list[str]:
    out = _title(title)
    left, right = MARGIN_L, WIDTH - MARGIN_R
    top, bottom = MARGIN_T, HEIGHT - MARGIN_B
    for t in frame.y_ticks:
        y = frame.py(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" class="grid"/>')
        out.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{_fmt_tick(t)}</text>'
        )
    for t in frame.x_ticks:
        x = frame.px(t)
        out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" class="axis"/>')
        label = x_tick_fmt.format(_fmt_tick(t))
        out.append(
            f'<text x="{x:.1f}" y="{bottom + 17}" text-anchor="middle" class="tick">{escape(label)}</text>'
        )
    out.append(f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" class="axis"/>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" class="axis"/>')
    out.append(
        f'<text x="{(left + right) / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle" class="label">'
        f"{escape(x_label)}</text>"
    )
    out.append(
        f'<text transform="translate(14 {(top + bottom) / 2:.0f}) rotate(-90)" text-anchor="middle" '
        f'class="label">{escape(y_label)}</text>'
    )
    return out


def _legend(series: Sequence[Series]) -> list[str]:
    out = []
    for i, s in enumerate(series):
        y = MARGIN_T + 8 + i * 18
        x = WIDTH - MARGIN_R + 14
        out.append(f'<rect x="{x}" y="{y - 8}" width="12" height="12" fill="{s.color}"/>')
        out.append(fitted_text(x + 18, y + 2, s.name, "tick", WIDTH - x - 18 - TEXT_PAD, anchor="start"))
    return out


def _svg(body: list[str], label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
        f'height="{HEIGHT}" role="img" aria-label="{escape(label)}">' + "".join(body) + "</svg>"
    )


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    log_x: bool = True,
    reference_y: float | None = None,
    y_from_zero: bool = True,
    x_tick_fmt: str = "{}",
    y_extent: Sequence[float] = (),
    markers_x: Sequence[tuple[float, str]] = (),
) -> str:
    """Lines with markers (and shaded bands where given); log2 x for concurrency levels.

    ``y_extent``: values the y axis must cover as well (small multiples share one axis this way);
    ``markers_x``: vertical dashed lines at these x values, each with a label (a crossing, say).
    """
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points] + [
        v for s in series for _, lo, hi in s.band for v in (lo, hi)
    ]
    ys += list(y_extent)
    if reference_y is not None:
        ys.append(reference_y)
    frame = _Frame(xs, ys, log_x, y_from_zero)
    body = _axes(frame, title, x_label, y_label, x_tick_fmt)
    if reference_y is not None:
        y = frame.py(reference_y)
        body.append(f'<line x1="{MARGIN_L}" y1="{y:.1f}" x2="{WIDTH - MARGIN_R}" y2="{y:.1f}" class="ref"/>')
    body += _vertical_markers(frame, markers_x)
    for s in series:
        if s.band:
            band = sorted(s.band)
            upper = " ".join(f"{frame.px(x):.1f},{frame.py(hi):.1f}" for x, _, hi in band)
            lower = " ".join(f"{frame.px(x):.1f},{frame.py(lo):.1f}" for x, lo, _ in reversed(band))
            body.append(
                f'<polygon points="{upper} {lower}" fill="{s.color}" fill-opacity="0.15" stroke="none"/>'
            )
        pts = sorted(s.points)
        if len(pts) > 1:
            path = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in pts)
            body.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="2"/>')
        for x, y in pts:
            body.append(
                f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(y):.1f}" r="3.5" fill="{s.color}">'
                f"<title>{escape(s.name)}: {_fmt_tick(x)} → {y:.3g}</title></circle>"
            )
    return _svg(body + _legend(series), title)


def _vertical_markers(frame: _Frame, markers: Sequence[tuple[float, str]]) -> list[str]:
    out = []
    for i, (x, label) in enumerate(markers):
        px = frame.px(x)
        out.append(
            f'<line x1="{px:.1f}" y1="{MARGIN_T}" x2="{px:.1f}" y2="{HEIGHT - MARGIN_B}" class="ref marker"/>'
        )
        # a label that would run past the plot's right edge goes on the line's left
        fits = px + 4 + text_width(label, FONT_SIZE["tick"]) <= WIDTH - MARGIN_R
        anchor, at = ("start", px + 4) if fits else ("end", px - 4)
        out.append(
            f'<text x="{at:.1f}" y="{MARGIN_T + 12 + 13 * i}" text-anchor="{anchor}" class="tick marker">'
            f"{escape(label)}</text>"
        )
    return out


def cdf_chart(
    series: Sequence[Series], *, title: str, x_label: str, y_label: str = "fraction of calls"
) -> str:
    """Empirical CDFs: each series' points are (value, cumulative fraction)."""
    xs = [x for s in series for x, _ in s.points]
    frame = _Frame(xs or [0.0, 1.0], [0.0, 1.0], log_x=False, y_from_zero=True)
    frame.y_ticks = [0.0, 0.25, 0.5, 0.75, 1.0]
    frame.y0, frame.y1 = 0.0, 1.0
    body = _axes(frame, title, x_label, y_label)
    for s in series:
        path = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in s.points)
        body.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="2"/>')
    return _svg(body + _legend(series), title)


def bar_chart(
    groups: Sequence[str],
    series: Sequence[Series],
    *,
    title: str,
    y_label: str,
    reference_y: float | None = None,
) -> str:
    """Grouped bars: series[i].points[j] = (j, value) is series i's bar in group j."""
    values = [y for s in series for _, y in s.points]
    frame = _Frame(
        [0.0, 1.0], values + ([reference_y] if reference_y is not None else []), False, True, x_ticks=[]
    )
    body = _axes(frame, title, "category", y_label)
    w = WIDTH - MARGIN_L - MARGIN_R
    slot = w / max(len(groups), 1)
    bar = slot * 0.8 / max(len(series), 1)
    for j, g in enumerate(groups):
        cx = MARGIN_L + slot * (j + 0.5)
        body.append(fitted_text(cx, HEIGHT - MARGIN_B + 17, g, "tick", slot - 4))
        for i, s in enumerate(series):
            for x, y in s.points:
                if int(x) != j:
                    continue
                x0 = MARGIN_L + slot * j + slot * 0.1 + i * bar
                y0 = frame.py(y)
                body.append(
                    f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{bar * 0.9:.1f}" '
                    f'height="{frame.py(frame.y0) - y0:.1f}" fill="{s.color}">'
                    f"<title>{escape(s.name)} · {escape(g)}: {y:.2f}</title></rect>"
                )
    if reference_y is not None:
        y = frame.py(reference_y)
        body.append(f'<line x1="{MARGIN_L}" y1="{y:.1f}" x2="{WIDTH - MARGIN_R}" y2="{y:.1f}" class="ref"/>')
    return _svg(body + _legend(series), title)
