"""The DuckDB span store's schema, versioned and migrated forward.

``migrate(conn)`` brings any specproxy DuckDB file (or a new one) to :data:`SCHEMA_VERSION`. Each
migration is a list of statements applied once, in order, inside a transaction; the applied version is
kept in ``schema_version``. Add a migration by appending to :data:`MIGRATIONS`, never by editing one
that has shipped.
"""

from __future__ import annotations

from typing import Any

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
    config_json VARCHAR,   -- the experiment, as JSON
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

# One list of statements per version; index 0 brings an empty file to version 1.
MIGRATIONS: list[list[str]] = [
    [REQUESTS_DDL, RUNS_DDL, BACKEND_METRICS_DDL],
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
