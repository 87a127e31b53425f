"""specproxy.analysis: the span store's verdicts, report and SQL.

Public API (used by `specproxy lab` and the click commands):

- :func:`analyze_text` — the verdict table of one or several span store files, as text;
- :func:`analyze` — the same, with the arms whose every call failed;
- :func:`write_report` — the self-contained HTML report;
- :func:`~specproxy.analysis.store.open_store` — a read-only DuckDB connection over several files,
  with the views ``arm_summary``, ``pairs``, ``identity``, ``acceptance``, ``slo_calls``, ``latency``;
- :func:`~specproxy.analysis.verdicts.evaluation.evaluate` — the figures as dataclasses.

Errors are :class:`~specproxy.analysis.store.StoreError` (a sentence saying what to do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specproxy.analysis.store import SpanStore, StoreError, open_store, query_errors
from specproxy.analysis.verdicts.evaluation import RunEvaluation, Settings, evaluate

__all__ = [
    "Analysis",
    "RunEvaluation",
    "Settings",
    "SpanStore",
    "StoreError",
    "analyze",
    "analyze_text",
    "evaluate",
    "open_store",
    "write_report",
]


def analyze_text(
    db_paths: Sequence[str | Path],
    run: str | None = None,
    fmt: str = "table",
    settings: Settings | None = None,
) -> str:
    """The verdict table of the runs in ``db_paths`` (each with its worker siblings).

    ``fmt`` is one of table, markdown, json, csv. Raises StoreError for a missing, corrupt or locked
    file, an unknown run or a run without a baseline arm.

    >>> print(analyze_text(["specproxy.duckdb"], fmt="markdown"))  # doctest: +SKIP
    """
    return analyze(db_paths, run, fmt, settings).text


@dataclass(frozen=True)
class Analysis:
    """The verdict table as text, and the arms whose every call failed (one sentence each)."""

    text: str
    failed_arms: list[str]


def analyze(
    db_paths: Sequence[str | Path],
    run: str | None = None,
    fmt: str = "table",
    settings: Settings | None = None,
) -> Analysis:
    """:func:`analyze_text`, with the failed arms beside it (`analyze` exits non-zero on them)."""
    from specproxy.analysis.render.table import render

    settings = settings or Settings()
    skipped: list[str] = []
    with open_store(db_paths) as store, query_errors(store.paths):
        evals = evaluate(store, run, settings, skipped)
        text = render(evals, settings, fmt, skipped)
    return Analysis(text, [f"run {ev.name}: {f}" for ev in evals for f in ev.failed_arms])


def write_report(
    db_paths: Sequence[str | Path],
    out_path: str | Path,
    run: str | None = None,
    settings: Settings | None = None,
) -> Path:
    """Write the self-contained HTML report (no network needed to open it); returns its path."""
    from specproxy.analysis.render.report import build_report

    settings = settings or Settings()
    out = Path(out_path)
    skipped: list[str] = []
    with open_store(db_paths) as store, query_errors(store.paths):
        html = build_report(store, evaluate(store, run, settings, skipped), settings, skipped)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out
