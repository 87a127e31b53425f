"""The span sink: records into real DuckDB files, the bounded queue, shutdown, no silent loss, OTLP, the
file lock."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from specproxy import schema
from specproxy.proxy.spans.sink import BackendMetricRow, SpanSink, SpanSinkError, SpanStoreLocked, otlp_target
from specproxy.proxy.spans.table import RequestsTable
from specproxy.proxy.spans.trace import TraceParent
from specproxy.record import COLUMNS, SpanRecord
from tests import processes
from tests.records import T0, T0_NS, full_record


def minimal_record(i: int, run_id: str = "run-1") -> SpanRecord:
    return SpanRecord(
        run_id=run_id,
        request_id=f"req-{i}",
        arm="baseline",
        arm_role="baseline",
        backend_url="http://127.0.0.1:8001",
    )


def read(path: Path, sql: str) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(path), read_only=True) as conn:
        return conn.execute(sql).fetchall()


def count(path: Path, table: str = "requests") -> int:
    return int(read(path, f"SELECT count(*) FROM {table}")[0][0])


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "spans.duckdb"


@pytest.fixture
def sink(db: Path) -> Iterator[SpanSink]:
    s = SpanSink(db, flush_interval_s=0.05)
    s.start()
    yield s
    s.close()


def test_schema_is_created_on_first_use(db: Path) -> None:
    assert not db.exists()
    with SpanSink(db):
        pass
    tables = {r[0] for r in read(db, "SELECT table_name FROM information_schema.tables")}
    assert {"requests", "runs", "backend_metrics", "schema_version"} <= tables
    assert read(db, "SELECT max(version) FROM schema_version")[0][0] == schema.SCHEMA_VERSION
    # A second sink on the same file finds the schema current and adds nothing.
    with SpanSink(db):
        pass
    assert read(db, "SELECT count(*) FROM schema_version")[0][0] == schema.SCHEMA_VERSION


def test_every_column_round_trips_through_duckdb(db: Path) -> None:
    record = full_record()
    with SpanSink(db) as sink:
        assert sink.emit(record)
    assert len(record.trace_id) == 32 and len(record.span_id) == 16 and int(record.trace_id, 16) != 0
    columns = [r[0] for r in read(db, "DESCRIBE requests")]
    row = dict(zip(columns, read(db, "SELECT * FROM requests")[0], strict=True))
    for name in COLUMNS:
        assert row[name] == getattr(record, name), name
    assert row["t_start_ns"] == T0_NS and row["notes"] is None  # nanoseconds survive; nothing changed


def test_t_start_alone_sets_the_start_and_none_fields_stay_null(db: Path) -> None:
    record = minimal_record(0)
    record.t_start = T0
    before = datetime.now(UTC)
    with SpanSink(db) as sink:
        sink.emit(record)
        sink.emit(minimal_record(1))  # no start at all: now
    after = datetime.now(UTC)
    rows = read(
        db,
        "SELECT request_id, t_start, t_start_ns, model, stream, ttft_s, identical, status "
        "FROM requests ORDER BY request_id",
    )
    assert rows[0] == ("req-0", T0, T0_NS // 1000 * 1000, None, False, None, None, "ok")
    assert before <= rows[1][1] <= after


def test_otel_spans_carry_genai_names(db: Path) -> None:
    seen = InMemorySpanExporter()
    with SpanSink(db) as sink:
        sink.add_span_processor(SimpleSpanProcessor(seen))
        sink.emit(full_record(0))
        sink.emit(
            full_record(
                1, status="upstream_error", error="connection reset", http_status=None, endpoint="completions"
            )
        )
    ok, failed = sorted(seen.get_finished_spans(), key=lambda s: s.start_time or 0)
    assert ok.name == "chat meta-llama/Llama-3.1-8B-Instruct"
    assert ok.kind is SpanKind.CLIENT
    attrs = ok.attributes or {}
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.request.max_tokens"] == 256
    assert attrs["gen_ai.usage.input_tokens"] == 321
    assert attrs["gen_ai.usage.output_tokens"] == 256
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["specproxy.arm"] == "eagle3" and attrs["specproxy.accepted_tokens"] == 130
    assert ok.start_time == T0_NS and ok.end_time == T0_NS + 1_875_000_000
    assert ok.status.status_code is StatusCode.UNSET
    assert failed.name == "text_completion meta-llama/Llama-3.1-8B-Instruct"
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "connection reset"
    assert "http.response.status_code" not in (failed.attributes or {})  # None values are left out
    assert read(db, "SELECT error FROM requests WHERE status = 'upstream_error'") == [("connection reset",)]


def test_spans_from_many_threads_and_tasks_all_land(db: Path) -> None:
    threads, per_thread, tasks = 8, 400, 200
    sink = SpanSink(db, batch_size=256, flush_interval_s=0.02)
    sink.start()

    def worker(t: int) -> None:
        for i in range(per_thread):
            assert sink.emit(minimal_record(t * 10_000 + i))

    async def from_the_loop() -> None:
        async def one(i: int) -> None:
            await asyncio.sleep(0)
            assert sink.emit(minimal_record(1_000_000 + i))

        await asyncio.gather(*(one(i) for i in range(tasks)))

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    asyncio.run(from_the_loop())
    for th in pool:
        th.join()
    sink.close()
    total = threads * per_thread + tasks
    assert sink.dropped == 0 and sink.written == total
    assert read(db, "SELECT count(*), count(DISTINCT request_id), count(DISTINCT span_id) FROM requests") == [
        (total, total, total)
    ]


def test_close_writes_every_accepted_span(db: Path) -> None:
    # A flush interval far beyond the test: nothing is written until close() drains the queue.
    sink = SpanSink(db, batch_size=1_000_000, flush_interval_s=3600)
    sink.start()
    n = 5000
    assert all(sink.emit(minimal_record(i)) for i in range(n))
    assert sink.queue_depth == n and sink.written == 0
    sink.close()
    assert sink.written == n and sink.queue_depth == 0
    assert count(db) == n


class _StalledTable(RequestsTable):
    """The real table writer, held up until the test lets it go (a disk that stopped answering)."""

    release = threading.Event()
    entered = threading.Event()
    left = threading.Event()  # set once the stall is over (released, or given up after 30 s)

    def insert(self, rows: Any) -> None:
        type(self).entered.set()
        try:
            assert type(self).release.wait(30)
        finally:
            type(self).left.set()
        super().insert(rows)


def test_full_queue_drops_and_counts_without_blocking(
    db: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("specproxy.proxy.spans.sink.RequestsTable", _StalledTable)
    _StalledTable.release.clear()
    _StalledTable.entered.clear()
    _StalledTable.left.clear()
    capacity, batch, n = 1000, 100, 6000
    sink = SpanSink(db, queue_size=capacity, batch_size=batch, flush_interval_s=0.01)
    sink.start()
    sink.emit(minimal_record(0))
    assert _StalledTable.entered.wait(10)  # the writer now sits in insert() with one span
    accepted = 1
    with caplog.at_level(logging.WARNING, logger="specproxy.proxy.spans.sink"):
        for i in range(1, n):
            accepted += sink.emit(minimal_record(i))
    # Every emit() returned while the writer was still stalled: none of them waited for it.
    assert not _StalledTable.left.is_set()
    assert accepted == 1 + capacity  # the one being written plus a full queue
    assert caplog.text.count("the span queue is full") == 1  # said once, not once per span
    assert sink.dropped == n - accepted
    assert sink.queue_depth == capacity
    # Backend metric rows have their own bound and are dropped the same way, not blocked.
    rows = [BackendMetricRow("run-1", "a", T0, "periodic", "vllm:x", "{}", 1.0)] * (capacity + 1)
    assert not sink.emit_backend_metrics(rows) and sink.dropped_metric_rows == capacity + 1
    _StalledTable.release.set()
    sink.close()
    assert sink.written == accepted == count(db)


def test_emit_after_close_is_dropped_and_counted(db: Path) -> None:
    sink = SpanSink(db)
    sink.start()
    sink.close()
    assert not sink.emit(minimal_record(0))
    assert sink.dropped == 1
    sink.close()  # idempotent


def test_runs_and_backend_metrics_rows(sink: SpanSink, db: Path) -> None:
    sink.begin_run(
        "run-1",
        name="llama8b-spec",
        mode="shadow",
        source="live",
        config_json='{"name": "llama8b-spec"}',
        stacks_json='{"baseline": {}}',
    )
    with pytest.raises(SpanSinkError, match="already in"):
        sink.begin_run(
            "run-1", name="again", mode="shadow", source="live", config_json="{}", stacks_json="{}"
        )
    rows = [
        BackendMetricRow(
            "run-1",
            "eagle3",
            T0,
            "c=16:before",
            "vllm:spec_decode_num_drafts_total",
            '{"engine":"0","model_name":"m"}',
            812.0,
        ),
        BackendMetricRow(
            "run-1",
            "eagle3",
            T0,
            "c=16:before",
            "vllm:num_requests_running",
            '{"engine":"1","model_name":"m"}',
            3.0,
        ),
    ]
    assert sink.emit_backend_metrics(rows)
    sink.end_run("run-1")
    sink.close()
    (run,) = read(
        db,
        "SELECT run_id, name, mode, source, started_at, ended_at, config_json, specproxy_version FROM runs",
    )
    assert run[:4] == ("run-1", "llama8b-spec", "shadow", "live")
    assert run[4] <= run[5] and run[6] == '{"name": "llama8b-spec"}' and run[7]
    got = read(
        db,
        "SELECT run_id, arm, scraped_at, phase, name, labels_json, value FROM backend_metrics ORDER BY name",
    )
    assert got == [tuple(r) for r in sorted(rows, key=lambda r: r.name)]


def test_sdk_disabled_by_environment_still_fills_the_store(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    record = full_record()
    with SpanSink(db) as sink:
        assert not sink.otlp_enabled
        assert sink.emit(record)
    assert read(db, "SELECT trace_id, t_start_ns, model, finish_reason FROM requests") == [
        (record.trace_id, T0_NS, record.model, "length")
    ]


def test_a_file_locked_by_another_process_is_a_clear_error(db: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import duckdb, sys; c = duckdb.connect(sys.argv[1]); "
            "print('ready', flush=True); sys.stdin.read()",
            str(db),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        sink = SpanSink(db)
        with pytest.raises(SpanStoreLocked) as info:
            sink.start()
        message = str(info.value)
        assert str(db) in message and f"process {holder.pid}" in message and "one writer" in message
        sink.close()
    finally:
        holder.communicate("", timeout=20)


def test_a_file_that_is_not_duckdb_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "notes.duckdb"
    bogus.write_text("this is not a database\n" * 100)
    with pytest.raises(SpanSinkError, match="cannot open the span store"):
        SpanSink(bogus).start()


def test_otlp_endpoint_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    # conftest sets OTEL_TRACES_EXPORTER=none: off unless configured explicitly.
    assert otlp_target(None) is None
    target = otlp_target("http://127.0.0.1:4318")
    assert target is not None and target.url == "http://127.0.0.1:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert otlp_target(None) is None  # OTEL_TRACES_EXPORTER=none wins over an endpoint
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    assert otlp_target(None) == (None, "OTEL_EXPORTER_OTLP_ENDPOINT")  # the exporter reads the variable
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert otlp_target(None) is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    assert otlp_target(None) is not None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert otlp_target("http://127.0.0.1:4318") is None


def test_otlp_without_its_extra_is_a_clear_error(db: Path, tmp_path: Path) -> None:
    # A Python that cannot import the OTLP exporter (installed without the `otlp` extra).
    blocker = tmp_path / "blocker"
    (blocker / "opentelemetry" / "exporter").mkdir(parents=True)
    (blocker / "opentelemetry" / "exporter" / "__init__.py").write_text(
        "raise ImportError('not installed')\n"
    )
    script = (
        "import sys; sys.path.insert(0, sys.argv[2])\n"
        "from specproxy.proxy.spans.sink import SpanSink, SpanSinkError\n"
        "try:\n    SpanSink(sys.argv[1], otlp_endpoint='http://127.0.0.1:4318')\n"
        "except SpanSinkError as exc:\n    print(exc)\n"
    )
    done = processes.run([sys.executable, "-c", script, str(db), str(blocker)])
    assert done.returncode == 0, done.stderr
    assert "otlp_endpoint http://127.0.0.1:4318 asks for OTLP export of spans, but" in done.stdout
    assert "pip install 'specproxy[otlp]'" in done.stdout


class _Collector:
    """A tiny OTLP/HTTP receiver on 127.0.0.1: decodes each protobuf POST to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.content_types: list[str] = []

    async def receive(self, request: web.Request) -> web.Response:
        self.content_types.append(request.content_type)
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource_spans in message.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")


@pytest.mark.parametrize("configured_by", ["argument", "environment"])
async def test_otlp_export_reaches_a_collector(
    db: Path, aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch, configured_by: str
) -> None:
    collector = _Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", collector.receive)
    server = await aiohttp_server(app, host="127.0.0.1")
    base = f"http://127.0.0.1:{server.port}"
    if configured_by == "environment":
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", base)
        sink = SpanSink(db)
    else:
        sink = SpanSink(db, otlp_endpoint=base)
    assert sink.otlp_enabled
    await asyncio.to_thread(sink.start)
    records = [full_record(i) for i in range(3)]
    assert all(sink.emit(r) for r in records)
    await asyncio.to_thread(sink.close)  # flushes the OTLP batch processor while the loop serves the POST
    assert collector.content_types and set(collector.content_types) == {"application/x-protobuf"}
    assert sorted(s.span_id.hex() for s in collector.spans) == sorted(r.span_id for r in records)
    span = collector.spans[0]
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["gen_ai.request.model"].string_value == "meta-llama/Llama-3.1-8B-Instruct"
    assert attrs["gen_ai.usage.output_tokens"].int_value == 256
    assert span.start_time_unix_nano in {T0_NS, T0_NS + 1, T0_NS + 2}
    assert count(db) == 3  # OTLP is in addition to the span store


def test_values_no_column_can_hold_are_stored_as_null_with_a_note(db: Path) -> None:
    # Records the proxy makes are fitted where they are made; the writer fits whatever else arrives,
    # so a batch never fails on a value and no span is lost to one.
    poisoned = [
        full_record(1, seed=2**64 - 1),
        full_record(2, max_tokens=2**31),
        full_record(3, concurrency_level=2**31, inflight_at_start=-(2**31) - 1),
        full_record(4, request_id="req-\udcff"),  # an undecodable header byte, as aiohttp hands it over
        full_record(5, prompt_tokens="many", temperature=10**400, output_text="\ud800"),
        full_record(6, t_start_ns=2**63),
    ]
    with SpanSink(db, flush_interval_s=0.02) as sink:
        assert all(sink.emit(r) for r in [full_record(0), *poisoned])
    assert (sink.written, sink.dropped) == (7, 0)
    rows = read(
        db,
        "SELECT seed, max_tokens, concurrency_level, inflight_at_start, request_id, prompt_tokens, "
        "temperature, output_text, t_start_ns, notes FROM requests ORDER BY t_start_ns NULLS LAST",
    )
    notes = {row[4]: row[-1] for row in rows}
    assert notes["req-0"] is None
    assert "seed 18446744073709551615 is out of range for BIGINT: stored as NULL" in notes["req-1"]
    assert "max_tokens 2147483648 is out of range for INTEGER" in notes["req-2"]
    assert "concurrency_level" in notes["req-3"] and "inflight_at_start" in notes["req-3"]
    assert "request_id was not valid UTF-8" in notes["req-\ufffd"]
    assert all(w in notes["req-5"] for w in ("prompt_tokens 'many' is not", "temperature", "output_text"))
    assert "t_start_ns 9223372036854775808 is out of range for BIGINT" in notes["req-6"]
    by_id = {row[4]: row for row in rows}
    assert by_id["req-1"][0] is None and by_id["req-2"][1] is None and by_id["req-3"][2:4] == (None, None)
    assert by_id["req-5"][5:8] == (None, None, "\ufffd")
    assert by_id["req-6"][8] is None and by_id["req-0"][0] == 1234567890123


class _PickyTable(RequestsTable):
    """The real table writer, whose insert fails like a rejected value whenever a batch holds a row
    of request ``poison``: a row that no check foresaw. Counts its inserts."""

    inserts = 0

    def insert(self, rows: Any) -> None:
        type(self).inserts += 1
        if any(row[1] == "poison" for row in rows):
            raise duckdb.ConversionException("Conversion Error: the store refused this row")
        super().insert(rows)


def test_a_row_the_store_still_refuses_is_left_out_alone_counted_and_logged(
    db: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("specproxy.proxy.spans.sink.RequestsTable", _PickyTable)
    _PickyTable.inserts = 0
    n = 4096
    sink = SpanSink(db, batch_size=n, flush_interval_s=3600)
    sink.start()
    for i in range(n):
        record = minimal_record(i)
        if i in (1000, 3000):
            record.request_id = "poison"
        assert sink.emit(record)
    with caplog.at_level(logging.ERROR, logger="specproxy.proxy.spans.sink"):
        sink.close()  # one batch of 4096 with two bad rows
    assert (sink.written, sink.dropped, sink.failed) == (n - 2, 2, 2)
    assert count(db) == n - 2
    # The batch is split down to the bad rows: a few dozen inserts, never one per row.
    assert _PickyTable.inserts <= 4 * 12 + 1, _PickyTable.inserts
    assert caplog.text.count("could not be written") == 1 and "2 of 4096 spans" in caplog.text


class _BrokenDisk(RequestsTable):
    def insert(self, rows: Any) -> None:
        raise duckdb.IOException("IO Error: No space left on device")


def test_a_batch_the_store_cannot_write_is_counted_as_dropped(
    db: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("specproxy.proxy.spans.sink.RequestsTable", _BrokenDisk)
    with caplog.at_level(logging.ERROR, logger="specproxy.proxy.spans.sink"):
        with SpanSink(db) as sink:
            assert all(sink.emit(minimal_record(i)) for i in range(5))
    assert (sink.written, sink.dropped) == (0, 5)
    assert "5 of 5 spans could not be written" in caplog.text and "No space left" in caplog.text


def test_rows_are_taken_when_emitted(db: Path) -> None:
    record = full_record(0)
    with SpanSink(db) as sink:
        sink.emit(record)
        record.status = "timeout"  # a caller that changes the record afterwards does not change the row
    assert read(db, "SELECT status FROM requests") == [("ok",)]


def test_readme_spans_example_runs(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "proxy" / "README.md").read_text()
    section = readme.split("<!-- section: spans -->")[1].split("<!-- /section: spans -->")[0]
    blocks = [block.split("```")[0] for block in section.split("```python\n")[1:]]
    example = next(block for block in blocks if "SpanSink(" in block)
    done = processes.run([sys.executable, "-c", example], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "baseline" in done.stdout and "0.66" in done.stdout
    assert count(tmp_path / "spans.duckdb") == 1


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_a_stalled_writer_keeps_memory_bounded(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Soak: 300k spans against a writer stalled from the start: memory holds the queue, no more."""
    monkeypatch.setattr("specproxy.proxy.spans.sink.RequestsTable", _StalledTable)
    _StalledTable.release.clear()
    _StalledTable.entered.clear()
    capacity = 50_000
    sink = SpanSink(db, queue_size=capacity, flush_interval_s=0.01)
    sink.start()
    sink.emit(full_record(0))
    assert _StalledTable.entered.wait(10)
    rss_empty = _rss_bytes()
    for i in range(1, capacity + 1):
        sink.emit(full_record(i))
    rss_full = _rss_bytes()
    per_span = (rss_full - rss_empty) / capacity
    assert per_span < 2048, f"a queued span takes {per_span:.0f} bytes"
    for i in range(capacity + 1, 300_000):
        assert not sink.emit(full_record(i))
    grown = _rss_bytes() - rss_full
    assert grown < 20 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB while every span was dropped"
    assert sink.dropped == 300_000 - capacity - 1
    _StalledTable.release.set()
    sink.close()
    assert count(db) == capacity + 1


def test_the_writer_connection_has_a_memory_cap(db: Path) -> None:
    # DuckDB's default is 80 % of RAM, and it caches what it writes up to that.
    with SpanSink(db) as sink:
        assert sink._conn.execute("SELECT current_setting('memory_limit')").fetchone()[0] == "244.1 MiB"
    with SpanSink(db, memory_limit="64MB") as sink:
        assert sink._conn.execute("SELECT current_setting('memory_limit')").fetchone()[0] == "61.0 MiB"
    with pytest.raises(SpanSinkError, match="not a DuckDB size"):
        SpanSink(db, memory_limit="lots").start()


def test_records_keep_their_ids_and_a_parent_makes_a_child(db: Path) -> None:
    seen = InMemorySpanExporter()
    parent = TraceParent(format(0xABC, "032x"), format(0xDEF, "016x"), flags=1)
    with SpanSink(db) as sink:
        sink.add_span_processor(SimpleSpanProcessor(seen))
        own = minimal_record(0)
        own.trace_id, own.span_id = "1" * 32, "2" * 16
        child = minimal_record(1)
        child.trace_id, child.span_id = "1" * 32, "3" * 16
        fresh = minimal_record(2)  # no ids: new ones, written back
        assert sink.emit(own) and sink.emit(child, parent) and sink.emit(fresh)
    assert (child.trace_id, child.span_id) == (format(0xABC, "032x"), "3" * 16)  # the parent's trace wins
    assert len(fresh.trace_id) == 32 and len(fresh.span_id) == 16
    rows = read(db, "SELECT request_id, trace_id, span_id FROM requests ORDER BY request_id")
    assert [r[1:] for r in rows] == [
        ("1" * 32, "2" * 16),
        (child.trace_id, "3" * 16),
        (fresh.trace_id, fresh.span_id),
    ]
    parents = {format(s.context.span_id, "016x"): s.parent for s in seen.get_finished_spans()}
    assert parents["2" * 16] is None and parents[fresh.span_id] is None
    assert parents["3" * 16] is not None and parents["3" * 16].span_id == 0xDEF
    assert parents["3" * 16].trace_id == 0xABC and parents["3" * 16].is_remote


def test_a_snapshot_holds_every_span_accepted_so_far_and_the_sink_keeps_writing(
    sink: SpanSink, db: Path, tmp_path: Path
) -> None:
    """The copy opens while the sink still holds the file (which DuckDB refuses to a second connection
    in one process) and has every span emitted before it was taken; later spans go to the original only."""
    from specproxy.analysis import open_store

    sink.begin_run("run-1", name="x", mode="replay", source="replay", config_json="{}", stacks_json="{}")
    for i in range(300):
        assert sink.emit(minimal_record(i))
    copy = tmp_path / "snapshot.duckdb"
    sink.snapshot(copy)
    assert sink.emit(minimal_record(300))
    assert count(copy) == 300 and read(copy, "SELECT name FROM runs") == [("x",)]
    with open_store([copy]) as store:
        assert store.query("SELECT count(DISTINCT request_id) AS n FROM requests") == [{"n": 300}]
    with pytest.raises(SpanSinkError, match="already exists|cannot copy"):
        sink.snapshot(copy)  # a second copy into a store that has the tables fails with a sentence
    sink.close()
    assert count(db) == 301 and count(copy) == 300


def test_a_sink_without_a_store_has_nothing_to_snapshot(tmp_path: Path) -> None:
    s = SpanSink(None)
    s.start()
    try:
        with pytest.raises(SpanSinkError, match="no span store"):
            s.snapshot(tmp_path / "copy.duckdb")
    finally:
        s.close()
