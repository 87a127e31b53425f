"""The client's side of a relayed call: :class:`ClientRelay` writes an upstream response to the client."""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from specproxy.proxy.server.errors import error_body, openai_error
from specproxy.proxy.server.headers import response_headers_for_client
from specproxy.proxy.server.shutdown import CLIENT_MESSAGE
from specproxy.proxy.upstream.calls import CallResult
from specproxy.proxy.upstream.relay import ClientGone


class ClientRelay:
    """Writes an upstream response to the client: SSE as it arrives, anything else in one piece.

    A stream's bytes go straight to the client's socket from the upstream connection's read callback
    (see :class:`~specproxy.proxy.upstream.relay.Relay`): aiohttp sends the headers and, at the end, the last
    chunk; in between this class frames each piece as an HTTP chunk itself, since a coroutine per
    relayed token (``StreamResponse.write``) costs more CPU than everything else the proxy does for it.
    """

    __slots__ = ("request", "own", "headers", "response", "writer", "chunked", "status", "parts")

    def __init__(self, request: web.Request, headers: dict[str, str]) -> None:
        self.request = request
        self.own = headers  # the proxy's headers (request id, arm)
        self.headers: CIMultiDict[str] = CIMultiDict()  # the response's: the arm's, then the proxy's
        self.response: web.StreamResponse | None = None
        self.writer: AbstractStreamWriter | None = None
        self.chunked = False
        self.status = 0
        self.parts: list[bytes] = []

    async def start(self, status: int, content_type: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.status = status
        self.headers = response_headers_for_client(headers)
        self.headers.update(self.own)
        self.headers["Content-Type"] = content_type or "application/octet-stream"  # as sent (or none)
        if content_type.split(";", 1)[0].strip().lower() == "text/event-stream":
            self.headers.setdefault("Cache-Control", "no-cache")
            resp = web.StreamResponse(status=status, headers=self.headers)
            if self.request.version >= aiohttp.HttpVersion11:
                resp.enable_chunked_encoding()  # (an HTTP/1.0 client gets the body until close)
            writer = await resp.prepare(self.request)
            assert writer is not None
            writer.send_headers()  # aiohttp holds them for the first write(), which send() bypasses
            self.response, self.writer, self.chunked = resp, writer, resp.chunked

    def send(self, data: bytes) -> bool:
        if self.response is None:
            self.parts.append(data)
            return False
        if not data:
            return False  # (an empty chunk would end the body)
        protocol = self.request.protocol
        transport = protocol.transport
        if transport is None or transport.is_closing():
            raise ClientGone()
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        return protocol.writing_paused

    async def drain(self) -> None:
        if self.writer is not None:
            await self.writer.drain()

    async def finish(self, result: CallResult | None) -> web.StreamResponse:
        """The response to return from the handler, completing a stream or building a plain one."""
        rec = result.record if result is not None else None
        gone = result is not None and result.client_gone
        if self.response is not None:
            if rec is not None and not gone and rec.status not in ("ok", "http_error"):
                # A failure mid-stream: tell the client in the stream (the OpenAI client raises on it),
                # then end the stream cleanly.
                status = 504 if rec.status == "timeout" else 502
                msg = f"upstream {rec.arm} failed mid-stream: {rec.error or rec.status}"
                if rec.status == "proxy_shutdown":
                    status, msg = 503, CLIENT_MESSAGE
                try:
                    await self.response.write(b"data: " + error_body(status, msg) + b"\n\n")
                except ConnectionError:  # (aiohttp's ClientConnectionResetError is one)
                    pass
            try:
                await self.response.write_eof()
            except ConnectionError:  # (aiohttp's ClientConnectionResetError is one)
                pass
            return self.response
        if self.status:
            return web.Response(status=self.status, body=b"".join(self.parts), headers=self.headers)
        if rec is not None and rec.status == "proxy_shutdown":
            return openai_error(503, CLIENT_MESSAGE, headers={**self.own, "Retry-After": "1"})
        if rec is not None and rec.status == "timeout":
            return openai_error(504, f"upstream {rec.arm} timed out: {rec.error}", headers=self.own)
        arm = rec.arm if rec is not None else "?"
        error = rec.error if rec is not None else "no response"
        return openai_error(502, f"upstream {arm} failed: {error}", headers=self.own)
