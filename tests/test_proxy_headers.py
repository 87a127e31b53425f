"""Headers cross the proxy as they cross an HTTP proxy (RFC 9110 §7.6.1): the client's end-to-end
request headers reach every arm, the serving arm's response headers reach the client, hop-by-hop and
denied ones do not. The official openai SDK is the client, scripted backends on real sockets the arms."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from specproxy.proxy.server.headers import request_headers_for_arms, response_headers_for_client
from tests.backends import BackendConfig, running_backend
from tests.proxies import running_proxy, two_arm_proxy, wait_for_calls

CLIENT_HEADERS = {
    "X-Custom-Tenant": "acme",
    "OpenAI-Organization": "org-123",
    "User-Agent": "tenant-app/2.1",
    "Connection": "keep-alive, X-Hop-Secret",
    "X-Hop-Secret": "must-not-pass",
    "Proxy-Authorization": "Basic c2VjcmV0",
}
ENGINE_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Engine-Build", "b42"),
    ("Set-Cookie", "a=1"),
    ("Set-Cookie", "b=2"),
    ("Keep-Alive", "timeout=5"),
)


def test_filters_drop_hop_by_hop_and_denied_headers() -> None:
    sent = [
        ("Host", "proxy:8000"),
        ("Connection", "close, X-Named"),
        ("X-Named", "1"),
        ("TE", "trailers"),
        ("Proxy-Connection", "keep-alive"),
        ("Authorization", "Bearer proxy-key"),
        ("X-Specproxy-Category", "code"),
        ("Content-Length", "10"),
        ("Accept", "application/json"),
        ("X-Tenant", "t"),
        ("X-Tenant", "u"),
    ]
    assert list(request_headers_for_arms(sent).items()) == [
        ("Accept", "application/json"),
        ("X-Tenant", "t"),
        ("X-Tenant", "u"),
    ]
    got = response_headers_for_client(
        [("upgrade", "h2c"), ("date", "x"), ("x-request-id", "r"), ("etag", "e")]
    )
    assert list(got.items()) == [("etag", "e")]


async def test_client_headers_reach_every_arm_and_the_baselines_come_back(tmp_path: Path) -> None:
    cfg = BackendConfig(tokens=4, response_headers=ENGINE_HEADERS)
    async with two_arm_proxy(tmp_path, cfg) as (p, base, cand):
        client = openai.AsyncOpenAI(
            base_url=p.url + "/v1", api_key="client-key", max_retries=0, default_headers=CLIENT_HEADERS
        )
        async with client:
            for stream in (False, True):
                raw = await client.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=stream, max_tokens=4
                )
                parsed = raw.parse()
                if stream:
                    async for _ in parsed:  # type: ignore[union-attr]
                        pass
                headers = raw.headers
                assert headers["cache-control"] == "no-store"
                assert headers["x-engine-build"] == "b42"
                assert headers.get_list("set-cookie") == ["a=1", "b=2"]
                assert "keep-alive" not in headers
                assert headers["x-specproxy-arm"] == "base"
                assert headers["x-request-id"] != ""
        await wait_for_calls(p, 4)
    for backend in (base, cand):
        assert len(backend.stats.headers) == 2
        for got in backend.stats.headers:
            assert got["X-Custom-Tenant"] == "acme"
            assert got["OpenAI-Organization"] == "org-123"
            assert got["User-Agent"] == "tenant-app/2.1"
            assert "X-Hop-Secret" not in got
            assert "Proxy-Authorization" not in got
            assert "Authorization" not in got  # the client's key is the proxy's, never an arm's
            assert got["Host"] == backend.url.removeprefix("http://")
            assert int(got["Content-Length"]) > 0


async def test_each_arm_gets_its_own_authorization(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASE_KEY", "base-secret")
    async with (
        running_backend(BackendConfig(tokens=2)) as base,
        running_backend(BackendConfig(tokens=2)) as cand,
    ):
        arms = [
            {"name": "base", "role": "baseline", "url": base.url, "api_key_env": "BASE_KEY"},
            {"name": "cand", "url": cand.url},
        ]
        async with running_proxy(tmp_path, arms) as p:
            async with openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="client-key", max_retries=0) as c:
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            await wait_for_calls(p, 2)
    assert base.stats.headers[0]["Authorization"] == "Bearer base-secret"
    assert "Authorization" not in cand.stats.headers[0]


async def test_a_429_with_retry_after_reaches_the_sdk(tmp_path: Path) -> None:
    limited = (("Retry-After", "7"), ("x-should-retry", "false"), ("X-RateLimit-Remaining-Requests", "0"))
    cfg = BackendConfig(fail="http429", response_headers=limited)
    async with running_backend(cfg) as base:
        async with running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": base.url}]) as p:
            # x-should-retry: false makes the SDK give up at once despite max_retries: only the header
            # relayed from the backend can tell it that.
            async with openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="k", max_retries=3) as client:
                with pytest.raises(openai.RateLimitError) as err:
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "x"}]
                    )
    assert base.stats.requests == 1
    assert err.value.response.headers["retry-after"] == "7"
    assert err.value.response.headers["x-ratelimit-remaining-requests"] == "0"


async def test_the_sdk_retries_as_the_backend_says(tmp_path: Path) -> None:
    cfg = BackendConfig(
        fail="http429",
        fail_requests=1,
        tokens=2,
        response_headers=(("retry-after-ms", "5"), ("x-should-retry", "true")),
    )
    async with running_backend(cfg) as base:
        async with running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": base.url}]) as p:
            async with openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="k", max_retries=1) as client:
                out = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}]
                )
    assert base.stats.requests == 2
    assert out.choices[0].message.content


async def test_a_connection_header_from_the_client_never_passes(tmp_path: Path) -> None:
    """Raw bytes, as a client the SDK does not model would send them: ``Connection`` names a header,
    ``TE`` and ``Upgrade`` are hop-by-hop; the arm sees none of them."""
    async with running_backend(BackendConfig(tokens=2)) as base:
        async with running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": base.url}]) as p:
            host, port = p.url.removeprefix("http://").split(":")
            body = b'{"model":"m","messages":[{"role":"user","content":"x"}]}'
            head = (
                "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close, X-Private\r\nX-Private: 1\r\n"
                "TE: trailers\r\nUpgrade: websocket\r\nX-Kept: yes\r\n\r\n"
            )
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(head.encode() + body)
                answer = await reader.read()  # (Connection: close: the proxy ends the connection)
            finally:
                writer.close()
                await writer.wait_closed()
            assert answer.startswith(b"HTTP/1.1 200")
    got = base.stats.headers[0]
    assert got["X-Kept"] == "yes"
    for name in ("X-Private", "TE", "Upgrade"):
        assert name not in got
    assert got.get("Connection", "keep-alive").lower() != "close"  # the proxy's own connection stays open
