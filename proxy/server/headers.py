"""Which headers cross the proxy, each way, as an HTTP proxy relays them (RFC 9110 §7.6.1).

A client's end-to-end request headers go on to every arm the request is sent to (the one that serves
it and each copy); the serving arm's response headers come back to the client. Left out both ways:

- the hop-by-hop headers, which describe one connection, not the message: ``Connection`` and every
  header it names, ``Keep-Alive``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade`` and every
  ``Proxy-*`` header;
- the headers the proxy sets itself (:data:`REQUEST_DENY`, :data:`RESPONSE_DENY`, each with its
  reason): ``Host`` and ``Content-Length`` are the arm's and the body's, the client's
  ``Authorization`` is the proxy's own key (each arm gets its ``api_key_env`` instead), and so on.

Both filters run once per client request (not per arm, not per chunk).

Example::

    to_arms = request_headers_for_arms(request.headers)      # passed to call_arm(headers=...)
    to_client = response_headers_for_client(ex.header_items)  # the client's response headers
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

# Connection-scoped headers (RFC 9110 §7.6.1; Proxy-Connection and Keep-Alive are the pre-standard
# ones it names). Every header a Connection header lists is dropped too, as is any Proxy-* header.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "proxy-connection"}
)

# Request headers that never reach an arm, lower-case name → why.
REQUEST_DENY: Mapping[str, str] = {
    "host": "set from the arm's URL",
    "content-length": "recomputed: the body is encoded again for each arm",
    "content-type": "the proxy sends application/json",
    "content-encoding": "the proxy has decoded the body",
    "accept-encoding": "the proxy reads the response, so it asks for identity",
    "authorization": "the proxy's own key (SPECPROXY_API_KEY); an arm gets its api_key_env",
    "expect": "the proxy has read the whole body already",
    "x-request-id": "the proxy sends its request id (as a UUID) to every arm",
    "traceparent": "each call sends its own span's context",
}
# Request headers with this prefix are the proxy's own labels (category, level, round): it reads them
# and sends what arms need itself.
PROXY_PREFIX = "x-specproxy-"

# Response headers that never reach the client, lower-case name → why.
RESPONSE_DENY: Mapping[str, str] = {
    "content-length": "recomputed: the proxy may strip what it asked for from the body",
    "date": "the proxy's own (as nginx does)",
    "server": "the proxy's own (as nginx does)",
    "x-request-id": "the proxy's request id, the one its spans carry",
    "x-specproxy-arm": "the proxy names the arm that served",
}


def _connection_named(headers: Iterable[tuple[str, str]]) -> set[str]:
    """The lower-case names a message's Connection headers list (``Connection: close, X-Foo``)."""
    named: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            named.update(token.strip().lower() for token in value.split(","))
    return named


def _end_to_end(headers: Iterable[tuple[str, str]], deny: Mapping[str, str]) -> CIMultiDict[str]:
    items = list(headers)
    named = _connection_named(items)
    kept: CIMultiDict[str] = CIMultiDict()
    for name, value in items:
        low = name.lower()
        if low in HOP_BY_HOP or low in deny or low in named or low.startswith("proxy-"):
            continue
        kept.add(name, value)
    return kept


def request_headers_for_arms(headers: Iterable[tuple[str, str]] | Mapping[str, str]) -> CIMultiDict[str]:
    """The client's request headers an arm gets (the proxy adds its own to them).

    >>> dict(request_headers_for_arms({"User-Agent": "x", "Connection": "X-Hop", "X-Hop": "1",
    ...                                "Authorization": "Bearer proxy-key", "X-Tenant": "t"}))
    {'User-Agent': 'x', 'X-Tenant': 't'}
    """
    items = headers.items() if isinstance(headers, Mapping) else headers
    return _end_to_end((kv for kv in items if not kv[0].lower().startswith(PROXY_PREFIX)), REQUEST_DENY)


def response_headers_for_client(headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The serving arm's response headers the client gets (the proxy adds its own to them).

    >>> dict(response_headers_for_client([("cache-control", "no-store"), ("transfer-encoding", "chunked"),
    ...                                   ("content-length", "12"), ("retry-after", "1")]))
    {'cache-control': 'no-store', 'retry-after': '1'}
    """
    return _end_to_end(headers, RESPONSE_DENY)
