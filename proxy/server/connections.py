"""The proxy's client connections: what bad HTTP gets.

:class:`ProxyRunner` is aiohttp's ``AppRunner`` with this rule added where aiohttp's server makes
a protocol per connection (:class:`GuardedRequestHandler`):

- **Bad HTTP** (a request line or headers aiohttp cannot parse, too long or too many headers, a bad
  Transfer-Encoding, TLS on the plain port) gets one log line, without a traceback, and an
  OpenAI-shaped JSON answer before the connection closes.

Example::

    runner = ProxyRunner(app, shutdown_timeout=30)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 8000).start()
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from specproxy.proxy.server.errors import error_body

log = logging.getLogger(__name__)


class GuardedRequestHandler(web.RequestHandler):
    """aiohttp's protocol for one client connection, answering bad HTTP in OpenAI's shape with one
    log line."""

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError):
            # The client's bytes are not HTTP we accept: its problem, one line for the operator.
            status = exc.code if 400 <= exc.code < 500 else status
            what = " ".join((exc.message or str(exc)).split())[:200]
            log.info("bad HTTP from %s: %d %s", request.remote, status, what)
            text = f"bad HTTP request: {what}"
        else:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            text = "internal error in specproxy (see its log)"
        if request.writer.output_size > 0:
            raise ConnectionError("a response is under way; cannot send another")
        resp = web.Response(status=status, body=error_body(status, text), content_type="application/json")
        resp.force_close()
        return resp


class _GuardedServer(web.Server):
    """aiohttp's server, building :class:`GuardedRequestHandler` protocols."""

    def __init__(self, base: web.Server) -> None:
        # Take over the server aiohttp built for the application (its handler, factory, options).
        self.__dict__.update(base.__dict__)

    def __call__(self) -> web.RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)


class ProxyRunner(web.AppRunner):
    """``web.AppRunner`` with the client-connection rules of this module (see its docstring)."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs.setdefault("handler_cancellation", True)
        kwargs.setdefault("access_log", None)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        return _GuardedServer(await super()._make_server())
