"""The engine model: identical greedy text across arms, real n-gram search, the formula, load shape."""

from __future__ import annotations

import aiohttp
import pytest

from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.proposers import NgramIndex
from specproxy.engines.sim.server import running_sim
from specproxy.engines.sim.virtual import chat_workload, run_closed_loop, summarization_workload

ARMS = {
    "baseline": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "eagle3": {"method": "eagle3", "model": "e3", "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "model": "small", "num_speculative_tokens": 5},
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
}
ARTICLE = (
    "Summarize the following article. The city council approved a new energy plan on Monday. The plan "
    "will cut the price of water and energy for each school in the city by the end of the year. The "
    "government said the plan was the result of a study of health and growth in every group of people. "
    "Critics said the cost of the plan is a risk for the market."
)


def _spec(raw: dict[str, object] | None) -> SpeculativeConfig | None:
    return SpeculativeConfig.from_dict(raw) if raw else None


async def _chat(url: str, content: str, **extra: object) -> dict[str, object]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 80, **extra}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            result: dict[str, object] = await resp.json()
            return result


def _text(resp: dict[str, object]) -> str:
    return resp["choices"][0]["message"]["content"]  # type: ignore[index,no-any-return]


async def test_greedy_text_identical_across_every_arm_and_deterministic() -> None:
    texts = {}
    for name, raw in ARMS.items():
        async with running_sim(SimConfig(speculative=_spec(raw), time_scale=100)) as sim:
            texts[name] = _text(await _chat(sim.url, ARTICLE, temperature=0))
            assert _text(await _chat(sim.url, ARTICLE, temperature=0)) == texts[name]
    assert len(set(texts.values())) == 1, texts
    async with running_sim(SimConfig(model="another/model", time_scale=100)) as sim:
        assert _text(await _chat(sim.url, ARTICLE, temperature=0)) != texts["baseline"]


async def test_sampling_differs_unless_seeded() -> None:
    async with running_sim(SimConfig(time_scale=100)) as sim:
        a = _text(await _chat(sim.url, ARTICLE, temperature=0.8))
        b = _text(await _chat(sim.url, ARTICLE, temperature=0.8))
        c = _text(await _chat(sim.url, ARTICLE, temperature=0.8, seed=7))
        d = _text(await _chat(sim.url, ARTICLE, temperature=0.8, seed=7))
    assert a != b and c == d


async def test_summaries_copy_prompt_spans() -> None:
    async with running_sim(SimConfig(time_scale=100)) as sim:
        text = _text(await _chat(sim.url, ARTICLE, temperature=0, max_tokens=200))
    words = text.split()
    copied = sum(1 for i in range(len(words) - 2) if " ".join(words[i : i + 3]) in ARTICLE)
    assert copied >= 5, text


def test_ngram_index_finds_earliest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    index = NgramIndex(list(tokens), 2, 3)
    assert index.propose(2) == [9, 1]  # [1, 2, 3] first occurred at 0, followed by 9, 1
    index.append([9])
    assert index.propose(3) == [1, 2, 3]  # [2, 3, 9] -> what followed it
    assert NgramIndex([4, 5, 6], 2, 3).propose(3) == []


def test_acceptance_formula_fixed_alpha() -> None:
    chat = chat_workload(16)
    for alpha in (0.8, 0.5):
        spec = SpeculativeConfig.from_dict(
            {
                "method": "draft_model",
                "model": "x",
                "num_speculative_tokens": 4,
                "synthetic_acceptance_rate": alpha,
            }
        )
        result = run_closed_loop(
            SimConfig(speculative=spec), chat, concurrency=8, num_requests=32, max_tokens=300, ignore_eos=True
        )
        expected = (1 - alpha**5) / (1 - alpha)
        assert result.acceptance_length == pytest.approx(expected, rel=0.02)


def test_speculation_pays_at_low_load_and_fades_at_high_load() -> None:
    chat = chat_workload(32)
    eagle = SimConfig(speculative=_spec(ARMS["eagle3"]))
    low = [run_closed_loop(c, chat, concurrency=2, num_requests=8) for c in (SimConfig(), eagle)]
    high = [run_closed_loop(c, chat, concurrency=64, num_requests=128) for c in (SimConfig(), eagle)]
    low_ratio = low[1].output_tok_s / low[0].output_tok_s
    high_ratio = high[1].output_tok_s / high[0].output_tok_s
    assert 1.45 < low_ratio < 2.2 and high_ratio < low_ratio - 0.2


def test_ngram_helps_summaries_not_chat() -> None:
    ngram = SimConfig(speculative=_spec(ARMS["ngram"]))
    summ, chat = summarization_workload(8), chat_workload(8)
    s = [run_closed_loop(c, summ, concurrency=1, num_requests=4) for c in (SimConfig(), ngram)]
    c = [run_closed_loop(cfg, chat, concurrency=1, num_requests=4) for cfg in (SimConfig(), ngram)]
    assert s[1].mean_decode_tok_s / s[0].mean_decode_tok_s > 1.3
    assert c[1].mean_decode_tok_s / c[0].mean_decode_tok_s < 1.2
    assert s[1].accepted_tokens / s[1].draft_tokens > c[1].accepted_tokens / max(1, c[1].draft_tokens)


async def test_suffix_learns_across_requests() -> None:
    config = SimConfig(speculative=_spec(ARMS["suffix"]), time_scale=100)
    async with running_sim(config) as sim, aiohttp.ClientSession() as session:
        prompt = "Write a poem about the cost of the energy plan."
        rates = []
        for i in range(2):
            headers = {"X-Request-Id": f"suffix-{i}", "X-Specproxy-Category": "chat"}
            body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 120}
            async with session.post(sim.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
            async with session.get(f"{sim.url}/sim/requests/suffix-{i}") as resp:
                truth = await resp.json()
            rates.append(truth["accepted_tokens"] / max(1, truth["completion_tokens"]))
    assert rates[1] > rates[0] + 0.3  # the second time, the first answer is in the suffix cache


async def test_prefix_caching_skips_seen_prompt_blocks() -> None:
    prompt = ARTICLE * 4  # ~260 words: several 16-token blocks
    for enabled in (True, False):
        config = SimConfig(time_scale=5, enable_prefix_caching=enabled)
        async with running_sim(config) as sim, aiohttp.ClientSession() as session:
            truths = []
            for i in range(2):
                body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 4}
                async with session.post(
                    sim.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": f"pc{i}"}
                ) as resp:
                    assert resp.status == 200
                async with session.get(f"{sim.url}/sim/requests/pc{i}") as resp:
                    truths.append(await resp.json())
        first, second = truths
        assert first["cached_prompt_tokens"] == 0
        if enabled:
            assert second["cached_prompt_tokens"] >= first["prompt_tokens"] - 16
        else:
            assert second["cached_prompt_tokens"] == 0


def test_kv_capacity_queues_and_preempts_without_changing_outputs() -> None:
    summ = summarization_workload(8)
    roomy = run_closed_loop(SimConfig(), summ, concurrency=8, num_requests=8, max_tokens=300, ignore_eos=True)
    # ~760-token prompts, 8 at once, in a 3,000-token cache: most wait, decoding ones get preempted.
    tight_config = SimConfig(kv_cache_tokens=3000, enable_prefix_caching=False)
    tight = run_closed_loop(
        tight_config, summ, concurrency=8, num_requests=8, max_tokens=300, ignore_eos=True
    )
    assert tight.requests == roomy.requests == 8 and tight.output_tokens == roomy.output_tokens == 8 * 300
    assert tight.preemptions > 0 and roomy.preemptions == 0
    assert tight.duration_s > 1.5 * roomy.duration_s
