"""Span ingest throughput: how many span rows per second reach the DuckDB file.

    .venv/bin/python tests/bench/bench_ingest.py [--spans 200000] [--repeats 3]

Target: ≥ 100k span rows/s from the exporter thread into DuckDB. Measured side by side:

- ``writer thread``: ``DuckDBSpanExporter.write_rows`` on queued rows, exactly what the sink's writer
  thread does per batch (rows → numpy columns → one INSERT ... SELECT);
- ``exporter.export(spans)``: the plain OTel ``SpanExporter`` path on one thread, finished spans →
  rows → file (the sink splits it: ``span_row`` runs in the span processor's ``on_end``);
- ``span_row`` alone: that on_end share, on spans already finished (cold in cache, so an upper bound);
- ``executemany``: the same rows inserted row by row (why the writer inserts columns);
- the wake-up lag of a thread sleeping 1 ms at a time beside the writer (what the proxy's event loop
  feels from the GIL the writer holds), against the same thread alone;
- ``emit → file``: ``SpanSink.emit()`` from one thread, then ``close()``: OTel span creation, the
  queue, the writer, until every row is in the file;
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
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind

from specproxy import schema
from specproxy.proxy.spans.otel import DuckDBSpanExporter, record_attributes, span_name, span_row
from specproxy.proxy.spans.sink import SpanSink, open_store
from specproxy.record import COLUMNS, SpanRecord


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


def finished_spans(n: int) -> list[ReadableSpan]:
    """n finished OTel spans, made through a SpanSink's own TracerProvider (no file)."""
    sink = SpanSink(None, queue_size=n + 1, batch_size=n + 1, flush_interval_s=3600)
    seen = InMemorySpanExporter()
    sink.tracer_provider.add_span_processor(SimpleSpanProcessor(seen))
    t0 = time.time_ns()
    for i in range(n):
        sink.emit(make_record(i, t0))
    sink.close()
    return list(seen.get_finished_spans())


def bench_span_row(spans: list[ReadableSpan]) -> tuple[float, float]:
    t, cpu = time.perf_counter(), time.process_time()
    for s in spans:
        span_row(s)
    return len(spans) / (time.perf_counter() - t), len(spans) / (time.process_time() - cpu)


def bench_writer(tmp: Path, spans: list[ReadableSpan], batch: int, rows: bool) -> tuple[float, float]:
    """(rows/s by the wall clock, rows per CPU-second of the whole process, DuckDB's threads included).

    rows=True: write_rows on ready rows (the writer thread); False: export(spans) (span → row too)."""
    path = fresh_db(tmp, "writer")
    conn = open_store(path)  # with the sink's settings
    exporter = DuckDBSpanExporter(conn)
    ready = [span_row(s) for s in spans] if rows else []
    t, cpu = time.perf_counter(), time.process_time()
    for k in range(0, len(spans), batch):
        if rows:
            exporter.write_rows(ready[k : k + batch])
        else:
            exporter.export(spans[k : k + batch])
    assert conn.execute("SELECT count(*) FROM requests").fetchone()[0] == len(spans)
    conn.close()  # the final checkpoint is part of the cost
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    return len(spans) / dt, len(spans) / dcpu


def sleeper_lags(stop: threading.Event) -> list[float]:
    """How late a thread that sleeps 1 ms at a time wakes up (what an event loop feels), until stop."""
    lags: list[float] = []
    while not stop.is_set():
        t = time.perf_counter()
        time.sleep(0.001)
        lags.append(time.perf_counter() - t - 0.001)
    return lags


def bench_loop_lag(tmp: Path, spans: list[ReadableSpan], batch: int) -> tuple[float, float, float, float]:
    """(p99, max) wake-up lag of a 1 ms sleeper beside the writer thread, then alone for as long, in ms."""
    path = fresh_db(tmp, "lag")
    conn = open_store(path)
    exporter = DuckDBSpanExporter(conn)
    ready = [span_row(s) for s in spans]
    stop = threading.Event()

    def write() -> None:
        for k in range(0, len(ready), batch):
            exporter.write_rows(ready[k : k + batch])
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
    """Where emit()'s time goes, µs of CPU per span, each step timed alone on the same records."""
    t0 = time.time_ns()
    records = [make_record(i, t0) for i in range(n)]
    provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)  # no processors: SDK cost only
    tracer = provider.get_tracer("bench")

    def per_span(fn: Callable[[], object]) -> float:
        cpu = time.thread_time()
        fn()
        return (time.thread_time() - cpu) / n * 1e6

    attrs = [record_attributes(r) for r in records]

    def otel_spans(keep: list[ReadableSpan] | None) -> None:
        for r, a in zip(records, attrs, strict=True):
            start = r.t_start_ns or 0
            span = tracer.start_span(span_name(r), kind=SpanKind.CLIENT, attributes=a, start_time=start)
            span.end(end_time=start + 1000)
            if keep is not None:
                keep.append(span)  # type: ignore[arg-type]

    made: list[ReadableSpan] = []
    otel_spans(made)
    steps = [
        ("record → attributes (record_attributes)", per_span(lambda: list(map(record_attributes, records)))),
        ("OTel SDK: start_span + end (attribute validation)", per_span(lambda: otel_spans(None))),
        ("finished span → row (span_row, in on_end)", per_span(lambda: [span_row(s) for s in made])),
    ]
    sink = SpanSink(None, queue_size=n + 1, batch_size=n + 1, flush_interval_s=3600)
    steps.append(("the whole emit()", per_span(lambda: [sink.emit(r) for r in records])))
    sink.close()
    provider.shutdown()
    return steps


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
        spans = finished_spans(n)
        writer = medians(args.repeats, lambda: bench_writer(tmp, spans, args.batch, True))
        writer_big = medians(args.repeats, lambda: bench_writer(tmp, spans, 65536, True))
        export = medians(args.repeats, lambda: bench_writer(tmp, spans, args.batch, False))
        to_rows = medians(args.repeats, lambda: bench_span_row(spans))
        rows = medians(1, lambda: bench_executemany(tmp, min(n, 2_000)))
        lag = medians(args.repeats, lambda: bench_loop_lag(tmp, spans, args.batch))
        e2e = medians(args.repeats, lambda: bench_end_to_end(tmp, n, args.batch))
        breakdown = emit_breakdown(min(n, 50_000))
    load = os.getloadavg()[0]
    print(
        f"span ingest, {n} spans per measurement, median of {args.repeats}; python "
        f"{sys.version.split()[0]}, duckdb {duckdb.__version__}, {os.cpu_count()} cpus, load {load:.1f}"
    )
    print(f"{'path':<46}{'rows/s':>10}{'rows/cpu-s':>12}{'vs 100k (wall, cpu)':>22}")
    for label, (wall, cpu) in [
        (f"writer thread: write_rows, batches of {args.batch}", writer),
        ("writer thread: write_rows, batches of 65536", writer_big),
        (f"exporter.export(spans), batches of {args.batch}", export),
        ("span_row alone (on_end's share)", to_rows),
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
    print("where emit()'s time goes (µs of CPU per span, each step alone):")
    for label, us in breakdown:
        print(f"  {label:<52}{us:>8.1f}")
    print("rows/cpu-s: rows per CPU-second of the process (all threads), what a dedicated core would give;")
    print("rows/s: by the wall clock on this machine as loaded now.")


if __name__ == "__main__":
    main()
