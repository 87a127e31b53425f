"""The latency table: TPOT, inter-token latency, E2E, queueing and tokens per chunk per arm and level.

A section of its own beside the verdict table (``analyze --latency``; always in the HTML report; the
JSON and CSV outputs always carry the figures): the verdict table is already as wide as a terminal.

Printed precision: TPOT, ITL, stalls and queueing in milliseconds with one decimal, E2E in seconds with
two, tokens per chunk with two (percentiles of whole-token counts with one). A figure that rests on a
part of the calls says so: ITL on the calls with at least two content chunks (``(12% sample)``: a
level with more gaps than the analysis parses, pooled over a uniform sample of its calls), queueing
on the calls whose engine reported it, tokens per chunk on the chunks whose counts the engine gave
(else ``~``, the mean of completion_tokens / chunks per call).

A tail figure (ITL P95, P99, the largest stall) that its level's timing resolution does not resolve
(:mod:`.resolution`: the noise one gap can carry is more than 2 % of it) is marked ``*``, and a note
under the table says how far it can be trusted.
"""

from __future__ import annotations

from typing import Any

from specproxy.analysis.figures.resolution import ArmTails, TimingResolution, resolution_note
from specproxy.analysis.figures.run_figures import RESOLUTION_FIELDS, LatencyFigures
from specproxy.analysis.verdicts.rows import LevelRow

DASH = "—"

LATENCY_HEADERS = (
    "level",
    "arm",
    "calls",
    "TPOT ms mean/P50/P99",
    "ITL ms P50/P95/P99",
    "max stall ms",
    "E2E s P50/P95/P99",
    "queue ms P50/P99",
    "tokens/chunk mean (P50, P99)",
)

# The CSV columns the latency figures add, in order (each a LatencyFigures field).
LATENCY_CSV_FIELDS = (
    "tpot_calls",
    "mean_tpot_s",
    "p50_tpot_s",
    "p99_tpot_s",
    "gap_calls",
    "itl_calls",
    "sample_share",
    "itl_gaps",
    "p50_itl_s",
    "p95_itl_s",
    "p99_itl_s",
    "max_stall_s",
    "p50_e2e_s",
    "p95_e2e_s",
    "p99_e2e_s",
    "queue_calls",
    "p50_queue_s",
    "p95_queue_s",
    "p99_queue_s",
    "tokens_per_chunk_basis",
    "sized_chunks",
    "mean_tokens_per_chunk",
    "p50_tokens_per_chunk",
    "p99_tokens_per_chunk",
    *RESOLUTION_FIELDS,
)
UNRESOLVED_MARK = "*"


def _num(value: float | None, digits: int, scale: float = 1.0) -> str:
    return DASH if value is None else f"{value * scale:.{digits}f}"


def _triple(
    values: tuple[float | None, ...], digits: int, scale: float, resolved: tuple[bool | None, ...] = ()
) -> str:
    if all(v is None for v in values):
        return DASH
    marks = [UNRESOLVED_MARK if ok is False else "" for ok in resolved] + [""] * len(values)
    return " / ".join(_num(v, digits, scale) + mark for v, mark in zip(values, marks, strict=False))


def tokens_per_chunk_cell(lat: LatencyFigures) -> str:
    """``2.71 (3.0, 4.0)`` from the engine's counts per chunk, ``~2.71 per call`` from the calls' means."""
    if lat.mean_tokens_per_chunk is None:
        return DASH
    if lat.tokens_per_chunk_basis == "chunks":
        return (
            f"{lat.mean_tokens_per_chunk:.2f} ({_num(lat.p50_tokens_per_chunk, 1)}, "
            f"{_num(lat.p99_tokens_per_chunk, 1)})"
        )
    return f"~{lat.mean_tokens_per_chunk:.2f} per call"


def latency_cells(row: LevelRow) -> list[str]:
    """One line of the latency table."""
    lat = row.latency
    head = [row.level if row.level == "live" else f"c={row.level}", row.arm]
    if lat is None:
        return [*head, "0", *([DASH] * (len(LATENCY_HEADERS) - 3))]
    queue = DASH
    if lat.queue_calls:
        queue = f"{_num(lat.p50_queue_s, 1, 1000.0)} / {_num(lat.p99_queue_s, 1, 1000.0)}"
        if lat.queue_calls < lat.calls:
            queue += f" ({lat.queue_calls} calls)"
    return [
        *head,
        str(lat.calls),
        _triple((lat.mean_tpot_s, lat.p50_tpot_s, lat.p99_tpot_s), 1, 1000.0),
        _triple(
            (lat.p50_itl_s, lat.p95_itl_s, lat.p99_itl_s),
            1,
            1000.0,
            (None, lat.p95_itl_resolved, lat.p99_itl_resolved),
        )
        + (f" ({lat.sample_share:.0%} sample)" if lat.sample_share < 1 else ""),
        _num(lat.max_stall_s, 1, 1000.0) + (UNRESOLVED_MARK if lat.max_stall_resolved is False else ""),
        _triple((lat.p50_e2e_s, lat.p95_e2e_s, lat.p99_e2e_s), 2, 1.0),
        queue,
        tokens_per_chunk_cell(lat),
    ]


def latency_notes(rows: list[LevelRow]) -> list[str]:
    """One note per level whose ITL tails are marked unresolved for some arm: the noise and its share."""
    by_level: dict[str, list[ArmTails]] = {}
    for row in rows:
        lat = row.latency
        if lat is None or lat.timing_resolution_s is None:
            continue
        resolution = TimingResolution(lat.resolution_loop_lag_s, lat.resolution_write_delay_s)
        by_level.setdefault(row.level, []).append((row.arm, resolution, lat.tails()))
    notes = (resolution_note(level, arms) for level, arms in by_level.items())
    return [f"{UNRESOLVED_MARK} {note}" for note in notes if note is not None]


def latency_csv(row: LevelRow) -> dict[str, Any]:
    """The latency figures of a row as CSV cells (empty where unknown)."""
    lat = row.latency
    return {f: getattr(lat, f) if lat is not None else None for f in LATENCY_CSV_FIELDS}


LATENCY_TITLE = (
    "latency (ok calls; ITL pooled over every gap between content chunks; TPOT = (e2e - ttft) / "
    "(tokens - 1) per call; queue where the engine reported it; tokens/chunk from the engine's "
    "counts, ~ = completion_tokens / chunks per call)"
)
