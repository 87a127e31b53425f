"""The OpenTelemetry side of the span pipeline: records ⇄ spans, the DuckDB span exporter, OTLP.

:class:`~specproxy.proxy.sink.SpanSink` drives these pieces; nothing here owns a thread.

- :func:`record_attributes` turns a :class:`~specproxy.record.SpanRecord` into OTel span attributes,
  named by :data:`~specproxy.record.OTEL_ATTRIBUTE` (GenAI semantic conventions where they exist, e.g.
  ``gen_ai.request.model``, ``gen_ai.usage.output_tokens``; ``specproxy.*`` otherwise). ``t_start`` and
  ``t_start_ns`` are not attributes: they are the span's start time.
- :class:`DuckDBSpanExporter` is an ordinary OTel ``SpanExporter``: it turns finished spans back into
  rows of table ``requests`` and writes each batch with one columnar ``INSERT ... SELECT`` (DuckDB scans
  a dict of numpy arrays), which is what makes ≥ 100k rows/s possible; row-by-row ``executemany`` manages
  a few thousand.
- :func:`otlp_exporter` builds the OTLP/HTTP exporter from an explicit endpoint or the standard
  ``OTEL_*`` environment variables (rules in its docstring), or returns None.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any

import numpy as np
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.types import AttributeValue

from specproxy.record import COLUMNS, OTEL_ATTRIBUTE, SpanRecord

log = logging.getLogger(__name__)

# Record fields carried by the span itself rather than by attributes.
_SPAN_FIELDS = frozenset({"trace_id", "span_id", "t_start", "t_start_ns"})
# (record field, attribute name) for every field that travels as an attribute.
ATTRIBUTE_FIELDS: tuple[tuple[str, str], ...] = tuple(
    (name, OTEL_ATTRIBUTE[name]) for name in COLUMNS if name not in _SPAN_FIELDS
)
# Semantic conventions make finish reasons a string array; the record holds one reason.
_FINISH_REASONS = OTEL_ATTRIBUTE["finish_reason"]
OPERATION_ATTRIBUTE = "gen_ai.operation.name"
_OPERATION = {"chat": "chat", "completions": "text_completion"}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def span_name(record: SpanRecord) -> str:
    """GenAI convention: ``"{operation} {model}"``, e.g. ``"chat meta-llama/Llama-3.1-8B-Instruct"``."""
    operation = _OPERATION.get(record.endpoint, record.endpoint)
    return f"{operation} {record.model}" if record.model else operation


def record_attributes(record: SpanRecord) -> dict[str, AttributeValue]:
    """The record as OTel attributes; None fields are left out (OTel has no null attribute value)."""
    attrs: dict[str, AttributeValue] = {OPERATION_ATTRIBUTE: _OPERATION.get(record.endpoint, record.endpoint)}
    for name, key in ATTRIBUTE_FIELDS:
        value = getattr(record, name)
        if value is not None:
            attrs[key] = value
    reason = attrs.get(_FINISH_REASONS)
    if reason is not None:
        attrs[_FINISH_REASONS] = (str(reason),)
    return attrs


def start_time_ns(record: SpanRecord) -> int:
    """The record's start in epoch nanoseconds: ``t_start_ns``, else ``t_start``; ValueError if neither."""
    if record.t_start_ns is not None:
        return record.t_start_ns
    if record.t_start is not None:
        t = record.t_start if record.t_start.tzinfo else record.t_start.replace(tzinfo=UTC)
        delta = t - _EPOCH
        # Integer arithmetic: a float timestamp would lose the microseconds.
        return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000
    raise ValueError("record has no start time")


def _attribute_dict(span: ReadableSpan) -> Mapping[str, Any]:
    # ReadableSpan.attributes is a MappingProxy over BoundedAttributes whose every lookup runs Python
    # code (~0.5 µs); 40 lookups per span would cap the exporter near 50k spans/s. The SDK keeps the
    # cleaned values in a plain dict (`_dict`); read it directly when present, else go the public way.
    inner = getattr(getattr(span, "_attributes", None), "_dict", None)
    if type(inner) is dict:
        return inner
    return dict(span.attributes or {})


# A batch column: its values and, when some are null, the null mask.
Column = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]

# DuckDB column type → how the exporter builds its numpy column.
_NUMPY_KIND = {
    "INTEGER": np.int64,
    "BIGINT": np.int64,
    "SMALLINT": np.int64,
    "DOUBLE": np.float64,
    "FLOAT": np.float64,
    "BOOLEAN": np.bool_,
}


def column_array(values: list[Any], sql_type: str) -> Column:
    """One column as a numpy array (typed where the SQL type allows) and its null mask (None: no nulls).

    Typed arrays with a separate mask are several times faster for DuckDB to scan than object arrays,
    and they coerce mixed ints/floats (a client that sent ``"temperature": 0``) to the column's type.
    """
    kind = _NUMPY_KIND.get(sql_type)
    if kind is None:
        return np.array(values, dtype=object), None
    if None not in values:
        return np.array(values, dtype=kind), None
    mask = np.fromiter((v is None for v in values), dtype=np.bool_, count=len(values))
    filled: np.ndarray[Any, Any] = np.array([0 if v is None else v for v in values], dtype=kind)
    return filled, mask


def insert_columns(
    conn: Any, table: str, columns: Mapping[str, Column], extra_sql: Mapping[str, str] | None = None
) -> None:
    """``INSERT INTO table (...) SELECT ...`` from numpy columns in one statement.

    ``extra_sql`` maps a target column to an SQL expression over the batch (e.g. a timestamp built from
    an integer column); a column whose name starts with ``_`` is only scanned, for such expressions. A
    column whose mask is all-true becomes a plain NULL.
    """
    batch: dict[str, np.ndarray[Any, Any]] = {}
    targets: list[str] = []
    exprs: list[str] = []
    for name, (values, mask) in columns.items():
        if name.startswith("_"):  # a helper column that extra_sql reads, not a column of the table
            batch[name] = values
            continue
        targets.append(name)
        if mask is None:
            batch[name] = values
            exprs.append(f'"{name}"')
        elif mask.all():
            exprs.append("NULL")
        else:
            batch[name] = values
            batch[f"{name}__null"] = mask
            exprs.append(f'CASE WHEN "{name}__null" THEN NULL ELSE "{name}" END')
    for name, expr in (extra_sql or {}).items():
        targets.append(name)
        exprs.append(expr)
    if not batch:  # DuckDB needs at least one column to scan; the batch length lives in extra_sql users
        raise ValueError("insert_columns needs at least one non-null column")
    conn.register("_specproxy_batch", batch)
    try:
        conn.execute(
            f"INSERT INTO {table} ({', '.join(targets)}) SELECT {', '.join(exprs)} FROM _specproxy_batch"
        )
    finally:
        conn.unregister("_specproxy_batch")


def epoch_us_to_timestamptz(column: str) -> str:
    """SQL turning an epoch-microseconds column into TIMESTAMPTZ, whatever the session's time zone."""
    return f"timezone('UTC', make_timestamp(\"{column}\"))"


class DuckDBSpanExporter(SpanExporter):
    """Writes finished spans as rows of ``requests``, one columnar INSERT per :meth:`export` call.

    Owns no connection: it is given one (and must be called from the thread that uses it). Spans that
    did not come from :class:`SpanSink` (no ``specproxy.run_id`` attribute) still get a row; required
    columns they lack are filled with ``""`` so the insert never fails for the whole batch.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        described = conn.execute("DESCRIBE requests").fetchall()
        self._types: dict[str, str] = {str(r[0]): str(r[1]) for r in described}
        self._not_null = {str(r[0]) for r in described if r[2] == "NO"}
        self._fields = [(n, k) for n, k in ATTRIBUTE_FIELDS if n in self._types]
        self.rows_written = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        insert_columns(self._conn, "requests", *self._columns(spans))
        self.rows_written += len(spans)
        return SpanExportResult.SUCCESS

    def _columns(self, spans: Sequence[ReadableSpan]) -> tuple[dict[str, Column], dict[str, str]]:
        # Transposing spans into columns is the writer's hot loop. Spans with the same attribute keys
        # (in a batch there are a handful of such shapes: baseline vs candidate, ok vs error, ...) are
        # transposed together with itemgetter + zip, both in C; a per-cell dict.get loop is 5x slower.
        groups: dict[tuple[str, ...], tuple[list[ReadableSpan], list[Mapping[str, Any]]]] = {}
        for span in spans:
            d = _attribute_dict(span)
            group = groups.get(tuple(d))
            if group is None:
                groups[tuple(d)] = ([span], [d])
            else:
                group[0].append(span)
                group[1].append(d)
        values: dict[str, list[Any]] = {name: [] for name, _ in self._fields}
        ordered: list[ReadableSpan] = []
        for keys, (members, dicts) in groups.items():
            ordered.extend(members)
            transposed: dict[str, tuple[Any, ...]] = {}
            if len(keys) == 1:
                transposed[keys[0]] = tuple(d[keys[0]] for d in dicts)
            elif keys:
                transposed = dict(zip(keys, zip(*map(itemgetter(*keys), dicts), strict=True), strict=True))
            nulls = [None] * len(members)
            for name, key in self._fields:
                values[name].extend(transposed.get(key, nulls))
        columns: dict[str, Column] = {}
        for name, key in self._fields:
            column = values[name]
            if key == _FINISH_REASONS:
                column = [v[0] if isinstance(v, (tuple, list)) and v else v for v in column]
            if name in self._not_null and None in column:
                column = ["" if v is None else v for v in column]
            columns[name] = column_array(column, self._types[name])
        contexts = [s.context for s in ordered]
        columns["trace_id"] = (np.array([format(c.trace_id, "032x") if c else "" for c in contexts],
                                        dtype=object), None)
        columns["span_id"] = (np.array([format(c.span_id, "016x") if c else "" for c in contexts],
                                       dtype=object), None)
        starts = np.array([s.start_time or 0 for s in ordered], dtype=np.int64)
        columns["t_start_ns"] = (starts, None)
        columns["_t_start_us"] = (starts // 1000, None)
        return columns, {"t_start": epoch_us_to_timestamptz("_t_start_us")}

    def shutdown(self) -> None:
        """Nothing to release: the connection belongs to whoever gave it."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def otlp_exporter(endpoint: str | None) -> SpanExporter | None:
    """The OTLP/HTTP (protobuf) span exporter to use, or None for no OTLP export.

    - ``endpoint`` given (the experiment's ``otlp_endpoint``, or ``--otlp-endpoint``): export there. A
      base URL such as ``http://collector:4318`` gets ``/v1/traces`` appended, as the OTel spec does for
      ``OTEL_EXPORTER_OTLP_ENDPOINT``; a URL already ending in ``/v1/traces`` is used as it is.
    - otherwise ``OTEL_TRACES_EXPORTER`` containing ``otlp`` turns it on; ``none`` (or any value without
      ``otlp``) keeps it off;
    - otherwise, a set ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` turns it on.
    Headers, timeout, compression and certificates come from the standard ``OTEL_EXPORTER_OTLP_*``
    variables, read by the exporter itself. Only the http/protobuf protocol is supported.
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if endpoint:
        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        return OTLPSpanExporter(endpoint=url)
    chosen = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    env_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    wanted = "otlp" in {c.strip() for c in chosen.split(",")} if chosen else bool(env_endpoint)
    if not wanted:
        return None
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    )
    if protocol and protocol != "http/protobuf":
        log.warning("OTLP protocol %r is not supported; exporting spans with http/protobuf instead", protocol)
    return OTLPSpanExporter()
