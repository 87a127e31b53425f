"""A finished call's bookkeeping waits until the requests that follow have gone upstream
(proxy/server/after_calls.py): queued in order, run later in slices, drained by whatever reads it."""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specproxy.proxy.server.after_calls import AfterCalls
from tests.backends import BackendConfig, running_backend
from tests.proxies import running_proxy, spans, two_arm_proxy
from tests.support import loop_turns, metric_totals, wait_until

MSG: Any = [{"role": "user", "content": "hello"}]


async def test_work_runs_later_in_order() -> None:
    after, done = AfterCalls(delay_s=0.001), list[int]()
    for i in range(5):
        after.add(functools.partial(done.append, i))
    assert done == [] and len(after) == 5  # nothing on the adding call's path
    await wait_until(lambda: len(done) == 5, "the queued work to run")
    assert done == [0, 1, 2, 3, 4]


async def test_a_slice_lets_the_loop_run_between_items() -> None:
    # A zero slice runs one item per loop pass: what the loop schedules meanwhile runs in between.
    after, order = AfterCalls(delay_s=0.0, slice_s=0.0), []

    def first() -> None:
        order.append("a")
        asyncio.get_running_loop().call_soon(order.append, "io")

    after.add(first)
    after.add(lambda: order.append("b"))
    await wait_until(lambda: len(order) == 3, "both items and the callback between them")
    assert order == ["a", "io", "b"]


async def test_drain_runs_everything_now_and_close_runs_later_adds_at_once() -> None:
    after, done = AfterCalls(delay_s=3600), []
    after.add(lambda: done.append(1))
    after.add(lambda: done.append(2))
    after.drain()
    assert done == [1, 2] and len(after) == 0
    await loop_turns(3)
    assert done == [1, 2]  # the cancelled timer runs nothing again
    after.add(lambda: done.append(3))
    after.close()
    after.add(lambda: done.append(4))
    assert done == [1, 2, 3, 4]


async def test_one_failing_item_does_not_lose_the_next(caplog: pytest.LogCaptureFixture) -> None:
    after, done = AfterCalls(delay_s=3600), []

    def fail() -> None:
        raise RuntimeError("boom")

    after.add(fail)
    after.add(lambda: done.append("next"))
    with caplog.at_level(logging.ERROR):
        after.drain()
    assert done == ["next"]
    assert "bookkeeping of a finished call failed" in caplog.text


async def test_the_client_has_its_answer_before_the_bookkeeping_and_nothing_is_lost(
    tmp_path: Path,
) -> None:
    async with (
        running_backend() as base,
        running_proxy(tmp_path, [{"name": "b", "role": "baseline", "url": base.url}]) as p,
    ):
        p.state.after_calls.delay_s = 3600  # the bookkeeping waits until something reads it
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.chat.completions.create(model="m", messages=MSG)
        assert text
        # Both calls are over for their clients; their figures and spans are still queued.
        assert len(p.state.after_calls) >= 4
        async with aiohttp.ClientSession() as session, session.get(p.url + "/metrics") as resp:
            totals = metric_totals(await resp.text())
        assert totals["specproxy_requests_total"] == 2  # /metrics counts every call that has ended
        assert len(p.state.after_calls) == 0
        last = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        assert [c async for c in last]
        await client.close()
        assert len(p.state.after_calls) >= 2
    # The proxy stopped with a call's bookkeeping still queued: shutdown ran it, its span is stored.
    rows = spans(p.db)
    assert len(rows) == 3
    assert all(r["status"] == "ok" and r["completion_tokens"] and r["prompt_sha256"] for r in rows)
    assert [r["stream"] for r in rows] == [True, False, True]


async def test_a_shadow_copy_s_bookkeeping_waits_too(tmp_path: Path) -> None:
    async with two_arm_proxy(tmp_path, BackendConfig()) as (p, _base, _cand):
        p.state.after_calls.delay_s = 3600
        dispatcher = p.state.dispatcher
        assert dispatcher is not None
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
        await client.chat.completions.create(model="m", messages=MSG, temperature=0)
        await client.close()
        assert await _metric_totals(p.url) == {"primary": 1, "checks": 0}
        # The copy compares its output with the baseline's, which that /metrics read handed it.
        await wait_until(lambda: dispatcher.pending == 0, "the shadow copy to end")
        assert len(p.state.after_calls) >= 1  # (at least) the copy's hand-off to the sink
        assert await _metric_totals(p.url) == {"primary": 1, "checks": 1}
    rows = {r["arm"]: r for r in spans(p.db)}
    assert rows.keys() == {"base", "cand"}
    assert rows["cand"]["identical"] is True and rows["cand"]["completion_tokens"]


async def _metric_totals(url: str) -> dict[str, float]:
    """Calls ended by route primary, and identity checks, as /metrics counts them."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    primary = sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "specproxy_requests_total" and s.labels.get("route") == "primary"
    )
    return {"primary": primary, "checks": metric_totals(text).get("specproxy_identity_checks_total", 0)}
