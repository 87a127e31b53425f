"""OpenAI-shaped error responses, and the middleware that turns every proxy-side failure into one.

OpenAI clients parse ``{"error": {"message", "type", "param", "code"}}``; returning that shape with the
right status makes the official client raise the matching exception (``BadRequestError`` for 400,
``NotFoundError`` for 404, ``APIStatusError`` for 502/504, ...).

Example::

    return openai_error(413, "request body is 40 MiB; the limit is 32 MiB (max_body_bytes)")
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(status: int, message: str, *, code: str | None = None) -> bytes:
    # A message may quote what a client sent, undecodable bytes included (kept by aiohttp as lone
    # surrogates, which JSON cannot hold): those are written as \udcXX escapes.
    if not message.isascii():
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "api_error"),
                "param": None,
                "code": code if code is not None else status,
            }
        }
    )


def openai_error(
    status: int, message: str, *, code: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    """An error response in OpenAI's shape."""
    return web.Response(
        status=status,
        body=error_body(status, message, code=code),
        content_type="application/json",
        headers=headers,
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def json_http_exceptions(request: web.Request, response: web.StreamResponse) -> None:
    """An ``on_response_prepare`` signal: an error aiohttp itself raises outside the middleware (an
    unsupported ``Expect`` on any path) gets OpenAI's shape instead of its plain text."""
    if isinstance(response, web.HTTPException) and response.status >= 400:
        text = (response.text or response.reason or "").strip()
        response.body = error_body(response.status, text)
        response.content_type = "application/json"


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """404, 405, 413 and anything unexpected from aiohttp's router become OpenAI-shaped errors."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"method {request.method} is not allowed on {request.path} (allowed: {allowed})"
        return openai_error(405, message, headers={"Allow": allowed})
    except web.HTTPNotFound:
        return openai_error(404, f"no such endpoint: {request.method} {request.path}")
    except web.HTTPRequestEntityTooLarge as exc:
        return openai_error(413, f"request body too large: {exc.text}")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return openai_error(exc.status, exc.reason)
    except Exception:
        log.exception("unexpected error handling %s %s", request.method, request.path)
        return openai_error(500, "internal error in specproxy (see its log)")
