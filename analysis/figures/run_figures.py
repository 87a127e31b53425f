"""The span store's figures for one run, as frozen values: the SQL side of the analysis.

Each function is one pass over the views of :mod:`specproxy.schema` (DuckDB does the heavy lifting)
and returns plain frozen values; :mod:`.evaluation` turns them into intervals and verdicts. Samples for
the bootstrap are uniform subsamples (hash of request_id, keep-probability from the level's call
count) carried as float matrices with the unit's block (round, or time block) in the last column.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specproxy.analysis.figures.provenance import MEASURED_SPEC_SOURCES, NOT_RECORDED, SpecCounts, TokenCounts
from specproxy.analysis.figures.resolution import TimingResolution, resolution_for, timing_resolutions
from specproxy.analysis.levels import LEVEL_SQL, level_load, level_sort_key
from specproxy.analysis.stats import FloatArray
from specproxy.analysis.store import SpanStore
from specproxy.schema import LATENCY_SAMPLE_BYTES, start_s_sql


@dataclass(frozen=True)
class SummaryFigures:
    """An arm's figures at one level as the arm_summary and acceptance views give them: what a level's
    summary holds and a verdict row (analysis.verdicts.rows.LevelRow) carries on as they are."""

    arm: str
    role: str
    spec_method: str
    level: str
    concurrency_level: int | None
    offered_rate: float | None
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


# The arm_summary view's columns a summary takes as they are.
_SUMMARY_VIEW_COLUMNS = (
    "arm",
    "level",
    "concurrency_level",
    "offered_rate",
    "calls",
    "ok",
    "first_start_s",
    "last_end_s",
    "wall_s",
    "agg_tok_s",
    "p50_decode_tok_s",
    "p50_ttft_s",
    "p95_ttft_s",
)


@dataclass(frozen=True)
class LevelSummary(SummaryFigures):
    """One arm at one level: the arm_summary view's figures, the level's /metrics acceptance, and where
    its token counts and per-request acceptance came from (``req_acceptance_*``: measured calls only)."""

    first_start_s: float | None
    last_end_s: float | None
    tokens: TokenCounts = TokenCounts({})
    spec: SpecCounts = SpecCounts({}, None, None, None, None)
    shadow_calls: int = 0  # its calls that were shadow copies (paced by the baseline's traffic)

    @property
    def shadow(self) -> bool:
        """Most of its calls here were shadow copies: they reached it at the baseline's pace, so its
        wall-clock throughput is the baseline's by construction (its capacity is not measured)."""
        return 2 * self.shadow_calls > self.calls

    @property
    def level_load(self) -> float | None:
        """The replay level's load (its concurrency, or offered req/s); None for live traffic."""
        return level_load(self.level)


def level_summaries(store: SpanStore, run_id: str) -> list[LevelSummary]:
    """Every (arm, level) of the run, levels in order, the baseline first within a level."""
    acceptance = {
        (r["arm"], r["level"]): r for r in store.query("SELECT * FROM acceptance WHERE run_id = ?", [run_id])
    }
    tokens, spec = _sources(store, run_id)
    # copies routed_as 'shadow' are serve's in shadow mode (a synthetic paired replay may call its
    # candidates' calls that too: they were sent at each arm's own pace)
    modes = store.query("SELECT DISTINCT mode FROM runs WHERE run_id = ?", [run_id])
    shadow_mode = any(m["mode"] == "shadow" for m in modes)
    out = []
    for r in store.query("SELECT * FROM arm_summary WHERE run_id = ?", [run_id]):
        acc = acceptance.get((r["arm"], r["level"]), {})
        key = (r["arm"], r["level"])
        measured = spec.get(key, SpecCounts({}, None, None, None, None))
        out.append(
            LevelSummary(
                **{name: r[name] for name in _SUMMARY_VIEW_COLUMNS},
                role=r["arm_role"],
                spec_method=r["spec_method"] or "none",
                completion_tokens=int(r["completion_tokens"]),
                decode_calls=int(r["decode_calls"]),
                acceptance_rate=acc.get("acceptance_rate"),
                acceptance_length=acc.get("acceptance_length"),
                req_acceptance_rate=measured.acceptance_rate,
                req_acceptance_length=measured.acceptance_length,
                tokens=tokens.get(key, TokenCounts({})),
                spec=measured,
                shadow_calls=int(r["shadow_calls"] or 0) if shadow_mode else 0,
            )
        )
    out.sort(key=lambda s: (level_sort_key(s.level), s.role != "baseline", s.arm))
    return out


def _sources(
    store: SpanStore, run_id: str
) -> tuple[dict[tuple[str, str], TokenCounts], dict[tuple[str, str], SpecCounts]]:
    """Per arm and level, the ok calls per token source and per speculation source, and the request
    acceptance sums of the calls whose speculation figures are measured."""
    rows = store.query(
        f"""
        SELECT arm, {LEVEL_SQL} AS level,
               CASE WHEN completion_tokens IS NULL THEN NULL ELSE coalesce(tokens_source, $nr) END AS ts,
               coalesce(spec_source, 'none') AS ss, count(*) AS n,
               sum(accepted_tokens) AS accepted, sum(draft_tokens) AS drafted, sum(num_drafts) AS drafts,
               sum(acceptance_length) AS len_sum, count(acceptance_length) AS len_n
        FROM requests WHERE run_id = $run AND status = 'ok'
        GROUP BY ALL
        """,
        {"run": run_id, "nr": NOT_RECORDED},
    )
    tokens: dict[tuple[str, str], dict[str, int]] = {}
    spec: dict[tuple[str, str], dict[str, int]] = {}
    sums: dict[tuple[str, str], list[float | None]] = {}
    for r in rows:
        key = (r["arm"], r["level"])
        if r["ts"] is not None:
            tokens.setdefault(key, {}).setdefault(r["ts"], 0)
            tokens[key][r["ts"]] += int(r["n"])
        spec.setdefault(key, {}).setdefault(r["ss"], 0)
        spec[key][r["ss"]] += int(r["n"])
        if r["ss"] in MEASURED_SPEC_SOURCES:
            acc = sums.setdefault(key, [None, None, None, 0.0, 0.0])
            for i, name in enumerate(("accepted", "drafted", "drafts", "len_sum", "len_n")):
                if r[name] is not None:
                    acc[i] = (acc[i] or 0.0) + float(r[name])
    out_spec = {}
    for key, by_source in spec.items():
        a, d, n, len_sum, len_n = sums.get(key, [None, None, None, 0.0, 0.0])
        out_spec[key] = SpecCounts(by_source, a, d, n, (len_sum or 0.0) / len_n if len_n else None)
    return {k: TokenCounts(v) for k, v in tokens.items()}, out_spec


@dataclass(frozen=True)
class FailedArm:
    """An arm none of whose calls in the run succeeded, and its first failure (by start time)."""

    arm: str
    calls: int
    status: str
    http_status: int | None
    error: str | None

    def describe(self) -> str:
        what = self.status + (f" HTTP {self.http_status}" if self.http_status is not None else "")
        text = (self.error or "").strip()
        detail = text.splitlines()[0][:300] if text else "no error text (empty body)"
        return (
            f"arm {self.arm!r} failed: every call failed ({self.calls} of {self.calls}); "
            f"first error: {what}: {detail}"
        )


def failed_arms(store: SpanStore, run_id: str) -> list[FailedArm]:
    """The run's arms without a single ok call, with their first failure."""
    rows = store.query(
        """
        SELECT arm, count(*) AS calls,
               arg_min([status, CAST(http_status AS VARCHAR), error], coalesce(t_start_ns, epoch_ns(t_start)))
                   AS first
        FROM requests WHERE run_id = ?
        GROUP BY arm HAVING count(*) FILTER (WHERE status = 'ok') = 0
        ORDER BY arm
        """,
        [run_id],
    )
    return [
        FailedArm(
            r["arm"],
            int(r["calls"]),
            r["first"][0],
            int(r["first"][1]) if r["first"][1] is not None else None,
            r["first"][2],
        )
        for r in rows
    ]


@dataclass(frozen=True)
class RoundFigures:
    """One arm at one level, per replay round: ok calls, tokens and wall time (first start, last end)."""

    rounds: tuple[int, ...]
    ok: tuple[int, ...]
    tokens: tuple[float, ...]
    wall_s: tuple[float, ...]

    def rate(self, r: int) -> float | None:
        i = self.rounds.index(r)
        return self.tokens[i] / self.wall_s[i] if self.wall_s[i] > 0 and self.tokens[i] > 0 else None


def round_figures(store: SpanStore, run_id: str) -> dict[tuple[str, str], RoundFigures]:
    rows = store.query(
        f"""
        WITH calls AS (
            SELECT arm, {LEVEL_SQL} AS level, round, status,
                   completion_tokens, e2e_s, {start_s_sql()} AS start_s
            FROM requests WHERE run_id = ? AND round IS NOT NULL
        )
        SELECT arm, level, round, count(*) FILTER (WHERE status = 'ok') AS ok,
               coalesce(sum(completion_tokens) FILTER (WHERE status = 'ok'), 0) AS tokens,
               max(start_s + coalesce(e2e_s, 0)) FILTER (WHERE status <> 'dropped')
                   - min(start_s) FILTER (WHERE status <> 'dropped') AS wall_s
        FROM calls GROUP BY ALL ORDER BY arm, level, round
        """,
        [run_id],
    )
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault((r["arm"], r["level"]), []).append(r)
    return {
        key: RoundFigures(
            tuple(int(r["round"]) for r in rs),
            tuple(int(r["ok"]) for r in rs),
            tuple(float(r["tokens"]) for r in rs),
            tuple(float(r["wall_s"] or 0.0) for r in rs),
        )
        for key, rs in grouped.items()
    }


@dataclass(frozen=True)
class BlockKey:
    """How one arm's calls at one level are sampled and cut into blocks.

    ``keep``: the share kept for the bootstrap; ``by_round``: blocks are replay rounds (else ``blocks``
    time blocks of equal length from ``t0`` over ``span_s``, the level's span over every arm).
    """

    arm: str
    level: str
    keep: float
    by_round: bool
    t0: float
    span_s: float


def _load_keys(store: SpanStore, keys: Sequence[BlockKey]) -> None:
    store.conn.execute(
        "CREATE OR REPLACE TEMP TABLE block_keys (arm VARCHAR, level VARCHAR, p DOUBLE, by_round BOOLEAN, "
        "t0 DOUBLE, span DOUBLE)"
    )
    store.conn.executemany(
        "INSERT INTO block_keys VALUES (?, ?, ?, ?, ?, ?)",
        [(k.arm, k.level, k.keep, k.by_round, k.t0, k.span_s) for k in keys],
    )


def _block_sql(alias: str, blocks: int) -> str:
    return (
        f"CASE WHEN k.by_round THEN coalesce({alias}.round, 0) WHEN k.span > 0 THEN "
        f"least({blocks - 1}, greatest(0, floor({blocks} * ({alias}.start_s - k.t0) / k.span))) ELSE 0 END"
    )


def ordered(rows: list[list[float | None]] | None, width: int) -> FloatArray:
    """A sample as a float matrix (NULL → NaN) in a canonical row order.

    DuckDB's parallel ``list()`` aggregate returns rows in no fixed order; sorting them makes the
    bootstrap (same seed) give the same intervals every time.
    """
    sample = np.array(rows or [], dtype=np.float64).reshape(-1, width)
    return sample[np.lexsort(sample.T[::-1])] if len(sample) else sample


@dataclass(frozen=True)
class IdentityCounts:
    compared: int = 0
    identical: int = 0
    near_tie: int = 0
    gross: int = 0
    margin_unknown: int = 0


@dataclass(frozen=True, eq=False)
class PairGroup:
    """A candidate (or replica, or repeat) against the baseline at one level (one category when
    ``category`` is set): identity counts, the paired figures, and the pair sample with columns
    candidate decode, baseline decode, candidate tokens, baseline tokens, candidate e2e, baseline e2e,
    block."""

    arm: str
    level: str
    kind: str
    category: str | None
    identity: IdentityCounts
    n_decode: int
    c_med: float | None
    b_med: float | None
    n_thr: int
    c_tokens: float | None
    c_e2e: float | None
    b_tokens: float | None
    b_e2e: float | None
    sample: FloatArray = field(repr=False)

    @property
    def per_call_ratio(self) -> float | None:
        if self.c_e2e and self.b_e2e and self.c_tokens and self.b_tokens:
            return (self.c_tokens / self.c_e2e) / (self.b_tokens / self.b_e2e)
        return None


def pair_groups(
    store: SpanStore,
    run_id: str,
    baseline: str,
    keys: Sequence[BlockKey],
    *,
    near_tie_margin: float,
    seed: int,
    blocks: int,
) -> list[PairGroup]:
    """Identity counts and paired figures per (arm, level) and per (arm, level, category), in one pass
    over ``pairs`` (GROUPING SETS); the filters are evaluated once per pair, not per aggregate."""
    _load_keys(store, keys)
    both_ok = "q.status = 'ok' AND q.baseline_status = 'ok' AND q.kind <> 'repeat' AND q.baseline_arm = $base"
    dec_ok = "q.decode_tok_s > 0 AND q.baseline_decode_tok_s > 0"
    thr_ok = (
        "q.completion_tokens IS NOT NULL AND q.baseline_completion_tokens IS NOT NULL"
        " AND q.e2e_s > 0 AND q.baseline_e2e_s > 0"
    )
    groups = store.query(
        f"""
        WITH q AS (
            SELECT q.arm, q.level, q.kind, coalesce(q.category, '(none)') AS cat, q.identical,
                   q.divergence_margin, q.decode_tok_s, q.baseline_decode_tok_s, q.completion_tokens,
                   q.baseline_completion_tokens, q.e2e_s, q.baseline_e2e_s,
                   {_block_sql("q", blocks)} AS block,
                   ({both_ok} AND {dec_ok}) AS dok,
                   ({both_ok} AND {thr_ok}) AS tok,
                   ({both_ok} AND (coalesce(k.p, 1) >= 1
                                   OR hash(q.request_id, $seed) % 1000000007 < k.p * 1000000007)) AS sok
            FROM pairs q LEFT JOIN block_keys k ON k.arm = q.arm AND k.level = q.level
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
                     q.baseline_completion_tokens, q.e2e_s, q.baseline_e2e_s, q.block])
                   FILTER (WHERE sok) AS sample
        FROM q
        GROUP BY GROUPING SETS ((q.arm, q.level, q.kind), (q.arm, q.level, q.kind, q.cat))
        """,
        {"margin": near_tie_margin, "seed": seed, "run": run_id, "base": baseline},
    )
    return [_pair_group(g) for g in groups]


def _pair_group(g: dict[str, Any]) -> PairGroup:
    """One row of :func:`pair_groups`' query as its figures."""
    return PairGroup(
        arm=g["arm"],
        level=g["level"],
        kind=g["kind"],
        category=g["cat"] if g["by_category"] else None,
        identity=IdentityCounts(
            int(g["compared"]),
            int(g["identical"]),
            int(g["near_tie"]),
            int(g["gross"]),
            int(g["margin_unknown"]),
        ),
        n_decode=int(g["n_decode"]),
        c_med=g["c_med"],
        b_med=g["b_med"],
        n_thr=int(g["n_thr"]),
        c_tokens=g["c_tokens"],
        c_e2e=g["c_e2e"],
        b_tokens=g["b_tokens"],
        b_e2e=g["b_e2e"],
        sample=ordered(g["sample"], 7),
    )


@dataclass(frozen=True, eq=False)
class CallGroup:
    """One arm's own calls at one level (one category when ``category`` is set), for unpaired
    comparisons; sample columns: decode tok/s, tokens, e2e, block."""

    arm: str
    level: str
    category: str | None
    n_decode: int
    p50_decode: float | None
    n_thr: int
    thr_tokens: float | None
    thr_e2e: float | None
    sample: FloatArray = field(repr=False)

    @property
    def per_call_rate(self) -> float | None:
        return self.thr_tokens / self.thr_e2e if self.thr_tokens and self.thr_e2e else None


def call_groups(
    store: SpanStore, run_id: str, keys: Sequence[BlockKey], *, seed: int, blocks: int
) -> dict[tuple[str, str, str | None], CallGroup]:
    """Each keyed arm's calls per level and per level and category, in one scan (GROUPING SETS)."""
    if not keys:
        return {}
    _load_keys(store, keys)
    thr_ok = "r.completion_tokens IS NOT NULL AND r.e2e_s > 0"
    rows = store.query(
        f"""
        SELECT r.arm, r.level, r.cat, grouping(r.cat) = 0 AS by_category,
               count(*) FILTER (WHERE r.decode_tok_s > 0) AS n_decode,
               quantile_cont(r.decode_tok_s, 0.5) FILTER (WHERE r.decode_tok_s > 0) AS p50_decode,
               count(*) FILTER (WHERE {thr_ok}) AS n_thr,
               sum(r.completion_tokens) FILTER (WHERE {thr_ok}) AS thr_tokens,
               sum(CAST(round(r.e2e_s * 1e9) AS HUGEINT)) FILTER (WHERE {thr_ok}) / 1e9 AS thr_e2e,
               list([r.decode_tok_s, r.completion_tokens, r.e2e_s, {_block_sql("r", blocks)}])
                   FILTER (WHERE k.p >= 1 OR hash(r.request_id, r.span_id, $seed) % 1000000007
                                              < k.p * 1000000007) AS sample
        FROM (SELECT *, {LEVEL_SQL} AS level,
                     coalesce(category, '(none)') AS cat,
                     {start_s_sql()} AS start_s
              FROM requests WHERE run_id = $run AND status = 'ok') r
        JOIN block_keys k ON k.arm = r.arm AND k.level = r.level
        GROUP BY GROUPING SETS ((r.arm, r.level), (r.arm, r.level, r.cat))
        """,
        {"seed": seed, "run": run_id},
    )
    out = {}
    for g in rows:
        cat = g["cat"] if g["by_category"] else None
        out[(g["arm"], g["level"], cat)] = CallGroup(
            arm=g["arm"],
            level=g["level"],
            category=cat,
            n_decode=int(g["n_decode"]),
            p50_decode=g["p50_decode"],
            n_thr=int(g["n_thr"]),
            thr_tokens=g["thr_tokens"],
            thr_e2e=g["thr_e2e"],
            sample=ordered(g["sample"], 4),
        )
    return out


@dataclass(frozen=True)
class LatencyFigures:
    """One arm at one level: the latency a streaming user feels, from the ``latency`` view (ok calls).

    TPOT is vLLM's, per call (mean and percentiles over calls); ITL percentiles are pooled over every
    gap between content chunks of the level's calls (``itl_gaps`` of them, from ``itl_calls`` of the
    ``gap_calls`` calls with gaps: all of them unless the level's gap lists were large enough to be
    sampled, ``sample_share`` < 1) and ``max_stall_s`` is the longest gap of any call; queueing only
    where the engine reported it (``queue_calls``). Tokens per chunk: ``tokens_per_chunk_basis`` is
    ``chunks`` when the engine gave each chunk's count (``sized_chunks`` chunks; mean and percentiles
    over them), ``per-call mean`` when only completion_tokens / chunks per call is known (the mean of
    that, no percentiles), None when neither is.

    ``timing_resolution_s``: the noise one gap can carry at this level (:mod:`.resolution`: the
    measuring loop's lag P99 ``resolution_loop_lag_s`` plus the simulator's write delay P99
    ``resolution_write_delay_s``; None when the run recorded neither); ``p95_itl_resolved``,
    ``p99_itl_resolved`` and ``max_stall_resolved`` say whether each tail figure is at least 50 times
    that (None when either is unknown).
    """

    calls: int
    tpot_calls: int
    mean_tpot_s: float | None
    p50_tpot_s: float | None
    p99_tpot_s: float | None
    gap_calls: int
    itl_calls: int
    sample_share: float
    itl_gaps: int
    p50_itl_s: float | None
    p95_itl_s: float | None
    p99_itl_s: float | None
    max_stall_s: float | None
    p50_e2e_s: float | None
    p95_e2e_s: float | None
    p99_e2e_s: float | None
    queue_calls: int
    p50_queue_s: float | None
    p95_queue_s: float | None
    p99_queue_s: float | None
    tokens_per_chunk_basis: str | None
    sized_chunks: int
    mean_tokens_per_chunk: float | None
    p50_tokens_per_chunk: float | None
    p99_tokens_per_chunk: float | None
    timing_resolution_s: float | None = None
    resolution_loop_lag_s: float | None = None
    resolution_write_delay_s: float | None = None
    p95_itl_resolved: bool | None = None
    p99_itl_resolved: bool | None = None
    max_stall_resolved: bool | None = None

    def tails(self) -> dict[str, float | None]:
        """The tail figures a single gap's noise can move: name → seconds."""
        return {"P95": self.p95_itl_s, "P99": self.p99_itl_s, "max": self.max_stall_s}


# The fields built from the level's timing resolution rather than read from the latency view.
RESOLUTION_FIELDS = (
    "timing_resolution_s",
    "resolution_loop_lag_s",
    "resolution_write_delay_s",
    "p95_itl_resolved",
    "p99_itl_resolved",
    "max_stall_resolved",
)
_VIEW_FIELDS = tuple(f for f in LatencyFigures.__dataclass_fields__ if f not in RESOLUTION_FIELDS)


def _resolution_fields(resolution: TimingResolution | None, view: dict[str, Any]) -> dict[str, Any]:
    """The resolution columns of one (arm, level), from its resolution and its view row's tails."""
    if resolution is None:
        return {}
    return {
        "timing_resolution_s": resolution.total_s,
        "resolution_loop_lag_s": resolution.loop_lag_p99_s,
        "resolution_write_delay_s": resolution.write_delay_p99_s,
        "p95_itl_resolved": resolution.resolves(view["p95_itl_s"]),
        "p99_itl_resolved": resolution.resolves(view["p99_itl_s"]),
        "max_stall_resolved": resolution.resolves(view["max_stall_s"]),
    }


def latency_figures(store: SpanStore, run_id: str) -> dict[tuple[str, str], LatencyFigures]:
    """Per (arm, level) of the run, its latency figures (one pass over the ``latency`` view), each
    with its level's timing resolution (read first, from the health table)."""
    resolutions = timing_resolutions(store, run_id)
    columns = ", ".join(_VIEW_FIELDS)
    rows = store.query(f"SELECT arm, level, {columns} FROM latency WHERE run_id = ?", [run_id])
    out = {}
    for r in rows:
        view = {k: r[k] for k in _VIEW_FIELDS}
        resolution = resolution_for(resolutions, r["arm"], r["level"])
        out[(r["arm"], r["level"])] = LatencyFigures(**view, **_resolution_fields(resolution, view))
    return out


# The CDF's points: every percentile from 0 to 99, then 99.5 and 99.9 (a tail of stalls past them
# would flatten the rest of the curve; the largest stall is reported beside it).
CDF_QUANTILES = tuple(i / 100 for i in range(100)) + (0.995, 0.999)


def itl_cdf(store: SpanStore, run_id: str, level: str) -> dict[str, tuple[float, ...]]:
    """Per arm, the pooled inter-token latency's quantiles (seconds) at :data:`CDF_QUANTILES`, at one
    level (ok calls with at least two content chunks; the ``latency`` view's sample of them when their
    gap lists are large)."""
    rows = store.query(
        f"""
        WITH calls AS (
            SELECT arm, request_id, span_id, round, chunk_gaps_us, chunk_tokens FROM requests
            WHERE run_id = $run AND status = 'ok'
              AND {LEVEL_SQL} = $level
        ), budget AS (
            -- the latency view's share, so that the curve is drawn from the calls its figures use
            SELECT arm, least(1.0, $bytes / (coalesce(sum(length(chunk_gaps_us)), 0)
                                             + coalesce(sum(length(chunk_tokens)), 0))) AS share
            FROM calls GROUP BY arm
        )
        SELECT arm, quantile_cont(g, $qs) AS q
        FROM (SELECT c.arm, TRY_CAST(unnest(string_split(c.chunk_gaps_us, ',')) AS BIGINT) / 1e6 AS g
              FROM calls c JOIN budget b USING (arm)
              WHERE c.chunk_gaps_us IS NOT NULL AND coalesce(b.share, 1.0) >= 1
                 OR hash(c.request_id, c.span_id, c.round) % 1000000007 < b.share * 1000000007)
        GROUP BY arm
        """,
        {"qs": list(CDF_QUANTILES), "run": run_id, "level": level, "bytes": LATENCY_SAMPLE_BYTES},
    )
    return {r["arm"]: tuple(float(v) for v in r["q"]) for r in rows if r["q"] is not None}


def engine_lags(
    store: SpanStore, run_id: str, left_out: Collection[tuple[str, int]] = ()
) -> dict[tuple[str, str], dict[int, float]]:
    """(arm, level) → round → the share of that round's busy time the arm's simulator fell behind its
    own clock (the health table's ``engine_clock_lag``; absent for engines that have no such clock),
    over the rounds the level is judged on (``left_out``: the (level, round) it is judged without)."""
    rows = store.query(
        f"""
        SELECT arm, {LEVEL_SQL} AS level, round, max(value) AS lag
        FROM health
        WHERE run_id = ? AND check_name = 'engine_clock_lag' AND arm IS NOT NULL AND value IS NOT NULL
        GROUP BY ALL
        """,
        [run_id],
    )
    out: dict[tuple[str, str], dict[int, float]] = {}
    for r in rows:
        if (r["level"], r["round"]) in left_out:
            continue
        out.setdefault((r["arm"], r["level"]), {})[int(r["round"] or 0)] = float(r["lag"])
    return out
