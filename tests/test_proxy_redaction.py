"""No header value or body byte of a request reaches a log line or an error body.

Requests aiohttp's HTTP parser refuses (and ones the proxy refuses itself) carry planted secrets in
their header values and prompt markers in their bodies; the proxy's log lines, its 400 bodies, and the
span store are then searched for them."""

from __future__ import annotations

import logging
from pathlib import Path

import duckdb
import orjson
import pytest

from tests.proxies import one_arm_proxy
from tests.test_proxy_hardening import post, raw_exchange

SECRET = b"sk-PLANTEDsecret4711"
MARKER = b"PROMPTMARKERzebra"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": MARKER.decode()}]})
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
AUTH = b"Authorization: Bearer " + SECRET
LEAKY = [
    # an undecodable byte in a header value (aiohttp quotes the whole header line)
    HEAD + AUTH + b"\x01\r\nContent-Length: %d\r\n\r\n%b" % (len(BODY), BODY),
    # a header value over 8190 bytes (aiohttp quotes its start)
    HEAD + AUTH + b"A" * 9000 + b"\r\n\r\n",
    # a second request after `Connection: close` (aiohttp quotes the data after it)
    HEAD + b"Connection: close\r\nContent-Length: 0\r\n\r\n" + post("/v1/chat/completions", BODY, AUTH),
    # a request line with the secret in it, and a header name with one
    b"POST /v1/" + SECRET + b"\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    HEAD + SECRET + b"\x7f: x\r\n\r\n",
    # a chunked body that is not chunked (aiohttp quotes the chunk size line)
    HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + MARKER + b"\r\n" + BODY + b"\r\n0\r\n\r\n",
    # header values the proxy reads itself
    post("/v1/chat/completions", BODY, AUTH, b"Expect: " + SECRET),
    post("/v1/chat/completions", BODY, b"Content-Encoding: " + SECRET),
    post("/v1/chat/completions", BODY, b"X-Specproxy-Concurrency: " + SECRET),
    post("/v1/chat/completions", BODY, b"X-Specproxy-Offered-Rate: " + SECRET),
    post("/v1/chat/completions", b'{"messages": "' + MARKER + b"\xff"),
    post("/v1/chat/completions", b"[" * 200 + MARKER),
]


def planted(data: bytes) -> list[bytes]:
    return [w for w in (SECRET, MARKER, b"PLANTED", b"zebra") if w in data]


@pytest.mark.parametrize("request_bytes", LEAKY, ids=range(len(LEAKY)))
async def test_refused_requests_quote_no_header_value_or_body_byte(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, request_bytes: bytes
) -> None:
    caplog.set_level(logging.DEBUG)
    async with one_arm_proxy(tmp_path) as (p, base):
        out = await raw_exchange(p.url, request_bytes)
        assert out.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), out[:300]
        assert planted(out) == [], out[:500]
    logged = "\n".join(r.getMessage() + str(r.exc_info or "") for r in caplog.records).encode()
    assert planted(logged) == [], logged[-2000:]
    with duckdb.connect(str(p.db), read_only=True) as con:
        dumped = repr(con.execute("SELECT * FROM requests").fetchall()).encode()
    assert planted(dumped) == []
