"""The proxy's client connections: how many, how long they may take, what bad HTTP gets.

:class:`ProxyRunner` is aiohttp's ``AppRunner`` with three rules added where aiohttp's server makes
a protocol per connection (:class:`GuardedRequestHandler`):

- **A connection cap.** At most ``max_connections`` client connections are held (by default what
  the process's file limit allows, each request needing one socket per arm as well). A connection
  that arrives at the cap closes the oldest *idle* one: a connection waiting for a request head,
  never one carrying a request, so a client that is slow to read its stream is not touched. With
  none idle the newcomer gets a 503. A slowloris (many connections dribbling header bytes) thus
  cannot starve real clients, and the process never runs out of file descriptors.
- **A header timeout.** A request head must be complete ``header_timeout_s`` after the connection
  opened or after its previous response (aiohttp's keep-alive timer, which runs only while the
  connection waits for a head). The body's timeout is the handler's (:mod:`.validate`).
- **Bad HTTP** (a request line or headers aiohttp cannot parse, too long or too many headers, a bad
  Transfer-Encoding, TLS on the plain port) gets one log line, without a traceback, and an
  OpenAI-shaped JSON answer before the connection closes.

Example::

    runner = ProxyRunner(app, ClientLimits(max_connections=1000, header_timeout_s=30), shutdown_timeout=30)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 8000).start()
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from specproxy.proxy.server.errors import error_body

log = logging.getLogger(__name__)

# File descriptors kept for everything that is not a client connection (span store, logs, scrapes).
_RESERVED_FDS = 64
_NOTICE_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class ClientLimits:
    max_connections: int
    header_timeout_s: float = 30.0


def default_max_connections(arms: int) -> int:
    """What the file limit allows: each client connection may need one upstream socket per arm.

    Raises the soft file limit to the hard one first (the usual 1024 is a historical default)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(1, (soft - _RESERVED_FDS) // (1 + arms))


class ClientConnections:
    """The open client connections, oldest first, and the cap on their number."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._open: OrderedDict[GuardedRequestHandler, None] = OrderedDict()
        self.evicted = 0
        self.refused = 0
        self._last_notice = 0.0

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, handler: GuardedRequestHandler) -> bool:
        """Count a new connection; at the cap close the oldest idle one, or refuse (False)."""
        if len(self._open) >= self.max_connections:
            idle = next((h for h in self._open if not h.busy), None)
            if idle is None:
                self.refused += 1
                self._notice("refused a new one (every connection is carrying a request)")
                return False
            self.evicted += 1
            self._notice("closed the oldest idle one")
            self.forget(idle)
            idle.force_close()
        self._open[handler] = None
        return True

    def forget(self, handler: GuardedRequestHandler) -> None:
        self._open.pop(handler, None)

    def _notice(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last_notice >= _NOTICE_EVERY_S:
            self._last_notice = now
            log.warning(
                "client connections at the limit of %d: %s (so far %d closed idle, %d refused; "
                "raise max_client_connections or the file limit if these are real clients)",
                self.max_connections,
                what,
                self.evicted,
                self.refused,
            )


_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%b"
)


# Where aiohttp's parser errors start quoting what the client sent (b'...', a caret line under it).
_QUOTE_STARTS = ("b'", 'b"', "'", '"', "\n")


def without_quoted_bytes(message: str) -> str:
    r"""What an HTTP parser error says was wrong, cut before the bytes it quotes: those may be an
    Authorization value or prompt text, and go neither to the log nor back in the error body.

    >>> without_quoted_bytes("Invalid header value char:\n\n  b'Authorization: Bearer sk-1\x01'")
    'Invalid header value char'
    """
    cut = min((i for i in map(message.find, _QUOTE_STARTS) if i >= 0), default=len(message))
    text = " ".join(message[:cut].split()).rstrip(" :,")
    return text[:120] or "unparseable request"


class GuardedRequestHandler(web.RequestHandler):
    """aiohttp's protocol for one client connection, counted by :class:`ClientConnections` and
    answering bad HTTP in OpenAI's shape with one log line."""

    def __init__(self, manager: web.Server, *, connections: ClientConnections, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.connections = connections

    @property
    def busy(self) -> bool:
        """Carrying a request (reading its body, or writing its response)."""
        return bool(getattr(self, "_request_in_progress", False))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.connections.admit(self):
            body = error_body(503, "the proxy is at its limit of client connections; retry shortly")
            transport.write(_REFUSAL % (len(body), body))  # type: ignore[attr-defined]
            transport.close()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.connections.forget(self)
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, web.RequestPayloadError | HttpProcessingError):
            # A body the client broke (a Content-Encoding it does not have, a bad chunk), met when
            # aiohttp drains it after the answer: the client's problem, one line.
            log.info("bad request body from a client: %s", without_quoted_bytes(str(exc)))
            return
        super().log_exception(*args, **kwargs)

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
            what = without_quoted_bytes(exc.message or str(exc))
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

    def __init__(self, base: web.Server, connections: ClientConnections) -> None:
        # Take over the server aiohttp built for the application (its handler, factory, options).
        self.__dict__.update(base.__dict__)
        self.client_connections = connections

    def __call__(self) -> web.RequestHandler:
        return GuardedRequestHandler(
            self, loop=self._loop, connections=self.client_connections, **self._kwargs
        )


class ProxyRunner(web.AppRunner):
    """``web.AppRunner`` with the client-connection rules of this module (see its docstring)."""

    def __init__(self, app: web.Application, limits: ClientLimits, **kwargs: Any) -> None:
        kwargs.setdefault("handler_cancellation", True)
        kwargs.setdefault("access_log", None)
        # aiohttp's keep-alive timer runs only while a connection waits for a request head.
        super().__init__(app, keepalive_timeout=limits.header_timeout_s, **kwargs)
        self.connections = ClientConnections(limits.max_connections)

    async def _make_server(self) -> web.Server:
        return _GuardedServer(await super()._make_server(), self.connections)
