"""What a client request tells the proxy about itself: its OTel trace and its replay concurrency level."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specproxy.proxy.replay.runner import LoadPlan, run_replay
from specproxy.proxy.upstream.calls import upstream_request_id
from tests.backends import BackendConfig, running_backend
from tests.proxies import running_proxy, spans, two_arm_proxy
from tests.support import chat_items

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
BODY: Any = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "stream": True}


async def test_primary_and_shadow_spans_share_a_trace_under_the_clients_traceparent(tmp_path: Path) -> None:
    cfg = BackendConfig(tokens=4)
    async with (
        two_arm_proxy(tmp_path, cfg) as (p, base, cand),
    ):
        assert p.state.sink is not None
        seen = InMemorySpanExporter()
        p.state.sink.add_span_processor(SimpleSpanProcessor(seen))
        async with aiohttp.ClientSession() as s:
            headers = {"traceparent": f"00-{TRACE}-{PARENT}-01", "X-Request-Id": "with-parent"}
            async with s.post(p.url + "/v1/chat/completions", json=BODY, headers=headers) as r:
                assert r.status == 200
                await r.read()
            async with s.post(
                p.url + "/v1/chat/completions", json=BODY, headers={"X-Request-Id": "bare"}
            ) as r:
                await r.read()
            # A malformed traceparent is ignored (a new trace), never an error.
            async with s.post(
                p.url + "/v1/chat/completions",
                json=BODY,
                headers={"traceparent": "00-zz-yy-01", "X-Request-Id": "bad"},
            ) as r:
                assert r.status == 200
                await r.read()
    rows = spans(p.db)
    by_request: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_request.setdefault(row["request_id"], []).append(row)
    assert sorted(by_request) == ["bad", "bare", "with-parent"]
    for rid, pair in by_request.items():
        assert sorted(r["routed_as"] for r in pair) == ["primary", "shadow"]
        assert len({r["trace_id"] for r in pair}) == 1, rid  # one trace per client request
        assert len({r["span_id"] for r in pair}) == 2, rid  # each call its own span
    assert {r["trace_id"] for r in by_request["with-parent"]} == {TRACE}
    assert len({r["trace_id"] for r in rows}) == 3
    # In OTel (what OTLP exports) the client's span is the parent of both calls; other requests are roots.
    otel = {format(s.context.span_id, "016x"): s for s in seen.get_finished_spans()}
    for row in rows:
        span = otel[row["span_id"]]
        assert format(span.context.trace_id, "032x") == row["trace_id"]
        parent_id = format(span.parent.span_id, "016x") if span.parent is not None else None
        assert parent_id == (PARENT if row["request_id"] == "with-parent" else None)
    # Each arm is told its call's span, so its own tracing nests under it.
    for backend, arm in ((base, "base"), (cand, "cand")):
        sent = {h["X-Request-Id"]: h["traceparent"] for h in backend.stats.headers}
        for row in rows:
            if row["arm"] == arm:
                assert (
                    sent[upstream_request_id(row["request_id"])]
                    == f"00-{row['trace_id']}-{row['span_id']}-01"
                )


async def test_concurrency_level_header_labels_spans_and_is_not_forwarded(tmp_path: Path) -> None:
    cfg = BackendConfig(tokens=3)
    async with (
        two_arm_proxy(tmp_path, cfg) as (p, base, cand),
        aiohttp.ClientSession() as s,
    ):
        hdr = "X-Specproxy-Concurrency-Level"
        async with s.post(p.url + "/v1/chat/completions", json=BODY, headers={hdr: "16"}) as r:
            assert r.status == 200
            await r.read()
        for bad in ("sixteen", "0", "-3"):
            async with s.post(p.url + "/v1/chat/completions", json=BODY, headers={hdr: bad}) as r:
                assert r.status == 400 and hdr in (await r.json())["error"]["message"]
        async with s.post(
            p.url + "/v1/chat/completions", json=BODY, headers={"X-Specproxy-Round": "2nd"}
        ) as r:
            assert r.status == 400 and "X-Specproxy-Round" in (await r.json())["error"]["message"]
        async with s.post(p.url + "/v1/chat/completions", json=BODY) as r:
            await r.read()
        assert all(
            hdr not in h and "X-Specproxy-Round" not in h for h in base.stats.headers + cand.stats.headers
        )
    assert sorted((r["routed_as"], r["concurrency_level"] or 0) for r in spans(p.db)) == [
        ("primary", 0),
        ("primary", 16),
        ("shadow", 0),
        ("shadow", 16),
    ]


async def test_replay_through_the_proxy_labels_its_spans_with_each_level_and_round(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(tokens=3)) as base,
        running_proxy(tmp_path / "proxy", [{"name": "base", "role": "baseline", "url": base.url}]) as p,
    ):
        settings = p.replay_settings(tmp_path / "replay.duckdb", LoadPlan(levels=(1, 3), warmup=0, rounds=2))
        result = await run_replay(settings, chat_items(6))
        assert result.per_arm["target"].ok == 24
    phases = sorted((r["concurrency_level"], r["round"]) for r in spans(p.db))
    assert phases == [(c, k) for c in (1, 3) for k in (1, 2) for _ in range(6)]


def test_rows_are_the_same_with_otel_spans_built_or_not(tmp_path: Path) -> None:
    # OTel spans are built only when someone exports them; the store must not notice, errors too.
    from specproxy.proxy.spans.sink import SpanSink
    from specproxy.proxy.spans.trace import TraceParent
    from tests.records import full_record

    parent = TraceParent(TRACE, PARENT, flags=1)
    records = [full_record(0), full_record(1, status="timeout", error="upstream timed out"), full_record(2)]
    rows = []
    seen = InMemorySpanExporter()
    for name, with_otel in (("store-only", False), ("with-otel", True)):
        db = tmp_path / f"{name}.duckdb"
        with SpanSink(db) as sink:
            if with_otel:
                sink.add_span_processor(SimpleSpanProcessor(seen))
            for i, rec in enumerate(records):
                ids = {"trace_id": f"{i + 1:032x}", "span_id": f"{i + 1:016x}"}
                assert sink.emit(
                    full_record(i, status=rec.status, error=rec.error, **ids), parent if i == 2 else None
                )
        rows.append(spans(db))
    assert len(rows[0]) == 3 and rows[0] == rows[1]
    assert len(seen.get_finished_spans()) == 3


def test_traceparent_follows_the_w3c_rules() -> None:
    from specproxy.proxy.spans.trace import TraceParent, parse_traceparent

    assert parse_traceparent(f"00-{TRACE}-{PARENT}-01") == TraceParent(TRACE, PARENT, 1)
    assert parse_traceparent(f" 01-{TRACE}-{PARENT}-00-later-field") == TraceParent(TRACE, PARENT, 0)
    for bad in (
        f"00-{TRACE}-{PARENT}-01-extra",  # version 00 has exactly four fields
        f"ff-{TRACE}-{PARENT}-01",  # version ff is invalid
        f"00-{'0' * 32}-{PARENT}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE.upper()}-{PARENT}-01",
        "00-zz-yy-01",
        "",
    ):
        assert parse_traceparent(bad) is None, bad
