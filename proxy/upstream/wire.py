"""A lean HTTP/1.1 client for calls to arms: the proxy's hot path, with no task switch per chunk.

A streamed completion arrives as one small HTTP chunk per token. A general-purpose client (aiohttp's)
hands each one to the reading coroutine through a buffer and a future: one task wake-up, one timer
re-arm and several Python frames per token, which on a machine with few cores costs as much CPU as the
generation it relays. Here each call is an :class:`Exchange` on a pooled keep-alive connection
(an ``asyncio.Protocol``): ``httptools`` (llhttp, the parser uvicorn uses) decodes the response, and
the body pieces of each read go straight from ``data_received`` to the caller's consumer callback, in
one piece (a busy proxy finds several chunks per read: one call and one client write for them all),
which can parse it and write it to the client's socket in the same call. The reading coroutine wakes
only at the end of the body, or when the consumer asks to wait (the client's socket is full:
backpressure).

What it does, and nothing more: POST with a body, keep-alive connection reuse (LIFO, idle connections
expire after ``keepalive_s``; a reused connection that dies before answering is retried once on a new
one, which is what a server closing an idle connection looks like), ``Content-Length``, chunked and
read-until-close bodies, https, and a read timeout that bounds every wait for the next bytes (one timer
per timeout period, not one per read).

Example::

    client = UpstreamClient()
    ex = await client.post("http://127.0.0.1:8000/v1/chat/completions", body, {"Content-Type": ...},
                           connect_timeout=10, read_timeout=600)
    ex.status, ex.content_type
    ex.consume(lambda data: print(data) or False)     # True from the consumer: pause until resume()
    while not await ex.wait():                        # False: the consumer asked to pause
        ...; ex.resume()
    ex.release()                                      # the connection goes back to the pool
    await client.close()
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import quote, urlsplit

import httptools

from specproxy import __version__

# Called with each piece of the decoded body; returns True to pause reading (see Exchange.wait).
Consumer = Callable[[bytes], bool]

USER_AGENT = f"specproxy/{__version__}"


def header_safe(value: str) -> str:
    """``value`` as a header value any HTTP server accepts: printable ASCII as it is, anything else
    percent-encoded from its UTF-8 bytes (undecodable bytes kept as surrogates count as themselves).

    >>> header_safe("req-1"), header_safe("日本")
    ('req-1', '%E6%97%A5%E6%9C%AC')
    """
    if value.isascii() and value.isprintable():
        return value
    return quote(value.encode("utf-8", "surrogateescape"), safe=_PRINTABLE_ASCII)


_PRINTABLE_ASCII = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


class UpstreamReadTimeout(TimeoutError):
    """No bytes from the upstream for the read timeout (before its headers, or between body reads)."""


class UpstreamDisconnected(ConnectionError):
    """The upstream closed the connection before the response was complete."""


class BadResponse(ValueError):
    """The upstream's bytes are not an HTTP/1.x response."""


# The most a response body read whole (a JSON answer, an error body) may hold: vLLM's largest real
# answers (n choices with logprobs) are a few MiB; past this the exchange ends with BodyTooLarge.
MAX_BODY_BYTES = 64 * 1024 * 1024


class BodyTooLarge(ValueError):
    """A response body read whole grew past its cap (:data:`MAX_BODY_BYTES`)."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a URL's requests go (the pool key), and the Host header they carry."""

    scheme: str
    host: str
    port: int
    host_header: str

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        default = port == (443 if parts.scheme == "https" else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return cls(parts.scheme, parts.hostname, port, host if default else f"{host}:{port}")


class Exchange:
    """One request and its response on one connection. Made by :meth:`UpstreamClient.post`, which
    returns it once the response headers are in; the body is then read with :meth:`consume` +
    :meth:`wait`, or :meth:`read`. End it with :meth:`release` (reuse the connection when the body was
    read to its end) or :meth:`abort` (close it: vLLM then aborts the generation)."""

    __slots__ = (
        "status",
        "headers",
        "header_items",
        "content_type",
        "_conn",
        "_head",
        "_done",
        "_waiter",
        "_consumer",
        "_early",
        "_keep_alive",
        "_framed",
        "_got_bytes",
    )

    def __init__(self, conn: _Connection) -> None:
        loop = conn.loop
        self.status = 0
        self.headers: dict[str, str] = {}  # lower-case names; a repeated header keeps its last value
        self.header_items: list[tuple[str, str]] = []  # every header as sent, lower-case names, in order
        self.content_type = ""  # the media type, lower-case, without parameters (like aiohttp's)
        self._conn = conn
        self._head: asyncio.Future[None] = loop.create_future()
        self._done: asyncio.Future[None] = loop.create_future()
        self._waiter: asyncio.Future[None] | None = None
        self._consumer: Consumer | None = None
        self._early: list[bytes] = []  # body bytes that arrived before consume()
        self._keep_alive = False
        self._framed = False  # Content-Length or chunked: the end of the body is known
        self._got_bytes = False

    # -- the caller's side ------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """The whole body has arrived."""
        return self._done.done() and self._done.exception() is None

    def consume(self, consumer: Consumer) -> None:
        """Hand every body piece to ``consumer`` from now on (what already arrived, first)."""
        self._consumer = consumer
        early, self._early = self._early, []
        for data in early:  # (a pause stops the socket reads; what was already read is handed over)
            if self._done.done() and self._done.exception() is not None:
                break
            self._deliver(data)

    async def wait(self) -> bool:
        """Until the body has ended (True) or the consumer asked to pause (False: call :meth:`resume`
        when ready for more). Raises what ended the exchange: :class:`UpstreamReadTimeout`,
        :class:`UpstreamDisconnected`, a consumer's exception."""
        if self._done.done():
            self._done.result()
            return True
        if self._conn.reading_paused:
            return False
        waiter = self._waiter = self._conn.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._done.done():
            self._done.result()
            return True
        return False

    def resume(self) -> None:
        self._conn.resume_reading()

    async def read(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The whole body; :class:`BodyTooLarge` (the connection closed) once it passes ``limit`` bytes."""
        parts: list[bytes] = []
        size = 0

        def keep(data: bytes) -> bool:
            nonlocal size
            size += len(data)
            if size > limit:
                raise BodyTooLarge(f"a response body over {limit} bytes")
            parts.append(data)
            return False

        self.consume(keep)
        await self.wait()
        if size > limit:  # (raised in keep too, but lost there when the body had already ended)
            raise BodyTooLarge(f"a response body over {limit} bytes")
        return b"".join(parts)

    def release(self) -> None:
        """Done with it: the connection goes back to the pool when it can be reused, else closes."""
        if self.complete and self._keep_alive and self._framed:
            self._conn.release()
        else:
            self._conn.close()

    def abort(self) -> None:
        self._conn.close()

    # -- the connection's side --------------------------------------------------------------------

    def _on_headers(self, status: int, items: list[tuple[str, str]], http11: bool) -> None:
        self.status = status
        self.header_items = items
        self.headers = headers = dict(items)
        self.content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        connection = headers.get("connection", "").lower()
        self._keep_alive = http11 and "close" not in connection
        self._framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "")
        if not self._head.done():
            self._head.set_result(None)

    def _on_body(self, data: bytes) -> None:
        if self._consumer is None:
            self._early.append(data)
        else:
            self._deliver(data)

    def _deliver(self, data: bytes) -> None:
        assert self._consumer is not None
        try:
            pause = self._consumer(data)
        except BaseException as exc:  # the consumer's failure ends the exchange (ClientGone, a bug)
            self._fail(exc)
            self._conn.close()
            return
        if pause and not self._conn.reading_paused and not self._done.done():
            self._conn.pause_reading()
            self._wake()

    def _on_complete(self) -> None:
        if not self._done.done():
            self._done.set_result(None)
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._head.done():
            self._head.set_exception(exc)
        if not self._done.done():
            self._done.set_exception(exc)
            self._done.exception()  # retrieved: an exchange abandoned after its headers logs nothing
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an origin; carries one :class:`Exchange` at a time."""

    def __init__(self, client: UpstreamClient, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.origin = origin
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.idle_since = 0.0
        self.reused = False
        self.reading_paused = False
        self._header_items: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []  # the body pieces of the read being parsed
        self._read_timeout: float | None = None
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports are not subclasses)

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None or self.parser is None:
            self.close()  # bytes nobody asked for: this connection cannot be trusted with a request
            return
        self._last_read = time.perf_counter()
        ex._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._hand_over_body()
            ex._fail(BadResponse(f"malformed HTTP response from {self.origin.host_header}: {exc}"))
            self.close()
            return
        if self._body:
            self._hand_over_body()

    def _hand_over_body(self) -> None:
        """The body pieces of one read as one piece: a read that holds several HTTP chunks (several
        stream events) costs the consumer one call, and the client one write. Nothing waits for more
        data: what one read brought is handed over before the next read."""
        pieces, ex = self._body, self.exchange
        if not pieces:
            return
        self._body = []
        if ex is not None:
            ex._on_body(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._stop_timer()
        self.client._forget(self)
        ex = self.exchange
        if ex is None or ex._done.done():
            return
        if ex._head.done() and not ex._framed:
            ex._on_complete()  # a body that runs until the connection closes: this is its end
            return
        reason = f": {exc}" if exc else ""
        ex._fail(
            UpstreamDisconnected(
                f"{self.origin.host_header} closed the connection before the response was complete{reason}"
            )
        )

    def pause_writing(self) -> None:  # request bodies are written in one piece; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_items.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None and self.exchange is not None
        status = self.parser.get_status_code()
        items, self._header_items = self._header_items, []
        if 100 <= status < 200:
            return  # an interim response (100 Continue): the real one follows
        headers = [(n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in items]
        self.exchange._on_headers(status, headers, self.parser.get_http_version() == "1.1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)  # handed over at the end of the read (see _hand_over_body)

    def on_message_complete(self) -> None:
        self._hand_over_body()
        ex = self.exchange
        if ex is not None and ex._head.done():
            self._stop_timer()
            ex._on_complete()

    # -- the client's side --------------------------------------------------------------------------

    def start(self, request: bytes, read_timeout: float | None) -> Exchange:
        assert self.transport is not None
        # The request first: nothing can be read before the loop runs again, so what reads the
        # response (exchange, parser, read timer) need not delay it.
        self.transport.write(request)
        ex = self.exchange = Exchange(self)
        self.parser = httptools.HttpResponseParser(self)
        self._read_timeout = read_timeout
        self._last_read = time.perf_counter()
        if read_timeout is not None:
            self._timer = self.loop.call_later(read_timeout, self._check_read)
        return ex

    def _check_read(self) -> None:
        """The read timeout: fires at most once per period; each read only stores its time."""
        self._timer = None
        ex, timeout = self.exchange, self._read_timeout
        if ex is None or timeout is None or ex._done.done():
            return
        idle = time.perf_counter() - self._last_read
        if self.reading_paused:  # waiting on the client, not on the upstream: check again later
            self._timer = self.loop.call_later(timeout, self._check_read)
            return
        if idle < timeout:
            self._timer = self.loop.call_later(timeout - idle, self._check_read)
            return
        ex._fail(UpstreamReadTimeout(f"no bytes from {self.origin.host_header} for {timeout:g} s"))
        self.close()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def pause_reading(self) -> None:
        if self.transport is not None and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and self.reading_paused:
            self.reading_paused = False
            self._last_read = time.perf_counter()
            self.transport.resume_reading()

    def release(self) -> None:
        self._stop_timer()
        self.exchange = None
        self.parser = None
        if self.transport is None or self.transport.is_closing():
            return
        self.resume_reading()  # (paused on the body's last piece: the next call must be read)
        self.reused = True
        self.client._park(self)

    def close(self) -> None:
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
            self.client._forget(self)


class UpstreamClient:
    """Pooled keep-alive HTTP/1.1 connections to arms; :meth:`post` starts one call."""

    def __init__(self, *, keepalive_s: float = 15.0, ssl_context: ssl.SSLContext | None = None) -> None:
        """``ssl_context``: for https arms (default: the system's CAs, which honour ``SSL_CERT_FILE``)."""
        self.keepalive_s = keepalive_s
        self._targets: dict[str, tuple[Origin, str]] = {}  # url -> (origin, request target)
        self._idle: dict[Origin, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._ssl = ssl_context
        self._closed = False

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        connect_timeout: float | None = 10.0,
        read_timeout: float | None = None,
    ) -> Exchange:
        """Send ``body`` and return the exchange once the response headers are in. Raises
        ``OSError`` (refused, unreachable), ``TimeoutError`` (connect or read timeout),
        :class:`UpstreamDisconnected` or :class:`BadResponse`."""
        if self._closed:
            raise RuntimeError("UpstreamClient is closed")
        known = self._targets.get(url)
        if known is None:
            parts = urlsplit(url)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            known = self._targets[url] = (Origin.of(url), target)
        origin, target = known
        request = self._request_bytes(origin, target, body, headers)
        for attempt in range(2):
            idle = self._idle_connection(origin) if attempt == 0 else None
            conn = idle or await self._connect(origin, connect_timeout)
            self._busy.add(conn)
            ex = conn.start(request, read_timeout)
            try:
                await ex._head
                return ex
            except UpstreamDisconnected:
                conn.close()
                # A reused connection the server closed while idle, before reading our request: try
                # once more on a fresh one. A fresh connection that fails is the upstream's answer.
                if not conn.reused or ex._got_bytes:
                    raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _request_bytes(self, origin: Origin, target: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        lines = [
            f"POST {target} HTTP/1.1",
            f"Host: {origin.host_header}",
            f"Content-Length: {len(body)}",
            "Accept-Encoding: identity",
        ]
        if "User-Agent" not in headers:  # (a client's, relayed by the proxy, replaces ours)
            lines.append(f"User-Agent: {USER_AGENT}")
        # Values the caller took from a client (request id, category) may hold anything: what is not
        # printable ASCII is percent-encoded rather than sent as bytes a server may reject or mangle.
        lines += (f"{name}: {header_safe(value)}" for name, value in headers.items())
        return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if (
                conn.transport is not None
                and not conn.transport.is_closing()
                and now - conn.idle_since < self.keepalive_s
            ):
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin, timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if origin.scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        async with asyncio.timeout(timeout):
            # (asyncio and uvloop set TCP_NODELAY on TCP connections: each request leaves at once.)
            _, conn = await loop.create_connection(
                lambda: _Connection(self, origin, loop), origin.host, origin.port, ssl=context
            )
        return conn

    def _park(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        """Close every connection, idle or busy (calls still running fail)."""
        self._closed = True
        for conns in list(self._idle.values()):
            for conn in list(conns):
                conn.close()
        for conn in list(self._busy):
            conn.close()
        self._idle.clear()
        self._busy.clear()
