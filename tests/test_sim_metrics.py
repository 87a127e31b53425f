"""/metrics: vLLM's exact series, parsed with prometheus_client, and counters equal to the ground truth."""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.server import running_sim

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    key = tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items()))
    return samples[(name, key)]


async def _run(config: SimConfig, n: int) -> tuple[str, list[dict[str, Any]]]:
    async with running_sim(config) as sim, aiohttp.ClientSession() as session:
        for i in range(n):
            content = (
                f"Summarize the report: the plan cut the cost of energy for each school by {i} percent. " * 3
            )
            body = {
                "messages": [{"role": "user", "content": content}],
                "temperature": 0,
                "max_tokens": 50,
                "stream": i % 2 == 0,
            }
            async with session.post(
                sim.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": f"m{i}"}
            ) as resp:
                await resp.read()
        async with session.get(sim.url + "/metrics") as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = await resp.text()
        truths = []
        for i in range(n):
            async with session.get(f"{sim.url}/sim/requests/m{i}") as resp:
                truths.append(await resp.json())
    return text, truths


async def test_spec_counters_equal_ground_truth() -> None:
    config = SimConfig(speculative=SpeculativeConfig.from_dict(NGRAM), time_scale=100)
    text, truths = await _run(config, 6)
    samples = _samples(text)
    assert _value(samples, "vllm:spec_decode_num_drafts_total") == sum(t["num_drafts"] for t in truths)
    assert _value(samples, "vllm:spec_decode_num_draft_tokens_total") == sum(
        t["draft_tokens"] for t in truths
    )
    accepted = sum(t["accepted_tokens"] for t in truths)
    assert accepted > 0
    assert _value(samples, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    per_pos = [
        _value(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(4)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert _value(samples, "vllm:generation_tokens_total") == sum(t["completion_tokens"] for t in truths)
    assert _value(samples, "vllm:prompt_tokens_total") == sum(t["prompt_tokens"] for t in truths)
    assert _value(samples, "vllm:prefix_cache_hits_total") == sum(t["cached_prompt_tokens"] for t in truths)
    assert _value(samples, "vllm:prefix_cache_queries_total") == sum(t["prompt_tokens"] for t in truths)
    assert _value(samples, "vllm:request_success_total", finished_reason="length") == 6
    assert _value(samples, "vllm:e2e_request_latency_seconds_count") == 6
    assert _value(samples, "vllm:time_to_first_token_seconds_count") == 6
    steps = sum(t["decode_steps"] for t in truths)
    assert _value(samples, "vllm:inter_token_latency_seconds_count") == steps  # one per step, not per token
    assert _value(samples, "vllm:num_requests_running") == 0
    assert _value(samples, "vllm:num_requests_waiting") == 0


async def test_no_spec_series_without_speculation() -> None:
    text, truths = await _run(SimConfig(time_scale=100), 2)
    names = {family.name for family in text_string_to_metric_families(text)}
    assert not any(name.startswith("vllm:spec_decode") for name in names)
    assert {
        "vllm:generation_tokens",
        "vllm:prompt_tokens",
        "vllm:iteration_tokens_total",
        "vllm:kv_cache_usage_perc",
    } <= names
    assert all(t["num_drafts"] == 0 for t in truths)
