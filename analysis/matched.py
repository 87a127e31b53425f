"""Live and split traffic compared at matched engine load.

In shadow mode with ``sample = 0.2`` a candidate gets a fifth of the baseline's requests, so it runs
at a fifth of the load and decodes faster for that reason alone; a split with unequal weights, or a
multi-replica baseline, does the same. So for live and split levels the arms are compared at the load
each engine actually had when the call started: the engine's running-requests gauge
(``engine_running``, scraped from /metrics) where every call of both arms has it, else the proxy's
in-flight count for that arm (``inflight_at_start``).

The estimator stratifies by load band (an eighth of an octave of 1 + load wide): in each band both
arms have at least :data:`MIN_BAND_CALLS` calls in, the log ratio of the arms' median decode speeds
(and of their Σ tokens / Σ e2e); the bands are weighted by the candidate's calls in them (the
comparison is at the loads the candidate saw), and the share of its calls in matched bands is
reported. The interval is a bootstrap stratified by band and arm, re-centred on the estimate. It is
used when the arms' median loads differ by more than :data:`UNEQUAL_LOAD`; at equal loads the plain
(paired) comparison is sharper. When no band holds both arms, nothing is compared: the arms never ran
at the same load, and the row says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specproxy.analysis.figures import ordered
from specproxy.analysis.levels import LEVEL_SQL
from specproxy.analysis.stats import FloatArray, Interval, percentile_interval
from specproxy.analysis.store import SpanStore
from specproxy.schema import level_sql

MIN_BAND_CALLS = 8
UNEQUAL_LOAD = 1.10
# A basis is used for a level only when this share of every compared arm's calls carries it.
MIN_COVERAGE = 0.9
BANDS_PER_OCTAVE = 8


@dataclass(frozen=True)
class LoadFigures:
    """The load each arm saw, and how much of the candidate's traffic a matched comparison covers."""

    basis: str  # "engine running" | "proxy in-flight"
    p50: float | None
    baseline_p50: float | None
    matched_share: float | None = None
    bands: int = 0

    @property
    def unequal(self) -> bool:
        if not self.p50 or not self.baseline_p50:
            return self.p50 != self.baseline_p50
        return max(self.p50, self.baseline_p50) / min(self.p50, self.baseline_p50) > UNEQUAL_LOAD


@dataclass(frozen=True, eq=False)
class Band:
    """One arm's calls in one load band: counts, full-data figures, and a sample (decode, tokens, e2e)."""

    n: int
    median_decode: float | None
    tokens: float
    e2e: float
    sample: FloatArray = field(repr=False)


@dataclass(frozen=True, eq=False)
class LoadBands:
    figures: LoadFigures
    candidate: dict[int, Band]
    baseline: dict[int, Band]


@dataclass(frozen=True)
class MatchedLoad:
    """The matched-load comparison of one arm at one level (``decode`` None: nothing to compare)."""

    figures: LoadFigures
    decode: Interval | None
    throughput: Interval | None
    note: str


def load_bands(
    store: SpanStore,
    run_id: str,
    baseline: str,
    keys: Sequence[tuple[str, str]],
    *,
    max_sample: int,
    seed: int,
) -> dict[tuple[str, str], LoadBands]:
    """Per (arm, level) of ``keys`` whose arms carry load figures: the arm's and the baseline's bands."""
    if not keys:
        return {}
    wanted = set(keys) | {(baseline, level) for _, level in keys}
    coverage = {
        (r["arm"], r["level"]): r
        for r in store.query(
            f"""
            SELECT arm, {LEVEL_SQL} AS level, count(*) AS n,
                   count(engine_running) AS running, count(inflight_at_start) AS inflight,
                   quantile_cont(engine_running, 0.5) AS p50_running,
                   quantile_cont(inflight_at_start, 0.5) AS p50_inflight
            FROM requests WHERE run_id = ? AND status = 'ok' GROUP BY ALL
            """,
            [run_id],
        )
        if (r["arm"], r["level"]) in wanted
    }
    basis: dict[tuple[str, str], str] = {}
    for arm, level in keys:
        pair = [coverage.get((arm, level)), coverage.get((baseline, level))]
        for column in ("running", "inflight"):
            if all(c is not None and c["n"] and c[column] >= MIN_COVERAGE * c["n"] for c in pair):
                basis[(arm, level)] = column
                break
    if not basis:
        return {}
    store.conn.execute(
        "CREATE OR REPLACE TEMP TABLE load_keys (arm VARCHAR, level VARCHAR, basis VARCHAR, p DOUBLE)"
    )
    rows = {(a, lv, b) for (a, lv), b in basis.items()} | {(baseline, lv, b) for (_, lv), b in basis.items()}
    store.conn.executemany(
        "INSERT INTO load_keys VALUES (?, ?, ?, ?)",
        [(a, lv, b, min(1.0, max_sample / max(coverage[(a, lv)]["n"], 1))) for a, lv, b in sorted(rows)],
    )
    groups = store.query(
        f"""
        WITH calls AS (
            SELECT r.arm, k.level, k.basis, r.decode_tok_s, r.completion_tokens, r.e2e_s, r.request_id,
                   r.span_id, k.p,
                   floor({BANDS_PER_OCTAVE} * log2(1 + greatest(0, CASE k.basis WHEN 'running'
                       THEN r.engine_running ELSE r.inflight_at_start END))) AS band
            FROM requests r
            JOIN load_keys k
              ON k.arm = r.arm AND k.level = {level_sql("r")}
            WHERE r.run_id = $run AND r.status = 'ok' AND r.decode_tok_s > 0
        )
        SELECT arm, level, basis, band, count(*) AS n, quantile_cont(decode_tok_s, 0.5) AS med,
               coalesce(sum(completion_tokens) FILTER (WHERE e2e_s > 0), 0) AS tokens,
               coalesce(sum(e2e_s) FILTER (WHERE completion_tokens IS NOT NULL AND e2e_s > 0), 0) AS e2e,
               list([decode_tok_s, completion_tokens, e2e_s])
                   FILTER (WHERE p >= 1 OR hash(request_id, span_id, $seed) % 1000000007 < p * 1000000007)
                   AS sample
        FROM calls WHERE band IS NOT NULL GROUP BY ALL
        """,
        {"run": run_id, "seed": seed},
    )
    by_arm: dict[tuple[str, str, str], dict[int, Band]] = {}
    for g in groups:
        by_arm.setdefault((g["arm"], g["level"], g["basis"]), {})[int(g["band"])] = Band(
            int(g["n"]), g["med"], float(g["tokens"]), float(g["e2e"]), ordered(g["sample"], 3)
        )
    out = {}
    for (arm, level), b in basis.items():
        p50 = "p50_running" if b == "running" else "p50_inflight"
        figures = LoadFigures(
            basis="engine running" if b == "running" else "proxy in-flight",
            p50=coverage[(arm, level)][p50],
            baseline_p50=coverage[(baseline, level)][p50],
        )
        out[(arm, level)] = LoadBands(
            figures, by_arm.get((arm, level, b), {}), by_arm.get((baseline, level, b), {})
        )
    return out


def _log_medians(values: FloatArray, n_full: int, iterations: int, rng: np.random.Generator) -> FloatArray:
    m = len(values)
    idx = rng.integers(0, m, size=(iterations, m))
    logs: FloatArray = np.log(np.median(values[idx], axis=1))
    out: FloatArray = math.sqrt(m / max(n_full, m)) * (logs - logs.mean())
    return out


def _log_rates(sample: FloatArray, n_full: int, iterations: int, rng: np.random.Generator) -> FloatArray:
    ok = sample[np.isfinite(sample[:, 1]) & (sample[:, 2] > 0)]
    m = len(ok)
    if m < 2:
        return np.zeros(iterations)
    idx = rng.integers(0, m, size=(iterations, m))
    logs: FloatArray = np.log(ok[idx, 1].sum(axis=1) / ok[idx, 2].sum(axis=1))
    out: FloatArray = math.sqrt(m / max(n_full, m)) * (logs - logs.mean())
    return out


def compare(bands: LoadBands, *, iterations: int, confidence: float, rng: np.random.Generator) -> MatchedLoad:
    """The matched-load decode speedup and per-call throughput ratio (module docstring)."""
    fig = bands.figures
    loads = f"P50 {fig.basis} {fig.p50:.1f} vs baseline {fig.baseline_p50:.1f}"
    matched = sorted(
        b
        for b, c in bands.candidate.items()
        if c.n >= MIN_BAND_CALLS
        and bands.baseline.get(b) is not None
        and bands.baseline[b].n >= MIN_BAND_CALLS
    )
    total = sum(c.n for c in bands.candidate.values())
    share = sum(bands.candidate[b].n for b in matched) / total if total else 0.0
    fig = LoadFigures(fig.basis, fig.p50, fig.baseline_p50, share, len(matched))
    if not fig.unequal:
        return MatchedLoad(fig, None, None, "")
    if not matched:
        return MatchedLoad(
            fig, None, None, f"arms ran at different loads ({loads}) and never at the same load: not compared"
        )
    weights = np.array([bands.candidate[b].n for b in matched], dtype=np.float64)
    weights /= weights.sum()
    d_logs, t_logs = np.zeros(len(matched)), np.zeros(len(matched))
    d_dev, t_dev = np.zeros(iterations), np.zeros(iterations)
    for i, b in enumerate(matched):
        c, base = bands.candidate[b], bands.baseline[b]
        d_logs[i] = math.log((c.median_decode or 1.0) / (base.median_decode or 1.0))
        t_logs[i] = math.log((c.tokens / c.e2e) / (base.tokens / base.e2e)) if c.e2e and base.e2e else 0.0
        d_dev += weights[i] * (
            _log_medians(c.sample[:, 0], c.n, iterations, rng)
            - _log_medians(base.sample[:, 0], base.n, iterations, rng)
        )
        t_dev += weights[i] * (
            _log_rates(c.sample, c.n, iterations, rng) - _log_rates(base.sample, base.n, iterations, rng)
        )
    decode = percentile_interval(float(weights @ d_logs), d_dev, confidence)
    throughput = percentile_interval(float(weights @ t_logs), t_dev, confidence)
    note = f"arms ran at different loads ({loads}): compared at matched load over {share:.0%} of its calls"
    return MatchedLoad(fig, decode, throughput, note)
