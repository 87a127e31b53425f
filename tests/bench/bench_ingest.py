"""Span ingest throughput: how many span rows per second reach the DuckDB file.

    .venv/bin/python tests/bench/bench_ingest.py [--spans 200000] [--repeats 3]

Target: ≥ 100k span rows/s from the writer thread into DuckDB. Measured side by side:

- ``writer thread``: ``RequestsTable.insert`` on queued rows, exactly what the sink's writer thread
  does per batch (rows → checked numpy columns → one INSERT ... SELECT);
- the same with one poisoned row (a seed beyond int64) in every batch: what a bad value costs;
- ``executemany``: the same rows inserted row by row (why the writer inserts columns);
- the wake-up lag of a thread sleeping 1 ms at a time beside the writer (what the proxy's event loop
  feels from the GIL the writer holds), against the same thread alone;
- ``emit → file``: ``SpanSink.emit()`` from one thread, then ``close()``: the queue, the writer,
  until every row is in the file;
- ``emit only``: the caller's cost of ``emit()`` (what the proxy's event loop pays per upstream call).

Prints medians over the repeats. The machine is shared, so figures are noisy; compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import duckdb
from opentelemetry.sdk.resources import Resource

from specproxy import schema
from specproxy.proxy.spans.otel import otel_span
from specproxy.proxy.spans.sink import SpanSink, open_store
from specproxy.proxy.spans.table import RequestsTable, Row, record_row
from specproxy.record import COLUMNS, SpanRecord, fit_to_columns


def make_record(i: int, t0_ns: int) -> SpanRecord:
    """A realistic streamed, speculative, greedy span (most columns set)."""
    return SpanRecord(
        run_id="bench-run",
        request_id=f"req-{i // 2:08d}",
        arm="eagle3" if i % 2 else "baseline",
        arm_role="candidate" if i % 2 else "baseline",
        backend_url="http://127.0.0.1:8002",
        spec_method="eagle3" if i % 2 else "none",
        num_speculative_tokens=3 if i % 2 else None,
        source="replay",
        routed_as="replay",
        category="code",
        concurrency_level=16,
        inflight_at_start=i % 16,
        endpoint="chat",
        model="meta-llama/Llama-3.1-8B-Instruct",
        stream=True,
        temperature=0.0,
        max_tokens=256,
        seed=None,
        prompt_sha256=f"{i:064x}",
        prompt_tokens=100 + i % 400,
        t_start_ns=t0_ns + i * 1_000_000,
        ttft_s=0.021 + (i % 7) * 1e-3,
        e2e_s=1.3 + (i % 11) * 0.01,
        decode_tok_s=95.5 + i % 30,
        chunks=70,
        completion_tokens=256,
        finish_reason="length",
        output_sha256=f"{i * 7:064x}",
        num_drafts=60 if i % 2 else None,
        draft_tokens=180 if i % 2 else None,
        accepted_tokens=130 if i % 2 else None,
        acceptance_length=3.1 if i % 2 else None,
        spec_source="vllm_request_metrics" if i % 2 else "none",
        identical=True if i % 2 else None,
        status="ok",
        http_status=200,
    )


def fresh_db(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.duckdb"
    for p in (path, path.with_suffix(".duckdb.wal")):
        if p.exists():
            p.unlink()
    return path


def ready_rows(n: int, poison_every: int = 0) -> list[Row]:
    """n rows as the sink queues them; with poison_every, every that many rows one has a seed beyond
    int64 (a value the writer must make fit)."""
    t0 = time.time_ns()
    records = [make_record(i, t0) for i in range(n)]
    for i, r in enumerate(records):
        r.trace_id, r.span_id = f"{i + 1:032x}", f"{i + 1:016x}"
        if poison_every and i % poison_every == poison_every // 2:
            r.seed = 2**64 - 1
    return [record_row(r) for r in records]


def bench_writer(tmp: Path, rows: list[Row], batch: int) -> tuple[float, float]:
    """(rows/s by the wall clock, rows per CPU-second of the whole process, DuckDB's threads included)."""
    path = fresh_db(tmp, "writer")
    conn = open_store(path)  # with the sink's settings
    table = RequestsTable(conn)
    t, cpu = time.perf_counter(), time.process_time()
    for k in range(0, len(rows), batch):
        table.insert(rows[k : k + batch])
    assert conn.execute("SELECT count(*) FROM requests").fetchone()[0] == len(rows)
    conn.close()  # the final checkpoint is part of the cost
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    return len(rows) / dt, len(rows) / dcpu


def sleeper_lags(stop: threading.Event) -> list[float]:
    """How late a thread that sleeps 1 ms at a time wakes up (what an event loop feels), until stop."""
    lags: list[float] = []
    while not stop.is_set():
        t = time.perf_counter()
        time.sleep(0.001)
        lags.append(time.perf_counter() - t - 0.001)
    return lags


def bench_loop_lag(tmp: Path, ready: list[Row], batch: int) -> tuple[float, float, float, float]:
    """(p99, max) wake-up lag of a 1 ms sleeper beside the writer thread, then alone for as long, in ms."""
    path = fresh_db(tmp, "lag")
    conn = open_store(path)
    table = RequestsTable(conn)
    stop = threading.Event()

    def write() -> None:
        for k in range(0, len(ready), batch):
            table.insert(ready[k : k + batch])
        stop.set()

    writer = threading.Thread(target=write)
    t = time.perf_counter()
    writer.start()
    beside = sleeper_lags(stop)
    writer.join()
    conn.close()
    quiet = threading.Event()
    threading.Timer(time.perf_counter() - t, quiet.set).start()
    alone = sleeper_lags(quiet)

    def p99_max(lags: list[float]) -> tuple[float, float]:
        ordered = sorted(lags)
        return ordered[int(0.99 * (len(ordered) - 1))] * 1e3, ordered[-1] * 1e3

    return (*p99_max(beside), *p99_max(alone))


def bench_executemany(tmp: Path, n: int) -> tuple[float, float]:
    path = fresh_db(tmp, "rows")
    conn = duckdb.connect(str(path))
    schema.migrate(conn)
    t0 = time.time_ns()
    rows = [make_record(i, t0) for i in range(n)]
    for r in rows:
        r.t_start = datetime.fromtimestamp((r.t_start_ns or 0) / 1e9, UTC)
    marks = ", ".join("?" for _ in COLUMNS)
    sql = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({marks})"
    t, cpu = time.perf_counter(), time.process_time()
    conn.executemany(sql, [r.as_row() for r in rows])
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    conn.close()
    return n / dt, n / dcpu


def bench_end_to_end(tmp: Path, n: int, batch: int) -> tuple[float, float, float, float]:
    """Rows/s from the first emit until close() returned (wall, per CPU-second), and emit() calls/s as
    the caller sees them (wall, per CPU-second of the emitting thread)."""
    path = fresh_db(tmp, "e2e")
    t0 = time.time_ns()
    records = [make_record(i, t0) for i in range(n)]
    sink = SpanSink(path, queue_size=n, batch_size=batch)
    sink.start()
    t, cpu, tcpu = time.perf_counter(), time.process_time(), time.thread_time()
    for r in records:
        sink.emit(r)
    t_emitted, tcpu_emitted = time.perf_counter() - t, time.thread_time() - tcpu
    sink.close()
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    assert sink.written == n and sink.dropped == 0, (sink.written, sink.dropped)
    return n / dt, n / dcpu, n / t_emitted, n / tcpu_emitted


def emit_breakdown(n: int) -> list[tuple[str, float]]:
    """Where a span's CPU goes, µs per span, each step timed alone on the same records."""
    t0 = time.time_ns()
    records = [make_record(i, t0) for i in range(n)]

    def per_span(fn: Callable[[], object]) -> float:
        cpu = time.thread_time()
        fn()
        return (time.thread_time() - cpu) / n * 1e6

    resource = Resource.create({"service.name": "bench"})
    rows = [record_row(r) for r in ready_records(records)]
    steps = [
        ("fit_to_columns (where the record is made)", per_span(lambda: list(map(fit_to_columns, records)))),
        ("record → row (record_row)", per_span(lambda: list(map(record_row, records)))),
    ]
    sink = SpanSink(None, queue_size=n + 1, batch_size=n + 1, flush_interval_s=3600)
    steps.append(("the whole emit()", per_span(lambda: [sink.emit(r) for r in records])))
    sink.close()
    steps.append(
        (
            "OTel span from a row (writer thread, OTLP only)",
            per_span(lambda: [otel_span(r, None, resource) for r in rows]),
        )
    )
    return steps


def ready_records(records: list[SpanRecord]) -> list[SpanRecord]:
    for i, r in enumerate(records):
        r.trace_id, r.span_id = f"{i + 1:032x}", f"{i + 1:016x}"
    return records


def medians(repeats: int, fn: Callable[[], tuple[float, ...]]) -> tuple[float, ...]:
    runs = [fn() for _ in range(repeats)]
    return tuple(statistics.median(r[i] for r in runs) for i in range(len(runs[0])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--spans", type=int, default=200_000, help="span rows per measurement")
    ap.add_argument("--batch", type=int, default=8192, help="spans per INSERT (SpanSink's batch_size)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per row; the median is printed")
    args = ap.parse_args()
    n = args.spans
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ready = ready_rows(n)
        poisoned = ready_rows(n, poison_every=args.batch)
        writer = medians(args.repeats, lambda: bench_writer(tmp, ready, args.batch))
        writer_big = medians(args.repeats, lambda: bench_writer(tmp, ready, 65536))
        writer_poisoned = medians(args.repeats, lambda: bench_writer(tmp, poisoned, args.batch))
        rows = medians(1, lambda: bench_executemany(tmp, min(n, 2_000)))
        lag = medians(args.repeats, lambda: bench_loop_lag(tmp, ready, args.batch))
        e2e = medians(args.repeats, lambda: bench_end_to_end(tmp, n, args.batch))
        breakdown = emit_breakdown(min(n, 50_000))
    load = os.getloadavg()[0]
    print(
        f"span ingest, {n} spans per measurement, median of {args.repeats}; python "
        f"{sys.version.split()[0]}, duckdb {duckdb.__version__}, {os.cpu_count()} cpus, load {load:.1f}"
    )
    print(f"{'path':<46}{'rows/s':>10}{'rows/cpu-s':>12}{'vs 100k (wall, cpu)':>22}")
    for label, (wall, cpu) in [
        (f"writer thread: insert, batches of {args.batch}", writer),
        ("writer thread: insert, batches of 65536", writer_big),
        (f"  batches of {args.batch}, one bad value in each", writer_poisoned),
        ("executemany, row by row (2k rows)", rows),
        (f"emit → file (1 thread, batches of {args.batch})", e2e[:2]),
        ("emit() calls alone (the caller's thread)", e2e[2:]),
    ]:
        print(f"{label:<46}{wall:>10,.0f}{cpu:>12,.0f}{wall / 1e5:>14.2f}x{cpu / 1e5:>7.2f}x")
    print(f"emit() costs the caller {1e6 / e2e[3]:.1f} µs of CPU per span ({1e6 / e2e[2]:.1f} µs wall)")
    print(
        f"a 1 ms sleeper (an event loop) beside the writer at full speed wakes late by p99 "
        f"{lag[0]:.1f} ms, max {lag[1]:.1f} ms; alone: p99 {lag[2]:.1f} ms, max {lag[3]:.1f} ms"
    )
    print("where a span's CPU goes (µs per span, each step alone):")
    for label, us in breakdown:
        print(f"  {label:<52}{us:>8.1f}")
    print("rows/cpu-s: rows per CPU-second of the process (all threads), what a dedicated core would give;")
    print("rows/s: by the wall clock on this machine as loaded now.")


if __name__ == "__main__":
    main()
