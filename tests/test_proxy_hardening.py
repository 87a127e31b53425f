"""The proxy under hostile input: raw bytes on real sockets, broken backends, its own bad luck.

Each test sends what a careless or malicious client (or a broken backend) sends and checks that the
answer is an OpenAI-shaped error with the right status, never a 500 or a traceback, and that spans
say what happened.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.backends import BackendConfig, running_backend
from tests.proxies import one_arm_proxy, running_proxy, spans
from tests.test_proxy_app import shadow_arms

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def raw_exchange(url: str, request: bytes, *, read_timeout: float = 10.0) -> bytes:
    """Send ``request`` as it is on a new connection; return everything the server sent until it
    closed the connection (requests here ask for ``Connection: close``) or went quiet."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        out = b""
        while True:
            data = await asyncio.wait_for(reader.read(65536), read_timeout)
            if not data:
                return out
            out += data
    finally:
        writer.close()


def post(path: str, body: bytes, *headers: bytes) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: proxy", b"Connection: close"]
    head += [b"Content-Type: application/json", b"Content-Length: %d" % len(body), *headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def status_and_error(response: bytes) -> tuple[int, dict[str, Any]]:
    """The status of a raw HTTP/1.1 response and its OpenAI-shaped ``error`` object."""
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), response[:300]
    if b"transfer-encoding: chunked" in head.lower():
        body = body.split(b"\r\n", 2)[1]
    return status, orjson.loads(body)["error"]


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


async def test_an_api_key_of_undecodable_bytes_is_refused_not_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        running_backend(BackendConfig()) as base,
        running_proxy(tmp_path, [{"name": "b", "role": "baseline", "url": base.url}], api_key="k") as p,
    ):
        for key in (b"Bearer \xff\xfe", b"Bearer k\xc3\xa9", b"Bearer \xe9"):
            out = await raw_exchange(p.url, post("/v1/chat/completions", CHAT, b"Authorization: " + key))
            status, err = status_and_error(out)
            assert (status, err["code"]) == (401, "invalid_api_key"), out[:300]
        out = await raw_exchange(p.url, post("/v1/chat/completions", CHAT, b"Authorization: Bearer k"))
        assert out.startswith(b"HTTP/1.1 200"), out[:300]
    no_tracebacks(caplog)


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate", b"\xff\r\nContent-Encoding: gzip"])
async def test_a_content_encoding_the_body_does_not_have_is_a_400(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, encoding: bytes
) -> None:
    async with one_arm_proxy(tmp_path) as (p, base):
        out = await raw_exchange(p.url, post("/v1/chat/completions", CHAT, b"Content-Encoding: " + encoding))
        status, err = status_and_error(out)
        assert status == 400 and "Content-Encoding" in err["message"], out[:400]
        assert base.stats.requests == 0
    no_tracebacks(caplog)


def nested(depth: int) -> bytes:
    """JSON text of ``depth`` nested containers (orjson refuses to write past 254)."""
    opens = [b'{"k":' if i % 2 else b"[" for i in range(depth)]
    closes = [b"}" if i % 2 else b"]" for i in reversed(range(depth))]
    return b"".join(opens) + b'"x"' + b"".join(closes)


@pytest.mark.parametrize("depth", [129, 255, 600, 1024])
@pytest.mark.parametrize("where", ["messages", "metadata", "prompt"])
async def test_json_nested_too_deep_is_a_400_and_shallower_json_passes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, depth: int, where: str
) -> None:
    async with one_arm_proxy(tmp_path) as (p, base):
        for d, want in ((depth, 400), (60, 200)):
            if where == "messages":  # (the body, messages, a message: 3 levels)
                body = b'{"messages": [{"role": "user", "content": ' + nested(d - 3) + b"}]}"
            elif where == "metadata":
                body = b'{"messages": [], "metadata": ' + nested(d - 1) + b"}"
            else:
                body = b'{"prompt": ' + nested(d - 1) + b"}"
            path = "/v1/completions" if where == "prompt" else "/v1/chat/completions"
            out = await raw_exchange(p.url, post(path, body))
            assert out.startswith(b"HTTP/1.1 %d" % want), out[:300]
            if want == 400:
                assert "nested" in status_and_error(out)[1]["message"]
    rows = spans(p.db)
    assert [(r["status"], r["http_status"]) for r in rows] == [("ok", 200)]  # only the one that passed
    no_tracebacks(caplog)


@pytest.mark.parametrize(
    "value", ["日本".encode(), "é".encode("latin-1"), "é".encode(), b"\xff\xfe", b"a\tb"]
)
async def test_request_id_and_category_that_are_not_ascii_reach_every_arm_as_valid_headers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: bytes
) -> None:
    async with (
        running_backend(BackendConfig(tokens=5)) as base,
        running_backend(BackendConfig(tokens=5)) as cand,
        running_proxy(tmp_path, shadow_arms(base, cand)) as p,
    ):
        for stream in (False, True):
            body = orjson.dumps({"model": "m", "prompt": "p", "stream": stream})
            headers = (b"X-Request-Id: " + value, b"X-Specproxy-Category: " + value)
            out = await raw_exchange(p.url, post("/v1/completions", body, *headers))
            head, _, rest = out.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), out[:300]
            assert rest.rstrip().endswith(b"0") if stream else rest.endswith(b"}")
            assert (b"data: [DONE]" in rest) == stream
            sent_id = [h for h in head.split(b"\r\n") if h.lower().startswith(b"x-request-id:")]
            assert sent_id and sent_id[0].split(b":", 1)[1].strip().isascii()
        for seen in (*base.stats.headers, *cand.stats.headers):
            assert seen["X-Request-Id"].isascii() and seen["X-Request-Id"].isprintable()
            assert seen["X-Specproxy-Category"].isascii() and seen["X-Specproxy-Category"].isprintable()
    rows = spans(p.db)
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert {r["category"] for r in rows} == {value.decode("utf-8", "replace")}
    (request_id,) = {r["request_id"] for r in rows}  # the one the client got back
    assert request_id.isascii() and sent_id[0].split(b":", 1)[1].strip() == request_id.encode()
    no_tracebacks(caplog)


GOOD_CHUNK = b'{"choices": [{"index": 0, "text": " w1", "finish_reason": null}]}'
MALFORMED = [
    b'{"choices": "abc"}',
    b"[null]",
    b'{"choices": [null]}',
    b'{"choices": [{"index": 0, "text": 5}]}',
    b'{"choices": [{"index": 0, "token_ids": "abc"}]}',
    b'{"choices": [], "usage": {"completion_tokens": "abc"}}',
    b'{"choices": [], "usage": "lots"}',
    b'{"choices": [{"index": 0, "text": "a", "logprobs": {"top_logprobs": [5], "tokens": 3}}]}',
    b'{"choices": [{"index": 0, "finish_reason": 7}]}',
    b"not json",
    b'{"choices": [], "metrics": {"speculative_decoding": {"num_spec_steps": "x"}}}',
    b'{"choices": [], "usage": {"completion_tokens": 1e400}}',
]


@pytest.mark.parametrize("event", MALFORMED)
async def test_a_baseline_sending_malformed_events_ends_the_stream_with_an_error_and_a_502(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, event: bytes
) -> None:
    async with one_arm_proxy(tmp_path, BackendConfig(script=(GOOD_CHUNK, event))) as (p, base):
        streamed = await raw_exchange(
            p.url, post("/v1/completions", orjson.dumps({"prompt": "p", "stream": True}))
        )
        assert streamed.startswith(b"HTTP/1.1 200") and streamed.count(b"HTTP/1.1") == 1, streamed
        assert streamed.endswith(b"\r\n0\r\n\r\n")  # the chunked body ended cleanly, once
        # (What arrived in the same read as the bad event was already relayed: forward first, parse after.)
        assert b'data: {"error":{"message":"upstream b failed mid-stream: malformed' in streamed
        plain = await raw_exchange(p.url, post("/v1/completions", orjson.dumps({"prompt": "p"})))
        status, err = status_and_error(plain)
        assert status == 502 and "malformed" in err["message"], plain
    rows = spans(p.db)
    assert [r["status"] for r in rows] == ["upstream_error"] * 2
    assert all("malformed" in (r["error"] or "") for r in rows), [r["error"] for r in rows]
    no_tracebacks(caplog)


async def test_empty_data_lines_are_keep_alives_not_malformed(tmp_path: Path) -> None:
    script = (b"", GOOD_CHUNK, b" ", GOOD_CHUNK)
    async with one_arm_proxy(tmp_path, BackendConfig(script=script)) as (p, base):
        body = orjson.dumps({"model": "m", "prompt": "p", "stream": True})
        out = await raw_exchange(p.url, post("/v1/completions", body))
        assert out.startswith(b"HTTP/1.1 200") and b"[DONE]" in out and b'"error"' not in out
    assert [(r["status"], r["chunks"]) for r in spans(p.db)] == [("ok", 2)]


async def test_a_candidate_sending_malformed_events_is_an_upstream_error_span_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        running_backend(BackendConfig(tokens=5)) as base,
        running_backend(BackendConfig(script=(MALFORMED[0],))) as cand,
        running_proxy(tmp_path, shadow_arms(base, cand)) as p,
    ):
        for stream in (True, False):
            out = await raw_exchange(
                p.url, post("/v1/completions", orjson.dumps({"prompt": "p", "stream": stream}))
            )
            assert out.startswith(b"HTTP/1.1 200") and b'"error"' not in out
    rows = sorted(spans(p.db), key=lambda r: (r["arm"], r["stream"]))
    assert [(r["arm"], r["status"]) for r in rows] == [("base", "ok")] * 2 + [("cand", "upstream_error")] * 2
    no_tracebacks(caplog)


SECRET = "the launch code is zebra-7731 and the vault opens at midnight behind the 秘密の扉"


@pytest.mark.parametrize("capture", [False, True])
async def test_error_texts_in_spans_hold_no_prompt_text_unless_capture_is_on(
    tmp_path: Path, capture: bool
) -> None:
    kw: dict[str, Any] = {"capture": str(tmp_path / "c.jsonl")} if capture else {}
    async with (
        running_backend(BackendConfig(fail="echo400")) as base,
        running_backend(BackendConfig(fail="echo400")) as cand,
        running_proxy(tmp_path, shadow_arms(base, cand), **kw) as p,
    ):
        for body in (
            {"messages": [{"role": "user", "content": SECRET}]},
            {"messages": [{"role": "user", "content": SECRET[:30]}]},
        ):
            out = await raw_exchange(p.url, post("/v1/chat/completions", orjson.dumps(body)))
            assert out.startswith(b"HTTP/1.1 400")
            assert "'}]" in out.decode()  # the client gets the arm's answer as it is
        out = await raw_exchange(p.url, post("/v1/completions", orjson.dumps({"prompt": SECRET})))
    rows = spans(p.db)
    assert len(rows) == 6 and {r["status"] for r in rows} == {"http_error"}
    for r in rows:
        error = r["error"]
        assert error.startswith("1 validation error for Request") and len(error) <= 300
        leaked = [w for w in ("zebra", "7731", "night", "behind", "秘密", "扉") if w in error]
        assert bool(leaked) == capture, error


TLS_HELLO = bytes.fromhex("16030100c4010000c00303") + b"\x00" * 64
BAD_HTTP = [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"a" * 20000 + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(300)) + b"\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: bogus\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    TLS_HELLO,
]


@pytest.mark.parametrize("request_bytes", BAD_HTTP)
async def test_malformed_http_gets_one_log_line_and_a_json_400(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, request_bytes: bytes
) -> None:
    caplog.set_level(logging.INFO)
    async with one_arm_proxy(tmp_path) as (p, base):
        out = await raw_exchange(p.url, request_bytes)
        status, err = status_and_error(out)
        assert 400 <= status < 500 and err["message"], out[:300]
        # Good requests still flow.
        good = await raw_exchange(p.url, post("/v1/completions", orjson.dumps({"prompt": "p"})))
        assert good.startswith(b"HTTP/1.1 200")
    no_tracebacks(caplog)
    lines = [r for r in caplog.records if "bad HTTP" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


async def test_no_host_header_and_unknown_encodings_are_answered_in_json(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with one_arm_proxy(tmp_path) as (p, base):
        body = orjson.dumps({"prompt": "p"})
        no_host = b"POST /v1/completions HTTP/1.1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%b"
        out = await raw_exchange(p.url, no_host % (len(body), body))
        assert out.startswith(b"HTTP/1.1 200") or status_and_error(out)[0] == 400
        for encoding in (b"br", b"zstd", b"x-unknown"):
            out = await raw_exchange(p.url, post("/v1/completions", body, b"Content-Encoding: " + encoding))
            assert out.startswith(b"HTTP/1.1 200") or status_and_error(out)[0] == 400, out[:300]
    no_tracebacks(caplog)


async def test_expect_100_continue_over_the_limit_is_a_413_before_the_body(tmp_path: Path) -> None:
    async with one_arm_proxy(tmp_path, max_body_bytes=1000) as (p, _base):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        head += b"Content-Length: %d\r\nExpect: %b\r\n\r\n"
        out = await raw_exchange(p.url, head % (5000, b"100-continue"))
        assert b"100 Continue" not in out and status_and_error(out)[0] == 413
        out = await raw_exchange(p.url, head % (10, b"something-else"))
        assert status_and_error(out)[0] == 417
        body = orjson.dumps({"prompt": "p"})
        out = await raw_exchange(p.url, head % (len(body), b"100-continue") + body)
        assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200")


@pytest.mark.parametrize(
    ("level", "ok"),
    [
        (b"4", True),
        ("٣".encode(), False),
        (b"1_0", False),
        (b"+5", False),
        (b"0", False),
        (b"99999999999999999999", False),
    ],
)
async def test_the_concurrency_level_header_takes_ascii_digits_only(
    tmp_path: Path, level: bytes, ok: bool
) -> None:
    async with one_arm_proxy(tmp_path) as (p, base):
        body = orjson.dumps({"prompt": "p"})
        out = await raw_exchange(
            p.url, post("/v1/completions", body, b"X-Specproxy-Concurrency-Level: " + level)
        )
        assert out.startswith(b"HTTP/1.1 200") if ok else status_and_error(out)[0] == 400, out[:300]
    assert [r["concurrency_level"] for r in spans(p.db)] == ([4] if ok else [])


async def test_slowloris_connections_are_closed_and_never_starve_real_or_slow_reading_clients(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    limits = {"max_client_connections": 20, "client_header_timeout_s": 1.0, "client_body_timeout_s": 1.0}
    async with (
        running_backend(BackendConfig(itl_s=0.03, tokens=60)) as base,
        running_proxy(tmp_path, [{"name": "b", "role": "baseline", "url": base.url}], **limits) as p,
    ):
        host, port = p.url.removeprefix("http://").split(":")
        # A client that reads its stream slowly: longer than the header timeout, and through the attack.
        slow = await asyncio.open_connection(host, int(port))
        slow[1].write(post("/v1/completions", orjson.dumps({"prompt": "p", "stream": True})))
        first = await slow[0].read(200)
        assert first.startswith(b"HTTP/1.1 200")
        attackers = []
        for _ in range(60):  # three times the cap, each holding a request head open
            r, w = await asyncio.open_connection(host, int(port))
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            attackers.append((r, w))
        for i in range(10):  # real clients keep getting through
            out = await raw_exchange(p.url, post("/v1/completions", orjson.dumps({"prompt": f"g{i}"})))
            assert out.startswith(b"HTTP/1.1 200"), out[:300]
        for r, w in attackers:  # every attacker is closed: evicted, or at the header timeout
            for _ in range(100):
                w.write(b"X")  # (one more header byte now and then)
                try:
                    if await asyncio.wait_for(r.read(100), 0.1) == b"":
                        break
                except TimeoutError:
                    continue
                except ConnectionError:  # (closed, and our byte after that got a reset)
                    break
            else:
                pytest.fail("a connection sending a header byte every 0.1 s was never closed")
            w.close()
        body = first
        while not body.endswith(b"\r\n0\r\n\r\n"):
            await asyncio.sleep(0.05)  # reading slowly
            data = await slow[0].read(256)
            assert data, body[-300:]
            body += data
        slow[1].close()
        assert body.count(b"data: ") == 61  # 60 tokens and [DONE]: every event arrived
        # A body that trickles in slower than the body timeout: 408.
        head = post("/v1/completions", b"x" * 100)[:-100]
        out = await raw_exchange(p.url, head + b'{"prompt":')
        assert status_and_error(out)[0] == 408
    no_tracebacks(caplog)
    assert any("client connections at the limit of 20" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("path", [b"/health", b"/v1/models", b"/nowhere"])
async def test_errors_aiohttp_raises_on_any_path_are_json_and_broken_bodies_log_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, path: bytes
) -> None:
    async with one_arm_proxy(tmp_path) as (p, base):
        head = b"POST %b HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 4\r\n" % path
        out = await raw_exchange(p.url, head + b"Expect: something\r\n\r\nabcd")
        assert status_and_error(out)[0] == 417
        out = await raw_exchange(p.url, head + b"Content-Encoding: gzip\r\n\r\nabcd")
        assert status_and_error(out)[0] in (404, 405)
    no_tracebacks(caplog)


async def test_a_chunked_body_that_came_whole_is_checked_against_the_limit(tmp_path: Path) -> None:
    # No Content-Length to refuse it by: the body's own size decides, read as it came with the headers.
    async with one_arm_proxy(tmp_path, max_body_bytes=1000) as (p, _base):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        head += b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"

        def chunked(body: bytes) -> bytes:
            return b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)

        out = await raw_exchange(p.url, head + chunked(orjson.dumps({"prompt": "x" * 2000})))
        status, err = status_and_error(out)
        assert status == 413 and "over the limit of 1000 bytes" in err["message"]
        out = await raw_exchange(p.url, head + chunked(orjson.dumps({"prompt": "p", "max_tokens": 3})))
        assert out.startswith(b"HTTP/1.1 200"), out[:300]
    assert [r["status"] for r in spans(p.db)] == ["ok"]
