"""The DuckDB span store's schema, versioned and migrated forward.

``migrate(conn)`` brings any specproxy DuckDB file (or a new one) to :data:`SCHEMA_VERSION`. Each
migration is a list of statements applied once, in order, inside a transaction; the applied version is
kept in ``schema_version``. Add a migration by appending to :data:`MIGRATIONS`, never by editing one
that has shipped.
"""

from __future__ import annotations

from typing import Any

from specproxy.visits import visits_sql


def sql_literal(text: str) -> str:
    """``text`` as a DuckDB string literal, for the statements that take no parameters (ATTACH, COPY
    ... TO): ``it's`` → ``'it''s'``."""
    return "'" + text.replace("'", "''") + "'"


REQUESTS_DDL = """
CREATE TABLE IF NOT EXISTS requests (
    run_id VARCHAR NOT NULL,
    request_id VARCHAR NOT NULL,
    arm VARCHAR NOT NULL,
    arm_role VARCHAR NOT NULL,
    backend_url VARCHAR,
    trace_id VARCHAR,
    span_id VARCHAR,
    spec_method VARCHAR,
    num_speculative_tokens INTEGER,
    source VARCHAR,
    routed_as VARCHAR,
    category VARCHAR,
    concurrency_level INTEGER,
    inflight_at_start INTEGER,
    endpoint VARCHAR,
    model VARCHAR,
    stream BOOLEAN,
    temperature DOUBLE,
    max_tokens INTEGER,
    seed BIGINT,
    prompt_sha256 VARCHAR,
    prompt_tokens INTEGER,
    t_start TIMESTAMPTZ,
    t_start_ns BIGINT,
    ttft_s DOUBLE,
    e2e_s DOUBLE,
    decode_tok_s DOUBLE,
    chunks INTEGER,
    completion_tokens INTEGER,
    finish_reason VARCHAR,
    output_sha256 VARCHAR,
    output_text VARCHAR,
    num_drafts INTEGER,
    draft_tokens INTEGER,
    accepted_tokens INTEGER,
    acceptance_length DOUBLE,
    spec_source VARCHAR,
    identical BOOLEAN,
    first_divergence INTEGER,
    divergence_margin DOUBLE,
    status VARCHAR NOT NULL,
    http_status INTEGER,
    error VARCHAR
)
"""

RUNS_DDL = """
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY,
    name VARCHAR,
    mode VARCHAR,          -- shadow | split | replay-paired | replay-split
    source VARCHAR,        -- live | replay
    started_at TIMESTAMPTZ,
    ended_at TIMESTAMPTZ,
    config_json VARCHAR,   -- the experiment, as JSON (and the lab's JUDGED_PEAK_KEY, see below)
    stacks_json VARCHAR,   -- per arm: /version, /v1/models, description, engine facts
    host VARCHAR,
    specproxy_version VARCHAR
)
"""

BACKEND_METRICS_DDL = """
CREATE TABLE IF NOT EXISTS backend_metrics (
    run_id VARCHAR,
    arm VARCHAR NOT NULL,
    scraped_at TIMESTAMPTZ NOT NULL,
    phase VARCHAR,         -- e.g. 'c=16:before', 'c=16:after', 'periodic'
    name VARCHAR NOT NULL, -- e.g. vllm:spec_decode_num_drafts_total
    labels_json VARCHAR,   -- labels as sorted JSON, without `engine` when summed
    value DOUBLE
)
"""

# The measurement's own health, per level and round: did the machine keep up? One row per check,
# e.g. check_name = 'engine_clock_lag' (a simulator's lag behind its clock, as a fraction),
# 'loadgen_start_lag_p99_s', 'event_loop_lag_share', 'proxy_queue_p99_s'. arm is NULL for checks
# of the client side; threshold is the limit above which the level is not trusted (NULL: shown only,
# e.g. 'event_loop_lag_p99_s', 'sim_time_scale'). Live traffic's rows have no level or round.
HEALTH_DDL = """
CREATE TABLE IF NOT EXISTS health (
    run_id VARCHAR,
    arm VARCHAR,
    concurrency_level INTEGER,
    round INTEGER,
    check_name VARCHAR NOT NULL,
    value DOUBLE,
    threshold DOUBLE,
    measured_at TIMESTAMPTZ
)
"""

# A level is judged on the rounds that passed every health check when at least this many did (fewer
# rounds cannot show between-round drift); a round holds every arm, so dropping one favours none. The
# runner reruns a level until it has them, the analysis judges by them: both read it here.
MIN_HEALTHY_ROUNDS = 3


def level_sql(alias: str = "") -> str:
    """The SQL expression of a call's (or health row's) level label, the one name every query groups by.

    A closed-loop level is its concurrency as text ('16'), an open-loop level its offered rate in
    requests/s ('r=2', 'r=0.5': as :func:`rate_label` writes it), serve's traffic 'live'.
    ``alias``: the table alias to qualify the columns with.
    """
    p = f"{alias}." if alias else ""
    return (
        f"coalesce(CAST({p}concurrency_level AS VARCHAR), "
        f"'r=' || regexp_replace(CAST({p}offered_rate AS VARCHAR), '\\.0$', ''), 'live')"
    )


# The key of runs.config_json under which `specproxy lab` records where it judged the peak when it
# could not measure its top level soundly (it writes it after the sweep, beside the experiment the run
# recorded): {"concurrency": 64, "label": "judged at c=64: c=256 could not be measured on this
# machine", "why": "2 of 5 rounds passed the health checks"}. `analyze` reads the peak there unless
# --peak-concurrency or the experiment names one, so the lab's table and a later analyze agree.
JUDGED_PEAK_KEY = "judged_peak"


# Health checks whose value is a share (stored as a fraction, shown as a percentage); a check whose
# name ends in _s is in seconds (shown in milliseconds).
SHARE_CHECKS = frozenset({"engine_clock_lag", "event_loop_lag_share", "open_loop_rate_shortfall"})


def health_figure(check: str, value: float | None) -> str:
    """A health row's value or limit as a person reads it: '3.1%' for a share, '61.2 ms' for seconds,
    else three significant digits ('?' for none). JSON, CSV and the store keep the raw number."""
    if value is None:
        return "?"
    if check in SHARE_CHECKS:
        return f"{value:.1%}"
    if check.endswith("_s"):
        return f"{value * 1000:.1f} ms"
    return f"{value:.3g}"


def over_limit(check: str, value: float | None, threshold: float | None) -> str:
    """'3.1% > 2.0%': a failed health row's value over its limit."""
    return f"{health_figure(check, value)} > {health_figure(check, threshold)}"


def rate_label(rate_per_s: float) -> str:
    """An open-loop level's label, as :func:`level_sql` computes it: 'r=2' for 2.0, 'r=0.5' for 0.5.

    DuckDB writes a DOUBLE as text the way Python's ``repr`` does (shortest round trip), so both agree.
    """
    return "r=" + repr(float(rate_per_s)).removesuffix(".0")


def start_s_sql(alias: str = "") -> str:
    """The SQL expression of a call's start in seconds since the epoch: from ``t_start_ns`` when the
    span has it (exact), else from ``t_start`` (microseconds). ``alias``: the table alias to qualify
    the columns with."""
    p = f"{alias}." if alias else ""
    return f"coalesce({p}t_start_ns / 1e9, epoch_us({p}t_start) / 1e6)"


# The level label before open-loop levels had one (views of migrations 2-9).
_LEVEL_SQL_V2 = "coalesce(CAST({p}concurrency_level AS VARCHAR), 'live')"

# Views (migration 2): the analysis' building blocks, kept in the file so the DuckDB CLI sees them too.
# specproxy.analysis creates the same views over the union of several files. A level is named by
# level_sql(): the concurrency as text, 'r=<rate>' for an open-loop level, 'live' for serve's traffic.
# A call's start in seconds since the epoch is start_s_sql().
ARM_SUMMARY_VIEW_TEMPLATE = """
CREATE OR REPLACE VIEW arm_summary AS
WITH calls AS {not_materialized}(
    SELECT run_id, arm, arm_role, spec_method, status, completion_tokens, decode_tok_s, ttft_s, e2e_s,
           num_drafts, draft_tokens, accepted_tokens, acceptance_length, spec_source,
           {offered_rate}concurrency_level,
           {level} AS level,
           {start_s} AS start_s{busy_calls}
    FROM requests
), agg AS (
    SELECT run_id, arm, level,
           any_value(arm_role) AS arm_role,
           any_value(spec_method) AS spec_method,
           any_value(concurrency_level) AS concurrency_level,
           {any_offered_rate}count(*) AS calls,
           count(*) FILTER (WHERE status = 'ok') AS ok,
           coalesce(sum(completion_tokens) FILTER (WHERE status = 'ok'), 0) AS completion_tokens,
           -- the level's wall time: first start to last end of the calls that were sent
           min(start_s) FILTER (WHERE status <> 'dropped') AS first_start_s,
           max(start_s + coalesce(e2e_s, 0)) FILTER (WHERE status <> 'dropped') AS last_end_s,
           count(*) FILTER (WHERE status = 'ok' AND decode_tok_s > 0) AS decode_calls,
           quantile_cont(decode_tok_s, 0.5) FILTER (WHERE status = 'ok') AS p50_decode_tok_s,
           -- both TTFT percentiles from one sort of the level's values
           quantile_cont(ttft_s, [0.5, 0.95]) FILTER (WHERE status = 'ok') AS ttft_q,
           sum(accepted_tokens) FILTER (WHERE status = 'ok') AS req_accepted_tokens,
           sum(draft_tokens) FILTER (WHERE status = 'ok') AS req_draft_tokens,
           sum(num_drafts) FILTER (WHERE status = 'ok') AS req_num_drafts,
           avg(acceptance_length) FILTER (WHERE status = 'ok') AS req_mean_acceptance_length{busy_agg}
    FROM calls
    GROUP BY run_id, arm, level
)
SELECT run_id, arm, arm_role, spec_method, level, concurrency_level, calls, ok, calls - ok AS failed,
       completion_tokens, {offered_rate}first_start_s, last_end_s, {rate},
       decode_calls, p50_decode_tok_s, ttft_q[1] AS p50_ttft_s, ttft_q[2] AS p95_ttft_s,
       req_accepted_tokens / nullif(req_draft_tokens, 0) AS req_acceptance_rate,
       -- vLLM's definition (1 + accepted / drafts) where drafts were reported, else the per-request mean
       coalesce(1 + req_accepted_tokens / nullif(req_num_drafts, 0), req_mean_acceptance_length)
           AS req_acceptance_length
FROM agg{busy_join}
"""

# The pairs view's columns beside each call's kind, and its join to the baseline call (every version).
_PAIR_COLUMNS = """       b.arm AS baseline_arm,
       c.status, b.status AS baseline_status,
       c.decode_tok_s, b.decode_tok_s AS baseline_decode_tok_s,
       c.decode_tok_s / nullif(b.decode_tok_s, 0) AS decode_speedup,
       c.ttft_s, b.ttft_s AS baseline_ttft_s,
       c.e2e_s, b.e2e_s AS baseline_e2e_s,
       c.completion_tokens, b.completion_tokens AS baseline_completion_tokens,
       coalesce(c.identical,
                CASE WHEN c.status = 'ok' AND b.status = 'ok' AND c.greedy AND b.greedy
                     THEN c.output_hash = b.output_hash END) AS identical,
       c.first_divergence, abs(c.divergence_margin) AS divergence_margin,
       c.output_text, b.output_text AS baseline_output_text
FROM others c
JOIN base b ON c.run_id = b.run_id AND c.request_id = b.request_id
"""

# Each call beside the baseline call of the same request_id in the same replay round (the first ok
# one). kind says what the comparison measures: 'candidate' (a speculative arm), 'replica' (an arm with
# role 'replica', or any non-speculative arm beside the baseline: Diffy's secondary) or 'repeat' (the
# same request sent to the baseline again); the last two give the noise floor. start_s is the call's
# start in seconds since the epoch (the analysis cuts levels into time blocks with it). identical is
# the proxy's verdict, else a comparison of output hashes when both calls were greedy (temperature 0).
# Columns are listed, not `*`: DuckDB does not prune unused columns through the window, and the view
# over 10 M spans is twice as fast for it. `calls` is used twice and DuckDB would materialise it (all
# spans, in memory): NOT MATERIALIZED halves peak memory.
PAIRS_VIEW_TEMPLATE = (
    """
CREATE OR REPLACE VIEW pairs AS
WITH calls AS NOT MATERIALIZED (
    SELECT run_id, request_id, arm, arm_role, spec_method, routed_as, category, concurrency_level,
           {offered_rate}status, decode_tok_s, ttft_s, e2e_s, completion_tokens, identical, first_divergence,
           divergence_margin, output_text, t_start, t_start_ns, span_id, round,
           {start_s} AS start_s,
           temperature = 0 AS greedy, hash(output_sha256) AS output_hash
    FROM requests
), ranked AS (
    SELECT *, row_number() OVER (
        PARTITION BY run_id, request_id, round
        ORDER BY (status = 'ok') DESC, t_start, t_start_ns, span_id) AS base_rank
    FROM calls
    WHERE arm_role = 'baseline'
), base AS (
    SELECT run_id, request_id, round, arm, status, decode_tok_s, ttft_s, e2e_s, completion_tokens,
           output_text, greedy, output_hash
    FROM ranked WHERE base_rank = 1
), others AS (
    SELECT * EXCLUDE (t_start, t_start_ns, span_id) FROM calls WHERE arm_role <> 'baseline'
    UNION ALL
    SELECT * EXCLUDE (t_start, t_start_ns, span_id, base_rank) FROM ranked WHERE base_rank > 1
)
SELECT c.run_id, c.request_id,
       {c_level} AS level,
       c.concurrency_level, {c_offered_rate}c.round, c.start_s, c.category, c.arm, c.arm_role, c.spec_method,
       c.routed_as,
       CASE WHEN c.arm_role = 'baseline' THEN 'repeat'
            WHEN c.arm_role = 'replica' OR coalesce(c.spec_method, 'none') IN ('none', '') THEN 'replica'
            ELSE 'candidate' END AS kind,
"""
    + _PAIR_COLUMNS
    + """            AND c.round IS NOT DISTINCT FROM b.round
"""
)

# The pairs view of migrations 2-7 (before calls carried a replay round), kept as those migrations ran it.
PAIRS_VIEW_V2 = (
    """
CREATE OR REPLACE VIEW pairs AS
WITH calls AS NOT MATERIALIZED (
    SELECT run_id, request_id, arm, arm_role, spec_method, routed_as, category, concurrency_level,
           status, decode_tok_s, ttft_s, e2e_s, completion_tokens, identical, first_divergence,
           divergence_margin, output_text, t_start, t_start_ns, span_id,
           temperature = 0 AS greedy, hash(output_sha256) AS output_hash
    FROM requests
), ranked AS (
    SELECT *, row_number() OVER (
        PARTITION BY run_id, request_id
        ORDER BY (status = 'ok') DESC, t_start, t_start_ns, span_id) AS base_rank
    FROM calls
    WHERE arm_role = 'baseline'
), base AS (
    SELECT run_id, request_id, arm, status, decode_tok_s, ttft_s, e2e_s, completion_tokens, output_text,
           greedy, output_hash
    FROM ranked WHERE base_rank = 1
), others AS (
    SELECT * EXCLUDE (t_start, t_start_ns, span_id) FROM calls WHERE arm_role <> 'baseline'
    UNION ALL
    SELECT * EXCLUDE (t_start, t_start_ns, span_id, base_rank) FROM ranked WHERE base_rank > 1
)
SELECT c.run_id, c.request_id,
       coalesce(CAST(c.concurrency_level AS VARCHAR), 'live') AS level,
       c.concurrency_level, c.category, c.arm, c.arm_role, c.spec_method, c.routed_as,
       CASE WHEN c.arm_role = 'baseline' THEN 'repeat'
            WHEN coalesce(c.spec_method, 'none') IN ('none', '') THEN 'replica'
            ELSE 'candidate' END AS kind,
"""
    + _PAIR_COLUMNS
)

# Identity per run, arm and level. A mismatch is a near-tie when the logprob margin (top-1 minus
# top-2) at the first divergence is at most 0.5 nats (numerics can flip such a token), gross above it.
IDENTITY_VIEW = """
CREATE OR REPLACE VIEW identity AS
SELECT run_id, arm, level, any_value(concurrency_level) AS concurrency_level, any_value(kind) AS kind,
       count(identical) AS compared,
       count(*) FILTER (WHERE identical) AS identical,
       count(*) FILTER (WHERE NOT identical) AS mismatched,
       count(*) FILTER (WHERE identical) / nullif(count(identical), 0) AS identical_rate,
       count(*) FILTER (WHERE NOT identical AND divergence_margin <= 0.5) AS near_tie,
       count(*) FILTER (WHERE NOT identical AND divergence_margin > 0.5) AS gross,
       count(*) FILTER (WHERE NOT identical AND divergence_margin IS NULL) AS margin_unknown
FROM pairs
GROUP BY run_id, arm, level
"""

# What every version of the acceptance view does with the counters' increases: totals and the
# per-position shares per run, arm and phase, then the level each phase is of ({p}: the names' prefix).
_ACCEPTANCE_TOTALS = """), totals AS (
    SELECT run_id, arm, phase,
           sum(increase) FILTER (WHERE name = '{p}spec_decode_num_drafts_total') AS drafts,
           sum(increase) FILTER (WHERE name = '{p}spec_decode_num_draft_tokens_total') AS draft_tokens,
           sum(increase) FILTER (WHERE name = '{p}spec_decode_num_accepted_tokens_total') AS accepted_tokens
    FROM series
    GROUP BY run_id, arm, phase
), positions AS (
    SELECT s.run_id, s.arm, s.phase,
           list(s.increase / nullif(t.drafts, 0) ORDER BY TRY_CAST(s.position AS INTEGER))
               AS acceptance_per_position
    FROM (SELECT run_id, arm, phase, position, sum(increase) AS increase
          FROM series
          WHERE name = '{p}spec_decode_num_accepted_tokens_per_pos_total'
          GROUP BY run_id, arm, phase, position) s
    JOIN totals t USING (run_id, arm, phase)
    GROUP BY s.run_id, s.arm, s.phase
)
SELECT t.run_id, t.arm, t.phase,
       CASE WHEN t.phase LIKE 'c=%' THEN substr(t.phase, 3)
            WHEN t.phase = 'periodic' THEN 'live'
            ELSE t.phase END AS level,
       t.drafts, t.draft_tokens, t.accepted_tokens,
       t.accepted_tokens / nullif(t.draft_tokens, 0) AS acceptance_rate,
       1 + t.accepted_tokens / nullif(t.drafts, 0) AS acceptance_length,
       p.acceptance_per_position
FROM totals t
LEFT JOIN positions p USING (run_id, arm, phase)
"""

# Speculative-decoding counters per run, arm and level, from backend_metrics. A window is a phase
# pair 'X:before' / 'X:after' (replay's 'c=16', or one round of it, 'c=16 r2/3' or an extra round
# 'c=16 r4 extra' → level '16') or every scrape of one other phase ('periodic' → level 'live'). Each
# series (name + labels, so each `engine`) contributes its increase in each window, Prometheus-style:
# a drop means the counter restarted from zero, so the new value is the increase. Then windows and
# series are summed per level (over rounds, `engine` and any other label).
ACCEPTANCE_VIEW_TEMPLATE = (
    """
CREATE OR REPLACE VIEW acceptance AS
WITH samples AS (
    SELECT run_id, arm, scraped_at, {name_column}labels_json, value,
           CASE WHEN phase LIKE '%:before' OR phase LIKE '%:after'
                THEN regexp_replace(phase, ':(before|after)$', '')
                ELSE coalesce(phase, 'periodic') END AS win,
           json_extract_string(labels_json, '$.position') AS position
    FROM backend_metrics
    WHERE name IN ({names})
), steps AS (
    SELECT *, regexp_replace(win, '{round_suffix}', '') AS phase,
           lag(value) OVER (PARTITION BY run_id, arm, win, name, labels_json ORDER BY scraped_at) AS previous
    FROM samples
), series AS (
    SELECT run_id, arm, phase, name, position,
           sum(CASE WHEN previous IS NULL THEN 0
                    WHEN value >= previous THEN value - previous
                    ELSE value END) AS increase
    FROM steps
    GROUP BY run_id, arm, phase, win, name, labels_json, position
"""
    + _ACCEPTANCE_TOTALS
)


# A round's suffix of a replay phase: ' r2/3', and from migration 14 also an extra round's ' r6 extra'.
ROUND_SUFFIX_V8 = " r[0-9]+/[0-9]+$"
ROUND_SUFFIX = " r[0-9]+(/[0-9]+| extra)$"


def _acceptance_view(*prefixes: str, round_suffix: str = ROUND_SUFFIX_V8) -> str:
    """The acceptance view over the spec_decode_* counters of the engines with these metric prefixes:
    with one, the names are read whole; with several, the prefix is dropped and the rest summed alike.
    ``round_suffix``: the pattern cut from a phase to leave its level."""

    def names(prefix: str) -> str:
        drafts, tokens, accepted, per_pos = (
            f"'{prefix}:spec_decode_num_{counter}_total'"
            for counter in ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos")
        )
        return f"{drafts}, {tokens},\n                   {accepted},\n                   {per_pos}"

    if len(prefixes) == 1:
        name_column, p = "name, ", f"{prefixes[0]}:"
    else:
        name_column, p = f"regexp_replace(name, '^({'|'.join(prefixes)}):', '') AS name,\n           ", ""
    joined = ",\n                   ".join(names(prefix) for prefix in prefixes)
    return ACCEPTANCE_VIEW_TEMPLATE.format(
        name_column=name_column, names=joined, p=p, round_suffix=round_suffix
    )


ACCEPTANCE_VIEW = _acceptance_view("vllm")

# The acceptance view from migration 12: llama.cpp's llama-server counters too. It exports vLLM's
# spec_decode_* names under its own prefix (llamacpp:), with the same meaning (drafting steps, draft
# tokens, accepted tokens, accepted per draft position); the prefix is dropped and the rest is as above.
ACCEPTANCE_VIEW_ENGINES = _acceptance_view("vllm", "llamacpp")

# From migration 14: an extra round of a level ('c=256 r6 extra') counts toward its level too.
ACCEPTANCE_VIEW_EXTRA_ROUNDS = _acceptance_view("vllm", "llamacpp", round_suffix=ROUND_SUFFIX)

# The acceptance view of migrations 2-7 (one window per level), kept as those migrations ran it.
ACCEPTANCE_VIEW_V2 = """
CREATE OR REPLACE VIEW acceptance AS
WITH samples AS (
    SELECT run_id, arm, scraped_at, name, labels_json, value,
           CASE WHEN phase LIKE '%:before' OR phase LIKE '%:after'
                THEN regexp_replace(phase, ':(before|after)$', '')
                ELSE coalesce(phase, 'periodic') END AS phase,
           json_extract_string(labels_json, '$.position') AS position
    FROM backend_metrics
    WHERE name IN ('vllm:spec_decode_num_drafts_total', 'vllm:spec_decode_num_draft_tokens_total',
                   'vllm:spec_decode_num_accepted_tokens_total',
                   'vllm:spec_decode_num_accepted_tokens_per_pos_total')
), steps AS (
    SELECT *, lag(value) OVER (
        PARTITION BY run_id, arm, phase, name, labels_json ORDER BY scraped_at) AS previous
    FROM samples
), series AS (
    SELECT run_id, arm, phase, name, position,
           sum(CASE WHEN previous IS NULL THEN 0
                    WHEN value >= previous THEN value - previous
                    ELSE value END) AS increase
    FROM steps
    GROUP BY run_id, arm, phase, name, labels_json, position
""" + _ACCEPTANCE_TOTALS.format(p="vllm:")


def _arm_summary_view(*, with_rate: bool, visits: bool = False) -> str:
    """The arm_summary view; from migration 15 (``visits``) wall_s is the time the arm spent at the
    level (:mod:`specproxy.visits`), not first start to last end, and shadow_calls its shadow copies."""
    return ARM_SUMMARY_VIEW_TEMPLATE.format(
        level=level_sql() if with_rate else _LEVEL_SQL_V2.format(p=""),
        offered_rate="offered_rate, " if with_rate else "",
        any_offered_rate="any_value(offered_rate) AS offered_rate,\n           " if with_rate else "",
        start_s=start_s_sql(),
        not_materialized="NOT MATERIALIZED " if visits else "",
        busy_calls=",\n           routed_as, round, start_s + coalesce(e2e_s, 0) AS end_s" if visits else "",
        busy_agg=",\n           count(*) FILTER (WHERE routed_as = 'shadow') AS shadows" if visits else "",
        rate="v.busy_s AS wall_s, completion_tokens / nullif(v.busy_s, 0) AS agg_tok_s, "
        "shadows AS shadow_calls"
        if visits
        else "last_end_s - first_start_s AS wall_s,\n       "
        "completion_tokens / nullif(last_end_s - first_start_s, 0) AS agg_tok_s",
        busy_join=f" LEFT JOIN ({visits_sql('calls')}) v USING (run_id, arm, level)" if visits else "",
    )


def _pairs_view(*, with_rate: bool) -> str:
    return PAIRS_VIEW_TEMPLATE.format(
        offered_rate="offered_rate, " if with_rate else "",
        c_level=level_sql("c") if with_rate else _LEVEL_SQL_V2.format(p="c."),
        c_offered_rate="c.offered_rate, " if with_rate else "",
        start_s=start_s_sql(),
    )


# The views as migrations 2-9 created them (before open-loop levels had a label).
_ARM_SUMMARY_VIEW_V2 = _arm_summary_view(with_rate=False)
_PAIRS_VIEW_V8 = _pairs_view(with_rate=False)
_ARM_SUMMARY_VIEW_V10 = _arm_summary_view(with_rate=True)
ARM_SUMMARY_VIEW = _arm_summary_view(with_rate=True, visits=True)
PAIRS_VIEW = _pairs_view(with_rate=True)

# The current views (the analysis creates these over the stores it attaches).
VIEWS_DDL: list[str] = [ARM_SUMMARY_VIEW, PAIRS_VIEW, IDENTITY_VIEW, ACCEPTANCE_VIEW_EXTRA_ROUNDS]
# The views as migrations 2-6, 8 and 10 created them: a migration's statements never change once shipped.
VIEWS_DDL_V2: list[str] = [_ARM_SUMMARY_VIEW_V2, PAIRS_VIEW_V2, IDENTITY_VIEW, ACCEPTANCE_VIEW_V2]
VIEWS_DDL_V8: list[str] = [_ARM_SUMMARY_VIEW_V2, _PAIRS_VIEW_V8, IDENTITY_VIEW, ACCEPTANCE_VIEW]
VIEWS_DDL_V10: list[str] = [_ARM_SUMMARY_VIEW_V10, PAIRS_VIEW, IDENTITY_VIEW, ACCEPTANCE_VIEW]

# Every call (shadow copies never sent left out) with its load and the per-call latencies an SLO is
# checked on: goodput at any SLO is a filter and a count over it (analysis/README.md shows how).
SLO_CALLS_VIEW = f"""
CREATE OR REPLACE VIEW slo_calls AS
SELECT run_id, arm, arm_role, request_id, span_id, round, category,
       {level_sql()} AS level,
       CAST(coalesce(offered_rate, concurrency_level) AS DOUBLE) AS load,
       CASE WHEN offered_rate IS NOT NULL THEN 'rate'
            WHEN concurrency_level IS NOT NULL THEN 'concurrency' ELSE '' END AS load_axis,
       status, status = 'ok' AS ok,
       {start_s_sql()} AS start_s,
       {start_s_sql()} + coalesce(e2e_s, 0) AS end_s,
       ttft_s, tpot_s, itl_p50_s, itl_p95_s, itl_p99_s, itl_max_s, e2e_s,
       coalesce(completion_tokens, 0) AS completion_tokens
FROM requests WHERE status <> 'dropped'
"""

# Per arm and level, the latency a streaming user feels (ok calls): TPOT (vLLM's, per call: mean and
# percentiles over calls), inter-token latency pooled over the gaps between content chunks of the
# level's calls (from chunk_gaps_us: a long call weighs as many gaps as it has, as vLLM's benchmark
# pools them) and the largest stall (of every call), E2E, engine-reported queueing, and tokens per
# content chunk: over the chunks whose counts the engine gave (chunk_tokens) where any call has them,
# else completion_tokens / chunks per call, a per-call mean (tokens_per_chunk_basis says which).
# Percentiles interpolate linearly. Parsing every gap of a large store would dominate `analyze`, so a
# level whose gap and token lists hold more than LATENCY_SAMPLE_BYTES of text pools a uniform sample
# of its calls (by a hash of request_id, span_id and round: the same every time; sample_share the kept
# share, itl_calls of the gap_calls that have gaps). The largest stall, TPOT, E2E and queueing use
# every call.
LATENCY_SAMPLE_BYTES = 1_500_000
LATENCY_VIEW = f"""
CREATE OR REPLACE VIEW latency AS
WITH calls AS (
    SELECT run_id, arm, arm_role, spec_method, concurrency_level, offered_rate, request_id, span_id, round,
           {level_sql()} AS level,
           e2e_s, ttft_s, tpot_s, queue_s, itl_max_s, chunk_gaps_us, chunk_tokens, chunks, completion_tokens
    FROM requests WHERE status = 'ok'
), per_call AS (
    SELECT run_id, arm, level,
           any_value(arm_role) AS arm_role, any_value(spec_method) AS spec_method,
           any_value(concurrency_level) AS concurrency_level, any_value(offered_rate) AS offered_rate,
           count(*) AS calls,
           count(tpot_s) AS tpot_calls, avg(tpot_s) AS mean_tpot_s,
           quantile_cont(tpot_s, [0.5, 0.99]) AS tpot_q,
           quantile_cont(e2e_s, [0.5, 0.95, 0.99]) AS e2e_q,
           count(queue_s) AS queue_calls, quantile_cont(queue_s, [0.5, 0.95, 0.99]) AS queue_q,
           count(chunk_gaps_us) AS gap_calls, max(itl_max_s) AS max_stall_s,
           coalesce(sum(length(chunk_gaps_us)), 0) + coalesce(sum(length(chunk_tokens)), 0)
               AS list_bytes,
           count(chunk_tokens) AS chunk_tokens_calls,
           avg(completion_tokens / chunks) FILTER (WHERE chunks > 0) AS per_call_tokens_per_chunk
    FROM calls GROUP BY run_id, arm, level
), sampled AS (
    SELECT c.run_id, c.arm, c.level, c.chunk_gaps_us, c.chunk_tokens,
           least(1.0, {LATENCY_SAMPLE_BYTES} / p.list_bytes) AS share
    FROM calls c JOIN per_call p USING (run_id, arm, level)
    WHERE (c.chunk_gaps_us IS NOT NULL OR c.chunk_tokens IS NOT NULL)
      AND (p.list_bytes <= {LATENCY_SAMPLE_BYTES}
           OR hash(c.request_id, c.span_id, c.round) % 1000000007
              < {LATENCY_SAMPLE_BYTES} / p.list_bytes * 1000000007)
), sample_calls AS (
    SELECT run_id, arm, level, count(chunk_gaps_us) AS itl_calls, any_value(share) AS share
    FROM sampled GROUP BY run_id, arm, level
), gaps AS (
    SELECT run_id, arm, level, count(g) AS gaps, quantile_cont(g, [0.5, 0.95, 0.99]) AS itl_q
    FROM (SELECT run_id, arm, level, TRY_CAST(unnest(string_split(chunk_gaps_us, ',')) AS BIGINT) / 1e6 AS g
          FROM sampled WHERE chunk_gaps_us IS NOT NULL)
    GROUP BY run_id, arm, level
), sizes AS (
    SELECT run_id, arm, level, count(n) AS sized_chunks, avg(n) AS mean_n,
           quantile_cont(n, [0.5, 0.99]) AS n_q
    FROM (SELECT run_id, arm, level, TRY_CAST(unnest(string_split(chunk_tokens, ',')) AS BIGINT) AS n
          FROM sampled WHERE chunk_tokens IS NOT NULL)
    GROUP BY run_id, arm, level
)
SELECT p.run_id, p.arm, p.arm_role, p.spec_method, p.level, p.concurrency_level, p.offered_rate, p.calls,
       p.tpot_calls, p.mean_tpot_s, p.tpot_q[1] AS p50_tpot_s, p.tpot_q[2] AS p99_tpot_s,
       p.gap_calls, coalesce(sc.itl_calls, 0) AS itl_calls, coalesce(sc.share, 1.0) AS sample_share,
       coalesce(g.gaps, 0) AS itl_gaps,
       g.itl_q[1] AS p50_itl_s, g.itl_q[2] AS p95_itl_s, g.itl_q[3] AS p99_itl_s, p.max_stall_s,
       p.e2e_q[1] AS p50_e2e_s, p.e2e_q[2] AS p95_e2e_s, p.e2e_q[3] AS p99_e2e_s,
       p.queue_calls, p.queue_q[1] AS p50_queue_s, p.queue_q[2] AS p95_queue_s, p.queue_q[3] AS p99_queue_s,
       CASE WHEN s.sized_chunks > 0 THEN 'chunks' WHEN p.per_call_tokens_per_chunk IS NOT NULL
            THEN 'per-call mean' END AS tokens_per_chunk_basis,
       p.chunk_tokens_calls, coalesce(s.sized_chunks, 0) AS sized_chunks,
       coalesce(s.mean_n, p.per_call_tokens_per_chunk) AS mean_tokens_per_chunk,
       s.n_q[1] AS p50_tokens_per_chunk, s.n_q[2] AS p99_tokens_per_chunk
FROM per_call p
LEFT JOIN sample_calls sc USING (run_id, arm, level)
LEFT JOIN gaps g USING (run_id, arm, level)
LEFT JOIN sizes s USING (run_id, arm, level)
"""
# The views the analysis creates on top of a span store.
ANALYSIS_VIEWS: list[str] = [*VIEWS_DDL, LATENCY_VIEW]

# One list of statements per version; index 0 brings an empty file to version 1.
MIGRATIONS: list[list[str]] = [
    [REQUESTS_DDL, RUNS_DDL, BACKEND_METRICS_DDL],
    # 2: the analysis views (arm_summary, pairs, identity, acceptance)
    VIEWS_DDL_V2,
    # 3: the same views re-created (pairs lists its columns: twice as fast)
    VIEWS_DDL_V2,
    # 4: re-created again (pairs does not materialise its input: half the memory)
    VIEWS_DDL_V2,
    # 5: arm_summary.decode_calls (calls with a measured decode speed)
    VIEWS_DDL_V2,
    # 6: arm_summary takes both TTFT percentiles from one aggregate (30 % less CPU)
    VIEWS_DDL_V2,
    # 7: per-call round, engine, token source, queueing and engine load; the measurement's health
    [
        "ALTER TABLE requests ADD COLUMN round INTEGER",
        "ALTER TABLE requests ADD COLUMN engine VARCHAR",
        "ALTER TABLE requests ADD COLUMN tokens_source VARCHAR",
        "ALTER TABLE requests ADD COLUMN queue_s DOUBLE",
        "ALTER TABLE requests ADD COLUMN engine_running DOUBLE",
        "ALTER TABLE requests ADD COLUMN engine_waiting DOUBLE",
        "ALTER TABLE requests ADD COLUMN notes VARCHAR",
        HEALTH_DDL,
    ],
    # 8: pairs matches calls within a replay round, shows round and start_s; role 'replica' is a replica;
    # acceptance sums a level's rounds (each round its own before/after window, 'c=16 r2/3')
    VIEWS_DDL_V8,
    # 9: per-call TPOT and inter-token latency, chunk gaps and sizes; an open-loop level's offered rate
    [
        "ALTER TABLE requests ADD COLUMN tpot_s DOUBLE",
        "ALTER TABLE requests ADD COLUMN itl_p50_s DOUBLE",
        "ALTER TABLE requests ADD COLUMN itl_p95_s DOUBLE",
        "ALTER TABLE requests ADD COLUMN itl_p99_s DOUBLE",
        "ALTER TABLE requests ADD COLUMN itl_max_s DOUBLE",
        "ALTER TABLE requests ADD COLUMN chunk_gaps_us VARCHAR",
        "ALTER TABLE requests ADD COLUMN chunk_tokens VARCHAR",
        "ALTER TABLE requests ADD COLUMN offered_rate DOUBLE",
    ],
    # 10: open-loop levels: the health of a rate level; views label a level by its rate ('r=2')
    ["ALTER TABLE health ADD COLUMN offered_rate DOUBLE", *VIEWS_DDL_V10],
    # 11: slo_calls: each call's load and the per-call latencies an SLO is checked on
    [SLO_CALLS_VIEW],
    # 12: the acceptance view reads llama.cpp's llamacpp:spec_decode_* counters as well as vLLM's
    [ACCEPTANCE_VIEW_ENGINES],
    # 13: the latency view (TPOT, pooled inter-token latency, E2E, queueing, tokens per chunk)
    [LATENCY_VIEW],
    # 14: acceptance counts a level's extra rounds ('c=256 r6 extra') toward the level
    [ACCEPTANCE_VIEW_EXTRA_ROUNDS],
    # 15: arm_summary's wall_s and agg_tok_s over the arm's visits of the level, and shadow_calls
    [ARM_SUMMARY_VIEW],
    # 16: how old the engine gauges stamped on a call were, to place their reading in time
    ["ALTER TABLE requests ADD COLUMN engine_load_age_s DOUBLE"],
]
SCHEMA_VERSION = len(MIGRATIONS)


def current_version(conn: Any) -> int:
    """The schema version of an open DuckDB connection's database (0 for a new file)."""
    exists = conn.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_version'"
    ).fetchone()[0]
    if not exists:
        return 0
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def migrate(conn: Any) -> int:
    """Apply every migration the database lacks; returns the version it ends at.

    Raises RuntimeError for a file written by a newer specproxy (we never migrate backwards).
    """
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER, applied_at TIMESTAMPTZ)")
    have = current_version(conn)
    if have > SCHEMA_VERSION:
        raise RuntimeError(
            f"this span store has schema version {have}, newer than this specproxy understands "
            f"({SCHEMA_VERSION}); upgrade specproxy"
        )
    for version in range(have + 1, SCHEMA_VERSION + 1):
        conn.execute("BEGIN TRANSACTION")
        try:
            for stmt in MIGRATIONS[version - 1]:
                conn.execute(stmt)
            conn.execute("INSERT INTO schema_version VALUES (?, now())", [version])
            conn.execute("COMMIT")
        except Exception:
            conn.execute("ROLLBACK")
            raise
    return SCHEMA_VERSION
