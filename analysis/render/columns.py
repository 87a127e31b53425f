"""The verdict table's columns, defined once: a key to name it (``--columns``), its header, how a row
fills it, and whether its figure moves with the simulators' time scale.

The default text table shows the seven columns a decision reads (:data:`DEFAULT_COLUMNS`, under 120
characters wide); ``--wide`` shows every column that holds a figure, ``--columns`` the ones named. The
report shows every column; JSON and CSV carry every field at full precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specproxy.analysis.levels import level_name
from specproxy.analysis.stats import Interval
from specproxy.analysis.verdicts.rows import LevelRow
from specproxy.analysis.verdicts.rules import SHADOW_BASIS

DASH = "—"
ESTIMATED = "~"  # before a figure built on token counts estimated from the text
SLOWED = "†"  # after a figure measured with the simulators slower than their profile's clock
WIDE = ("all",)  # Settings.columns for --wide: every column that holds a figure


def fmt_num(value: float | None, digits: int, scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return DASH
    return f"{value * scale:.{digits}f}{suffix}"


def fmt_interval(iv: Interval | None) -> str:
    if iv is None:
        return DASH
    if iv.low is None or iv.high is None:
        return f"{iv.point:.2f}x"
    return f"{iv.point:.2f}x [{iv.low:.2f}, {iv.high:.2f}]"


def fmt_level(level: str) -> str:
    return level_name(level)


def fmt_margin(row: LevelRow) -> str:
    """The margin a bound must clear: one figure, or decode/throughput when they differ."""
    if row.decode_margin is None or row.throughput_margin is None:
        return DASH
    if round(row.decode_margin, 3) == round(row.throughput_margin, 3):
        return f"{row.decode_margin:.1%}"
    return f"{row.decode_margin:.1%}/{row.throughput_margin:.1%}"


def fmt_rounds(row: LevelRow) -> str:
    """Rounds the level is judged on: ``3``, ``1*`` (one round: no drift between runs seen), ``4 of 5``
    (a round dropped for failing the measurement's health checks)."""
    if row.rounds is None:
        return DASH
    if row.rounds_dropped:
        return f"{row.rounds} of {row.rounds_measured}"
    return f"{row.rounds}*" if row.drift_note else str(row.rounds)


def fmt_load(row: LevelRow) -> str:
    load = row.load
    if load is None or load.p50 is None or load.baseline_p50 is None:
        return DASH
    return f"{load.p50:.1f}/{load.baseline_p50:.1f}" + (" unequal" if load.unequal else "")


def fmt_speed(value: float | None, row: LevelRow) -> str:
    """The arm's own tok/s, marked when its token counts are estimated."""
    text = fmt_num(value, 1)
    return ESTIMATED + text if row.own_tokens_estimated and text != DASH else text


def fmt_speedup(iv: Interval | None, row: LevelRow) -> str:
    text = fmt_interval(iv)
    return ESTIMATED + text if row.tokens_estimated and text != DASH else text


def fmt_req_acceptance(row: LevelRow) -> str:
    """The per-request acceptance length, "est" when estimated from the stream shape, "not measured"
    when the arm's calls carried no measured figure."""
    if row.req_acceptance_length is None:
        return f"{DASH} not measured" if row.req_acceptance_not_measured else DASH
    text = f"{row.req_acceptance_length:.2f}"
    return text + " est" if "estimated" in row.req_acceptance_source else text


def fmt_verdict(row: LevelRow) -> str:
    if row.verdict is None:
        return "baseline" if row.role == "baseline" else DASH
    return row.verdict + (" (estimated tokens)" if row.tokens_estimated else "")


def per_call_suffix(row: LevelRow) -> str:
    """How the throughput ratio was read: per call, or not at all for shadow copies (the notes say why)."""
    return {"per call": " (per call)", SHADOW_BASIS: " (shadow)"}.get(row.throughput_basis, "")


def decode_suffix(row: LevelRow) -> str:
    if row.decode_speedup is None:
        return ""
    if row.unmatched_decode_speedup is not None:
        return " (matched load)"
    return " (unpaired)" if row.paired is False else ""


@dataclass(frozen=True)
class Column:
    """One column of the verdict table. ``scaled``: its figure is a speed or a time, which moves with
    the simulators' time scale (a ratio does not)."""

    key: str
    header: str
    cell: Callable[[LevelRow], str]
    scaled: bool = False


COLUMNS: tuple[Column, ...] = (
    Column("level", "level", lambda r: fmt_level(r.level)),
    Column("arm", "arm", lambda r: r.arm),
    Column("calls", "ok/calls", lambda r: f"{r.ok}/{r.calls}"),
    Column("agg_tok_s", "agg tok/s", lambda r: fmt_speed(r.agg_tok_s, r), scaled=True),
    Column("p50_decode", "P50 decode tok/s", lambda r: fmt_speed(r.p50_decode_tok_s, r), scaled=True),
    Column("p50_ttft", "P50 TTFT ms", lambda r: fmt_num(r.p50_ttft_s, 1, 1000.0), scaled=True),
    Column("p95_ttft", "P95 TTFT ms", lambda r: fmt_num(r.p95_ttft_s, 1, 1000.0), scaled=True),
    Column("accept_rate", "accept rate", lambda r: fmt_num(r.acceptance_rate, 1, 100.0, "%")),
    Column("accept_len", "accept len", lambda r: fmt_num(r.acceptance_length, 2)),
    Column("req_accept_len", "req accept len", fmt_req_acceptance),
    Column("identical", "identical", lambda r: f"{r.identical}/{r.compared}" if r.compared else DASH),
    Column(
        "decode_speedup",
        "decode speedup [95% CI]",
        lambda r: fmt_speedup(r.decode_speedup, r) + decode_suffix(r),
    ),
    Column(
        "throughput_ratio",
        "throughput ratio [95% CI]",
        lambda r: fmt_speedup(r.throughput_speedup, r) + per_call_suffix(r),
    ),
    Column("rounds", "rounds", fmt_rounds),
    Column("margin", "margin", fmt_margin),
    Column("load", "load P50 arm/base", fmt_load),
    Column("verdict", "verdict", fmt_verdict),
)
HEADERS = tuple(c.header for c in COLUMNS)
BY_KEY = {c.key: c for c in COLUMNS}
ALL_KEYS = tuple(BY_KEY)
DEFAULT_COLUMNS = ("level", "arm", "calls", "identical", "decode_speedup", "throughput_ratio", "verdict")
# Always shown: a row without its level and arm cannot be read.
KEY_COLUMNS = ("level", "arm")


def row_cells(row: LevelRow) -> list[str]:
    """Every column's cell (the report's table)."""
    return [c.cell(row) for c in COLUMNS]


def parse_columns(text: str) -> tuple[str, ...]:
    """``--columns`` as keys, in the table's order; a sentence naming the known keys for a typo.

    >>> parse_columns("verdict,agg_tok_s")
    ('level', 'arm', 'agg_tok_s', 'verdict')
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return WIDE
    unknown = [n for n in names if n not in BY_KEY]
    if unknown or not names:
        raise ValueError(
            f"unknown column {', '.join(repr(n) for n in unknown) or '(none given)'}; "
            f"known: {', '.join(BY_KEY)} (or all)"
        )
    wanted = set(names) | set(KEY_COLUMNS)
    return tuple(c.key for c in COLUMNS if c.key in wanted)


def chosen_columns(keys: Sequence[str], rows: Sequence[LevelRow]) -> list[Column]:
    """The columns to print: the default ones (with the rounds or the loads where they tell rows
    apart), the named ones, or (:data:`WIDE`) every column that holds a figure in some row (the
    per-request acceptance length only where it differs from the engine counters')."""
    if tuple(keys) == WIDE:
        # the per-request acceptance length only where it says something the /metrics one does not
        same = all(fmt_req_acceptance(r) == fmt_num(r.acceptance_length, 2) for r in rows)
        return [
            c
            for c in COLUMNS
            if c.key in KEY_COLUMNS or c.key == "verdict" or any(c.cell(r) != DASH for r in rows)
            if not (same and c.key == "req_accept_len")
        ]
    if keys:
        return [BY_KEY[k] for k in keys]
    # Where a figure's validity differs from row to row, its column joins the default ones: the rounds
    # when a level was judged on fewer than it ran (or on one), the loads where live arms ran unequal.
    extra = {"rounds"} if any(r.rounds_dropped or r.drift_note for r in rows) else set()
    extra |= {"load"} if any(fmt_load(r) != DASH for r in rows) else set()
    return [c for c in COLUMNS if c.key in DEFAULT_COLUMNS or c.key in extra]


def table_cells(columns: Sequence[Column], row: LevelRow, time_scale: float | None) -> list[str]:
    """A row's cells in ``columns``; a speed or time measured at a slowed time scale is marked."""
    slowed = time_scale is not None and time_scale != 1.0
    return [
        cell + SLOWED if slowed and c.scaled and cell != DASH else cell
        for c in columns
        for cell in [c.cell(row)]
    ]


def slowed_note(columns: Sequence[Column], scales: dict[str, float]) -> str:
    """What the slowed mark means, when a marked column is printed."""
    if not scales or not any(c.scaled for c in columns):
        return ""
    where = ", ".join(f"{fmt_level(lv)} at {s:g}" for lv, s in scales.items())
    return (
        f"{SLOWED} = measured with the simulators slower than the profile's clock ({where}): tok/s are "
        "that share of the profile's, times that many times longer; ratios are unaffected"
    )
