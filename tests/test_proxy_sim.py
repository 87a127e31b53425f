"""The proxy in shadow mode in front of two simulated vLLM servers (`specproxy sim`'s engine)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai

from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.server import running_sim
from specproxy.proxy.upstream.calls import upstream_request_id
from tests.proxies import running_proxy, spans, wait_for_calls
from tests.support import wait_until

SPEC = {"method": "ngram", "num_speculative_tokens": 3}


async def test_shadow_in_front_of_simulated_vllm_matches_its_ground_truth(tmp_path: Path) -> None:
    cand_cfg = SimConfig(
        time_scale=50,
        speculative=SpeculativeConfig.from_dict(dict(SPEC)),
        per_request_spec_decode_metrics="summary",
    )
    async with running_sim(SimConfig(time_scale=50)) as base, running_sim(cand_cfg) as cand:
        arms = [
            {"name": "base", "role": "baseline", "url": base.url, "return_token_ids": True},
            {"name": "ngram", "url": cand.url, "return_token_ids": True, "speculative": SPEC},
        ]
        async with running_proxy(tmp_path, arms) as p:
            client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
            model = (await client.models.list()).data[0].id
            for i in range(4):
                prompt = f"Repeat this code: def f(x): return x + {i}"
                stream = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    temperature=0,
                    max_tokens=48,
                    stream=True,
                    extra_headers={"X-Request-Id": f"r{i}"},
                )
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                assert text
            await client.close()
            await wait_for_calls(p, 8)  # the shadow copies end after their client's calls
            truths = {}
            async with aiohttp.ClientSession() as s:
                for i in range(4):
                    # the arm knows each request by the UUID the proxy sent for it
                    async with s.get(f"{cand.url}/sim/requests/{upstream_request_id(f'r{i}')}") as r:
                        truths[f"r{i}"] = await r.json()
    rows = spans(p.db, "arm = 'ngram'")
    assert len(rows) == 4
    for row in rows:
        truth = truths[row["request_id"]]
        assert row["status"] == "ok" and row["spec_source"] == "vllm_request_metrics"
        assert (row["num_drafts"], row["draft_tokens"], row["accepted_tokens"]) == (
            truth["num_drafts"],
            truth["draft_tokens"],
            truth["accepted_tokens"],
        )
        assert row["completion_tokens"] == truth["completion_tokens"]
        assert row["identical"] is True  # the simulator's n-gram is lossless


async def test_each_call_carries_its_arms_engine_load_from_the_latest_scrape(tmp_path: Path) -> None:
    async with running_sim(SimConfig()) as base, running_sim(SimConfig()) as twin:
        arms = [
            {"name": "base", "role": "baseline", "url": base.url},
            {"name": "twin", "role": "replica", "url": twin.url},
        ]
        async with running_proxy(tmp_path, arms, scrape_interval_s=0.2) as p:
            client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
            model = (await client.models.list()).data[0].id

            async def ask(i: int, max_tokens: int) -> None:
                await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"Tell me a long story number {i}."}],
                    temperature=0,
                    max_tokens=max_tokens,
                    extra_headers={"X-Request-Id": f"r{i}"},
                    extra_body={"ignore_eos": True},
                )

            await wait_until(lambda: len(p.state.engine_load) == 2, "a first scrape of both arms")
            long_calls = [asyncio.create_task(ask(i, 400)) for i in range(3)]
            # Until a scrape has seen the three long calls running on both engines ...
            await wait_until(
                lambda: all((p.state.engine_load.get(a) or (0, 0))[0] == 3 for a in ("base", "twin")),
                "a scrape that sees three requests running on both engines",
            )
            await ask(3, 4)  # ... then one more call starts: its spans carry that load
            await asyncio.gather(*long_calls)
            await client.close()
    rows = {(r["request_id"], r["arm"]): r for r in spans(p.db)}
    assert len(rows) == 8
    for arm in ("base", "twin"):
        assert rows[("r3", arm)]["engine_running"] == 3.0 and rows[("r3", arm)]["engine_waiting"] == 0.0
        # with how long before the call they were read: two scrape intervals at most when the proxy
        # chose them (older are not stamped), and the stamp follows within the same call
        assert 0 <= rows[("r3", arm)]["engine_load_age_s"] < 1.0, rows[("r3", arm)]
    assert rows[("r0", "twin")]["arm_role"] == "replica" and rows[("r0", "twin")]["routed_as"] == "shadow"
    assert all(r["engine_running"] is not None for r in rows.values())
