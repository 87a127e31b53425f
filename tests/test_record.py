"""The span record as a contract: its fields match the store's columns, and any value is made to fit."""

from __future__ import annotations

import dataclasses
from typing import Any

import duckdb
import pytest

from specproxy import schema
from specproxy.record import (
    BIGINT_FIELDS,
    COLUMNS,
    REQUIRED_FIELDS,
    STATUSES,
    SpanRecord,
    fit_to_columns,
    valid_utf8,
)


def record(**fields: Any) -> SpanRecord:
    identity = {"run_id": "r", "request_id": "q", "arm": "a", "arm_role": "baseline", "backend_url": "u"}
    return SpanRecord(**(identity | fields))


def test_fields_match_the_store_columns_types_and_constraints() -> None:
    conn = duckdb.connect()
    schema.migrate(conn)
    described = {r[0]: (r[1], r[2]) for r in conn.execute("DESCRIBE requests").fetchall()}
    conn.close()
    assert list(described) == list(COLUMNS)
    assert {name for name, (sql, _) in described.items() if sql == "BIGINT"} == BIGINT_FIELDS
    assert {name for name, (_, nullable) in described.items() if nullable == "NO"} == REQUIRED_FIELDS
    assert STATUSES == (
        "ok",
        "http_error",
        "upstream_error",
        "timeout",
        "client_cancelled",
        "proxy_shutdown",
        "dropped",
    )


def test_a_record_that_fits_is_left_alone() -> None:
    rec = record(seed=2**63 - 1, max_tokens=2**31 - 1, output_text="héllo ✓", temperature=0.7, stream=True)
    before = dataclasses.replace(rec)
    assert fit_to_columns(rec) is rec and rec == before and rec.notes is None


@pytest.mark.parametrize(
    ("field", "value", "stored", "note"),
    [
        ("seed", 2**64 - 1, None, "seed 18446744073709551615 is out of range for BIGINT: stored as NULL"),
        ("seed", -(2**63) - 1, None, "out of range for BIGINT"),
        ("max_tokens", 2**31, None, "max_tokens 2147483648 is out of range for INTEGER: stored as NULL"),
        ("concurrency_level", 2**31, None, "concurrency_level 2147483648 is out of range for INTEGER"),
        ("prompt_tokens", 2**2000, None, "prompt_tokens (an integer of 2001 bits) is out of range"),
        ("completion_tokens", 3.0, None, "completion_tokens 3.0 is not an integer: stored as NULL"),
        ("temperature", 1, 1.0, None),
        ("temperature", 10**400, None, "is not a number"),
        ("stream", "yes", None, "stream 'yes' is not a boolean"),
        ("request_id", "x\udcff", "x\ufffd", "request_id was not valid UTF-8"),
        ("category", "\ud83d\ude00 \ud800", "\U0001f600 \ufffd", "category was not valid UTF-8"),
        ("model", 42, None, "model 42 is not text"),
    ],
)
def test_a_value_that_does_not_fit_is_replaced_and_noted(
    field: str, value: Any, stored: Any, note: str | None
) -> None:
    rec = fit_to_columns(record(**{field: value}))
    assert getattr(rec, field) == stored
    if note is None:
        assert rec.notes is None
    else:
        assert rec.notes is not None and note in rec.notes


def test_notes_accumulate() -> None:
    rec = record(seed=2**64, max_tokens=2**40, notes="earlier")
    fit_to_columns(rec)
    assert rec.notes is not None and rec.notes.startswith("earlier; max_tokens") and "; seed" in rec.notes


def test_valid_utf8_keeps_what_is_valid() -> None:
    assert valid_utf8("plain") == "plain"
    assert valid_utf8("日本 \udce6\udc97\udca5") == "日本 日"  # surrogate-escaped UTF-8 bytes decode again
