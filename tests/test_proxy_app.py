"""The proxy in-process on a real socket, real test backends behind it, the openai client in front."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from specproxy.proxy.replay.formats import read_items
from specproxy.proxy.server.client_relay import ClientRelay
from specproxy.proxy.upstream.calls import upstream_request_id
from tests.backends import BackendConfig, RunningBackend, running_backend
from tests.proxies import running_proxy, spans, wait_for_calls
from tests.support import free_port, wait_until

MSG: Any = [{"role": "user", "content": "Write a haiku about proxies."}]


def shadow_arms(base: RunningBackend, cand: RunningBackend, **cand_kw: Any) -> list[dict[str, Any]]:
    return [
        {"name": "base", "role": "baseline", "url": base.url},
        {"name": "cand", "url": cand.url, **cand_kw},
    ]


async def test_openai_clients_sync_and_async_streaming_and_not(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(tokens=12)) as base,
        running_backend(BackendConfig(tokens=12, tokens_per_chunk=3)) as cand,
        running_proxy(
            tmp_path, shadow_arms(base, cand, speculative={"method": "ngram", "num_speculative_tokens": 2})
        ) as p,
    ):
        aclient = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
        r = await aclient.chat.completions.create(model="m", messages=MSG, temperature=0)
        assert r.choices[0].message.content and r.usage and r.usage.completion_tokens == 12
        text = ""
        stream = await aclient.completions.create(
            model="m", prompt="abc", temperature=0, stream=True, max_tokens=7
        )
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
        assert len(text.split()) == 7
        await aclient.close()

        def sync_calls() -> tuple[str, int]:
            with openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0) as client:
                c = client.completions.create(model="m", prompt="abc", temperature=0, max_tokens=7)
                pieces = [
                    ch.choices[0].delta.content or ""
                    for ch in client.chat.completions.create(
                        model="m", messages=MSG, temperature=0, stream=True
                    )
                    if ch.choices
                ]
                return c.choices[0].text, len("".join(pieces).split())

        sync_text, n_stream = await asyncio.to_thread(sync_calls)
        assert sync_text == text and n_stream == 12
    rows = spans(p.db)
    assert len(rows) == 8 and {r["status"] for r in rows} == {"ok"}
    assert sorted(r["routed_as"] for r in rows) == ["primary"] * 4 + ["shadow"] * 4
    assert all(r["identical"] is True for r in rows if r["arm"] == "cand")
    assert all(r["identical"] is None for r in rows if r["arm"] == "base")
    streamed = [r for r in rows if r["stream"]]
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] and r["chunks"] for r in streamed)
    # n-gram drafts only where the text matched: its stream shape is never taken as measured.
    assert {r["spec_source"] for r in streamed if r["arm"] == "cand"} == {"stream_shape_unreliable"}
    assert all(r["output_text"] is None and len(r["prompt_sha256"]) == 64 for r in rows)


def _normalise(stream: bytes) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', stream)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"stream_options": {"include_usage": True}},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"return_token_ids": True},
    ],
)
async def test_client_gets_the_bytes_the_backend_would_have_sent(
    tmp_path: Path, extra: dict[str, Any]
) -> None:
    async with (
        running_backend(BackendConfig(tokens=6)) as base,
        running_proxy(
            tmp_path, [{"name": "base", "role": "baseline", "url": base.url, "return_token_ids": True}]
        ) as p,
        aiohttp.ClientSession() as s,
    ):
        body = {"model": "m", "messages": MSG, "stream": True, **extra}
        # a UUID: the backend sees the id the client sent, so both streams carry it
        headers = {"X-Request-Id": "0f8e2a4c-6b1d-4e3f-9a5c-7d2b1e0f3a6c"}
        async with s.post(base.url + "/v1/chat/completions", json=body, headers=headers) as r:
            direct = await r.read()
        async with s.post(p.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.headers["Content-Type"] == "text/event-stream" and r.headers["X-Specproxy-Arm"] == "base"
            proxied = await r.read()
        # The proxy asked the backend for usage and token ids; the client sees only what it asked for.
        assert base.stats.bodies[-1]["stream_options"]["include_usage"] is True
        assert base.stats.bodies[-1]["return_token_ids"] is True
        # Per-chunk usage only when the client asked: this arm has no speculation to measure.
        client_continuous = bool(extra.get("stream_options", {}).get("continuous_usage_stats"))
        assert base.stats.bodies[-1]["stream_options"]["continuous_usage_stats"] is client_continuous
        assert _normalise(proxied) == _normalise(direct)


async def test_a_slow_client_slows_the_upstream_read_and_still_gets_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long stream (~9 MB, more than the kernel's socket buffers hold) to a client that does not read
    # for a while: the proxy's socket buffer fills, the relay waits for the client (drain) with the
    # upstream read paused instead of buffering the stream, and the client still gets every byte.
    drains = 0
    real_drain = ClientRelay.drain

    async def counting_drain(self: ClientRelay) -> None:
        nonlocal drains
        drains += 1
        await real_drain(self)

    monkeypatch.setattr(ClientRelay, "drain", counting_drain)
    body = orjson.dumps({"model": "m", "prompt": "p", "stream": True, "max_tokens": 60000})
    async with (
        running_backend(BackendConfig(tokens=60000)) as base,
        running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": base.url}]) as p,
        aiohttp.ClientSession() as s,
    ):
        # the backend sees the id the proxy forwards for "r" (see below)
        rid = upstream_request_id("r")
        async with s.post(base.url + "/v1/completions", data=body, headers={"X-Request-Id": rid}) as r:
            direct = await r.read()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", int(p.url.rsplit(":", 1)[1])))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: r\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        # Not reading until the proxy waits for this client.
        await wait_until(lambda: drains > 0, "the proxy to wait for a client that does not read")
        raw = await reader.read()
        writer.close()
    assert drains > 0
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    parts, at = [], 0
    while True:  # undo the chunked framing
        eol = chunked.index(b"\r\n", at)
        size = int(chunked[at:eol], 16)
        if size == 0:
            break
        parts.append(chunked[eol + 2 : eol + 2 + size])
        at = eol + 4 + size
    proxied = b"".join(parts)
    assert _normalise(proxied) == _normalise(direct)


async def test_shadow_dead_and_slow_arms_never_touch_the_primary(tmp_path: Path) -> None:
    fast = BackendConfig(ttft_s=0.02, itl_s=0.005, tokens=10)
    slow_done = asyncio.Event()
    slow = BackendConfig(tokens=10, gate=slow_done)  # answers only once every primary call is over
    async with (
        running_backend(fast) as base,
        running_backend(slow) as slow_arm,
        running_proxy(
            tmp_path,
            [
                {"name": "base", "role": "baseline", "url": base.url},
                {"name": "dead", "url": f"http://127.0.0.1:{free_port()}"},
                {"name": "slow", "url": slow_arm.url, "max_shadow_inflight": 4},
            ],
        ) as p,
    ):
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> None:
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"q{i}"}], stream=True, temperature=0
            )
            n = len([1 async for c in stream if c.choices and c.choices[0].delta.content])
            assert n == 10

        # Every primary call completes while the slow arm has not answered a single copy.
        await asyncio.gather(*(one(i) for i in range(12)))
        await client.close()
        assert slow_arm.stats.completed == 0
        slow_done.set()
        await wait_for_calls(p, 36)
    rows = spans(p.db)
    by_arm: dict[str, list[str]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], []).append(r["status"])
    assert by_arm["base"] == ["ok"] * 12
    assert by_arm["dead"] == ["upstream_error"] * 12
    assert sorted(set(by_arm["slow"])) == ["dropped", "ok"] and by_arm["slow"].count("ok") == 4
    assert len(by_arm["slow"]) == 12  # every copy accounted for, dropped or not


async def test_client_disconnect_cancels_the_upstream_call(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(itl_s=0.05, tokens=200)) as base,
        running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": base.url}]) as p,
    ):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with aiohttp.ClientSession() as s:
            async with s.post(
                p.url + "/v1/completions",
                json={"model": "m", "prompt": "p", "stream": True, "max_tokens": 60000},
            ) as r:
                await r.content.readuntil(b"\n\n")
                await r.content.readuntil(b"\n\n")
        await wait_for_calls(p, 1)
        seen_s = loop.time() - t0
        await wait_until(lambda: base.stats.cancelled == 1, "the backend to see the call cancelled")
        assert base.stats.completed == 0
    rows = spans(p.db)
    assert [r["status"] for r in rows] == ["client_cancelled"]
    assert 0 < rows[0]["e2e_s"] <= seen_s  # the span ends when the client left, not with the stream


async def test_client_disconnect_cancels_a_non_streaming_upstream_call(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(ttft_s=3.0)) as base,
        running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": base.url}]) as p,
    ):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with aiohttp.ClientSession() as s:
            with pytest.raises(TimeoutError):
                await s.post(
                    p.url + "/v1/completions",
                    json={"model": "m", "prompt": "p"},
                    timeout=aiohttp.ClientTimeout(total=0.3),
                )
        await wait_for_calls(p, 1)
        seen_s = loop.time() - t0
        await wait_until(lambda: base.stats.cancelled == 1, "the backend to see the call cancelled")
        assert base.stats.completed == 0
    rows = spans(p.db)
    assert [r["status"] for r in rows] == ["client_cancelled"] and 0 < rows[0]["e2e_s"] <= seen_s


async def test_candidate_that_diverges_is_caught_with_token_index_and_margin(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(tokens=20)) as base,
        running_backend(BackendConfig(tokens=20, diverge_at=7)) as cand,
        running_proxy(
            tmp_path,
            [
                {"name": "base", "role": "baseline", "url": base.url, "return_token_ids": True},
                {"name": "cand", "url": cand.url, "return_token_ids": True},
            ],
        ) as p,
    ):
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model="m", messages=MSG, temperature=0, stream=True, logprobs=True, top_logprobs=2
        )
        chunks = [c async for c in stream]
        assert all(
            not hasattr(c.choices[0], "token_ids") or c.choices[0].token_ids is None
            for c in chunks
            if c.choices
        )
        # Not greedy: not compared.
        await client.chat.completions.create(model="m", messages=MSG, temperature=0.8)
        await client.close()
        await wait_for_calls(p, 4)  # the candidate's copies, compared when they end
        text = p.state.metrics.render().decode()
        assert 'specproxy_identity_mismatches_total{arm="cand"} 1.0' in text
    cand_rows = spans(p.db, "arm = 'cand'")
    assert [r["identical"] for r in cand_rows] == [False, None]
    assert cand_rows[0]["first_divergence"] == 7
    # tests/backends.py gives odd token ids a 0.05 top-1/top-2 margin and even ones 2.0.
    assert cand_rows[0]["divergence_margin"] in (pytest.approx(0.05), pytest.approx(2.0))


async def test_split_mode_weights_stickiness_and_verify(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(tokens=4)) as base,
        running_backend(BackendConfig(tokens=4, diverge_at=2)) as cand,
        running_proxy(
            tmp_path,
            [
                {"name": "base", "role": "baseline", "url": base.url, "weight": 1},
                {"name": "cand", "url": cand.url, "weight": 3},
            ],
            mode="split",
            sticky_key="header:X-Session-ID",
            verify_fraction=1.0,
        ) as p,
        aiohttp.ClientSession() as s,
    ):
        served: dict[str, set[str]] = {}
        for i in range(80):
            session_id = f"user-{i % 20}"
            body = {"model": "m", "prompt": f"p{i}", "temperature": 0, "max_tokens": 4}
            headers = {"X-Session-ID": session_id}
            async with s.post(p.url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200
                served.setdefault(session_id, set()).add(r.headers["X-Specproxy-Arm"])
        assert all(len(arms) == 1 for arms in served.values())  # sticky
        to_cand = sum("cand" in arms for arms in served.values())
        assert 9 <= to_cand <= 19  # about 3/4 of 20 sessions
        await wait_for_calls(p, 80 + to_cand * 4)  # and a verify copy of each call sent to cand
    rows = spans(p.db)
    split_cand = [r for r in rows if r["arm"] == "cand"]
    verify = [r for r in rows if r["routed_as"] == "verify"]
    assert len(verify) == len(split_cand) == to_cand * 4 and all(r["arm"] == "base" for r in verify)
    assert all(r["identical"] is False and r["first_divergence"] is not None for r in split_cand)


async def test_bad_input_and_upstream_failures_are_openai_shaped(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(fail="http429")) as bad,
        running_backend(BackendConfig(fail="hang")) as hang,
    ):
        exp_arms = [{"name": "base", "role": "baseline", "url": bad.url}]
        async with running_proxy(tmp_path, exp_arms, max_body_bytes=1000) as p, aiohttp.ClientSession() as s:
            cases: list[tuple[str, str, Any, int]] = [
                ("POST", "/v1/chat/completions", b"{not json", 400),
                ("POST", "/v1/chat/completions", b"[1, 2]", 400),
                ("POST", "/v1/completions", b'{"prompt": "' + b"x" * 2000 + b'"}', 413),
                ("GET", "/v1/nothing", None, 404),
                ("GET", "/v1/chat/completions", None, 405),
                ("POST", "/v1/chat/completions", orjson.dumps({"model": "m", "messages": MSG}), 429),
            ]
            for method, path, data, status in cases:
                async with s.request(method, p.url + path, data=data) as r:
                    assert r.status == status, (path, await r.text())
                    err = (await r.json())["error"]
                    assert err["message"] and err["type"]
        for dead_url, experiment, status in (
            (f"http://127.0.0.1:{free_port()}", {}, 502),
            (hang.url, {"upstream_read_timeout_s": 0.3}, 504),
        ):
            arms = [{"name": "base", "role": "baseline", "url": dead_url}]
            async with running_proxy(tmp_path / str(status), arms, **experiment) as p:
                client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
                with pytest.raises(openai.APIStatusError) as info:
                    await client.chat.completions.create(model="m", messages=MSG)
                assert info.value.status_code == status
                await client.close()
            assert [r["status"] for r in spans(p.db)] == ["upstream_error" if status == 502 else "timeout"]
    rows = spans(tmp_path / "spans.duckdb")
    assert [(r["status"], r["http_status"]) for r in rows] == [("http_error", 429)]


async def test_mid_stream_failure_ends_the_stream_with_an_error(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(fail="reset", tokens=10)) as base,
        running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": base.url}]) as p,
    ):
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass
        await client.close()
    assert [r["status"] for r in spans(p.db)] == ["upstream_error"]


async def test_api_key_models_health_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARM_KEY", "upstream-secret")
    async with (
        running_backend(BackendConfig()) as base,
        running_proxy(
            tmp_path,
            [{"name": "base", "role": "baseline", "url": base.url, "api_key_env": "ARM_KEY"}],
            api_key="proxy-secret",
        ) as p,
    ):
        bad = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        await bad.close()
        good = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="proxy-secret", max_retries=0)
        assert [m.id for m in (await good.models.list()).data] == ["test-model"]
        await good.chat.completions.create(model="m", messages=MSG)
        await good.close()
        # The upstream sees its own key, never the client's.
        assert base.stats.headers[-1]["Authorization"] == "Bearer upstream-secret"
        async with aiohttp.ClientSession() as s:
            async with s.get(p.url + "/health") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            async with s.get(p.url + "/metrics") as r:
                text = await r.text()
        assert 'specproxy_requests_total{arm="base",route="primary",status="ok"} 1.0' in text
        assert 'specproxy_inflight{arm="base"} 0.0' in text and "specproxy_span_queue_depth" in text
        assert 'specproxy_client_errors_total{status="401"} 1.0' in text


async def test_capture_file_is_replayable_and_never_holds_keys(tmp_path: Path) -> None:
    capture = tmp_path / "capture.jsonl"
    async with (
        running_backend(BackendConfig(tokens=5)) as base,
        running_proxy(
            tmp_path,
            [{"name": "base", "role": "baseline", "url": base.url}],
            capture=str(capture),
            capture_responses=True,
            api_key="sekrit-key",
        ) as p,
    ):
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="sekrit-key", max_retries=0)
        await client.chat.completions.create(
            model="m", messages=MSG, temperature=0, extra_headers={"X-Specproxy-Category": "poetry"}
        )
        await client.completions.create(model="m", prompt="hello", max_tokens=3)
        await client.close()
    raw = capture.read_bytes()
    assert b"sekrit" not in raw
    lines = [orjson.loads(line) for line in raw.splitlines()]
    assert [ln["path"] for ln in lines] == ["/v1/chat/completions", "/v1/completions"]
    assert lines[0]["category"] == "poetry" and lines[0]["body"]["messages"] == MSG
    assert lines[0]["response_text"] and lines[0]["status"] == "ok"
    assert all(r["output_text"] for r in spans(p.db))  # capture on: spans keep the text
    items = read_items(capture)  # the replay reader
    assert items.format == "capture" and [i.category for i in items.items] == ["poetry", None]
    assert [i.endpoint for i in items.items] == ["chat", "completions"]


async def test_non_vllm_backend_works_without_extensions(tmp_path: Path) -> None:
    async with (
        running_backend(BackendConfig(vllm=False, reject_extensions=True, tokens=6)) as base,
        running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": base.url}]) as p,
    ):
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):
            stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
            assert len([1 async for c in stream if c.choices and c.choices[0].delta.content]) == 6
        await client.close()
    rows = spans(p.db)
    assert [(r["status"], r["spec_source"], r["tokens_source"]) for r in rows] == [
        ("ok", "none", "text_estimate")
    ] * 2
    assert all(r["completion_tokens"] > 0 for r in rows)
    # vLLM's extensions rejected, then the standard include_usage rejected; both remembered.
    assert base.stats.requests == 4
