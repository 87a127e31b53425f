"""Each fault option of `specproxy sim`, off by default, does what it says."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from specproxy.engines.sim.config import Faults, SimConfig
from specproxy.engines.sim.server import running_sim
from tests.support import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPTS = [f"Question {i}: what does the report say about the cost of the plan?" for i in range(12)]


def _body(prompt: str, **extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 60, **extra}


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> dict[str, object]:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        result: dict[str, object] = await resp.json()
        return result


async def test_lossy_rate_diverges_at_a_near_tie() -> None:
    async with (
        running_sim(SimConfig(time_scale=100)) as clean,
        running_sim(SimConfig(time_scale=100, faults=Faults(lossy_rate=1.0))) as lossy,
        aiohttp.ClientSession() as session,
    ):
        for prompt in PROMPTS[:4]:
            body = _body(prompt, max_tokens=250, logprobs=True, top_logprobs=2, return_token_ids=True)
            a = await _post(session, clean.url, body)
            b = await _post(session, lossy.url, {**body, "request_id": "lossy"})
            ids_a = a["choices"][0]["token_ids"]  # type: ignore[index]
            ids_b = b["choices"][0]["token_ids"]  # type: ignore[index]
            diverge = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
            async with session.get(lossy.url + "/sim/requests/lossy") as resp:
                truth = await resp.json()
            assert truth["lossy"] and truth["divergence_position"] == diverge
            top = a["choices"][0]["logprobs"]["content"][diverge]["top_logprobs"]  # type: ignore[index]
            assert top[0]["logprob"] - top[1]["logprob"] < 0.05  # a near-tie, seen from the clean side
            # What the lossy server emitted there is the clean server's runner-up.
            assert b["choices"][0]["logprobs"]["content"][diverge]["token"] == top[1]["token"]  # type: ignore[index]


async def test_lossy_rate_zero_is_lossless_and_partial_rate_hits_a_share() -> None:
    async with (
        running_sim(SimConfig(time_scale=100, faults=Faults(lossy_rate=0.5))) as sim,
        aiohttp.ClientSession() as session,
    ):
        flags = []
        for i, prompt in enumerate(PROMPTS):
            await _post(session, sim.url, {**_body(prompt), "request_id": f"p{i}"})
            async with session.get(f"{sim.url}/sim/requests/p{i}") as resp:
                flags.append((await resp.json())["lossy"])
    assert 0 < sum(flags) < len(flags)


async def test_error_rate_returns_500_in_vllm_shape() -> None:
    async with running_sim(SimConfig(time_scale=100, faults=Faults(error_rate=1.0))) as sim:
        async with (
            aiohttp.ClientSession() as session,
            session.post(sim.url + "/v1/chat/completions", json=_body(PROMPTS[0])) as resp,
        ):
            body = await resp.json()
        assert resp.status == 500
        assert body["error"]["code"] == 500 and body["error"]["type"] == "InternalServerError"
        async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.InternalServerError):
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}]
                )


async def test_drop_rate_cuts_the_stream() -> None:
    async with running_sim(SimConfig(time_scale=20, faults=Faults(drop_rate=1.0))) as sim:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientPayloadError):
                async with session.post(
                    sim.url + "/v1/chat/completions", json=_body(PROMPTS[0], stream=True, max_tokens=200)
                ) as resp:
                    await resp.read()
        # The engine stops generating for the dropped request.
        await wait_until(lambda: not sim.engine.core.running, "the engine to drop the request")


async def test_stall_ms_pauses_mid_stream() -> None:
    async with running_sim(SimConfig(time_scale=5, faults=Faults(stall_ms=300))) as sim:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                sim.url + "/v1/chat/completions", json=_body(PROMPTS[0], stream=True, max_tokens=40)
            ) as resp,
        ):
            stamps = []
            async for line in resp.content:
                if line.startswith(b"data: "):
                    stamps.append(time.monotonic())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    # The pause comes after the first write (the role chunk and the first tokens), mid-stream.
    assert len(gaps) > 2 and max(gaps[:2]) >= 0.28


async def test_max_concurrency_queues() -> None:
    config = SimConfig(time_scale=20, faults=Faults(max_concurrency=1))
    async with running_sim(config) as sim, aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            body = {**_body(PROMPTS[i], max_tokens=40, ignore_eos=True), "request_id": f"q{i}"}
            await _post(session, sim.url, body)

        await asyncio.gather(one(0), one(1))
        truths = sim.engine.core.truths
        first, second = sorted((truths["q0"], truths["q1"]), key=lambda t: t.arrival)
    # The second reached the engine only once the first had finished.
    assert first.finished is not None and second.arrival >= first.finished


async def test_client_disconnect_aborts_the_request() -> None:
    async with running_sim(SimConfig(time_scale=1)) as sim:
        async with aiohttp.ClientSession() as session:
            body = {**_body(PROMPTS[0], stream=True, max_tokens=500, ignore_eos=True), "request_id": "gone"}
            async with session.post(sim.url + "/v1/chat/completions", json=body) as resp:
                await resp.content.readline()
                resp.close()
        truths = sim.engine.core.truths
        await wait_until(lambda: truths["gone"].finish_reason is not None, "the engine to abort the request")
        truth = truths["gone"]
        assert truth.finish_reason == "abort" and truth.completion_tokens < 500
        assert not sim.engine.core.running
