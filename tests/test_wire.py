"""proxy/wire.py, the upstream HTTP/1.1 client, against small raw-socket servers on 127.0.0.1.

Each server here answers with hand-written bytes, so the test decides exactly how the response is
framed (Content-Length, chunked, until close), when a connection closes, and what arrives when.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trustme
from aiohttp import web

from specproxy.proxy.upstream.wire import (
    BadResponse,
    BodyTooLarge,
    UpstreamClient,
    UpstreamDisconnected,
    UpstreamReadTimeout,
)
from tests.support import WAIT_S, free_port, loop_turns

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server calling ``handler(reader, writer, n)`` per request (n: the request's index on its
    connection); yields its URL and the peer port of every request (equal ports: a reused connection)."""
    peers: list[int] = []

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                peers.append(writer.get_extra_info("peername")[1])
                await handler(reader, writer, n)
                n += 1
                if writer.is_closing():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/completions", peers
    finally:
        server.close()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def test_keep_alive_reuses_one_connection_for_sequential_calls() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: 2\r\n\r\n{}"
        )

    async with raw_server(handler) as (url, peers), UpstreamClient() as client:
        for _ in range(3):
            ex = await client.post(url, b"{}", {"Content-Type": "application/json"})
            assert (ex.status, ex.content_type) == (200, "application/json")
            assert await ex.read() == b"{}"
            ex.release()
        assert len(peers) == 3 and len(set(peers)) == 1


async def test_chunked_and_until_close_bodies_and_an_interim_response() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        if n == 0:  # 100 Continue first, then a chunked body
            w.write(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                b"Content-Type: text/event-stream\r\n\r\n" + chunked(b"data: 1\n\n", b"data: 2\n\n")
            )
        else:  # no framing: the body ends when the connection does
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
            await w.drain()
            await asyncio.sleep(0.05)  # paced: the body most likely comes in two reads
            w.write(b"close")
            w.close()

    async with raw_server(handler) as (url, peers), UpstreamClient() as client:
        ex = await client.post(url, b"", {})
        assert (ex.status, ex.content_type) == (200, "text/event-stream")
        assert await ex.read() == b"data: 1\n\ndata: 2\n\n"
        ex.release()
        ex = await client.post(url, b"", {})
        assert await ex.read() == b"until close"
        ex.release()  # not reusable: the next call opens a new connection
        ex = await client.post(url, b"", {})
        assert await ex.read() == b"data: 1\n\ndata: 2\n\n"
        ex.release()
        assert peers[0] == peers[1] != peers[2]


async def test_a_reused_connection_closed_by_the_server_is_retried_once_on_a_new_one() -> None:
    # The server answers the first request on a connection and drops the connection at the second,
    # without a byte: what a server closing an idle keep-alive connection looks like to the client.
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        if n == 0:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        else:
            w.close()

    async with raw_server(handler) as (url, peers), UpstreamClient() as client:
        for _ in range(3):
            ex = await client.post(url, b"", {})
            assert await ex.read() == b"ok"
            ex.release()
        # Calls 2 and 3 each went to a reused connection that died, then to a new one.
        assert len(peers) == 5 and len(set(peers)) == 3


async def test_a_fresh_connection_that_closes_early_is_an_error_not_a_retry() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        w.close()

    async with raw_server(handler) as (url, peers), UpstreamClient() as client:
        ex = await client.post(url, b"", {})
        with pytest.raises(UpstreamDisconnected):
            await ex.read()
        ex.release()
        assert len(peers) == 1


async def test_garbage_is_a_bad_response_and_silence_a_read_timeout() -> None:
    async def garbage(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"SMTP ready\r\n\r\n")

    async def silent(r: asyncio.StreamReader, _w: asyncio.StreamWriter, _n: int) -> None:
        await r.read()  # until the client gives up

    async with raw_server(garbage) as (url, _), UpstreamClient() as client:
        with pytest.raises(BadResponse):
            await client.post(url, b"", {})
    async with raw_server(silent) as (url, _), UpstreamClient() as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(UpstreamReadTimeout):
            await client.post(url, b"", {}, read_timeout=0.2)
        assert loop.time() - t0 >= 0.15  # gave up at its read timeout, not at once


async def test_a_body_read_whole_stops_at_its_cap_and_closes_the_connection() -> None:
    body = b"x" * 5000

    async def large(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 1000):
            w.write(body[i : i + 1000])
            await w.drain()

    async with raw_server(large) as (url, peers), UpstreamClient() as client:
        ex = await client.post(url, b"", {})
        with pytest.raises(BodyTooLarge, match="over 1000 bytes"):
            await ex.read(limit=1000)
        ex.abort()
        ex = await client.post(url, b"", {})
        assert await ex.read(limit=len(body)) == body  # at the cap is not over it
        ex.release()
    assert len(peers) == 2 and peers[0] != peers[1]  # the cut connection was not reused


async def test_the_chunks_of_one_read_reach_the_consumer_in_one_call() -> None:
    consuming = asyncio.Event()

    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await w.drain()
        await asyncio.wait_for(consuming.wait(), WAIT_S)
        events = (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n")
        if n == 0:  # three chunks and the body's end in one write: one read
            w.write(chunked(*events))
        else:  # the same, then a chunk size that is not one
            w.write(b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"zz\r\n")
        await w.drain()

    got: list[bytes] = []

    def keep(data: bytes) -> bool:
        got.append(data)
        return False

    async with raw_server(handler) as (url, _peers), UpstreamClient() as client:
        for n in range(2):
            consuming.clear()
            got.clear()
            ex = await client.post(url, b"", {})
            ex.consume(keep)
            consuming.set()
            if n == 0:
                assert await ex.wait() is True
                ex.release()
            else:
                with pytest.raises(BadResponse):
                    await ex.wait()  # the pieces before the bad bytes were handed over first
                ex.abort()
            assert got == [b"data: 1\n\ndata: 2\n\ndata: 3\n\n"]


async def test_a_consumer_that_asks_to_pause_stops_the_reads_until_resume() -> None:
    all_sent = asyncio.Event()

    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(20):
            w.write(b"%x\r\n%b\r\n" % (2, b"%02d" % i))
            await w.drain()
            await asyncio.sleep(0.005)  # paced like a token stream
        w.write(b"0\r\n\r\n")
        await w.drain()
        all_sent.set()

    async with raw_server(handler) as (url, peers), UpstreamClient() as client:
        ex = await client.post(url, b"", {})
        got: list[bytes] = []

        def consumer(data: bytes) -> bool:
            got.append(data)
            return len(got) == 1  # a full client after the first piece

        ex.consume(consumer)
        assert await ex.wait() is False  # paused
        held = len(got)
        await asyncio.wait_for(all_sent.wait(), WAIT_S)
        await loop_turns(10)  # the rest sits in the socket: a reading client would have it by now
        assert len(got) == held
        ex.resume()
        assert await ex.wait() is True
        assert b"".join(got) == b"".join(b"%02d" % i for i in range(20))
        ex.release()
        # A consumer that pauses at every piece, the last one included: the connection goes back to the
        # pool reading again, and the next call on it gets its answer.
        ex = await client.post(url, b"", {})
        pieces: list[bytes] = []

        def pause_at_every_piece(data: bytes) -> bool:
            pieces.append(data)
            return True

        ex.consume(pause_at_every_piece)
        while not await ex.wait():
            ex.resume()
        ex.release()
        ex = await client.post(url, b"", {}, read_timeout=2)
        assert len(await ex.read()) == 40
        ex.release()
        assert len(peers) == 3 and len(set(peers)) == 1


async def test_cancelling_a_call_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"2\r\nhi\r\n")
        await r.read()  # returns when the client closes
        closed.set()

    async with raw_server(handler) as (url, _), UpstreamClient() as client:
        ex = await client.post(url, b"", {})
        task = asyncio.create_task(ex.read())
        await loop_turns(1)  # the read starts and waits for the rest of the body
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ex.abort()
        await asyncio.wait_for(closed.wait(), WAIT_S)


async def test_https_arms_are_called_over_tls() -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + await request.read() + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_ctx).start()
    try:
        async with UpstreamClient(ssl_context=client_ctx) as client:
            for _ in range(2):  # the second call reuses the TLS connection
                ex = await client.post(f"https://127.0.0.1:{port}/v1/completions", b"{}", {})
                assert (ex.status, await ex.read()) == (200, b"data: {}\n\n")
                ex.release()
        async with UpstreamClient() as client:  # the system's CAs do not know this one
            with pytest.raises(ssl.SSLError):
                await client.post(f"https://127.0.0.1:{port}/v1/completions", b"{}", {})
    finally:
        await runner.cleanup()
