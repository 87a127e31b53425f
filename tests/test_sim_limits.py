"""The simulator bounds what one request can make it do, and a client that leaves costs it nothing:
no traceback, and its sequences are aborted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from specproxy.engines.sim.api_request import MAX_N
from specproxy.engines.sim.config import SimConfig
from specproxy.engines.sim.server import RunningSim, running_sim
from tests.support import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture
async def sim() -> AsyncIterator[RunningSim]:
    async with running_sim(SimConfig(time_scale=20)) as running:
        yield running


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("n", 2**31, f"n must be at most {MAX_N}"),
        ("n", MAX_N + 1, f"n must be at most {MAX_N}"),
        ("n", 0, "n must be at least 1"),
        ("max_tokens", 2**31, "'max_tokens' or 'max_completion_tokens' is too large"),
    ],
)
async def test_sizes_past_the_limits_are_a_400_in_openai_shape(
    sim: RunningSim, caplog: pytest.LogCaptureFixture, field: str, value: int, words: str
) -> None:
    body = {"model": MODEL, "prompt": "hello", "temperature": 1, field: value}
    async with aiohttp.ClientSession() as s, s.post(sim.url + "/v1/completions", json=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["type"] == "BadRequestError" and error["param"] == field and words in error["message"]
    assert not sim.engine.core.running and not sim.engine.core.waiting
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


async def test_n_null_and_n_at_the_limit_are_served(sim: RunningSim) -> None:
    async with aiohttp.ClientSession() as s:
        for n in (None, MAX_N):
            body = {"model": MODEL, "prompt": "hi", "temperature": 1, "max_tokens": 1, "n": n}
            async with s.post(sim.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                assert len((await r.json())["choices"]) == (n or 1)


async def leave_early(url: str, body: dict[str, object], after: bytes | None) -> None:
    """Send a request, read until ``after`` shows up (None: read nothing), then reset the connection."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = orjson.dumps(body)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    writer.write(b"Content-Length: %d\r\n\r\n%b" % (len(data), data))
    if after is not None:
        seen = b""
        while after not in seen:
            seen += await reader.read(4096)
    writer.transport.abort()


@pytest.mark.parametrize("after", [None, b"HTTP/1.1 200", b"data: "])
async def test_a_client_that_leaves_early_is_aborted_without_a_traceback(
    sim: RunningSim, caplog: pytest.LogCaptureFixture, after: bytes | None
) -> None:
    caplog.set_level(logging.DEBUG)
    core = sim.engine.core
    body = {
        "model": MODEL,
        "prompt": "a long answer",
        "max_tokens": 4000,
        "stream": True,
        "n": 3,
        "temperature": 1,
    }
    for _ in range(5):
        await leave_early(sim.url, body, after)
    await wait_until(lambda: not core.running and not core.waiting, "every sequence aborted")
    logged = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert logged == [], [r.getMessage() for r in logged]
