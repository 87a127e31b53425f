"""The OpenTelemetry side of the span pipeline: records ⇄ spans, the DuckDB span exporter, OTLP.

:class:`~specproxy.proxy.spans.sink.SpanSink` drives these pieces; nothing here owns a thread.

- :func:`record_attributes` turns a :class:`~specproxy.record.SpanRecord` into OTel span attributes,
  named by :data:`~specproxy.record.OTEL_ATTRIBUTE` (GenAI semantic conventions where they exist, e.g.
  ``gen_ai.request.model``, ``gen_ai.usage.output_tokens``; ``specproxy.*`` otherwise). ``t_start`` and
  ``t_start_ns`` are not attributes: they are the span's start time.
- :func:`span_row` turns a finished span back into a row of table ``requests``;
  :class:`DuckDBSpanExporter` is an ordinary OTel ``SpanExporter`` that writes such rows with one
  columnar ``INSERT ... SELECT`` per batch (DuckDB scans a dict of numpy arrays), which is what makes
  ~100k rows per CPU-second possible; row-by-row ``executemany`` manages a few hundred.
- :func:`otlp_exporter` builds the OTLP/HTTP exporter from an explicit endpoint or the standard
  ``OTEL_*`` environment variables (rules in its docstring), or returns None.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from itertools import chain
from typing import Any

import numpy as np
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
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
    # code (~0.2 µs); 40 of them per span would triple span_row's cost. The SDK keeps the cleaned
    # values in a plain dict (`_dict`); read it directly when present, else go the public way.
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


# A span as a plain row: the attribute fields in ATTRIBUTE_FIELDS order, then trace_id, span_id (hex)
# and the start in epoch ns. This is what the sink's queue holds (a tuple of ~45 values, ~0.7 KB with
# its strings, where a finished OTel span with its attributes is ~4 KB), made while the span is fresh.
ROW_FIELDS: tuple[str, ...] = (*(name for name, _ in ATTRIBUTE_FIELDS), "trace_id", "span_id", "t_start_ns")
_ROW_KEYS = tuple(key for _, key in ATTRIBUTE_FIELDS)
_FINISH_INDEX = ROW_FIELDS.index("finish_reason")
_INDEX = {name: i for i, name in enumerate(ROW_FIELDS)}
_SLICE = 2048  # rows per C call when building a batch (a few ms of GIL at most)


def span_row(span: ReadableSpan) -> tuple[Any, ...]:
    """The ``requests`` row of a finished span, in :data:`ROW_FIELDS` order (None where absent)."""
    row = list(map(_attribute_dict(span).get, _ROW_KEYS))
    reasons = row[_FINISH_INDEX]
    if isinstance(reasons, (tuple, list)):
        row[_FINISH_INDEX] = str(reasons[0]) if reasons else None
    context = span.context
    if context is not None:
        row += (format(context.trace_id, "032x"), format(context.span_id, "016x"), span.start_time or 0)
    else:
        row += ("", "", span.start_time or 0)
    return tuple(row)


class DuckDBSpanExporter(SpanExporter):
    """Writes finished spans as rows of ``requests``, one columnar INSERT per :meth:`export` call.

    ``export(spans)`` is ``write_rows([span_row(s) for s in spans])``; the sink runs the two halves on
    different threads (rows are made in the span processor's ``on_end``, written by the writer thread).
    Owns no connection: it is given one, and must be called from the thread that uses it. A row that
    lacks a NOT NULL column (a span that did not come from :class:`SpanSink`) gets ``""`` there.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        described = conn.execute("DESCRIBE requests").fetchall()
        types: dict[str, str] = {str(r[0]): str(r[1]) for r in described}
        not_null = {str(r[0]) for r in described if r[2] == "NO"}
        # (row index, column, numpy kind or None for objects, NOT NULL?) for each row field in the table
        self._plan = [
            (i, name, _NUMPY_KIND.get(types[name]), name in not_null)
            for i, name in enumerate(ROW_FIELDS)
            if name in types and name not in ("t_start_ns",)
        ]
        self.rows_written = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            self.write_rows([span_row(s) for s in spans])
        except Exception:  # the SpanExporter contract: report, do not raise into the SDK's thread
            log.exception("could not write %d spans to the span store", len(spans))
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def write_rows(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Insert rows made by :func:`span_row`, in one statement. Raises on a value the column rejects."""
        if not rows:
            return
        # C-level passes make an (n, fields) object matrix; its columns are then converted whole.
        # fromiter over the chained rows, unlike np.array(rows), never mistakes a value for a dimension.
        # It runs in slices: one C call holds the GIL throughout, and the proxy's event loop shares it.
        width = len(ROW_FIELDS)
        if any(len(row) != width for row in rows):
            raise ValueError(f"span rows must have {width} values, as span_row() makes them")
        matrix = np.empty((len(rows), width), dtype=object)
        for k in range(0, len(rows), _SLICE):
            part = rows[k : k + _SLICE]
            flat = np.fromiter(chain.from_iterable(part), dtype=object, count=len(part) * width)
            matrix[k : k + len(part)] = flat.reshape(len(part), width)
        columns: dict[str, Column] = {}
        for index, name, kind, required in self._plan:
            columns[name] = _convert(matrix[:, index], kind, "" if required else None)
        starts = matrix[:, _INDEX["t_start_ns"]].astype(np.int64)
        columns["t_start_ns"] = (starts, None)
        columns["_t_start_us"] = (starts // 1000, None)
        insert_columns(self._conn, "requests", columns, {"t_start": epoch_us_to_timestamptz("_t_start_us")})
        self.rows_written += len(rows)

    def shutdown(self) -> None:
        """Nothing to release: the connection belongs to whoever gave it."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _convert(column: np.ndarray[Any, Any], kind: Any, null_fill: str | None) -> Column:
    """An object column of the row matrix as a DuckDB-scannable array plus null mask."""
    if kind is None:  # DuckDB reads None in an object column as NULL; only NOT NULL columns need a look
        values = np.ascontiguousarray(column)
        if null_fill is not None:
            values[values == None] = null_fill  # noqa: E711 (elementwise, not an identity test)
        return values, None
    nulls: np.ndarray[Any, Any] = column == None  # noqa: E711
    has_nulls = bool(nulls.any())
    if has_nulls:
        column = column.copy()
        column[nulls] = 0
    return column.astype(kind), nulls if has_nulls else None


TRACEPARENT_HEADER = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()


def client_trace_context(headers: Mapping[str, str]) -> SpanContext | None:
    """The trace context a client sent (W3C ``traceparent``/``tracestate``); None if absent or invalid."""
    context = get_current_span(_PROPAGATOR.extract(headers)).get_span_context()
    return context if context.is_valid else None


def traceparent(trace_id: str, span_id: str) -> str:
    """The W3C ``traceparent`` value naming a (sampled) span: what an arm's own tracing parents under."""
    return f"00-{trace_id}-{span_id}-01"


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
    url: str | None = None
    if endpoint:
        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
    else:
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
    # Imported only when wanted: it pulls in `requests` and protobuf (~0.1 s at start-up).
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=url) if url else OTLPSpanExporter()
