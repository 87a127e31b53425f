"""The proxy's client connections: how many, how long they may take, what bad HTTP gets.

:class:`ProxyRunner` is aiohttp's ``AppRunner`` with three rules added where aiohttp's server makes
a protocol per connection (:class:`GuardedRequestHandler`):

- **A connection cap.** At most ``max_connections`` client connections are held (by default what
  the process's file limit allows, each request needing one socket per arm as well). A connection
  that arrives at the cap closes the oldest *idle* one: a connection waiting for a request head,
  never one carrying a request, so a client that is slow to read its stream is not touched. With
  none idle the newcomer gets a 503 in OpenAI's shape with ``Retry-After: 1``; the proxy then closes
  its side for writing and reads what the client sends until it closes (at most ``_LINGER_S``), so a
  client that had sent its whole request reads the 503 rather than a reset. Refusals are counted
  (``specproxy_client_connections_refused_total``) and logged at most once per ``_NOTICE_EVERY_S``,
  each line with the totals since the last. A slowloris (many connections dribbling header bytes) thus
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
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError

from specproxy.proxy.server.errors import error_body
from specproxy.proxy.server.metrics import METRICS

log = logging.getLogger(__name__)

# File descriptors kept for everything that is not a client connection (span store, logs, scrapes).
_RESERVED_FDS = 64
_NOTICE_EVERY_S = 10.0
_PEER_CHECK_S = 0.1  # how often a half-closed connection's socket is checked for the client's reset
_LINGER_S = 2.0  # how long a refused connection is read (and its bytes dropped) before it is closed


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
        self._last_notice: float | None = None
        self._since_notice = 0  # connections closed or refused at the cap since the last line

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
        self._since_notice += 1
        if self._last_notice is None or now - self._last_notice >= _NOTICE_EVERY_S:
            self._last_notice = now
            log.warning(
                "client connections at the limit of %d: %s (%d at the limit since the last such line; "
                "so far %d closed idle, %d refused; raise max_client_connections or the file limit "
                "if these are real clients)",
                self.max_connections,
                what,
                self._since_notice,
                self.evicted,
                self.refused,
            )
            self._since_notice = 0


_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%b"
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
        self._refused: asyncio.TimerHandle | None = None  # a refused connection's closing timer
        self._half_closed = False  # the client closed its side; its answer is still to come

    @property
    def busy(self) -> bool:
        """Carrying a request (reading its body, or writing its response)."""
        return bool(getattr(self, "_request_in_progress", False))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.connections.admit(self):
            self._refuse(transport)
            return
        super().connection_made(transport)

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        """The 503, then a lingering close: closing with the client's request unread would reset the
        connection, and a reset discards the 503 before the client reads it."""
        stream = cast(asyncio.WriteTransport, transport)  # (uvloop's transports are not subclasses)
        body = error_body(503, "the proxy is at its limit of client connections; retry shortly")
        stream.write(_REFUSAL % (len(body), body))
        if stream.can_write_eof():
            stream.write_eof()
        self._refused = asyncio.get_running_loop().call_later(_LINGER_S, stream.close)

    def data_received(self, data: bytes) -> None:
        if self._refused is None:
            super().data_received(data)  # (a refused connection's bytes are dropped)

    def eof_received(self) -> bool:  # type: ignore[override]
        """The client closed its side: no request can follow, but the one it sent still gets its
        answer before the connection closes (aiohttp's default closes at once, cancelling the
        handler). An idle or refused connection just closes.

        A client half-closed with ``shutdown(SHUT_WR)`` and one that closed its socket send the
        same FIN; only a write tells them apart (the second answers it with a reset). So an answer
        not begun is preceded by an interim ``100 Continue``, which every HTTP/1.1 client must accept
        before the final one, and the socket is then watched for the reset: a client that is gone
        still cancels its upstream call. A FIN once the answer is under way (the sync openai client
        closes after ``[DONE]``) ends the connection, as before."""
        if self._half_closed:
            return True  # (uvloop may report the EOF again)
        request = getattr(self, "_current_request", None)
        if self._refused is not None or self._idle() or self.transport is None:
            return False  # (nothing to answer: the transport closes)
        if request is not None and request.writer.output_size > 0:
            return False  # an answer under way: a client that stops sending mid-stream has left
        self.close()
        self._half_closed = True
        if request is None or request.version >= HttpVersion11:  # (no 1xx to an HTTP/1.0 client)
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._watch_peer()
        return True

    def _watch_peer(self) -> None:
        """Until the answer is sent: abort the connection once the socket holds a reset."""
        transport = self.transport
        if transport is None or transport.is_closing() or self._idle():
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            transport.abort()  # (connection_lost follows: the handler, and its upstream call, are cancelled)
            return
        asyncio.get_running_loop().call_later(_PEER_CHECK_S, self._watch_peer)

    def _idle(self) -> bool:
        """No request received and unanswered: none yet, or aiohttp waits for the next one. (Between
        the parse of a request and the start of its handler, neither ``busy`` nor a queued message
        says that one is under way.)"""
        if getattr(self, "_messages", None) or self.busy:
            return False
        return getattr(self, "_request_count", 0) == 0 or getattr(self, "_waiter", None) is not None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused is not None:
            self._refused.cancel()
            return
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
        self.connections = connections = ClientConnections(limits.max_connections)
        if METRICS in app:
            app[METRICS].watch_connections(lambda: (connections.evicted, connections.refused))

    async def _make_server(self) -> web.Server:
        return _GuardedServer(await super()._make_server(), self.connections)
