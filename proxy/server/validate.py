"""What the proxy checks in a client's completion request before it routes it anywhere.

:func:`read_request` reads the body (size limit, Content-Encoding), parses it (a JSON object, nested
at most :data:`MAX_JSON_DEPTH` deep) and reads the proxy's own headers (request id, category,
concurrency level or offered rate), made safe to forward. Anything wrong raises
:class:`Rejected` with the status and a sentence for the client.

A rejected request is answered with an OpenAI-shaped 4xx and counted in
``specproxy_client_errors_total{status}``; it gets no span, like every request refused before
routing: a span records an upstream call, and none was made.

Example::

    try:
        req = await read_request(request, max_body_bytes=exp.max_body_bytes)
    except Rejected as exc:
        return openai_error(exc.status, exc.message)
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import HttpVersion11, web

from specproxy.proxy.server.errors import error_body
from specproxy.proxy.spans.random_ids import uuid4_hex
from specproxy.proxy.upstream.calls import (
    CATEGORY_HEADER,
    CONCURRENCY_HEADER,
    OFFERED_RATE_HEADER,
    REQUEST_ID_HEADER,
    ROUND_HEADER,
)
from specproxy.proxy.upstream.wire import header_safe

# Deeper JSON is refused. orjson cannot serialise past 254 levels (the body is serialised again for
# each arm) and no OpenAI request needs more than a few dozen (structured-output schemas allow 10).
MAX_JSON_DEPTH = 128


class Rejected(Exception):
    """The client's request is refused with ``status`` and ``message`` (OpenAI-shaped)."""

    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close  # the connection cannot carry another request: close it after the answer


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A completion request that passed the checks."""

    body: dict[str, Any]
    request_id: str  # the client's X-Request-Id as a valid header value, else a new one
    category: str | None  # X-Specproxy-Category as text (bytes that are not UTF-8 replaced)
    concurrency_level: int | None  # X-Specproxy-Concurrency-Level
    offered_rate: float | None = None  # X-Specproxy-Offered-Rate (requests/s)
    round: int | None = None  # X-Specproxy-Round


async def read_request(
    request: web.Request, *, max_body_bytes: int, body_timeout_s: float | None = None
) -> ClientRequest:
    """The request's body, checked (see the module docstring); raises :class:`Rejected`.
    ``body_timeout_s``: the whole body must have arrived by then (408 otherwise)."""
    try:
        if request.content.is_eof():
            # The whole body came with the headers (most requests): reading it cannot wait, so no
            # timer is armed for it.
            raw = await _read_body(request, max_body_bytes)
        else:
            async with asyncio.timeout(body_timeout_s):
                raw = await _read_body(request, max_body_bytes)
    except TimeoutError as exc:
        request.content.feed_eof()  # (aiohttp would otherwise wait for the rest after the answer)
        raise Rejected(
            408, f"the request body did not arrive within {body_timeout_s:g} s", close=True
        ) from exc
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Rejected(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise Rejected(400, "request body must be a JSON object")
    # Every level of nesting opens a bracket: a body with few brackets cannot be too deep (a count in
    # C, where the walk below is Python over every container).
    if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH and json_depth_over(body, MAX_JSON_DEPTH):
        raise Rejected(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
    headers = request.headers
    # The request id goes back to the client and on to every arm in headers: it must be one.
    request_id = header_safe(headers.get(REQUEST_ID_HEADER) or "") or uuid4_hex()
    category = headers.get(CATEGORY_HEADER)
    if category is not None:
        category = category.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return ClientRequest(
        body,
        request_id,
        category or None,
        _counter_header(headers, CONCURRENCY_HEADER),
        _offered_rate(headers),
        _counter_header(headers, ROUND_HEADER),
    )


def _counter_header(headers: Mapping[str, str], name: str) -> int | None:
    """A header holding a count from 1 (replay's concurrency level, its round); None when absent."""
    text = headers.get(name)
    if text is None:
        return None
    # ASCII digits only: int() would also take "1_000", "+5" and digits of other scripts.
    if not (text.isascii() and text.isdigit() and len(text) <= 7 and int(text) >= 1):
        raise Rejected(400, f"header {name} must be an integer from 1 to 9999999")
    return int(text)


def _offered_rate(headers: Mapping[str, str]) -> float | None:
    text = headers.get(OFFERED_RATE_HEADER)
    if text is None:
        return None
    try:
        rate = float(text) if text.isascii() and len(text) <= 32 else math.nan
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise Rejected(400, f"header {OFFERED_RATE_HEADER} must be a number of requests/s > 0")
    return rate


def expect_handler(max_body_bytes: int) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """aiohttp's ``Expect`` handling, answered in OpenAI's shape: ``100-continue`` only for a body
    within the limit (413 before the client sends it otherwise), 417 for any other expectation."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        expectation = request.headers.get("Expect", "")
        if expectation.lower() != "100-continue":
            return _refusal(request, 417, "unsupported Expect header (only 100-continue)")
        length = request.content_length
        if length is not None and length > max_body_bytes:
            return _refusal(
                request,
                413,
                f"request body is {length} bytes; the limit is {max_body_bytes} "
                "(max_body_bytes in the experiment file)",
            )
        if request.version >= HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # (as aiohttp's own handler: the response has not begun)
        return None

    return expect


def _refusal(request: web.Request, status: int, message: str) -> web.Response:
    # The body will not come (the client waits for 100 Continue): end it, so that aiohttp does not
    # wait for it after the answer, and close the connection, which cannot be reused.
    request.content.feed_eof()
    resp = web.Response(status=status, body=error_body(status, message), content_type="application/json")
    resp.force_close()
    return resp


async def _read_body(request: web.Request, max_body_bytes: int) -> bytes:
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise Rejected(
            413,
            f"request body is {length} bytes; the limit is {max_body_bytes} "
            "(max_body_bytes in the experiment file)",
        )
    try:
        # A body that came whole with its headers (most requests) is taken as it is, without the read
        # loop's awaits; the size check below then does what aiohttp's client_max_size does in read().
        raw = request.content.read_nowait() if request.content.is_eof() else await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise Rejected(413, _over_the_limit(max_body_bytes)) from exc
    except web.RequestPayloadError as exc:
        # Content-Encoding that the body does not have (aiohttp decodes it while reading), or a body
        # cut short: the client's mistake, not ours.
        encoding = request.headers.get("Content-Encoding")
        cause = exc.__cause__ or exc
        what = f" (Content-Encoding: {encoding})" if encoding else ""
        # The rest of the body cannot be read either: end it here, so that aiohttp does not try to
        # read (and fail on) it again after the answer, and close the connection.
        request.content.feed_eof()
        raise Rejected(400, f"request body could not be read{what}: {cause}", close=True) from exc
    if len(raw) > max_body_bytes:
        raise Rejected(413, _over_the_limit(max_body_bytes))
    return raw


def _over_the_limit(max_body_bytes: int) -> str:
    return f"request body is over the limit of {max_body_bytes} bytes (max_body_bytes in the experiment file)"


def json_depth_over(value: Any, limit: int) -> bool:
    """True when ``value`` (parsed JSON) nests containers more than ``limit`` deep.

    >>> json_depth_over({"a": [1, [2]]}, 3), json_depth_over({"a": [1, [2]]}, 2)
    (False, True)
    """
    level: list[Any] = [value]
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        deeper: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                deeper.extend(v for v in item.values() if isinstance(v, dict | list))
            elif isinstance(item, list):
                deeper.extend(v for v in item if isinstance(v, dict | list))
        level = deeper
    return False
