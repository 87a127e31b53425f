"""Goodput at an SLO, per arm and level: the calls that met every target, as requests/s and output
tokens/s, their share, and each target's percentile over the level's calls; with intervals.

A call meets the SLO when it succeeded and each target's per-call value (:attr:`SloTarget.column`) is
at most its threshold. A value that was not recorded (an older span store, a non-streamed call
without a TTFT) cannot be checked: the call is not counted as meeting, the level's percentile of that
target is not estimated, and the level says how many calls lacked it. A failed call (error, timeout,
cancelled) met nothing; in a percentile it counts as a call :data:`FAILED_FACTOR` times over the
threshold (finite, so a round with a few failures moves the interval by a bounded amount).

Goodput is the met calls (or their tokens) over the arm's wall time at the level, summed over the
replay rounds (each round's first start to last end). The intervals come from the same two sources as
the verdict's (:mod:`.stats`): a bootstrap of the calls within each round, and, where the rounds
disagree more than that explains, a between-round term (a random-effects variance with Satterthwaite's
degrees of freedom, drawn as Student's t). Percentile replicates are kept on the log scale for
:mod:`.capacity`. Large levels are resampled from a uniform subsample (hash of the call), the
deviations scaled by sqrt(m / n).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specproxy.analysis.figures.run_figures import ordered
from specproxy.analysis.levels import level_sort_key
from specproxy.analysis.stats import FloatArray, Interval
from specproxy.analysis.store import SpanStore
from specproxy.slo import Slo
from specproxy.visits import visits_sql

# A failed call's value in a percentile, as a multiple of the target's threshold.
FAILED_FACTOR = 10.0
_HASH_MOD = 1000000007
_MAX_DF = 400


@dataclass(frozen=True)
class BlockFigures:
    """One replay round of an arm at a level (block 0: calls without a round)."""

    block: int
    calls: int
    met: int
    met_tokens: float
    wall_s: float
    percentiles: tuple[float | None, ...]


@dataclass(frozen=True, eq=False)
class SloLevelFigures:
    """Stage 1 for one arm at one level: exact counts and percentiles from SQL, per round too, and a
    sample of calls with columns met, met tokens, each target's value, block."""

    arm: str
    level: str
    load: float | None
    axis: str  # "concurrency", "rate", or "" (live traffic)
    calls: int
    ok: int
    met: int
    met_tokens: float
    missing: tuple[int, ...]  # per target: ok calls whose value was not recorded
    percentiles: tuple[float | None, ...]  # per target, over every call; None when any is missing
    blocks: tuple[BlockFigures, ...]
    sample: FloatArray = field(repr=False)

    @property
    def wall_s(self) -> float:
        return sum(b.wall_s for b in self.blocks)


def _call_columns(slo: Slo) -> str:
    """Each call of the run with its level's call count ``n`` (from ``$sizes``), block, hash and each
    target's value ``v<i>``, and whether it met the SLO."""
    values = ", ".join(
        f"CASE WHEN ok THEN {t.column} ELSE {t.threshold_s * FAILED_FACTOR!r} END AS v{i}"
        for i, t in enumerate(slo.targets)
    )
    met = " AND ".join(f"v{i} <= {t.threshold_s!r}" for i, t in enumerate(slo.targets))
    return f"""
        WITH sizes AS (SELECT unnest($sizes, recursive := true)), raw AS (
            SELECT arm, level, load, load_axis AS axis, coalesce(round, 0) AS block, ok, start_s, e2e_s,
                   completion_tokens AS tokens, hash(request_id, span_id, $seed) AS h,
                   {values}
            FROM slo_calls WHERE run_id = $run
        ), c AS (SELECT raw.*, n, coalesce(ok AND {met}, false) AS met FROM raw JOIN sizes USING (arm, level))
    """


def _aggregates(slo: Slo) -> str:
    parts = [
        "any_value(load) AS load, any_value(axis) AS axis, count(*) AS calls",
        "count(*) FILTER (WHERE ok) AS ok, count(*) FILTER (WHERE met) AS met",
        "coalesce(sum(tokens) FILTER (WHERE met), 0) AS met_tokens",
        "max(start_s + coalesce(e2e_s, 0)) - min(start_s) AS wall_s",
    ]
    for i, t in enumerate(slo.targets):
        parts.append(f"quantile_cont(v{i}, {t.percentile / 100!r}) AS p{i}")
        parts.append(f"count(*) FILTER (WHERE ok AND v{i} IS NULL) AS missing{i}")
    return ", ".join(parts)


def _level_sizes(store: SpanStore, run_id: str) -> dict[tuple[str, str], dict[int, int]]:
    """Calls per arm, level and block (round; 0 without one)."""
    rows = store.query(
        "SELECT arm, level, coalesce(round, 0) AS block, count(*) AS n FROM slo_calls WHERE run_id = $run "
        "GROUP BY ALL",
        {"run": run_id},
    )
    sizes: dict[tuple[str, str], dict[int, int]] = {}
    for r in rows:
        sizes.setdefault((r["arm"], r["level"]), {})[int(r["block"])] = int(r["n"])
    return sizes


def slo_level_figures(
    store: SpanStore, run_id: str, slo: Slo, *, seed: int, max_sample: int
) -> list[SloLevelFigures]:
    """Every arm and level of the run, levels in order.

    A count of calls per level first (it sets the level's sample share), then one pass over the calls
    that aggregates per round and, where a level has several rounds, per level too (a level of one
    round is that round: its figures are computed once)."""
    sizes = _level_sizes(store, run_id)
    if not sizes:
        return []
    k = len(slo.targets)
    several = any(len(blocks) > 1 for blocks in sizes.values())
    grouping = "GROUPING SETS ((arm, level, block), (arm, level))" if several else "arm, level, block"
    sample_cols = ", ".join(
        ["CAST(met AS DOUBLE)", "CASE WHEN met THEN tokens ELSE 0 END"] + [f"v{i}" for i in range(k)]
    )
    rows = store.query(
        f"""{_call_columns(slo)}
        SELECT arm, level, block, grouping(block) AS whole_level, {_aggregates(slo)},
               list([{sample_cols}, block])
                   FILTER (WHERE h % {_HASH_MOD} < least(1.0, $max / n) * {_HASH_MOD}) AS sample
        FROM c GROUP BY {grouping}""",
        {
            "run": run_id,
            "seed": seed,
            "max": max_sample,
            "sizes": [
                {"arm": arm, "level": level, "n": sum(blocks.values())}
                for (arm, level), blocks in sizes.items()
            ],
        },
    )
    blocks: dict[tuple[str, str], list[BlockFigures]] = {}
    levels = [r for r in rows if r["whole_level"] or not several]
    unrounded = _unrounded_walls(store, run_id)
    for r in rows:
        if r["whole_level"]:
            continue
        wall = unrounded.get((r["arm"], r["level"])) if r["block"] == 0 else None
        blocks.setdefault((r["arm"], r["level"]), []).append(
            BlockFigures(
                int(r["block"]),
                int(r["calls"]),
                int(r["met"]),
                float(r["met_tokens"]),
                float(r["wall_s"] or 0.0) if wall is None else wall,
                _percentiles(r, k),
            )
        )
    out = [
        _level(r, k, sorted(blocks.get((r["arm"], r["level"]), []), key=lambda b: b.block)) for r in levels
    ]
    return sorted(out, key=lambda f: (level_sort_key(f.level), f.arm))


def _unrounded_walls(store: SpanStore, run_id: str) -> dict[tuple[str, str], float]:
    """Per arm and level, the time its calls without a round (serve's traffic) spent at the level,
    over their visits (:mod:`specproxy.visits`): their block's wall time. A round's is its span."""
    source = "(SELECT * FROM slo_calls WHERE run_id = $run AND round IS NULL)"
    rows = store.query(visits_sql(source, "arm, level"), {"run": run_id})
    return {(r["arm"], r["level"]): float(r["busy_s"] or 0.0) for r in rows}


def _percentiles(r: dict[str, Any], k: int) -> tuple[float | None, ...]:
    return tuple(None if r[f"missing{i}"] or r[f"p{i}"] is None else float(r[f"p{i}"]) for i in range(k))


def _level(r: dict[str, Any], k: int, blocks: list[BlockFigures]) -> SloLevelFigures:
    return SloLevelFigures(
        arm=r["arm"],
        level=r["level"],
        load=r["load"],
        axis=r["axis"] or "",
        calls=int(r["calls"]),
        ok=int(r["ok"]),
        met=int(r["met"]),
        met_tokens=float(r["met_tokens"]),
        missing=tuple(int(r[f"missing{i}"]) for i in range(k)),
        percentiles=_percentiles(r, k),
        blocks=tuple(blocks),
        sample=ordered(r["sample"], k + 3),
    )


@dataclass(frozen=True, eq=False)
class LevelReplicates:
    """Bootstrap replicates of one arm at one level (rounds' spread included): goodput (req/s,
    tokens/s), the share meeting the SLO, and each target's log percentile (None: not estimated)."""

    requests_per_s: FloatArray
    tokens_per_s: FloatArray
    share: FloatArray
    log_percentiles: tuple[FloatArray | None, ...]


def _resample_index(blocks: FloatArray, iterations: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    """Row indices of ``iterations`` resamples, each resampling the rows of every block within it."""
    parts = []
    for b in np.unique(blocks):
        rows = np.flatnonzero(blocks == b)
        parts.append(rows[rng.integers(0, len(rows), size=(iterations, len(rows)))])
    return np.concatenate(parts, axis=1)


def _resampled(sample: FloatArray, column: int, idx: np.ndarray[Any, Any]) -> FloatArray:
    """The column's values at the resampled rows (gathered from a contiguous copy of the column: a
    strided gather from the sample matrix is several times slower)."""
    out: FloatArray = np.ascontiguousarray(sample[:, column])[idx]
    return out


def between_blocks(
    within: FloatArray, block_points: Sequence[float], factors: Sequence[float], rng: np.random.Generator
) -> FloatArray:
    """A between-block draw for each replicate: Student's t scaled by the blocks' excess spread
    (tau² = var(block estimates) − their mean within variance; Satterthwaite's degrees of freedom), or
    zeros when the blocks agree as well as their calls explain (the model of :mod:`.stats`)."""
    points = np.asarray(block_points, dtype=np.float64)
    if len(points) < 2 or not np.all(np.isfinite(points)) or len(within) < 2:
        return np.zeros(len(within))
    v_w = float(np.var(within, ddof=1))
    tau2 = max(0.0, float(np.var(points, ddof=1)) - v_w * float(np.mean(factors)))
    if tau2 == 0.0:
        return np.zeros(len(within))
    r = len(points)
    b = tau2 / r
    df = min(_MAX_DF, max(1, math.floor((v_w + b) ** 2 / (b * b / (r - 1)))))
    draws: FloatArray = math.sqrt(b) * rng.standard_t(df, size=len(within))
    return draws


def level_replicates(
    fig: SloLevelFigures, slo: Slo, *, iterations: int, rng: np.random.Generator
) -> LevelReplicates | None:
    """Replicates of the level's goodput, share and percentiles; None with fewer than 2 sampled calls."""
    s, n, m = fig.sample, max(fig.calls, 1), len(fig.sample)
    wall = fig.wall_s
    if m < 2 or wall <= 0:
        return None
    idx = _resample_index(s[:, -1], iterations, rng)
    scale = math.sqrt(m / n)
    factors = [n / max(b.calls, 1) for b in fig.blocks]

    def replicate(point: float, reps: FloatArray, block_points: Sequence[float]) -> FloatArray:
        within = scale * (reps - reps.mean())
        out: FloatArray = point + within + between_blocks(within, block_points, factors, rng)
        return out

    met_sum = _resampled(s, 0, idx).sum(axis=1) * (n / m)
    tok_sum = _resampled(s, 1, idx).sum(axis=1) * (n / m)
    logs: list[FloatArray | None] = []
    for i, (point, target) in enumerate(zip(fig.percentiles, slo.targets, strict=True)):
        if point is None or point <= 0:
            logs.append(None)
            continue
        # the resampled matrix is this call's own: the quantile may reorder it in place (no copy)
        quantiles = np.quantile(
            _resampled(s, 2 + i, idx), target.percentile / 100, axis=1, overwrite_input=True
        )
        # a latency of exactly zero (a clock's resolution) must not become log(0)
        reps = np.log(np.maximum(quantiles, 1e-9))
        block_values = [b.percentiles[i] for b in fig.blocks]
        block_logs = [math.log(v) for v in block_values if v is not None and v > 0]
        logs.append(replicate(math.log(point), reps, block_logs))
    return LevelReplicates(
        requests_per_s=replicate(
            fig.met / wall, met_sum / wall, [b.met / b.wall_s for b in fig.blocks if b.wall_s > 0]
        ),
        tokens_per_s=replicate(
            fig.met_tokens / wall,
            tok_sum / wall,
            [b.met_tokens / b.wall_s for b in fig.blocks if b.wall_s > 0],
        ),
        share=replicate(fig.met / n, met_sum / n, [b.met / max(b.calls, 1) for b in fig.blocks]),
        log_percentiles=tuple(logs),
    )


def interval(
    point: float, reps: FloatArray | None, confidence: float, low: float = 0.0, high: float = math.inf
) -> Interval:
    """The percentile interval of replicates around ``point``, clipped to [low, high]."""
    if reps is None or len(reps) < 2:
        return Interval(point, None, None)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(reps, [alpha, 1 - alpha])
    return Interval(point, min(max(float(lo), low), high), min(max(float(hi), low), high))
