"""From the span store to the figures of the verdict table: one :class:`RunEvaluation` per run.

The per-level figures come from the views (DuckDB does the heavy lifting); speedup intervals are
bootstrapped in numpy from each level's pairs (or calls), subsampled in SQL for large levels.
"""

from __future__ import annotations

import json
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
from specproxy.analysis.verdict import (
    NO_CLEAR_GAIN,
    Crossover,
    DeployVerdict,
    Thresholds,
    crossover,
    deploy_verdict,
    level_verdict,
)

# Pairs must cover at least this share of a candidate level's calls with a decode speed for the level to
# be analysed paired (a split run with a small verify fraction has a few pairs: they would not represent
# the level).
PAIRED_MIN_SHARE = 0.5


@dataclass(frozen=True)
class Settings:
    """Everything `analyze` can be told; the defaults are the documented verdict rules."""

    thresholds: Thresholds = field(default_factory=Thresholds)
    near_tie_margin: float = 0.5
    confidence: float = 0.95
    bootstrap_iterations: int = 1000
    bootstrap_seed: int = 0
    bootstrap_max_sample: int = 2000


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
    decode_calls: int
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
    # "wall": agg tok/s ratio (closed-loop replay levels); "per call": Σ tokens / Σ e2e ratio (live
    # traffic, split traffic), where wall-clock rates reflect arrivals and traffic shares, not speed
    throughput_basis: str = "wall"
    verdict: str | None = None
    reason: str = ""

    @property
    def identical_rate(self) -> float | None:
        return self.identical / self.compared if self.compared else None


@dataclass
class CategoryRow:
    """A candidate arm on one workload category at one level: the requests of that category only.

    ``throughput_speedup`` is per call (Σ tokens / Σ e2e of the category's calls, candidate over
    baseline): a category has no wall time of its own inside a mixed closed-loop level. The verdict
    uses the category's decode speedup and identity with the LEVEL's aggregate throughput ratio.
    """

    arm: str
    category: str
    level: str
    concurrency_level: int | None
    paired: bool
    calls: int
    baseline_calls: int
    p50_decode_tok_s: float | None
    baseline_p50_decode_tok_s: float | None
    compared: int = 0
    identical: int = 0
    decode_speedup: Interval | None = None
    throughput_speedup: Interval | None = None
    throughput_basis: str = "per call"
    verdict: str | None = None
    reason: str = ""


@dataclass
class ArmOutcome:
    arm: str
    role: str
    spec_method: str
    kind: str  # baseline | candidate | replica
    crossover: Crossover | None
    crossover_text: str
    deploy: DeployVerdict | None
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
    categories: list[CategoryRow]
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
    store: SpanStore,
    run: str | None = None,
    settings: Settings | None = None,
    skipped: list[str] | None = None,
) -> list[RunEvaluation]:
    """Evaluate every run (or the one named by name or id).

    Without ``run``, a run that cannot be evaluated (no baseline arm) is left out and its reason
    appended to ``skipped``, as long as another run can be; a named run that cannot be is an error.
    """
    settings = settings or Settings()
    out: list[RunEvaluation] = []
    errors: list[StoreError] = []
    for info in select_runs(store, run):
        try:
            out.append(_evaluate_run(store, info, settings))
        except StoreError as exc:
            if run is not None:
                raise
            errors.append(exc)
    if errors and not out:
        raise errors[0]
    if skipped is not None:
        skipped.extend(f"skipped: {exc}" for exc in errors)
    return out


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
                decode_calls=int(r["decode_calls"]),
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
    by_key = {(row.arm, row.level): row for row in rows}
    numeric = sorted({row.concurrency_level for row in rows if row.concurrency_level is not None})
    peak_level = str(numeric[-1]) if numeric else "live"
    categories: list[CategoryRow] = []
    noise_compared, noise_mismatched = _fill_comparisons(store, run_id, baseline, rows, categories, settings)
    _fill_unpaired(store, run_id, baseline, rows, categories, settings)
    for cat in categories:
        # Aggregate throughput is the level's, shared by every category in the batch: a category has
        # no wall-clock throughput of its own, and an arm that lowers the level's throughput costs
        # every category's users. So the category's verdict is its own decode speedup and identity
        # against the level's aggregate throughput ratio (its per-call ratio is shown beside it).
        level_row = by_key.get((cat.arm, cat.level))
        cat.verdict, cat.reason = level_verdict(
            cat.decode_speedup,
            level_row.throughput_speedup if level_row else None,
            cat.identical,
            cat.compared,
            settings.thresholds,
        )
    categories.sort(key=lambda c: (c.arm, c.category, level_sort_key(c.level)))

    arms: list[ArmOutcome] = []
    for arm in sorted({row.arm for row in rows}, key=lambda a: (a != baseline, a)):
        arm_rows = [row for row in rows if row.arm == arm]
        for row in arm_rows:
            if row.arm == baseline or row.role == "baseline":
                continue
            # each level on its own figures: its decode speedup and its own throughput ratio
            row.verdict, row.reason = level_verdict(
                row.decode_speedup, row.throughput_speedup, row.identical, row.compared, settings.thresholds
            )
        first = arm_rows[0]
        kind = "baseline" if arm == baseline else ("replica" if first.spec_method == "none" else "candidate")
        compared = sum(r.compared for r in arm_rows)
        identical = sum(r.identical for r in arm_rows)
        cross: Crossover | None = None
        deploy: DeployVerdict | None = None
        text = "—" if kind == "baseline" else "n/a"
        if kind != "baseline":
            points = [
                (row.concurrency_level, row.verdict or NO_CLEAR_GAIN)
                for row in arm_rows
                if row.concurrency_level is not None
            ]
            if points:
                cross = crossover(points)
                text = cross.describe([p[0] for p in points])
            peak = by_key.get((arm, peak_level))
            if points:
                deploy = deploy_verdict(
                    points,
                    peak_level,
                    peak.throughput_speedup if peak else None,
                    identical,
                    compared,
                    settings.thresholds,
                )
            elif peak is not None and peak.verdict:
                deploy = DeployVerdict(peak.verdict, f"{peak.verdict} on live traffic ({peak.reason})")
        arms.append(
            ArmOutcome(
                arm=arm,
                role=first.role,
                spec_method=first.spec_method,
                kind=kind,
                crossover=cross,
                crossover_text=text,
                deploy=deploy,
                compared=compared,
                mismatched=compared - identical,
                near_tie=sum(r.near_tie for r in arm_rows),
                gross=sum(r.gross for r in arm_rows),
            )
        )
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
        categories=categories,
        noise_compared=noise_compared,
        noise_mismatched=noise_mismatched,
        stacks=stacks if isinstance(stacks, dict) else {},
        notes=notes,
    )


def _fill_comparisons(
    store: SpanStore,
    run_id: str,
    baseline: str,
    rows: list[LevelRow],
    categories: list[CategoryRow],
    settings: Settings,
) -> tuple[int, int]:
    """Identity counts, paired speedups and their intervals, in one pass over ``pairs``.

    The pass groups by level and, in the same scan (GROUPING SETS), by level and category: the
    category rows of paired levels are appended to ``categories``.

    The same pass returns, per group, a uniform subsample (hash of request_id, keep-probability from
    the level's call count) of the pairs for the bootstrap. Returns the noise floor (compared,
    mismatched) of the baseline-vs-baseline comparisons. Levels without enough pairs are analysed
    unpaired (:func:`_fill_unpaired`).
    """
    by_key = {(row.arm, row.level): row for row in rows}
    m, seed = settings.bootstrap_max_sample, settings.bootstrap_seed
    keep = [(row.arm, row.level, min(1.0, m / max(row.ok, 1))) for row in rows]
    store.conn.execute("CREATE OR REPLACE TEMP TABLE keep_pairs (arm VARCHAR, level VARCHAR, p DOUBLE)")
    store.conn.executemany("INSERT INTO keep_pairs VALUES (?, ?, ?)", keep)
    both_ok = "q.status = 'ok' AND q.baseline_status = 'ok' AND q.kind <> 'repeat' AND q.baseline_arm = $base"
    dec_ok = "q.decode_tok_s > 0 AND q.baseline_decode_tok_s > 0"
    thr_ok = (
        "q.completion_tokens IS NOT NULL AND q.baseline_completion_tokens IS NOT NULL"
        " AND q.e2e_s > 0 AND q.baseline_e2e_s > 0"
    )
    # The filters are evaluated once per pair (dok, tok, sok), not once per aggregate and grouping set.
    groups = store.query(
        f"""
        WITH q AS (
            SELECT q.arm, q.level, q.kind, coalesce(q.category, '(none)') AS cat, q.identical,
                   q.divergence_margin, q.decode_tok_s, q.baseline_decode_tok_s, q.completion_tokens,
                   q.baseline_completion_tokens, q.e2e_s, q.baseline_e2e_s,
                   ({both_ok} AND {dec_ok}) AS dok,
                   ({both_ok} AND {thr_ok}) AS tok,
                   ({both_ok} AND (coalesce(k.p, 1) >= 1
                                   OR hash(q.request_id, $seed) % 1000000007 < k.p * 1000000007)) AS sok
            FROM pairs q LEFT JOIN keep_pairs k ON k.arm = q.arm AND k.level = q.level
            WHERE q.run_id = $run
        )
        SELECT q.arm, q.level, q.kind, q.cat, grouping(q.cat) = 0 AS by_category,
               count(q.identical) AS compared,
               count(*) FILTER (WHERE q.identical) AS identical,
               count(*) FILTER (WHERE NOT q.identical AND q.divergence_margin <= $margin) AS near_tie,
               count(*) FILTER (WHERE NOT q.identical AND q.divergence_margin > $margin) AS gross,
               count(*) FILTER (WHERE NOT q.identical AND q.divergence_margin IS NULL) AS margin_unknown,
               count(*) FILTER (WHERE dok) AS n_decode,
               quantile_cont(q.decode_tok_s, 0.5) FILTER (WHERE dok) AS c_med,
               quantile_cont(q.baseline_decode_tok_s, 0.5) FILTER (WHERE dok) AS b_med,
               count(*) FILTER (WHERE tok) AS n_thr,
               sum(q.completion_tokens) FILTER (WHERE tok) AS c_tokens,
               -- e2e totals summed as integer nanoseconds: the same total (to the bit) whatever order
               -- the rows of several files arrive in, which a float sum does not promise
               sum(CAST(round(q.e2e_s * 1e9) AS HUGEINT)) FILTER (WHERE tok) / 1e9 AS c_e2e,
               sum(q.baseline_completion_tokens) FILTER (WHERE tok) AS b_tokens,
               sum(CAST(round(q.baseline_e2e_s * 1e9) AS HUGEINT)) FILTER (WHERE tok) / 1e9 AS b_e2e,
               list([q.decode_tok_s, q.baseline_decode_tok_s, q.completion_tokens,
                     q.baseline_completion_tokens, q.e2e_s, q.baseline_e2e_s]) FILTER (WHERE sok) AS sample
        FROM q
        GROUP BY GROUPING SETS ((q.arm, q.level, q.kind), (q.arm, q.level, q.kind, q.cat))
        """,
        {"margin": settings.near_tie_margin, "seed": seed, "run": run_id, "base": baseline},
    )
    noise_compared = noise_mismatched = 0
    by_category = [g for g in groups if g["by_category"]]
    groups = [g for g in groups if not g["by_category"]]
    for g in groups:
        if g["kind"] in ("replica", "repeat"):
            noise_compared += int(g["compared"])
            noise_mismatched += int(g["compared"]) - int(g["identical"])
        row = by_key.get((g["arm"], g["level"]))
        if row is None:
            continue
        row.compared += int(g["compared"])
        row.identical += int(g["identical"])
        row.near_tie += int(g["near_tie"])
        row.gross += int(g["gross"])
        row.margin_unknown += int(g["margin_unknown"])
        base = by_key.get((baseline, g["level"]))
        if g["kind"] == "repeat" or base is None:
            continue
        n_decode = int(g["n_decode"])
        row.pairs = n_decode
        row.paired = n_decode >= max(2, PAIRED_MIN_SHARE * row.decode_calls)
        if not row.paired:
            continue
        sample = _ordered(g["sample"], 6)
        rng = rng_for(seed, run_id, row.arm, row.level)
        if g["c_med"] and g["b_med"]:
            row.decode_speedup = _paired_decode_interval(sample, g, n_decode, settings, rng)
        # A replay level is a closed loop at a fixed concurrency: its wall-clock tok/s is the arm's
        # capacity. Live traffic arrives at the clients' pace (and shadows may be sampled), so there
        # the per-call token rate Σ tokens / Σ e2e over the pairs is compared instead.
        point = None
        if row.concurrency_level is not None:
            point = row.agg_tok_s / base.agg_tok_s if row.agg_tok_s and base.agg_tok_s else None
        elif g["c_e2e"] and g["b_e2e"] and g["c_tokens"] and g["b_tokens"]:
            point = (g["c_tokens"] / g["c_e2e"]) / (g["b_tokens"] / g["b_e2e"])
            row.throughput_basis = "per call"
        if point is not None:
            row.throughput_speedup = _paired_throughput_interval(sample, point, g, settings, rng)
    for row in rows:
        if row.arm != baseline and row.paired is None and (baseline, row.level) in by_key:
            row.paired = False
    for g in by_category:
        row = by_key.get((g["arm"], g["level"]))
        if row is None or not row.paired or g["kind"] == "repeat":
            continue
        cat = CategoryRow(
            arm=row.arm,
            category=g["cat"],
            level=row.level,
            concurrency_level=row.concurrency_level,
            paired=True,
            calls=int(g["n_decode"]),
            baseline_calls=int(g["n_decode"]),
            p50_decode_tok_s=g["c_med"],
            baseline_p50_decode_tok_s=g["b_med"],
            compared=int(g["compared"]),
            identical=int(g["identical"]),
        )
        categories.append(cat)
        sample = _ordered(g["sample"], 6)
        rng = rng_for(seed, run_id, row.arm, row.level, g["cat"])
        if g["c_med"] and g["b_med"]:
            cat.decode_speedup = _paired_decode_interval(sample, g, int(g["n_decode"]), settings, rng)
        if g["c_e2e"] and g["b_e2e"] and g["c_tokens"] and g["b_tokens"]:
            point = (g["c_tokens"] / g["c_e2e"]) / (g["b_tokens"] / g["b_e2e"])
            cat.throughput_speedup = _paired_throughput_interval(sample, point, g, settings, rng)
    return noise_compared, noise_mismatched


def _paired_decode_interval(
    sample: np.ndarray[Any, np.dtype[np.float64]],
    g: dict[str, Any],
    n_total: int,
    settings: Settings,
    rng: np.random.Generator,
) -> Interval:
    """Paired median-ratio interval of decode tok/s over a pair sample (columns 0: candidate, 1: baseline)."""
    dec = sample[(sample[:, 0] > 0) & (sample[:, 1] > 0)]
    return paired_median_ratio(
        dec[:, 0],
        dec[:, 1],
        point=g["c_med"] / g["b_med"],
        n_total=n_total,
        iterations=settings.bootstrap_iterations,
        rng=rng,
        confidence=settings.confidence,
    )


def _paired_throughput_interval(
    sample: np.ndarray[Any, np.dtype[np.float64]],
    point: float,
    g: dict[str, Any],
    settings: Settings,
    rng: np.random.Generator,
) -> Interval:
    """Paired Σtokens/Σe2e ratio interval (columns 2, 3: tokens; 4, 5: e2e; candidate then baseline)."""
    thr = sample[
        np.isfinite(sample[:, 2]) & np.isfinite(sample[:, 3]) & (sample[:, 4] > 0) & (sample[:, 5] > 0)
    ]
    return throughput_ratio(
        thr[:, 2],
        thr[:, 4],
        thr[:, 3],
        thr[:, 5],
        point=point,
        n_cand=max(int(g["n_thr"]), 1),
        n_base=max(int(g["n_thr"]), 1),
        paired=True,
        iterations=settings.bootstrap_iterations,
        rng=rng,
        confidence=settings.confidence,
    )


def _fill_unpaired(
    store: SpanStore,
    run_id: str,
    baseline: str,
    rows: list[LevelRow],
    categories: list[CategoryRow],
    settings: Settings,
) -> None:
    """Speedups of levels without (enough) pairs: each arm's own calls, resampled independently; the
    same scan groups by category too (GROUPING SETS) for those levels' category rows."""
    by_key = {(row.arm, row.level): row for row in rows}
    todo = [row for row in rows if row.paired is False]
    if not todo:
        return
    needed = {(r.arm, r.level) for r in todo} | {(baseline, r.level) for r in todo}
    m, seed = settings.bootstrap_max_sample, settings.bootstrap_seed
    store.conn.execute("CREATE OR REPLACE TEMP TABLE keep_calls (arm VARCHAR, level VARCHAR, p DOUBLE)")
    store.conn.executemany(
        "INSERT INTO keep_calls VALUES (?, ?, ?)",
        [(arm, level, min(1.0, m / max(by_key[(arm, level)].ok, 1))) for arm, level in needed],
    )
    thr_ok = "r.completion_tokens IS NOT NULL AND r.e2e_s > 0"
    groups = {
        (g["arm"], g["level"], g["cat"] if g["by_category"] else None): g
        for g in store.query(
            f"""
            SELECT r.arm, r.level, r.cat, grouping(r.cat) = 0 AS by_category,
                   count(*) FILTER (WHERE r.decode_tok_s > 0) AS n_decode,
                   quantile_cont(r.decode_tok_s, 0.5) FILTER (WHERE r.decode_tok_s > 0) AS p50_decode,
                   count(*) FILTER (WHERE {thr_ok}) AS n_thr,
                   sum(r.completion_tokens) FILTER (WHERE {thr_ok}) AS thr_tokens,
                   sum(CAST(round(r.e2e_s * 1e9) AS HUGEINT)) FILTER (WHERE {thr_ok}) / 1e9 AS thr_e2e,
                   list([r.decode_tok_s, r.completion_tokens, r.e2e_s])
                       FILTER (WHERE k.p >= 1 OR hash(r.request_id, r.span_id, $seed) % 1000000007
                                                  < k.p * 1000000007) AS sample
            FROM (SELECT *, coalesce(CAST(concurrency_level AS VARCHAR), 'live') AS level,
                         coalesce(category, '(none)') AS cat
                  FROM requests WHERE run_id = $run AND status = 'ok') r
            JOIN keep_calls k ON k.arm = r.arm AND k.level = r.level
            GROUP BY GROUPING SETS ((r.arm, r.level), (r.arm, r.level, r.cat))
            """,
            {"seed": seed, "run": run_id},
        )
    }
    for row in todo:
        base = by_key[(baseline, row.level)]
        c, b = groups.get((row.arm, row.level, None)), groups.get((baseline, row.level, None))
        if c is None or b is None:
            continue
        point = (
            row.p50_decode_tok_s / base.p50_decode_tok_s
            if row.p50_decode_tok_s and base.p50_decode_tok_s
            else None
        )
        row.decode_speedup, row.throughput_speedup = _unpaired_intervals(
            c, b, point, rng_for(seed, run_id, row.arm, row.level), settings
        )
        # The arms got different shares of the traffic, so their wall-clock tok/s say more about the
        # split than about speed: the per-call token rate Σ tokens / Σ e2e (by Little's law,
        # throughput per concurrent call) is compared instead.
        if row.throughput_speedup is not None:
            row.throughput_basis = "per call"
        for (arm, level, cat), cg in groups.items():
            if arm != row.arm or level != row.level or cat is None:
                continue
            bg = groups.get((baseline, row.level, cat))
            if bg is None:
                continue
            point = cg["p50_decode"] / bg["p50_decode"] if cg["p50_decode"] and bg["p50_decode"] else None
            dec, thr = _unpaired_intervals(cg, bg, point, rng_for(seed, run_id, arm, level, cat), settings)
            categories.append(
                CategoryRow(
                    arm=arm,
                    category=cat,
                    level=level,
                    concurrency_level=row.concurrency_level,
                    paired=False,
                    calls=int(cg["n_decode"]),
                    baseline_calls=int(bg["n_decode"]),
                    p50_decode_tok_s=cg["p50_decode"],
                    baseline_p50_decode_tok_s=bg["p50_decode"],
                    decode_speedup=dec,
                    throughput_speedup=thr,
                )
            )


def _unpaired_intervals(
    c: dict[str, Any],
    b: dict[str, Any],
    decode_point: float | None,
    rng: np.random.Generator,
    settings: Settings,
) -> tuple[Interval | None, Interval | None]:
    """(decode speedup, per-call throughput ratio) intervals of two independent groups of calls."""
    cs, bs = _ordered(c["sample"], 3), _ordered(b["sample"], 3)
    decode = None
    if decode_point:
        decode = unpaired_median_ratio(
            cs[cs[:, 0] > 0, 0],
            bs[bs[:, 0] > 0, 0],
            point=decode_point,
            n_cand=int(c["n_decode"]),
            n_base=int(b["n_decode"]),
            iterations=settings.bootstrap_iterations,
            rng=rng,
            confidence=settings.confidence,
        )
    thr = None
    if c["thr_e2e"] and b["thr_e2e"] and c["thr_tokens"] and b["thr_tokens"]:
        c_ok = np.isfinite(cs[:, 1]) & (cs[:, 2] > 0)
        b_ok = np.isfinite(bs[:, 1]) & (bs[:, 2] > 0)
        thr = throughput_ratio(
            cs[c_ok, 1],
            cs[c_ok, 2],
            bs[b_ok, 1],
            bs[b_ok, 2],
            point=(c["thr_tokens"] / c["thr_e2e"]) / (b["thr_tokens"] / b["thr_e2e"]),
            n_cand=max(int(c["n_thr"]), 1),
            n_base=max(int(b["n_thr"]), 1),
            paired=False,
            iterations=settings.bootstrap_iterations,
            rng=rng,
            confidence=settings.confidence,
        )
    return decode, thr


def _ordered(rows: list[list[float | None]] | None, width: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """A sample as a float matrix (NULL → NaN) in a canonical row order.

    DuckDB's parallel ``list()`` aggregate returns rows in no fixed order; sorting them makes the
    bootstrap (same seed) give the same intervals every time.
    """
    sample = np.array(rows or [], dtype=np.float64).reshape(-1, width)
    return sample[np.lexsort(sample.T[::-1])] if len(sample) else sample
