"""The runs a span store holds, and the ones a question names."""

from __future__ import annotations

from typing import Any

from specproxy.analysis.store import SpanStore, StoreError


def list_runs(store: SpanStore) -> list[dict[str, Any]]:
    """Runs that have spans, oldest first: run_id, name, mode, source, started_at, spans."""
    return store.query("""
        SELECT r.run_id, coalesce(any_value(u.name), r.run_id) AS name, any_value(u.mode) AS mode,
               coalesce(any_value(u.source), any_value(r.source)) AS source,
               coalesce(any_value(u.started_at), min(r.t_start)) AS started_at,
               any_value(u.stacks_json) AS stacks_json, any_value(u.config_json) AS config_json,
               count(*) AS spans
        FROM requests r
        LEFT JOIN (  -- each worker file of a run may hold its runs row: one per run_id
            SELECT run_id, any_value(name) AS name, any_value(mode) AS mode, any_value(source) AS source,
                   min(started_at) AS started_at, any_value(stacks_json) AS stacks_json,
                   any_value(config_json) AS config_json
            FROM runs GROUP BY run_id
        ) u ON u.run_id = r.run_id
        GROUP BY r.run_id ORDER BY started_at, r.run_id
    """)


def select_runs(store: SpanStore, run: str | None) -> list[dict[str, Any]]:
    runs = list_runs(store)
    if not runs:
        raise StoreError("the span store has no spans yet; run `specproxy serve` or `replay` first")
    if run is None:
        return runs
    chosen = [r for r in runs if run in (r["run_id"], r["name"])]
    if not chosen:
        names = ", ".join(sorted({str(r["name"]) for r in runs}))
        raise StoreError(f"no run named {run!r} in the span store; runs: {names}")
    return chosen
