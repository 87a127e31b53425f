"""Span ingest throughput: how many span rows per second reach the DuckDB file.

    .venv/bin/python tests/bench/bench_ingest.py [--spans 200000] [--repeats 3]

Target (issue 4): ≥ 100k span rows/s from the exporter thread into DuckDB. Measured side by side:

- ``writer``: the DuckDB exporter alone, on finished OTel spans already in memory (what the writer
  thread does per batch: spans → numpy columns → one INSERT);
- ``writer, row by row``: the same rows through ``executemany`` (why the exporter writes columns);
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
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import duckdb

from specproxy import schema
from specproxy.proxy.otel import DuckDBSpanExporter
from specproxy.proxy.sink import SpanSink
from specproxy.record import COLUMNS, SpanRecord


def make_record(i: int, t0_ns: int) -> SpanRecord:
    """A realistic streamed, speculative, greedy span (most columns set)."""
    return SpanRecord(
        run_id="bench-run", request_id=f"req-{i // 2:08d}", arm="eagle3" if i % 2 else "baseline",
        arm_role="candidate" if i % 2 else "baseline", backend_url="http://127.0.0.1:8002",
        spec_method="eagle3" if i % 2 else "none", num_speculative_tokens=3 if i % 2 else None,
        source="replay", routed_as="replay", category="code", concurrency_level=16, inflight_at_start=i % 16,
        endpoint="chat", model="meta-llama/Llama-3.1-8B-Instruct", stream=True, temperature=0.0,
        max_tokens=256, seed=None, prompt_sha256=f"{i:064x}", prompt_tokens=100 + i % 400,
        t_start_ns=t0_ns + i * 1_000_000, ttft_s=0.021 + (i % 7) * 1e-3, e2e_s=1.3 + (i % 11) * 0.01,
        decode_tok_s=95.5 + i % 30, chunks=70, completion_tokens=256, finish_reason="length",
        output_sha256=f"{i * 7:064x}", num_drafts=60 if i % 2 else None, draft_tokens=180 if i % 2 else None,
        accepted_tokens=130 if i % 2 else None, acceptance_length=3.1 if i % 2 else None,
        spec_source="vllm_request_metrics" if i % 2 else "none", identical=True if i % 2 else None,
        status="ok", http_status=200,
    )


def fresh_db(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.duckdb"
    for p in (path, path.with_suffix(".duckdb.wal")):
        if p.exists():
            p.unlink()
    return path


def finished_spans(n: int) -> list:  # type: ignore[type-arg]
    """n finished OTel spans, made through a SpanSink's own TracerProvider (no file)."""
    sink = SpanSink(None, queue_size=n + 1, batch_size=n + 1, flush_interval_s=3600)
    t0 = time.time_ns()
    for i in range(n):
        sink.emit(make_record(i, t0))
    spans, _ = sink._pending.take(n)  # the spans exactly as the writer thread receives them
    sink.close()
    return spans


def bench_writer(tmp: Path, spans: list, batch: int) -> float:  # type: ignore[type-arg]
    path = fresh_db(tmp, "writer")
    conn = duckdb.connect(str(path))
    schema.migrate(conn)
    exporter = DuckDBSpanExporter(conn)
    t = time.perf_counter()
    for k in range(0, len(spans), batch):
        exporter.export(spans[k : k + batch])
    dt = time.perf_counter() - t
    assert conn.execute("SELECT count(*) FROM requests").fetchone()[0] == len(spans)  # type: ignore[index]
    conn.close()
    return len(spans) / dt


def bench_executemany(tmp: Path, n: int) -> float:
    path = fresh_db(tmp, "rows")
    conn = duckdb.connect(str(path))
    schema.migrate(conn)
    t0 = time.time_ns()
    rows = [make_record(i, t0) for i in range(n)]
    for r in rows:
        r.t_start = datetime.fromtimestamp((r.t_start_ns or 0) / 1e9, UTC)
    marks = ", ".join("?" for _ in COLUMNS)
    t = time.perf_counter()
    sql = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({marks})"
    conn.executemany(sql, [r.as_row() for r in rows])
    dt = time.perf_counter() - t
    conn.close()
    return n / dt


def bench_end_to_end(tmp: Path, n: int, batch: int) -> tuple[float, float]:
    """(rows/s from the first emit until close() returned, emit() calls/s as the caller sees it)."""
    path = fresh_db(tmp, "e2e")
    t0 = time.time_ns()
    records = [make_record(i, t0) for i in range(n)]
    sink = SpanSink(path, queue_size=n, batch_size=batch)
    sink.start()
    t = time.perf_counter()
    for r in records:
        sink.emit(r)
    t_emitted = time.perf_counter() - t
    sink.close()
    dt = time.perf_counter() - t
    assert sink.written == n and sink.dropped == 0, (sink.written, sink.dropped)
    return n / dt, n / t_emitted


def median_of(repeats: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(repeats))


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
        writer = median_of(args.repeats, lambda: bench_writer(tmp, spans, args.batch))
        writer_big = median_of(args.repeats, lambda: bench_writer(tmp, spans, 65536))
        rows = median_of(1, lambda: bench_executemany(tmp, min(n, 2_000)))
        e2e = [bench_end_to_end(tmp, n, args.batch) for _ in range(args.repeats)]
    e2e_rate = statistics.median(x[0] for x in e2e)
    emit_rate = statistics.median(x[1] for x in e2e)
    print(f"span ingest, {n} spans per measurement, median of {args.repeats}; "
          f"python {sys.version.split()[0]}, duckdb {duckdb.__version__}, {os.cpu_count()} cpus")
    print(f"{'path':<44}{'rows/s':>12}{'vs 100k target':>16}")
    for label, rate in [
        (f"writer: exporter, batches of {args.batch}", writer),
        ("writer: exporter, batches of 65536", writer_big),
        ("writer: executemany row by row (2k rows)", rows),
        (f"emit → file (1 thread, batches of {args.batch})", e2e_rate),
        ("emit() calls alone (caller's cost)", emit_rate),
    ]:
        print(f"{label:<44}{rate:>12,.0f}{rate / 100_000:>15.2f}x")
    print(f"emit() costs the caller {1e6 / emit_rate:.1f} µs per span")


if __name__ == "__main__":
    main()
