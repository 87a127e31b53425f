"""The span sink: span records → OpenTelemetry spans → a bounded queue → DuckDB (and OTLP).

One :class:`SpanSink` per process holds the span store (a DuckDB file has one writer) for its lifetime::

    sink = SpanSink("specproxy.duckdb", otlp_endpoint=None)
    sink.start()                      # opens the file (SpanStoreLocked if another process has it),
                                      # migrates the schema, starts the writer thread
    sink.begin_run(run_id, name="exp", mode="shadow", source="live", config_json="{}", stacks_json="{}")
    sink.emit(record)                 # from any thread or the event loop; never blocks; False = dropped
    sink.emit(record, parent=ctx)     # the same, as a child of an OTel SpanContext (a traceparent)
    sink.emit_backend_metrics(rows)   # rows of backend_metrics (the metrics scraper), same rules
    sink.write_health(rows)           # rows of health (replay, between phases); written at once
    sink.end_run(run_id)
    sink.close()                      # writes every accepted span and row, then closes the file

The path of a span. :meth:`SpanSink.emit` starts and ends a real OTel span on the sink's own
``TracerProvider`` (start and end time from the record, attributes from
:func:`~specproxy.proxy.spans.otel.record_attributes`). The span keeps the record's ``trace_id`` and
``span_id`` when they are valid hex ids (:func:`~specproxy.proxy.upstream.calls.new_record` makes them, so
the proxy can give a request's primary and shadow calls one trace, and tell each arm its span's id in a
``traceparent`` header); otherwise new ones are made and written back into the record. With ``parent``
the span is that context's child, in its trace. The provider has two span processors:

- the sink's queue: ``on_end`` turns the span into a row (:func:`~specproxy.proxy.spans.otel.span_row`) and
  appends it to a bounded list, which the writer thread drains through
  :class:`~specproxy.proxy.spans.otel.DuckDBSpanExporter` on its own DuckDB connection: one columnar insert
  per batch of up to ``batch_size`` rows, whenever ``batch_size`` rows wait and at least every
  ``flush_interval_s`` (:meth:`SpanSink.flush` waits for everything accepted so far);
- when OTLP is configured (``otlp_endpoint``, or the standard ``OTEL_*`` variables, see
  :func:`~specproxy.proxy.spans.otel.otlp_exporter`), the SDK's ``BatchSpanProcessor`` with the OTLP/HTTP
  exporter, on its own thread.

The queue holds at most ``queue_size`` spans waiting for the writer. :meth:`emit` reserves a place before
it does any OTel work: when none is left the record is dropped (from DuckDB and OTLP alike), counted in
:attr:`SpanSink.dropped`, and ``emit`` returns False at once — traffic never waits on the writer.
Records emitted after :meth:`close` began are dropped and counted the same way.

The sink always records: it uses its own provider with an always-on sampler and no attribute limits,
so ``OTEL_TRACES_SAMPLER``, ``OTEL_SPAN_ATTRIBUTE_*_LIMIT`` and ``OTEL_SDK_DISABLED`` (which turns the
SDK's tracers into no-ops) cannot thin or truncate the span store; with the SDK disabled the sink builds
the finished spans itself and OTLP export is off.

Exceptions (translated from DuckDB's at this boundary)::

    SpanSinkError                 the span store cannot be used (a sentence saying why and what to do)
    └── SpanStoreLocked           another process holds the file open for writing
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import duckdb
import numpy as np
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)

from specproxy import __version__, schema
from specproxy.proxy.spans.otel import (
    DuckDBSpanExporter,
    column_array,
    epoch_us_to_timestamptz,
    insert_columns,
    otlp_exporter,
    record_attributes,
    span_name,
    span_row,
    start_time_ns,
)
from specproxy.record import SpanRecord

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8192
# DuckDB's own default is 80 % of the machine's RAM, and it keeps what it writes cached up to that: a
# proxy running for days would grow without bound. 256 MB holds a checkpoint's worth of spans (64 MB of
# WAL) several times over; beyond it DuckDB evicts written blocks (and spills to <db>.tmp if it must).
DEFAULT_MEMORY_LIMIT = "256MB"
# WAL size at which DuckDB folds new rows into the file (its default is 16MB); see open_store().
DEFAULT_CHECKPOINT_THRESHOLD = "64MB"
DEFAULT_FLUSH_INTERVAL_S = 0.5
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# An empty context: a span without a parent never picks one up from the caller's current OTel context.
_ROOT = Context()


class SpanSinkError(RuntimeError):
    """The span store cannot be opened or written; the message says why and what to do."""


class SpanStoreLocked(SpanSinkError):
    """Another process holds the DuckDB file open for writing (DuckDB allows one writer per file)."""


class BackendMetricRow(NamedTuple):
    """One row of table ``backend_metrics``: one scraped series of one arm at one moment."""

    run_id: str | None
    arm: str
    scraped_at: datetime  # tz-aware UTC
    phase: str  # 'periodic', or replay's 'c=16:before' / 'c=16:after'
    name: str  # e.g. vllm:spec_decode_num_drafts_total
    labels_json: str  # sorted JSON of the labels, `engine` included
    value: float


class HealthRow(NamedTuple):
    """One row of table ``health``: one check of the measurement itself at one level and round."""

    run_id: str
    arm: str | None  # None: a check of the client side (load generator, event loop, proxy)
    concurrency_level: int | None
    round: int | None
    check_name: str  # engine_clock_lag | loadgen_start_lag_p99_s | event_loop_lag_p99_s | proxy_queue_p99_s
    value: float | None
    threshold: float | None  # the limit applied; above it the level is not trusted
    measured_at: datetime  # tz-aware UTC


def _epoch_us(t: datetime) -> int:
    t = t if t.tzinfo else t.replace(tzinfo=UTC)
    d = t - _EPOCH
    return (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds


class _PendingWrites:
    """The bounded hand-off between emitters and the writer thread; producers never block.

    A span takes a place with :meth:`reserve` before its OTel span exists and fills it in
    :meth:`put_reserved` when the span ends (the processor's ``on_end``), so the bound holds exactly and
    a full queue costs the caller one lock, not an OTel span.
    """

    def __init__(self, capacity: int, batch_size: int) -> None:
        self._lock = threading.Lock()
        self.wake = threading.Event()
        self._capacity = capacity
        self._batch_size = batch_size
        self._spans: list[tuple[Any, ...]] = []  # rows made by span_row()
        self._reserved = 0  # places taken: spans queued plus spans being built by emit()
        self._metric_rows: list[BackendMetricRow] = []
        self._closed = False
        self.dropped = 0
        self.dropped_metric_rows = 0

    def reserve(self) -> bool:
        with self._lock:
            if self._closed or self._reserved >= self._capacity:
                self.dropped += 1
                return False
            self._reserved += 1
            return True

    def release(self) -> None:
        """Give back a reservation whose span never ended (emit failed before ending it)."""
        with self._lock:
            self._reserved -= 1
            self.dropped += 1

    def put_reserved(self, row: tuple[Any, ...]) -> None:
        with self._lock:
            self._spans.append(row)
            full_batch = len(self._spans) == self._batch_size
        if full_batch:
            self.wake.set()

    def offer_metrics(self, rows: Sequence[BackendMetricRow]) -> bool:
        with self._lock:
            if self._closed or len(self._metric_rows) + len(rows) > self._capacity:
                self.dropped_metric_rows += len(rows)
                return False
            self._metric_rows.extend(rows)
        self.wake.set()
        return True

    def take(self, max_spans: int) -> tuple[list[tuple[Any, ...]], list[BackendMetricRow]]:
        with self._lock:
            spans = self._spans[:max_spans]
            del self._spans[:max_spans]
            self._reserved -= len(spans)
            rows, self._metric_rows = self._metric_rows, []
        return spans, rows

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.wake.set()

    @property
    def depth(self) -> int:
        return self._reserved

    @property
    def settled(self) -> bool:
        """Nothing queued and no emit() half-way."""
        with self._lock:
            return self._reserved == 0 and not self._metric_rows


class _RecordIds(IdGenerator):
    """Span and trace ids for the SDK: the ones the record being emitted carries, else random ones.

    The SDK asks its id generator while ``start_span`` runs, on the emitting thread; :meth:`SpanSink.emit`
    sets the record's ids in a thread-local just before and clears them right after.
    """

    def __init__(self) -> None:
        self._next = threading.local()
        self._random = RandomIdGenerator()

    def use(self, trace_id: int, span_id: int) -> None:
        self._next.ids = (trace_id, span_id)

    def clear(self) -> None:
        self._next.ids = None

    def generate_trace_id(self) -> int:
        ids = getattr(self._next, "ids", None)
        return ids[0] if ids is not None and ids[0] else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        ids = getattr(self._next, "ids", None)
        return ids[1] if ids is not None and ids[1] else self._random.generate_span_id()


def _hex_id(text: str, digits: int) -> int:
    """A record's hex trace/span id as an int; 0 (OTel's invalid id) when it is not one."""
    if len(text) != digits:
        return 0
    try:
        return int(text, 16)
    except ValueError:
        return 0


class _QueueSpanProcessor(SpanProcessor):
    """Hands every ended span to the writer's queue as a row (its place was reserved by emit()).

    The row is made here, while the span's attributes are fresh in the CPU cache, and the queue holds
    compact rows rather than spans with their attribute dicts (a full 100k queue: ~70 MB, not ~450 MB).
    """

    def __init__(self, pending: _PendingWrites) -> None:
        self._pending = pending

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        try:
            row = span_row(span)
        except Exception:  # never leave a reserved place unfilled: close() would wait for it
            log.exception("could not turn span %s into a row; dropped", span.name)
            self._pending.release()
            return
        self._pending.put_reserved(row)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class SpanSink:
    """Turns span records into OTel spans and writes them to the DuckDB span store (module docstring)."""

    def __init__(
        self,
        db_path: str | Path | None,
        *,
        queue_size: int = 100_000,
        otlp_endpoint: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        service_name: str | None = None,
        memory_limit: str = DEFAULT_MEMORY_LIMIT,
        checkpoint_threshold: str = DEFAULT_CHECKPOINT_THRESHOLD,
    ) -> None:
        if queue_size < 1 or batch_size < 1 or flush_interval_s <= 0:
            raise ValueError("queue_size and batch_size must be ≥ 1 and flush_interval_s > 0")
        self.db_path = Path(db_path) if db_path is not None else None
        self.memory_limit = memory_limit
        self.checkpoint_threshold = checkpoint_threshold
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._pending = _PendingWrites(queue_size, batch_size)
        self._written = 0
        self._metric_rows_written = 0
        self._failed = 0
        self._conn: Any = None
        self._runs_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._busy = False  # the writer holds rows it took but has not written yet (flush() waits)
        self._closed = False

        resource = Resource.create(
            {"service.name": service_name or os.environ.get("OTEL_SERVICE_NAME") or "specproxy"}
        )
        unlimited = SpanLimits(
            max_span_attributes=SpanLimits.UNSET, max_span_attribute_length=SpanLimits.UNSET
        )
        self._ids = _RecordIds()
        self._provider = TracerProvider(
            sampler=ALWAYS_ON,
            resource=resource,
            span_limits=unlimited,
            shutdown_on_exit=False,
            id_generator=self._ids,
        )
        self._provider.add_span_processor(_QueueSpanProcessor(self._pending))
        tracer = self._provider.get_tracer("specproxy")
        # OTEL_SDK_DISABLED=true makes get_tracer hand out a no-op tracer; the store must still fill.
        self._tracer: SdkTracer | None = tracer if isinstance(tracer, SdkTracer) else None
        self._resource = resource
        self._otlp: BatchSpanProcessor | None = None
        exporter = otlp_exporter(otlp_endpoint) if self._tracer is not None else None
        if exporter is not None:
            self._otlp = BatchSpanProcessor(exporter)
            self._provider.add_span_processor(self._otlp)
        # While the span store is the provider's only reader, emit() makes the finished span directly
        # (~13 µs) instead of through the SDK's start/end (~37 µs, sampler, attribute checks): the row is
        # the same. Handing the provider out (to add a processor) or an OTLP exporter needs real spans.
        self._direct = self._otlp is None

    @property
    def tracer_provider(self) -> TracerProvider:
        """The sink's own provider (add a span processor to see the spans elsewhere too)."""
        self._direct = False
        return self._provider

    @property
    def otlp_enabled(self) -> bool:
        return self._otlp is not None

    @property
    def dropped(self) -> int:
        """Spans dropped because the queue was full (or the sink closed, or building the span failed)."""
        return self._pending.dropped

    @property
    def dropped_metric_rows(self) -> int:
        return self._pending.dropped_metric_rows

    @property
    def written(self) -> int:
        """Span rows written to the DuckDB file."""
        return self._written

    @property
    def metric_rows_written(self) -> int:
        """backend_metrics rows written to the DuckDB file."""
        return self._metric_rows_written

    @property
    def failed(self) -> int:
        """Span rows the writer could not write (the error was logged)."""
        return self._failed

    @property
    def queue_depth(self) -> int:
        """Spans accepted and not yet handed to the writer."""
        return self._pending.depth

    def start(self) -> None:
        """Open the span store, bring its schema up to date and start the writer thread."""
        if self._thread is not None:
            raise SpanSinkError("this span sink is already started")
        cursor: Any = None
        exporter: DuckDBSpanExporter | None = None
        if self.db_path is not None:
            self._conn = open_store(
                self.db_path, memory_limit=self.memory_limit, checkpoint_threshold=self.checkpoint_threshold
            )
            # The writer's own connection to the file, made here so that a failure surfaces in start().
            try:
                cursor = self._conn.cursor()
                exporter = DuckDBSpanExporter(cursor)
            except duckdb.Error as exc:
                self._conn.close()
                self._conn = None
                where = self.db_path
                raise SpanSinkError(f"the span store {where} has no usable requests table: {exc}") from exc
        self._thread = threading.Thread(
            target=self._run_writer, args=(cursor, exporter), name="specproxy-span-writer", daemon=True
        )
        self._thread.start()

    def begin_run(
        self, run_id: str, *, name: str, mode: str, source: str, config_json: str, stacks_json: str
    ) -> None:
        """Add the ``runs`` row of a run (started_at = now). A no-op without a span store."""
        if self._conn is None:
            self._require_started()
            return
        with self._runs_lock:
            cur = self._conn.cursor()
            try:
                cur.execute(
                    "INSERT INTO runs (run_id, name, mode, source, started_at, config_json, stacks_json, "
                    "host, specproxy_version) VALUES (?, ?, ?, ?, now(), ?, ?, ?, ?)",
                    [run_id, name, mode, source, config_json, stacks_json, socket.gethostname(), __version__],
                )
            except duckdb.ConstraintException as exc:
                raise SpanSinkError(f"run {run_id!r} is already in {self.db_path}; use a new run id") from exc
            finally:
                cur.close()

    def end_run(self, run_id: str) -> None:
        """Set the run's ``ended_at`` to now."""
        if self._conn is None:
            return
        with self._runs_lock:
            cur = self._conn.cursor()
            try:
                cur.execute("UPDATE runs SET ended_at = now() WHERE run_id = ?", [run_id])
            finally:
                cur.close()

    def write_health(self, rows: Sequence[HealthRow]) -> None:
        """Insert ``health`` rows now, on the caller's thread (a handful per level and round, written
        between phases: call it off the event loop). A no-op without a span store."""
        if self._conn is None or not rows:
            return
        with self._runs_lock:
            cur = self._conn.cursor()
            try:
                cur.executemany(
                    "INSERT INTO health (run_id, arm, concurrency_level, round, check_name, value, "
                    "threshold, measured_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [list(r) for r in rows],
                )
            finally:
                cur.close()

    def emit(self, record: SpanRecord, parent: SpanContext | None = None) -> bool:
        """Queue one span record; thread-safe and never blocking. False when it was dropped (counted).

        The span has the record's ``trace_id``/``span_id`` when they are valid (else new ones, written
        back into the record); with a valid ``parent`` it is that span's child in that span's trace.
        It starts at ``t_start_ns`` (else ``t_start``, else now) and lasts ``e2e_s``.
        """
        if not self._pending.reserve():
            return False
        ended = False
        try:
            try:
                start = start_time_ns(record)
            except ValueError:
                start = time.time_ns()
            e2e = record.e2e_s
            end = start + round(e2e * 1e9) if e2e is not None and e2e > 0 else start
            attributes = record_attributes(record)
            trace_id, span_id = _hex_id(record.trace_id, 32), _hex_id(record.span_id, 16)
            if parent is not None and parent.is_valid:
                trace_id = parent.trace_id
            else:
                parent = None
            if self._tracer is None or self._direct:
                self._emit_without_sdk(record, attributes, start, end, trace_id, span_id, parent)
                ended = True
                return True
            within = set_span_in_context(NonRecordingSpan(parent)) if parent is not None else _ROOT
            self._ids.use(trace_id, span_id)
            try:
                span = self._tracer.start_span(
                    span_name(record),
                    context=within,
                    kind=SpanKind.CLIENT,
                    attributes=attributes,
                    start_time=start,
                )
            finally:
                self._ids.clear()
            context = span.get_span_context()
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
            if record.status != "ok":
                span.set_status(Status(StatusCode.ERROR, record.error or record.status))
            ended = True  # from here on the processor owns the reserved place
            span.end(end_time=end)
            return True
        except Exception:
            # A malformed record must not fail the request that produced it.
            log.exception("could not build the span of request %s; dropped", record.request_id)
            if not ended:
                self._pending.release()
            return False

    def _emit_without_sdk(
        self,
        record: SpanRecord,
        attributes: dict[str, Any],
        start: int,
        end: int,
        trace_id: int,
        span_id: int,
        parent: SpanContext | None,
    ) -> None:
        context = SpanContext(
            trace_id=trace_id or random.getrandbits(128) or 1,
            span_id=span_id or random.getrandbits(64) or 1,
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        record.trace_id = format(context.trace_id, "032x")
        record.span_id = format(context.span_id, "016x")
        span = ReadableSpan(
            name=span_name(record),
            context=context,
            parent=parent,
            attributes=attributes,
            start_time=start,
            end_time=end,
            kind=SpanKind.CLIENT,
            resource=self._resource,
        )
        self._pending.put_reserved(span_row(span))

    def emit_backend_metrics(self, rows: Sequence[BackendMetricRow]) -> bool:
        """Queue rows for ``backend_metrics``; never blocks. False when dropped (queue full or closed)."""
        if not rows:
            return True
        return self._pending.offer_metrics(rows)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything accepted so far is written (True) or ``timeout`` passes (False)."""
        self._pending.wake.set()
        deadline = time.monotonic() + timeout
        while not self._pending.settled or self._busy:
            if time.monotonic() > deadline:
                return False
            self._pending.wake.set()
            time.sleep(0.005)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Write every accepted span and metric row, stop the writer, close the file, flush OTLP.

        With a ``timeout`` that passes first, the spans not yet written are reported in the log and the
        file is left to the (daemon) writer thread. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._pending.close()
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error(
                    "the span writer did not finish within %.1fs; %d spans not yet written to %s",
                    timeout or 0.0,
                    self._pending.depth,
                    self.db_path,
                )
                return
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        # After the file is released: an unreachable collector retries for up to its timeout (10 s).
        if self._otlp is not None:
            self._otlp.force_flush(int((timeout or 30.0) * 1000))
        self._provider.shutdown()

    def _run_writer(self, cursor: Any, exporter: DuckDBSpanExporter | None) -> None:
        try:
            while True:
                stopping = self._stopping.is_set()
                self._pending.wake.wait(0.005 if stopping else self._flush_interval_s)
                self._pending.wake.clear()
                while True:
                    self._busy = True
                    spans, rows = self._pending.take(self._batch_size)
                    if not spans and not rows:
                        self._busy = False
                        break
                    self._write(exporter, cursor, spans, rows)
                    self._busy = False
                    # Hand the GIL to the event loop between batches rather than after a 5 ms slice.
                    time.sleep(0)
                if stopping and self._pending.settled:
                    return
        finally:
            self._busy = False
            if cursor is not None:
                cursor.close()

    def _write(
        self,
        exporter: DuckDBSpanExporter | None,
        cursor: Any,
        spans: list[tuple[Any, ...]],
        rows: list[BackendMetricRow],
    ) -> None:
        if spans and exporter is not None:
            self._write_spans(exporter, spans)
        if rows and cursor is not None:
            try:
                _insert_backend_metrics(cursor, rows)
                self._metric_rows_written += len(rows)
            except Exception:
                log.exception("could not write %d backend metric rows to %s", len(rows), self.db_path)

    def _write_spans(self, exporter: DuckDBSpanExporter, spans: list[tuple[Any, ...]]) -> None:
        try:
            exporter.write_rows(spans)
            self._written += len(spans)
            return
        except _BAD_ROW_ERRORS:
            pass  # some value the table cannot take: find it below, keep the rest
        except Exception as exc:  # the store itself failed (disk full, I/O): the batch is lost
            self._failed += len(spans)
            log.error("could not write %d spans to %s: %s", len(spans), self.db_path, exc)
            return
        bad: list[Exception] = []
        for row in spans:
            try:
                exporter.write_rows([row])
                self._written += 1
            except Exception as exc:
                bad.append(exc)
        self._failed += len(bad)
        if bad:
            log.error(
                "%d of %d spans could not be written to %s (dropped): %s",
                len(bad),
                len(spans),
                self.db_path,
                bad[0],
            )

    def _require_started(self) -> None:
        if self._thread is None:
            raise SpanSinkError("the span sink is not started; call start() first")

    def __enter__(self) -> SpanSink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _insert_backend_metrics(conn: Any, rows: Sequence[BackendMetricRow]) -> None:
    columns = {
        "run_id": column_array([r.run_id for r in rows], "VARCHAR"),
        "arm": column_array([r.arm for r in rows], "VARCHAR"),
        "phase": column_array([r.phase for r in rows], "VARCHAR"),
        "name": column_array([r.name for r in rows], "VARCHAR"),
        "labels_json": column_array([r.labels_json for r in rows], "VARCHAR"),
        "value": column_array([float(r.value) for r in rows], "DOUBLE"),
        "_scraped_us": (np.array([_epoch_us(r.scraped_at) for r in rows], dtype=np.int64), None),
    }
    insert_columns(conn, "backend_metrics", columns, {"scraped_at": epoch_us_to_timestamptz("_scraped_us")})


# Errors that come from a value in a row rather than from the store: the batch is retried row by row.
_BAD_ROW_ERRORS = (
    ValueError,
    TypeError,
    OverflowError,
    duckdb.ConversionException,
    duckdb.ConstraintException,
    duckdb.InvalidInputException,
)

_LOCK_PID = re.compile(r"\(PID (\d+)\)")


def open_store(
    path: Path,
    *,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    checkpoint_threshold: str = DEFAULT_CHECKPOINT_THRESHOLD,
) -> Any:
    """Open (or create) a span store for writing, with the sink's settings, and migrate its schema.

    ``memory_limit`` caps DuckDB's memory on this connection (a DuckDB size: ``"256MB"``, ``"1GB"``).
    DuckDB's errors become :class:`SpanSinkError` / :class:`SpanStoreLocked` with a sentence.
    """
    try:
        conn = duckdb.connect(str(path))
    except duckdb.IOException as exc:
        text = str(exc)
        if "lock" in text.lower():
            pid = _LOCK_PID.search(text)
            holder = f"process {pid.group(1)}" if pid else "another process"
            raise SpanStoreLocked(
                f"the span store {path} is open for writing in {holder}; DuckDB allows one writer per "
                f"file: stop that process, or give this one another file (--db)"
            ) from exc
        raise SpanSinkError(f"cannot open the span store {path}: {text}") from exc
    except duckdb.Error as exc:
        raise SpanSinkError(
            f"cannot open the span store {path} ({exc}); is it a DuckDB file written by specproxy?"
        ) from exc
    try:
        # DuckDB checkpoints its WAL into the file every 16 MB by default, each time rewriting the last,
        # partly filled row group; at bulk span rates (replay, ingest) that is most of the writer's time.
        # 64 MB (~130k spans held in memory until checkpointed) makes sustained ingest ~40% faster;
        # close() checkpoints. serve, at a few hundred spans/s, uses a small threshold instead: memory
        # stays flat rather than climbing for the minutes it takes to reach 64 MB.
        conn.execute("SET checkpoint_threshold = ?", [checkpoint_threshold])
        try:
            conn.execute("SET memory_limit = ?", [memory_limit])
        except duckdb.Error as exc:
            raise SpanSinkError(
                f"span store memory limit {memory_limit!r} is not a DuckDB size such as '256MB' or '1GB' "
                f"({exc})"
            ) from exc
        schema.migrate(conn)
    except RuntimeError as exc:
        conn.close()
        raise SpanSinkError(str(exc)) from exc
    except duckdb.Error as exc:
        conn.close()
        raise SpanSinkError(f"cannot set up the schema of the span store {path}: {exc}") from exc
    return conn


__all__ = [
    "BackendMetricRow",
    "HealthRow",
    "SpanSink",
    "open_store",
    "SpanSinkError",
    "SpanStoreLocked",
]
