"""What the proxy cuts says that the proxy cut it: answers that are not completions, events past their
cap, requests refused at the connection cap, streams ended by shutdown, half-closed clients.

Real sockets on 127.0.0.1 throughout: raw asyncio servers where a backend must misbehave in ways the
aiohttp test backend cannot (no Content-Type at all), the in-process proxy otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import pytest

from tests.backends import BackendConfig, running_backend
from tests.proxies import running_proxy, spans, wait_for_calls
from tests.support import started_serve, stop, wait_until
from tests.test_proxy_hardening import CHAT, no_tracebacks, post, raw_exchange, status_and_error


@asynccontextmanager
async def raw_backend(answer: bytes) -> AsyncIterator[str]:
    """A backend that reads a request head and body, then sends ``answer`` as it is."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        await reader.readexactly(length)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def test_a_200_empty_object_without_content_type_is_a_502_not_passed_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        raw_backend(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}") as base,
        running_proxy(tmp_path, [{"name": "b", "role": "baseline", "url": base}]) as p,
    ):
        out = await raw_exchange(p.url, post("/v1/chat/completions", CHAT))
        status, err = status_and_error(out)
        assert status == 502 and "the body has no choices" in err["message"], out[:300]
    assert [(s["status"], s["error"]) for s in spans(p.db)] == [
        ("upstream_error", "malformed response from upstream: the body has no choices")
    ]
    no_tracebacks(caplog)


async def test_a_completion_without_content_type_gets_one_not_an_empty_header(tmp_path: Path) -> None:
    body = orjson.dumps({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]})
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body)
    async with (
        raw_backend(answer) as base,
        running_proxy(tmp_path, [{"name": "b", "role": "baseline", "url": base}]) as p,
    ):
        out = await raw_exchange(p.url, post("/v1/chat/completions", CHAT))
    head = out.partition(b"\r\n\r\n")[0].lower()
    assert out.startswith(b"HTTP/1.1 200") and b"content-type: application/octet-stream" in head, out[:300]
    assert b"content-type: \r\n" not in head + b"\r\n"


async def test_a_candidates_endless_event_is_cut_at_the_cap_and_costs_the_client_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        running_backend(BackendConfig(tokens=6)) as base,
        running_backend(BackendConfig(tokens=6, fail="endless_event")) as cand,
        running_proxy(
            tmp_path,
            [{"name": "base", "role": "baseline", "url": base.url}, {"name": "cand", "url": cand.url}],
            shadow_timeout_s=600,
        ) as p,
    ):
        body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        out = await raw_exchange(p.url, post("/v1/chat/completions", body))
        assert out.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in out and b'"error"' not in out
        await wait_for_calls(p, 2)
    by_arm = {s["arm"]: (s["status"], s["error"]) for s in spans(p.db)}
    assert by_arm == {"base": ("ok", None), "cand": ("upstream_error", "event over 16777216 bytes")}
    no_tracebacks(caplog)


async def test_at_the_connection_cap_a_whole_request_gets_a_503_with_retry_after_and_is_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = asyncio.Event()
    async with (
        running_backend(BackendConfig(gate=gate)) as base,
        running_proxy(
            tmp_path, [{"name": "b", "role": "baseline", "url": base.url}], max_client_connections=2
        ) as p,
    ):
        held = [
            asyncio.create_task(raw_exchange(p.url, post("/v1/chat/completions", CHAT))) for _ in range(2)
        ]
        await wait_until(lambda: base.stats.active == 2, "two requests held by the backend")
        refused = await asyncio.gather(
            *(raw_exchange(p.url, post("/v1/chat/completions", CHAT)) for _ in range(20))
        )
        for out in refused:
            status, err = status_and_error(out)
            assert status == 503 and "limit of client connections" in err["message"], out[:300]
            assert b"\r\nretry-after: 1\r\n" in out.partition(b"\r\n\r\n")[0].lower() + b"\r\n"
        metrics = p.state.metrics.render()  # (a /metrics request would be refused too)
        gate.set()
        assert all(out.startswith(b"HTTP/1.1 200") for out in await asyncio.gather(*held))
    assert b"\nspecproxy_client_connections_refused_total 20.0\n" in metrics, metrics[-1500:]
    lines = [r.getMessage() for r in caplog.records if "client connections at the limit" in r.getMessage()]
    assert len(lines) == 1 and "refused a new one" in lines[0], lines
    no_tracebacks(caplog)


async def half_closed_exchange(url: str, request: bytes) -> bytes:
    """Send ``request``, close the sending side (``shutdown(SHUT_WR)``), read until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_half_closed_client_gets_its_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    body = orjson.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
    async with (
        running_backend(BackendConfig(tokens=5, itl_s=0.01)) as base,
        running_proxy(tmp_path, [{"name": "b", "role": "baseline", "url": base.url}]) as p,
    ):
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        out = await half_closed_exchange(p.url, head + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        out = out.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")  # (the proxy's probe: see connections)
        assert out.startswith(b"HTTP/1.1 200"), out[:300]
        assert (b"data: [DONE]" in out) if stream else out.rstrip().endswith(b"}"), out[-300:]
        idle = await half_closed_exchange(p.url, b"")  # nothing sent: the proxy closes too
        assert idle == b""
    assert [s["status"] for s in spans(p.db)] == ["ok"]
    no_tracebacks(caplog)


async def test_the_cap_and_the_half_close_under_serve_on_uvloop(tmp_path: Path) -> None:
    # `specproxy serve` runs on uvloop, whose transports differ from asyncio's (the in-process tests).
    gate = asyncio.Event()
    async with running_backend(BackendConfig(gate=gate)) as base:
        cfg = tmp_path / "exp.toml"
        cfg.write_text(
            f'[experiment]\nname = "cap"\nmode = "shadow"\ndb = "{tmp_path / "s.duckdb"}"\n'
            f'max_client_connections = 2\n\n[[arms]]\nname = "b"\nrole = "baseline"\nurl = "{base.url}"\n'
        )
        port, proc = await started_serve(cfg)
        url = f"http://127.0.0.1:{port}"
        try:
            held = [
                asyncio.create_task(raw_exchange(url, post("/v1/chat/completions", CHAT))) for _ in range(2)
            ]
            await wait_until(lambda: base.stats.active == 2, "two requests held by the backend")
            for out in await asyncio.gather(
                *(raw_exchange(url, post("/v1/chat/completions", CHAT)) for _ in range(5))
            ):
                assert status_and_error(out)[0] == 503 and b"Retry-After: 1" in out, out[:300]
            gate.set()
            assert all(out.startswith(b"HTTP/1.1 200") for out in await asyncio.gather(*held))
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            out = await half_closed_exchange(url, head + b"Content-Length: %d\r\n\r\n%b" % (len(CHAT), CHAT))
            assert out.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n").startswith(b"HTTP/1.1 200"), out[:300]
            gate.clear()  # a client that closes its socket while its call waits: the call is cancelled
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/v1/chat/completions", CHAT))
            await wait_until(lambda: base.stats.active == 1, "the call held by the backend")
            writer.close()
            await wait_until(lambda: base.stats.cancelled >= 1, "the backend to see the call cancelled")
        finally:
            output = stop(proc)
    assert "Traceback" not in output and proc.returncode == 0, output
