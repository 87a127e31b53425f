"""The span sink: span records → a bounded queue → DuckDB rows on the writer's thread (and OTLP).

One :class:`SpanSink` per process holds the span store (a DuckDB file has one writer) for its lifetime::

    sink = SpanSink("specproxy.duckdb", otlp_endpoint=None)
    sink.start()                      # opens the file (SpanStoreLocked if another process has it),
                                      # migrates the schema, starts the writer thread
    sink.begin_run(run_id, name="exp", mode="shadow", source="live", config_json="{}", stacks_json="{}")
    sink.emit(record)                 # from any thread or the event loop; never blocks; False = dropped
    sink.emit(record, parent=tp)      # the same, as a child of the client's span (a TraceParent)
    sink.emit_backend_metrics(rows)   # rows of backend_metrics (the metrics scraper), same rules
    sink.write_health(rows)           # rows of health (replay, between phases); written at once
    sink.end_run(run_id)
    sink.close()                      # writes every accepted span and row, then closes the file

The path of a span. :meth:`SpanSink.emit` gives the record valid W3C ids if it lacks them (the
parent's trace id when it has a parent), takes its row (its values in column order, one C-level call)
and appends it to a bounded list. The writer thread drains the list through
:class:`~specproxy.proxy.spans.table.RequestsTable` on its own DuckDB connection: one checked, columnar
insert per batch of up to ``batch_size`` rows, whenever ``batch_size`` rows wait and at least every
``flush_interval_s`` (:meth:`SpanSink.flush` waits for everything accepted so far).

When OTLP export is configured (``otlp_endpoint``, or the standard ``OTEL_*`` variables, see
:func:`otlp_target`), the writer also builds each written row's OTel span and hands it to the OTLP
exporter's ``BatchSpanProcessor``, which exports on its own thread; this needs the ``otlp`` extra.
:meth:`SpanSink.add_span_processor` adds any other OTel span processor the same way.

Nothing is lost silently. The queue holds at most ``queue_size`` spans waiting for the writer: when it
is full the record is dropped (from DuckDB and OTLP alike), and ``emit`` returns False at once — traffic
never waits on the writer. Records emitted after :meth:`close` began are dropped the same way. A value
a column cannot hold is made to fit and noted in the row (``notes``), so a batch does not fail on one;
if an insert still fails on a row, the batch is split until only that row is left out, and a batch the
store refuses (a full disk) is left out whole. Every span left out is counted in
:attr:`SpanSink.dropped` and logged.

Exceptions (translated from DuckDB's at this boundary)::

    SpanSinkError                 the span store cannot be used (a sentence saying why and what to do)
    └── SpanStoreLocked           another process holds the file open for writing
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import duckdb
import numpy as np

from specproxy import __version__, schema
from specproxy.proxy.spans.failures import WriteFailures, close_store
from specproxy.proxy.spans.table import (
    T_START_NS,
    RequestsTable,
    Row,
    column_array,
    epoch_us_to_timestamptz,
    insert_columns,
    record_row,
)
from specproxy.proxy.spans.trace import TraceParent, is_span_id, is_trace_id, new_span_id, new_trace_id
from specproxy.record import SpanRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

    from specproxy.proxy.spans.otel import SpanExport

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
OTLP_EXTRA_HINT = "pip install 'specproxy[otlp]'"


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
    check_name: str  # engine_clock_lag | event_loop_lag_share | ...: proxy/health.py
    value: float | None
    threshold: float | None  # the limit applied; above it the level is not trusted
    measured_at: datetime  # tz-aware UTC
    offered_rate: float | None = None  # an open-loop level's offered load (requests/s); None otherwise


def _epoch_us(t: datetime) -> int:
    t = t if t.tzinfo else t.replace(tzinfo=UTC)
    d = t - _EPOCH
    return (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds


def _epoch_ns(t: datetime) -> int:
    # Integer arithmetic: a float timestamp would lose the microseconds.
    return _epoch_us(t) * 1_000


class OtlpTarget(NamedTuple):
    """Where OTLP export goes: ``url`` (…/v1/traces), or None for the exporter's own ``OTEL_*`` settings;
    ``why``: what configured it, for messages."""

    url: str | None
    why: str


def otlp_target(endpoint: str | None) -> OtlpTarget | None:
    """Whether to export spans over OTLP/HTTP (protobuf), and where; None for no export.

    - ``endpoint`` given (the experiment's ``otlp_endpoint``, or ``--otlp-endpoint``): export there. A
      base URL such as ``http://collector:4318`` gets ``/v1/traces`` appended, as the OTel spec does for
      ``OTEL_EXPORTER_OTLP_ENDPOINT``; a URL already ending in ``/v1/traces`` is used as it is.
    - otherwise ``OTEL_TRACES_EXPORTER`` containing ``otlp`` turns it on; ``none`` (or any value without
      ``otlp``) keeps it off;
    - otherwise, a set ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` turns it on;
    - ``OTEL_SDK_DISABLED=true`` turns it off whatever else says.
    Headers, timeout, compression and certificates come from the standard ``OTEL_EXPORTER_OTLP_*``
    variables, read by the exporter itself. Only the http/protobuf protocol is supported.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if endpoint:
        url = endpoint.rstrip("/")
        return OtlpTarget(
            url if url.endswith("/v1/traces") else url + "/v1/traces", f"otlp_endpoint {endpoint}"
        )
    chosen = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    env_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if chosen:
        if "otlp" not in {c.strip() for c in chosen.split(",")}:
            return None
        return OtlpTarget(None, "OTEL_TRACES_EXPORTER=otlp")
    return OtlpTarget(None, "OTEL_EXPORTER_OTLP_ENDPOINT") if env_endpoint else None


def _span_export(service_name: str | None, wanted: str) -> SpanExport:
    """The OTel side, imported only now: it needs the SDK (the ``otlp`` extra). ``wanted``: what asks
    for it, for the message."""
    try:
        from specproxy.proxy.spans.otel import SpanExport
    except ImportError as exc:
        raise _not_installed(wanted, exc) from exc
    return SpanExport(service_name)


def _not_installed(wanted: str, exc: ImportError) -> SpanSinkError:
    return SpanSinkError(
        f"{wanted}, but the OpenTelemetry SDK or its OTLP exporter is not installed "
        f"({exc.name or exc}): install them with {OTLP_EXTRA_HINT}"
    )


class _PendingWrites:
    """The bounded hand-off between emitters and the writer thread; producers never block."""

    def __init__(self, capacity: int, batch_size: int) -> None:
        self._lock = threading.Lock()
        self.wake = threading.Event()
        self._capacity = capacity
        self._batch_size = batch_size
        self._rows: list[Row] = []
        self._parents: list[TraceParent | None] = []
        self._metric_rows: list[BackendMetricRow] = []
        self._closed = False
        self.dropped = 0
        self.dropped_metric_rows = 0

    def offer(self, row: Row, parent: TraceParent | None) -> bool:
        with self._lock:
            if self._closed or len(self._rows) >= self._capacity:
                self.dropped += 1
                return False
            self._rows.append(row)
            self._parents.append(parent)
            full_batch = len(self._rows) == self._batch_size
        if full_batch:
            self.wake.set()
        return True

    def count_dropped(self, n: int = 1) -> None:
        with self._lock:
            self.dropped += n

    def offer_metrics(self, rows: Sequence[BackendMetricRow]) -> bool:
        with self._lock:
            if self._closed or len(self._metric_rows) + len(rows) > self._capacity:
                self.dropped_metric_rows += len(rows)
                return False
            self._metric_rows.extend(rows)
        self.wake.set()
        return True

    def take(self, max_rows: int) -> tuple[list[Row], list[TraceParent | None], list[BackendMetricRow]]:
        with self._lock:
            rows, parents = self._rows[:max_rows], self._parents[:max_rows]
            del self._rows[:max_rows], self._parents[:max_rows]
            metric_rows, self._metric_rows = self._metric_rows, []
        return rows, parents, metric_rows

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.wake.set()

    @property
    def depth(self) -> int:
        return len(self._rows)

    @property
    def settled(self) -> bool:
        """Nothing queued."""
        with self._lock:
            return not self._rows and not self._metric_rows


class SpanSink:
    """Writes span records to the DuckDB span store on its own thread (module docstring)."""

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
        self._failures = WriteFailures(self.db_path or "the span store")  # its log lines
        self._conn: Any = None
        self._runs_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._busy = False  # the writer holds rows it took but has not written yet (flush() waits)
        self._closed = False
        self._said_full = False
        self._service_name = service_name
        self._export: SpanExport | None = None
        self._otlp = False
        target = otlp_target(otlp_endpoint)
        if target is not None:
            wanted = f"{target.why} asks for OTLP export of spans"
            self._export = _span_export(service_name, wanted)
            try:
                from specproxy.proxy.spans.otel import otlp_processor

                self._export.add(otlp_processor(target.url))
            except ImportError as exc:
                raise _not_installed(wanted, exc) from exc
            self._otlp = True
            _warn_about_protocol()

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Also hand every span written from now on, as a finished OTel span, to ``processor`` (on the
        writer thread). Needs the OpenTelemetry SDK."""
        if self._export is None:
            self._export = _span_export(self._service_name, "add_span_processor needs OTel spans")
        self._export.add(processor)

    @property
    def otlp_enabled(self) -> bool:
        return self._otlp

    @property
    def dropped(self) -> int:
        """Spans accepted by nobody: the queue was full, the sink closed, the record could not be made a
        row, or the store could not write it (the last also in :attr:`failed`)."""
        return self._pending.dropped + self._failed

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
        """Span rows the store could not write (counted in :attr:`dropped` too; the error was logged)."""
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
        table: RequestsTable | None = None
        if self.db_path is not None:
            self._conn = open_store(
                self.db_path, memory_limit=self.memory_limit, checkpoint_threshold=self.checkpoint_threshold
            )
            # The writer's own connection to the file, made here so that a failure surfaces in start().
            try:
                cursor = self._conn.cursor()
                table = RequestsTable(cursor)
            except (duckdb.Error, ValueError) as exc:
                self._conn.close()
                self._conn = None
                where = self.db_path
                raise SpanSinkError(f"the span store {where} has no usable requests table: {exc}") from exc
        self._thread = threading.Thread(
            target=self._run_writer, args=(cursor, table), name="specproxy-span-writer", daemon=True
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
                    "threshold, measured_at, offered_rate) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [list(r) for r in rows],
                )
            finally:
                cur.close()

    def emit(self, record: SpanRecord, parent: TraceParent | None = None) -> bool:
        """Queue one span record; thread-safe and never blocking. False when it was dropped (counted).

        The record keeps its ``trace_id``/``span_id`` when they are valid W3C ids (else new ones are
        written into it); with a ``parent`` it is that span's child, in that span's trace. Its row
        starts at ``t_start_ns`` (else ``t_start``, else now). The row is taken now: later changes to
        the record are not stored.
        """
        try:
            if parent is not None:
                record.trace_id = parent.trace_id
            elif not is_trace_id(record.trace_id):
                record.trace_id = new_trace_id()
            if not is_span_id(record.span_id):
                record.span_id = new_span_id()
            row: Row = record_row(record)
            if row[T_START_NS] is None:
                start = _epoch_ns(record.t_start) if record.t_start is not None else time.time_ns()
                row = (*row[:T_START_NS], start, *row[T_START_NS + 1 :])
        except Exception:
            # A malformed record must not fail the request that produced it.
            log.exception("could not take the row of request %s; dropped", record.request_id)
            self._pending.count_dropped()
            return False
        if self._pending.offer(row, parent):
            return True
        if not self._said_full and not self._closed:
            self._said_full = True  # said once: a writer that fell behind would otherwise flood the log
            log.warning(
                "the span queue is full (%d spans wait for %s): spans are dropped and counted until the "
                "writer catches up",
                self._pending.depth,
                self.db_path,
            )
        return False

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

    def snapshot(self, dest: str | Path, timeout: float = 10.0) -> None:
        """Write everything accepted so far, then copy the span store to a new file ``dest`` that the
        analysis can open while this sink keeps writing (DuckDB lets no other connection in this
        process attach a file that a connection has open). Costs a copy of the whole store: meant for a
        store of one run, as a lab's is. SpanSinkError when there is no store or the copy fails."""
        if self._conn is None:
            raise SpanSinkError("this span sink has no span store to copy")
        if not self.flush(timeout):
            raise SpanSinkError(f"the span writer did not catch up within {timeout:.0f} s; no snapshot")
        with self._runs_lock:
            cur = self._conn.cursor()
            try:
                (name,) = cur.execute("SELECT current_database()").fetchone()
                cur.execute(f"ATTACH {schema.sql_literal(str(dest))} AS specproxy_snapshot")
                try:
                    cur.execute(f'COPY FROM DATABASE "{name}" TO specproxy_snapshot')
                finally:
                    cur.execute("DETACH specproxy_snapshot")
            except duckdb.Error as exc:
                raise SpanSinkError(f"cannot copy the span store {self.db_path} to {dest}: {exc}") from exc
            finally:
                cur.close()

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
            close_store(self._conn, self._failures)
            self._conn = None
        # After the file is released: an unreachable collector retries for up to its timeout (10 s).
        if self._export is not None:
            self._export.shutdown(timeout or 30.0)

    def _run_writer(self, cursor: Any, table: RequestsTable | None) -> None:
        try:
            while True:
                stopping = self._stopping.is_set()
                self._pending.wake.wait(0.005 if stopping else self._flush_interval_s)
                self._pending.wake.clear()
                while True:
                    self._busy = True
                    rows, parents, metric_rows = self._pending.take(self._batch_size)
                    if not rows and not metric_rows:
                        self._busy = False
                        break
                    self._write(table, cursor, rows, parents, metric_rows)
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
        table: RequestsTable | None,
        cursor: Any,
        rows: list[Row],
        parents: list[TraceParent | None],
        metric_rows: list[BackendMetricRow],
    ) -> None:
        if rows and table is not None:
            self._write_spans(table, rows)
        if rows and self._export is not None:
            try:
                self._export.export(rows, parents)
            except Exception:  # OTLP is in addition to the store: its trouble never stops the writer
                log.exception("could not hand %d spans to OpenTelemetry", len(rows))
        if metric_rows and cursor is not None:
            try:
                _insert_backend_metrics(cursor, metric_rows)
                self._metric_rows_written += len(metric_rows)
            except Exception:
                log.exception("could not write %d backend metric rows to %s", len(metric_rows), self.db_path)

    def _write_spans(self, table: RequestsTable, rows: list[Row]) -> None:
        errors: list[Exception] = []
        written = [0]
        try:
            _insert_splitting(table, rows, written, errors)
        except Exception as exc:  # the store itself failed (disk full, I/O): the rest of the batch is lost
            errors = [exc] * (len(rows) - written[0])
        self._written += written[0]
        if errors:
            self._failed += len(errors)
            self._failures.failed(len(errors), len(rows), errors[0])

    def _require_started(self) -> None:
        if self._thread is None:
            raise SpanSinkError("the span sink is not started; call start() first")

    def __enter__(self) -> SpanSink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _insert_splitting(
    table: RequestsTable, rows: list[Row], written: list[int], errors: list[Exception]
) -> None:
    """Insert ``rows``; when a value fails the insert, split the batch in halves until the failing
    rows stand alone and leave only them out (their errors appended to ``errors``); ``written[0]``
    counts the rows written. ~2·log2(n) extra inserts per bad row, so one bad row never makes a batch
    go row by row. Raises what is not about a value (the store itself failed)."""
    try:
        table.insert(rows)
        written[0] += len(rows)
        return
    except _BAD_ROW_ERRORS as exc:
        if len(rows) == 1:
            errors.append(exc)
            return
    half = len(rows) // 2
    _insert_splitting(table, rows[:half], written, errors)
    _insert_splitting(table, rows[half:], written, errors)


def _warn_about_protocol() -> None:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    )
    if protocol and protocol != "http/protobuf":
        log.warning("OTLP protocol %r is not supported; exporting spans with http/protobuf instead", protocol)


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


# Errors that come from a value in a row rather than from the store: the batch is split to find the row.
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
