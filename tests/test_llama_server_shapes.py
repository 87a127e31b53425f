"""llama.cpp's ``llama-server`` as recorded from a real one (``tests/fixtures/llama_server/``): the
proxy relays its answers byte for byte, and the tap, the engine adapter and the scraper read them.

A small aiohttp server answers each request with the recording of the same request (chat or
completions, streamed or not, with or without ``include_usage``), so the proxy meets llama-server's
exact bytes: its final chat chunk with ``timings``, its completions' last chunk with ``usage`` beside
``choices``, ``charset=utf-8`` on JSON. ``plain-*`` is a server without speculation, ``draft-*`` one
with a draft model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import duckdb
import orjson
import pytest
from aiohttp import web

from specproxy.analysis.store import open_store
from specproxy.config import Arm
from specproxy.proxy.upstream.acceptance import MergeCalibration, speculation_for
from specproxy.proxy.upstream.engines import engine_report
from specproxy.proxy.upstream.scrape import engine_load, parse_metrics, snapshot_rows, spec_decode_summary
from specproxy.proxy.upstream.sse import CompletionTap, SSEParser
from specproxy.proxy.upstream.tokens import ChunkEvidence, count_completion_tokens
from specproxy.schema import migrate
from tests.backends import serving_app
from tests.proxies import running_proxy, spans, wait_for_calls

FIXTURES = Path(__file__).parent / "fixtures" / "llama_server"
JSON_UTF8 = "application/json; charset=utf-8"
SSE = "text/event-stream"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BODIES: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "Count from 1 to 5."}]},
    "completions": {"prompt": "def add(a, b):"},
}
# Each recording holds 6 output tokens (max_tokens 6).
TOKENS = 6
DRAFT = {"method": "draft_model", "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "num_speculative_tokens": 4}


def recording(server: str, endpoint: str, stream: bool, include_usage: bool) -> Path:
    name = f"{server}-{endpoint}" + ("-stream" if stream else "") + ("-usage" if include_usage else "")
    return FIXTURES / (name + (".sse" if stream else ".json"))


def timings(server: str, endpoint: str) -> dict[str, Any]:
    timed: dict[str, Any] = orjson.loads(recording(server, endpoint, False, False).read_bytes())["timings"]
    return timed


class RecordedServer:
    """Answers as the recorded llama-server did; remembers the request ids it was sent."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.request_ids: list[str] = []
        self.served: list[Path] = []

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        endpoint = "chat" if request.path == PATHS["chat"] else "completions"
        stream = bool(body.get("stream"))
        usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
        self.served.append(recording(self.server, endpoint, stream, usage))
        raw = self.served[-1].read_bytes()
        if not stream:
            return web.Response(body=raw, headers={"Content-Type": JSON_UTF8})
        resp = web.StreamResponse(headers={"Content-Type": SSE})
        await resp.prepare(request)
        for event in raw.split(b"\n\n")[:-1]:  # one write per event, as llama-server sends them
            await resp.write(event + b"\n\n")
        await resp.write_eof()
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        name = "plain-metrics.txt" if self.server == "plain" else "draft-metrics-after.txt"
        return web.Response(body=(FIXTURES / name).read_bytes(), content_type="text/plain")


@asynccontextmanager
async def recorded_server(server: str) -> AsyncIterator[tuple[str, RecordedServer]]:
    recorded = RecordedServer(server)
    app = web.Application()
    app.router.add_post(PATHS["chat"], recorded.answer)
    app.router.add_post(PATHS["completions"], recorded.answer)
    app.router.add_get("/metrics", recorded.metrics)
    async with serving_app(app) as port:
        yield f"http://127.0.0.1:{port}", recorded


def _client_body(endpoint: str, stream: bool, include_usage: bool | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "max_tokens": TOKENS, "temperature": 0, **BODIES[endpoint]}
    if stream:
        body["stream"] = True
        if include_usage is not None:
            body["stream_options"] = {"include_usage": include_usage}
    return body


# Values that differ between two recordings of the same request: ids, clocks, the prompt cache.
_VARYING = frozenset({"id", "created", "cache_n", "cached_tokens", "prompt_n"})


def _masked(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: "…" if k in _VARYING or k.endswith(("_ms", "_per_second")) else _masked(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_masked(v) for v in value]
    return value


def masked(raw: bytes) -> list[Any]:
    """A body's or a stream's events, their varying values masked (key order kept)."""
    events = raw.split(b"\n\n")[:-1] if raw.startswith(b"data: ") else [raw]
    return [_masked(orjson.loads(e.removeprefix(b"data: "))) if e != b"data: [DONE]" else e for e in events]


# The client's options: not streamed; streamed without stream_options, with include_usage true, false.
CLIENT_OPTIONS = [(False, None), (True, None), (True, True), (True, False)]


@pytest.mark.parametrize("server", ["plain", "draft"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(("stream", "include_usage"), CLIENT_OPTIONS)
async def test_the_client_gets_llama_servers_bytes_through_the_proxy(
    tmp_path: Path, server: str, endpoint: str, stream: bool, include_usage: bool | None
) -> None:
    """The first call meets an arm whose engine is not known yet (the proxy asks a stream for
    include_usage), the second an arm known to be llama.cpp (it asks for nothing): both relay what the
    client would have received directly; byte for byte where the server got the client's own request.
    Where it got more (include_usage) it answered with another recording, equal but for ids and clocks."""
    body = _client_body(endpoint, stream, include_usage)
    want = recording(server, endpoint, stream, bool(include_usage)).read_bytes()
    async with recorded_server(server) as (url, recorded):
        arm: dict[str, Any] = {"name": server, "role": "baseline", "url": url}
        if server == "draft":
            arm["speculative"] = DRAFT
        async with running_proxy(tmp_path, [arm]) as p, aiohttp.ClientSession() as session:
            for call in range(2):
                headers = {"X-Request-Id": f"replay-1-c1-{call:05d}"}
                async with session.post(p.url + PATHS[endpoint], json=body, headers=headers) as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"] == (SSE if stream else JSON_UTF8)
                    got = await resp.read()
                own_request = recorded.served[-1] == recording(server, endpoint, stream, bool(include_usage))
                assert (got if own_request else masked(got)) == (want if own_request else masked(want))
            assert own_request, "the second call was sent as the client sent it"
            await wait_for_calls(p, 2)
    # The ids the client chose were not UUIDs: llama-server got UUIDs derived from them.
    assert len(recorded.request_ids) == 2 and all(len(rid) == 36 for rid in recorded.request_ids)
    rows = spans(p.db)
    assert [(r["status"], r["engine"]) for r in rows] == [("ok", "llamacpp")] * 2
    assert [(r["completion_tokens"], r["tokens_source"]) for r in rows] == [(TOKENS, "usage")] * 2


def _tapped(server: str, endpoint: str, stream: bool, include_usage: bool = False) -> CompletionTap:
    tap = CompletionTap("chat" if endpoint == "chat" else "completions")
    raw = recording(server, endpoint, stream, include_usage).read_bytes()
    if not stream:
        tap.feed_body(raw, 0.0)
        return tap
    parser = SSEParser()
    for i, event in enumerate(parser.feed(raw)):
        assert event.data is not None
        tap.feed_data(event.data, float(i))
    assert tap.done and tap.malformed is None
    return tap


ARMS = {
    "plain": Arm(name="plain", url="http://plain", role="baseline"),
    "draft": Arm(name="draft", url="http://draft", speculative=DRAFT),
}


@pytest.mark.parametrize("server", ["plain", "draft"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(("stream", "include_usage"), [(False, False), (True, False), (True, True)])
def test_tokens_are_the_servers_count_never_doubled(
    server: str, endpoint: str, stream: bool, include_usage: bool
) -> None:
    """The count is the server's: its usage (a completions stream's final chunk holds it beside
    choices: a total, not an increment), or a chat stream's timings.predicted_n."""
    tap = _tapped(server, endpoint, stream, include_usage)
    report = engine_report(tap, tap.engine_hint or "unknown")
    assert tap.engine_hint == "llamacpp" and report is not None
    count = count_completion_tokens(tap, ARMS[server], ChunkEvidence(), reported=report.completion_tokens)
    assert (count.tokens, count.source) == (TOKENS, "usage")
    chat_stream_without_usage = endpoint == "chat" and stream and not include_usage
    assert tap.usage_tokens == (None if chat_stream_without_usage else TOKENS)
    assert report.completion_tokens == TOKENS == timings(server, endpoint)["predicted_n"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(("stream", "include_usage"), [(False, False), (True, False), (True, True)])
def test_acceptance_is_what_the_draft_server_reported(
    endpoint: str, stream: bool, include_usage: bool
) -> None:
    tap = _tapped("draft", endpoint, stream, include_usage)
    spec, source = speculation_for(tap, ARMS["draft"], engine_report(tap, "llamacpp"), MergeCalibration())
    assert source == "llamacpp_timings" and spec is not None
    timed = tap.extras["timings"]
    assert (
        (spec.draft_tokens, spec.accepted_tokens) == (timed["draft_n"], timed["draft_n_accepted"]) == (4, 4)
    )
    # 6 tokens: the first from prefill, then one step that accepted 4 drafts (the server counted 1).
    assert spec.num_drafts is None and spec.acceptance_length == pytest.approx(5.0)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_plain_server_reports_no_drafts(endpoint: str) -> None:
    tap = _tapped("plain", endpoint, stream=True)
    report = engine_report(tap, "llamacpp")
    assert report is not None and (report.draft_tokens, report.accepted_tokens) == (0, 0)
    assert speculation_for(tap, ARMS["plain"], report, MergeCalibration()) == (None, "none")
    # The same answer from an arm configured to speculate: the server drafted nothing, and says so.
    spec, source = speculation_for(tap, ARMS["draft"], report, MergeCalibration())
    assert source == "llamacpp_timings" and spec is not None
    assert (spec.draft_tokens, spec.accepted_tokens, spec.acceptance_length) == (0, 0, None)


def test_metrics_pages_read_under_llama_servers_names() -> None:
    before = parse_metrics("draft", (FIXTURES / "draft-metrics-before.txt").read_text())
    after = parse_metrics("draft", (FIXTURES / "draft-metrics-after.txt").read_text())
    plain = parse_metrics("plain", (FIXTURES / "plain-metrics.txt").read_text())
    assert before.engine == after.engine == plain.engine == "llamacpp"
    assert engine_load(after) == engine_load(plain) == (0.0, 0.0)
    # Names as the server exports them (the parser would call this counter n_tokens_max_total).
    assert "llamacpp:n_tokens_max" in after.series and "llamacpp:n_tokens_max_total" not in after.series
    summary = spec_decode_summary(before, after)
    # Between the two pages the server answered draft-chat.json alone: the deltas are its timings.
    timed = timings("draft", "chat")
    assert (summary["draft_tokens"], summary["accepted_tokens"]) == (
        timed["draft_n"],
        timed["draft_n_accepted"],
    )
    assert summary["num_drafts"] == 1 and summary["mean_acceptance_length"] == pytest.approx(5.0)
    assert summary["per_position_rates"] == [1.0, 1.0, 1.0, 1.0]
    assert spec_decode_summary(plain, plain)["num_drafts"] == 0


def test_the_acceptance_view_reads_llama_servers_counters(tmp_path: Path) -> None:
    """A replay level's window of llama-server scrapes: analyze's acceptance is the counters' change."""
    pages = {"c=1:before": "draft-metrics-before.txt", "c=1:after": "draft-metrics-after.txt"}
    rows = []
    for i, (phase, name) in enumerate(pages.items()):
        scraped_at = datetime(2026, 12, 2, 0, 0, i, tzinfo=UTC)
        snapshot = parse_metrics("draft", (FIXTURES / name).read_text(), scraped_at)
        rows += snapshot_rows(snapshot, run_id="r", phase=phase)
    with duckdb.connect(str(tmp_path / "spans.duckdb")) as con:
        migrate(con)
        con.executemany(
            "INSERT INTO backend_metrics (run_id, arm, scraped_at, phase, name, labels_json, value) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [list(row) for row in rows],
        )
        got = con.execute(f"SELECT {ACCEPTANCE_COLUMNS} FROM acceptance WHERE arm = 'draft'").fetchall()
    assert got == [("1", 1.0, 4.0, 4.0, 1.0, 5.0, [1.0, 1.0, 1.0, 1.0])]
    # The analysis reads the store through its own views: the same figures.
    with open_store([tmp_path / "spans.duckdb"]) as store:
        analysed = store.query(f"SELECT {ACCEPTANCE_COLUMNS} FROM acceptance WHERE arm = 'draft'")
    assert [tuple(row.values()) for row in analysed] == got


ACCEPTANCE_COLUMNS = (
    "level, drafts, draft_tokens, accepted_tokens, acceptance_rate, acceptance_length, "
    "acceptance_per_position"
)
