"""The proxy in shadow mode in front of two simulated vLLM servers (`specproxy sim`'s engine)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import openai

from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.server import running_sim
from specproxy.proxy.upstream.calls import upstream_request_id
from tests.proxies import running_proxy, spans, wait_for_calls

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
