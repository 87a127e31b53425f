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

Its parts: the bounded queue (:mod:`.pending`), opening the file and the rows written on the main
connection (:mod:`.store`), the side tables' rows (:mod:`.rows`), whether and where spans go over OTLP
(:mod:`.export_config`), and the requests table the writer fills (:mod:`.table`).

Exceptions (translated from DuckDB's at this boundary)::

    SpanSinkError                 the span store cannot be used (a sentence saying why and what to do)
    └── SpanStoreLocked           another process holds the file open for writing
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from specproxy.proxy.spans.export_config import (
    OtlpTarget,
    otlp_export,
    otlp_target,
    span_export,
)
from specproxy.proxy.spans.failures import WriteFailures, close_store
from specproxy.proxy.spans.pending import PendingWrites
from specproxy.proxy.spans.rows import BackendMetricRow, HealthRow, epoch_ns, insert_backend_metrics
from specproxy.proxy.spans.store import (
    DEFAULT_CHECKPOINT_THRESHOLD,
    DEFAULT_MEMORY_LIMIT,
    RunRows,
    SpanSinkError,
    SpanStoreLocked,
    open_store,
)
from specproxy.proxy.spans.table import T_START_NS, RequestsTable, Row, record_row
from specproxy.proxy.spans.trace import TraceParent, is_span_id, is_trace_id, new_span_id, new_trace_id
from specproxy.record import SpanRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

    from specproxy.proxy.spans.otel import SpanExport

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8192
DEFAULT_FLUSH_INTERVAL_S = 0.5


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
        self._pending = PendingWrites(queue_size, batch_size)
        self._written = 0
        self._metric_rows_written = 0
        self._failed = 0
        self._failures = WriteFailures(self.db_path or "the span store")  # its log lines
        self._conn: Any = None
        self._runs: RunRows | None = None  # the runs and health rows, on the main connection
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
            self._export = otlp_export(target, service_name)
            self._otlp = True

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Also hand every span written from now on, as a finished OTel span, to ``processor`` (on the
        writer thread). Needs the OpenTelemetry SDK."""
        if self._export is None:
            self._export = span_export(self._service_name, "add_span_processor needs OTel spans")
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
            self._runs = RunRows(self._conn, self.db_path)
            # The writer's own connection to the file, made here so that a failure surfaces in start().
            try:
                cursor = self._conn.cursor()
                table = RequestsTable(cursor)
            except (duckdb.Error, ValueError) as exc:
                self._conn.close()
                self._conn = self._runs = None
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
        if self._runs is None:
            self._require_started()
            return
        self._runs.begin_run(
            run_id, name=name, mode=mode, source=source, config_json=config_json, stacks_json=stacks_json
        )

    def end_run(self, run_id: str) -> None:
        """Set the run's ``ended_at`` to now."""
        if self._runs is not None:
            self._runs.end_run(run_id)

    def write_health(self, rows: Sequence[HealthRow]) -> None:
        """Insert ``health`` rows now, on the caller's thread (a handful per level and round, written
        between phases: call it off the event loop). A no-op without a span store."""
        if self._runs is not None and rows:
            self._runs.write_health(rows)

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
                start = epoch_ns(record.t_start) if record.t_start is not None else time.time_ns()
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
        if self._runs is None:
            raise SpanSinkError("this span sink has no span store to copy")
        if not self.flush(timeout):
            raise SpanSinkError(f"the span writer did not catch up within {timeout:.0f} s; no snapshot")
        self._runs.copy_to(dest)

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
        if self._runs is not None:
            close_store(self._runs.conn, self._failures)
            self._conn = self._runs = None
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
                insert_backend_metrics(cursor, metric_rows)
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


# Errors that come from a value in a row rather than from the store: the batch is split to find the row.
_BAD_ROW_ERRORS = (
    ValueError,
    TypeError,
    OverflowError,
    duckdb.ConversionException,
    duckdb.ConstraintException,
    duckdb.InvalidInputException,
)

# The sink's names, wherever they are defined (the rest of specproxy imports them here).
__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_CHECKPOINT_THRESHOLD",
    "DEFAULT_FLUSH_INTERVAL_S",
    "DEFAULT_MEMORY_LIMIT",
    "BackendMetricRow",
    "HealthRow",
    "OtlpTarget",
    "SpanSink",
    "open_store",
    "otlp_target",
    "SpanSinkError",
    "SpanStoreLocked",
]
