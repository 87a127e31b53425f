"""The span record and the DuckDB schema agree, and the schema migrates forward once."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from specproxy import schema
from specproxy.record import COLUMNS, OTEL_ATTRIBUTE, SpanRecord, decode_tok_s


def test_requests_columns_match_the_record(tmp_path: Path) -> None:
    conn = duckdb.connect(str(tmp_path / "s.duckdb"))
    assert schema.migrate(conn) == schema.SCHEMA_VERSION
    cols = [r[0] for r in conn.execute("DESCRIBE requests").fetchall()]
    assert tuple(cols) == COLUMNS
    rec = SpanRecord(run_id="r", request_id="q", arm="a", arm_role="baseline", backend_url="http://x")
    conn.execute(f"INSERT INTO requests VALUES ({', '.join('?' * len(COLUMNS))})", rec.as_row())
    assert conn.execute("SELECT arm, status FROM requests").fetchall() == [("a", "ok")]
    conn.close()


def test_migrate_is_idempotent_and_refuses_newer_files(tmp_path: Path) -> None:
    path = str(tmp_path / "s.duckdb")
    with duckdb.connect(path) as conn:
        schema.migrate(conn)
        schema.migrate(conn)
        assert conn.execute("SELECT count(*) FROM schema_version").fetchone() == (schema.SCHEMA_VERSION,)
        conn.execute("INSERT INTO schema_version VALUES (999, now())")
        with pytest.raises(RuntimeError, match="newer than this specproxy"):
            schema.migrate(conn)


def test_genai_attribute_names() -> None:
    assert OTEL_ATTRIBUTE["completion_tokens"] == "gen_ai.usage.output_tokens"
    assert OTEL_ATTRIBUTE["model"] == "gen_ai.request.model"
    assert OTEL_ATTRIBUTE["accepted_tokens"] == "specproxy.accepted_tokens"
    assert len(set(OTEL_ATTRIBUTE.values())) == len(OTEL_ATTRIBUTE)


def test_decode_tok_s_definition() -> None:
    assert decode_tok_s(11, 1.0, 2.0) == 10.0
    assert decode_tok_s(1, 1.0, 2.0) is None
    assert decode_tok_s(5, 1.0, 1.0) is None
