"""A call whose final event reached the client is complete, whatever the client does afterwards.

The official `openai` client stops reading at `data: [DONE]` (the sync client closes the connection
without reading the rest of the body; the async one drains it), so a server that takes a moment to
end its body after [DONE] sees the client go away: that is not a cancellation.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai

from specproxy.engines.sim.config import SimConfig
from specproxy.engines.sim.server import running_sim
from tests.backends import BackendConfig
from tests.proxies import running_proxy, spans, two_arm_proxy, wait_for_calls


def _sync_streams(url: str, n: int, completions: bool = False) -> list[int]:
    """n streaming requests with the sync client, each stream read to [DONE]; content chunks per call."""
    counts = []
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        for i in range(n):
            if completions:
                stream: Any = client.completions.create(
                    model="m", prompt=f"p{i}", stream=True, max_tokens=6, temperature=0
                )
                counts.append(sum(1 for c in stream if c.choices and c.choices[0].text))
            else:
                stream = client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"q{i}"}],
                    stream=True,
                    max_tokens=6,
                    temperature=0,
                )
                counts.append(sum(1 for c in stream if c.choices and c.choices[0].delta.content))
    return counts


async def test_client_closing_right_after_done_is_not_a_cancellation(tmp_path: Path) -> None:
    # The backend ends its body only when told, after [DONE]: the sync client closes its connection first.
    body_end = asyncio.Event()
    cfg = BackendConfig(tokens=6, eof_gate=body_end)
    async with (
        two_arm_proxy(tmp_path, cfg) as (p, base, cand),
    ):
        counts = await asyncio.to_thread(_sync_streams, p.url, 6)
        counts += await asyncio.to_thread(_sync_streams, p.url, 2, True)
        assert counts == [6] * 8
        # The sync client's calls end at [DONE], not when the body ends: their spans are out while the
        # backend still holds the end of every body (the shadow copies read on until it comes).
        await wait_for_calls(p, 8, route="primary", status="ok")
        body_end.set()
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> int:
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"a{i}"}],
                stream=True,
                max_tokens=6,
                temperature=0,
            )
            return len([1 async for c in stream if c.choices and c.choices[0].delta.content])

        assert await asyncio.gather(*(one(i) for i in range(8))) == [6] * 8
        await client.close()
    rows = spans(p.db)
    assert len(rows) == 32
    assert [r["status"] for r in rows if r["routed_as"] == "primary"] == ["ok"] * 16
    assert all(r["completion_tokens"] == 6 and r["finish_reason"] == "length" for r in rows)
    # The primary's output still counts: every shadow copy was compared with it.
    assert [r["identical"] for r in rows if r["arm"] == "cand"] == [True] * 16


async def test_many_openai_streams_through_the_proxy_in_front_of_the_simulator(tmp_path: Path) -> None:
    async with (
        running_sim(SimConfig(time_scale=100)) as base,
        running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": base.url}]) as p,
    ):
        async with aiohttp.ClientSession() as s, s.get(base.url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        def sync_calls() -> int:
            with openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0) as client:
                for i in range(20):
                    stream = client.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": f"s{i}"}],
                        stream=True,
                        max_tokens=8,
                        temperature=0,
                    )
                    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            return 20

        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> None:
            stream = await client.completions.create(
                model=model, prompt=f"a{i}", stream=True, max_tokens=8, temperature=0
            )
            assert "".join([c.choices[0].text async for c in stream if c.choices])

        n_sync, _ = await asyncio.gather(
            asyncio.to_thread(sync_calls), asyncio.gather(*(one(i) for i in range(20)))
        )
        await client.close()
    rows = spans(p.db)
    assert len(rows) == n_sync + 20
    bad = [(r["status"], r["error"]) for r in rows if r["status"] != "ok"]
    assert not bad
