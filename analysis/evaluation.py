"""From the span store to the figures of the verdict table: one :class:`RunEvaluation` per run.

The per-level figures come from the views (DuckDB does the heavy lifting); speedup intervals are
bootstrapped in numpy from each level's pairs (or calls), subsampled in SQL for large levels.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specproxy.analysis.stats import (
    Interval,
    paired_median_ratio,
    rng_for,
    throughput_ratio,
    unpaired_median_ratio,
)
from specproxy.analysis.store import SpanStore, StoreError
from specproxy.analysis.verdict import Crossover, Thresholds, crossover, level_verdict

# Pairs must cover at least this share of a candidate level's calls for the level to be analysed paired
# (a split run with a small verify fraction has a few pairs: those would not represent the level).
PAIRED_MIN_SHARE = 0.5


@dataclass(frozen=True)
class Settings:
    """Everything `analyze` can be told; defaults are the issue's."""

    thresholds: Thresholds = field(default_factory=Thresholds)
    near_tie_margin: float = 0.5
    confidence: float = 0.95
    bootstrap_iterations: int = 1000
    bootstrap_seed: int = 0
    bootstrap_max_sample: int = 4000


@dataclass
class LevelRow:
    """One row of the verdict table: an arm at a concurrency level."""

    arm: str
    role: str
    spec_method: str
    level: str
    concurrency_level: int | None
    calls: int
    ok: int
    completion_tokens: int
    wall_s: float | None
    agg_tok_s: float | None
    p50_decode_tok_s: float | None
    p50_ttft_s: float | None
    p95_ttft_s: float | None
    acceptance_rate: float | None
    acceptance_length: float | None
    req_acceptance_rate: float | None
    req_acceptance_length: float | None
    compared: int = 0
    identical: int = 0
    near_tie: int = 0
    gross: int = 0
    margin_unknown: int = 0
    paired: bool | None = None
    pairs: int = 0
    decode_speedup: Interval | None = None
    throughput_speedup: Interval | None = None
    verdict: str | None = None
    reason: str = ""

    @property
    def identical_rate(self) -> float | None:
        return self.identical / self.compared if self.compared else None


@dataclass
class ArmOutcome:
    arm: str
    role: str
    spec_method: str
    kind: str  # baseline | candidate | replica
    crossover: Crossover | None
    crossover_text: str
    compared: int
    mismatched: int
    near_tie: int
    gross: int


@dataclass
class RunEvaluation:
    run_id: str
    name: str
    mode: str | None
    source: str | None
    started_at: Any
    baseline: str
    peak_level: str
    rows: list[LevelRow]
    arms: list[ArmOutcome]
    noise_compared: int
    noise_mismatched: int
    stacks: dict[str, Any]
    notes: list[str]

    @property
    def noise_floor(self) -> float | None:
        return self.noise_mismatched / self.noise_compared if self.noise_compared else None


def level_sort_key(level: str) -> tuple[int, int, str]:
    return (0, int(level), "") if level.isdigit() else (1, 0, level)


def list_runs(store: SpanStore) -> list[dict[str, Any]]:
    """Runs that have spans, oldest first: run_id, name, mode, source, started_at, spans."""
    return store.query("""
        SELECT r.run_id, coalesce(any_value(u.name), r.run_id) AS name, any_value(u.mode) AS mode,
               coalesce(any_value(u.source), any_value(r.source)) AS source,
               coalesce(any_value(u.started_at), min(r.t_start)) AS started_at,
               any_value(u.stacks_json) AS stacks_json, count(*) AS spans
        FROM requests r
        LEFT JOIN (  -- each worker file of a run may hold its runs row: one per run_id
            SELECT run_id, any_value(name) AS name, any_value(mode) AS mode, any_value(source) AS source,
                   min(started_at) AS started_at, any_value(stacks_json) AS stacks_json
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


def evaluate(
    store: SpanStore, run: str | None = None, settings: Settings | None = None
) -> list[RunEvaluation]:
    """Evaluate every run (or the one named by name or id)."""
    settings = settings or Settings()
    return [_evaluate_run(store, info, settings) for info in select_runs(store, run)]


def _evaluate_run(store: SpanStore, info: dict[str, Any], settings: Settings) -> RunEvaluation:
    run_id = info["run_id"]
    summary = store.query("SELECT * FROM arm_summary WHERE run_id = ?", [run_id])
    baselines = sorted({r["arm"] for r in summary if r["arm_role"] == "baseline"})
    if not baselines:
        raise StoreError(
            f"run {info['name']!r} has no baseline arm (no span with arm_role = 'baseline'); speedups need "
            'one: give one arm role = "baseline" in the experiment file'
        )
    notes: list[str] = []
    baseline = baselines[0]
    if len(baselines) > 1:
        notes.append(f"several baseline arms ({', '.join(baselines)}); speedups are against {baseline}")
    acceptance = {
        (r["arm"], r["level"]): r for r in store.query("SELECT * FROM acceptance WHERE run_id = ?", [run_id])
    }
    rows: list[LevelRow] = []
    for r in sorted(
        summary, key=lambda r: (level_sort_key(r["level"]), r["arm_role"] != "baseline", r["arm"])
    ):
        acc = acceptance.get((r["arm"], r["level"]), {})
        rows.append(
            LevelRow(
                arm=r["arm"],
                role=r["arm_role"],
                spec_method=r["spec_method"] or "none",
                level=r["level"],
                concurrency_level=r["concurrency_level"],
                calls=r["calls"],
                ok=r["ok"],
                completion_tokens=int(r["completion_tokens"]),
                wall_s=r["wall_s"],
                agg_tok_s=r["agg_tok_s"],
                p50_decode_tok_s=r["p50_decode_tok_s"],
                p50_ttft_s=r["p50_ttft_s"],
                p95_ttft_s=r["p95_ttft_s"],
                acceptance_rate=acc.get("acceptance_rate"),
                acceptance_length=acc.get("acceptance_length"),
                req_acceptance_rate=r["req_acceptance_rate"],
                req_acceptance_length=r["req_acceptance_length"],
            )
        )
    _fill_identity(store, run_id, rows, settings)
    by_key = {(row.arm, row.level): row for row in rows}
    numeric = sorted({row.concurrency_level for row in rows if row.concurrency_level is not None})
    peak_level = str(numeric[-1]) if numeric else "live"
    _fill_speedups(store, run_id, baseline, rows, by_key, settings)

    arms: list[ArmOutcome] = []
    for arm in sorted({row.arm for row in rows}, key=lambda a: (a != baseline, a)):
        arm_rows = [row for row in rows if row.arm == arm]
        peak = by_key.get((arm, peak_level))
        for row in arm_rows:
            if row.arm == baseline or row.role == "baseline":
                continue
            row.verdict, row.reason = level_verdict(
                row.decode_speedup,
                peak.throughput_speedup if peak else None,
                row.identical,
                row.compared,
                settings.thresholds,
            )
        first = arm_rows[0]
        kind = "baseline" if arm == baseline else ("replica" if first.spec_method == "none" else "candidate")
        points = [
            (row.concurrency_level, row.decode_speedup.point)
            for row in arm_rows
            if row.concurrency_level is not None and row.decode_speedup is not None
        ]
        cross = crossover(points) if kind != "baseline" and points else None
        text = cross.describe([p[0] for p in points]) if cross else ("—" if kind == "baseline" else "n/a")
        arms.append(
            ArmOutcome(
                arm=arm,
                role=first.role,
                spec_method=first.spec_method,
                kind=kind,
                crossover=cross,
                crossover_text=text,
                compared=sum(r.compared for r in arm_rows),
                mismatched=sum(r.compared - r.identical for r in arm_rows),
                near_tie=sum(r.near_tie for r in arm_rows),
                gross=sum(r.gross for r in arm_rows),
            )
        )
    noise = store.query(
        "SELECT count(identical) AS n, count(*) FILTER (WHERE NOT identical) AS bad FROM pairs "
        "WHERE run_id = ? AND kind IN ('replica', 'repeat')",
        [run_id],
    )[0]
    try:
        stacks = json.loads(info["stacks_json"]) if info.get("stacks_json") else {}
    except ValueError:
        stacks = {}
        notes.append("runs.stacks_json is not valid JSON; stacks not shown")
    return RunEvaluation(
        run_id=run_id,
        name=str(info["name"]),
        mode=info["mode"],
        source=info["source"],
        started_at=info["started_at"],
        baseline=baseline,
        peak_level=peak_level,
        rows=rows,
        arms=arms,
        noise_compared=int(noise["n"]),
        noise_mismatched=int(noise["bad"]),
        stacks=stacks if isinstance(stacks, dict) else {},
        notes=notes,
    )


def _fill_identity(store: SpanStore, run_id: str, rows: list[LevelRow], settings: Settings) -> None:
    by_key = {(row.arm, row.level): row for row in rows}
    for r in store.query(
        """
        SELECT arm, level, count(identical) AS compared, count(*) FILTER (WHERE identical) AS identical,
               count(*) FILTER (WHERE NOT identical AND divergence_margin <= ?) AS near_tie,
               count(*) FILTER (WHERE NOT identical AND divergence_margin > ?) AS gross,
               count(*) FILTER (WHERE NOT identical AND divergence_margin IS NULL) AS margin_unknown
        FROM pairs WHERE run_id = ? GROUP BY arm, level
    """,
        [settings.near_tie_margin, settings.near_tie_margin, run_id],
    ):
        row = by_key.get((r["arm"], r["level"]))
        if row is not None:
            row.compared, row.identical = int(r["compared"]), int(r["identical"])
            row.near_tie, row.gross, row.margin_unknown = (
                int(r["near_tie"]),
                int(r["gross"]),
                int(r["margin_unknown"]),
            )


def _fill_speedups(
    store: SpanStore,
    run_id: str,
    baseline: str,
    rows: list[LevelRow],
    by_key: dict[tuple[str, str], LevelRow],
    settings: Settings,
) -> None:
    """Point estimates over all calls (SQL), intervals from a bootstrap on (subsampled) arrays."""
    conn = store.conn
    # Paired point estimates and pair counts per candidate arm and level.
    paired_stats = {
        (r["arm"], r["level"]): r
        for r in store.query(
            """
            SELECT arm, level,
                   count(*) FILTER (WHERE decode_tok_s > 0 AND baseline_decode_tok_s > 0) AS n_decode,
                   quantile_cont(decode_tok_s, 0.5)
                       FILTER (WHERE decode_tok_s > 0 AND baseline_decode_tok_s > 0)
                       AS c_med,
                   quantile_cont(baseline_decode_tok_s, 0.5)
                       FILTER (WHERE decode_tok_s > 0 AND baseline_decode_tok_s > 0) AS b_med,
                   count(*) FILTER (WHERE completion_tokens IS NOT NULL
                                    AND baseline_completion_tokens IS NOT NULL
                                    AND e2e_s > 0 AND baseline_e2e_s > 0) AS n_thr
            FROM pairs
            WHERE run_id = ? AND kind <> 'repeat' AND baseline_arm = ? AND status = 'ok'
                  AND baseline_status = 'ok'
            GROUP BY arm, level
        """,
            [run_id, baseline],
        )
    }
    unpaired_counts = {
        (r["arm"], r["level"]): r
        for r in store.query(
            """
            SELECT arm, coalesce(CAST(concurrency_level AS VARCHAR), 'live') AS level,
                   count(*) FILTER (WHERE decode_tok_s > 0) AS n_decode,
                   count(*) FILTER (WHERE completion_tokens IS NOT NULL AND e2e_s > 0) AS n_thr
            FROM requests WHERE run_id = ? AND status = 'ok' GROUP BY ALL
        """,
            [run_id],
        )
    }
    plan: list[tuple[LevelRow, LevelRow, bool]] = []
    for row in rows:
        base = by_key.get((baseline, row.level))
        if row.arm == baseline or base is None:
            continue
        stats = paired_stats.get((row.arm, row.level))
        n_cand = int(unpaired_counts.get((row.arm, row.level), {}).get("n_decode", 0))
        paired = bool(stats) and stats is not None and stats["n_decode"] >= max(2, PAIRED_MIN_SHARE * n_cand)
        row.paired = paired
        row.pairs = int(stats["n_decode"]) if stats else 0
        plan.append((row, base, paired))
    if not plan:
        return
    m = settings.bootstrap_max_sample
    # Subsample keep-probabilities: pairs by (arm, level) of the candidate, calls by (arm, level).
    conn.execute("CREATE OR REPLACE TEMP TABLE boot_paired(arm VARCHAR, level VARCHAR, p DOUBLE)")
    conn.execute("CREATE OR REPLACE TEMP TABLE boot_calls(arm VARCHAR, level VARCHAR, p DOUBLE)")
    paired_p: list[tuple[str, str, float]] = []
    calls_p: dict[tuple[str, str], float] = {}
    for row, base, paired in plan:
        if paired:
            st = paired_stats[(row.arm, row.level)]
            n = max(int(st["n_decode"]), int(st["n_thr"]), 1)
            paired_p.append((row.arm, row.level, min(1.0, m / n)))
        else:
            for arm in (row.arm, base.arm):
                c = unpaired_counts.get((arm, row.level), {})
                n = max(int(c.get("n_decode", 0)), int(c.get("n_thr", 0)), 1)
                calls_p[(arm, row.level)] = min(1.0, m / n)
    if paired_p:
        conn.executemany("INSERT INTO boot_paired VALUES (?, ?, ?)", paired_p)
    if calls_p:
        conn.executemany(
            "INSERT INTO boot_calls VALUES (?, ?, ?)", [(a, lv, p) for (a, lv), p in calls_p.items()]
        )
    seed = settings.bootstrap_seed
    paired_data = (
        conn.execute(
            """
        SELECT q.arm, q.level, q.decode_tok_s, q.baseline_decode_tok_s, q.completion_tokens,
               q.baseline_completion_tokens, q.e2e_s, q.baseline_e2e_s
        FROM pairs q JOIN boot_paired b ON q.arm = b.arm AND q.level = b.level
        WHERE q.run_id = ? AND q.kind <> 'repeat' AND q.baseline_arm = ? AND q.status = 'ok'
              AND q.baseline_status = 'ok'
              AND (b.p >= 1 OR (hash(q.request_id, ?) % 1000000007) < b.p * 1000000007)
    """,
            [run_id, baseline, seed],
        ).fetchnumpy()
        if paired_p
        else None
    )
    calls_data = (
        conn.execute(
            """
        SELECT r.arm, coalesce(CAST(r.concurrency_level AS VARCHAR), 'live') AS level, r.decode_tok_s,
               r.completion_tokens, r.e2e_s
        FROM requests r JOIN boot_calls b
             ON r.arm = b.arm AND coalesce(CAST(r.concurrency_level AS VARCHAR), 'live') = b.level
        WHERE r.run_id = ? AND r.status = 'ok'
              AND (b.p >= 1 OR (hash(r.request_id, r.span_id, ?) % 1000000007) < b.p * 1000000007)
    """,
            [run_id, seed],
        ).fetchnumpy()
        if calls_p
        else None
    )

    for row, base, paired in plan:
        decode_point = None
        thr_point = row.agg_tok_s / base.agg_tok_s if row.agg_tok_s and base.agg_tok_s else None
        rng = rng_for(seed, run_id, row.arm, row.level)
        if paired and paired_data is not None:
            st = paired_stats[(row.arm, row.level)]
            sel = (paired_data["arm"] == row.arm) & (paired_data["level"] == row.level)
            c_dec = _floats(paired_data["decode_tok_s"][sel])
            b_dec = _floats(paired_data["baseline_decode_tok_s"][sel])
            ok = (c_dec > 0) & (b_dec > 0)
            if st["c_med"] and st["b_med"]:
                decode_point = st["c_med"] / st["b_med"]
                row.decode_speedup = paired_median_ratio(
                    c_dec[ok],
                    b_dec[ok],
                    point=decode_point,
                    n_total=int(st["n_decode"]),
                    iterations=settings.bootstrap_iterations,
                    rng=rng,
                    confidence=settings.confidence,
                )
            c_tok = _floats(paired_data["completion_tokens"][sel])
            b_tok = _floats(paired_data["baseline_completion_tokens"][sel])
            c_e2e = _floats(paired_data["e2e_s"][sel])
            b_e2e = _floats(paired_data["baseline_e2e_s"][sel])
            ok = np.isfinite(c_tok) & np.isfinite(b_tok) & (c_e2e > 0) & (b_e2e > 0)
            if thr_point is not None:
                row.throughput_speedup = throughput_ratio(
                    c_tok[ok],
                    c_e2e[ok],
                    b_tok[ok],
                    b_e2e[ok],
                    point=thr_point,
                    n_cand=int(st["n_thr"]),
                    n_base=int(st["n_thr"]),
                    paired=True,
                    iterations=settings.bootstrap_iterations,
                    rng=rng,
                    confidence=settings.confidence,
                )
        elif calls_data is not None:
            c_sel = (calls_data["arm"] == row.arm) & (calls_data["level"] == row.level)
            b_sel = (calls_data["arm"] == base.arm) & (calls_data["level"] == row.level)
            c_n = unpaired_counts.get((row.arm, row.level), {})
            b_n = unpaired_counts.get((base.arm, row.level), {})
            c_dec = _floats(calls_data["decode_tok_s"][c_sel])
            b_dec = _floats(calls_data["decode_tok_s"][b_sel])
            if row.p50_decode_tok_s and base.p50_decode_tok_s:
                decode_point = row.p50_decode_tok_s / base.p50_decode_tok_s
                row.decode_speedup = unpaired_median_ratio(
                    c_dec[c_dec > 0],
                    b_dec[b_dec > 0],
                    point=decode_point,
                    n_cand=int(c_n.get("n_decode", 0)),
                    n_base=int(b_n.get("n_decode", 0)),
                    iterations=settings.bootstrap_iterations,
                    rng=rng,
                    confidence=settings.confidence,
                )
            if thr_point is not None:
                c_tok, c_e2e = (
                    _floats(calls_data["completion_tokens"][c_sel]),
                    _floats(calls_data["e2e_s"][c_sel]),
                )
                b_tok, b_e2e = (
                    _floats(calls_data["completion_tokens"][b_sel]),
                    _floats(calls_data["e2e_s"][b_sel]),
                )
                c_ok = np.isfinite(c_tok) & (c_e2e > 0)
                b_ok = np.isfinite(b_tok) & (b_e2e > 0)
                row.throughput_speedup = throughput_ratio(
                    c_tok[c_ok],
                    c_e2e[c_ok],
                    b_tok[b_ok],
                    b_e2e[b_ok],
                    point=thr_point,
                    n_cand=max(int(c_n.get("n_thr", 0)), 1),
                    n_base=max(int(b_n.get("n_thr", 0)), 1),
                    paired=False,
                    iterations=settings.bootstrap_iterations,
                    rng=rng,
                    confidence=settings.confidence,
                )


def _floats(values: Any) -> np.ndarray[Any, np.dtype[np.float64]]:
    """A numpy float array from a fetchnumpy column (masked NULLs become NaN)."""
    if isinstance(values, np.ma.MaskedArray):
        return np.asarray(np.ma.filled(values.astype(np.float64), math.nan), dtype=np.float64)
    return np.asarray(values, dtype=np.float64)
