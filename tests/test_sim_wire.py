"""`specproxy sim` speaks vLLM 0.33's OpenAI-compatible API: checked with the official openai client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.server import RunningSim, running_sim

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
EAGLE3 = SpeculativeConfig.from_dict({"method": "eagle3", "model": "e3", "num_speculative_tokens": 3})
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me about the market and the energy plan of the city."}
]


async def _greedy_stream(
    client: openai.AsyncOpenAI, max_tokens: int, request_id: str, extra_body: dict[str, Any]
) -> openai.AsyncStream[ChatCompletionChunk]:
    """QUESTION streamed at temperature 0 with vLLM's request fields ``extra_body``, as ``request_id``."""
    return await client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        extra_body=extra_body,
        extra_headers={"X-Request-Id": request_id},
    )


@pytest.fixture
async def sim() -> AsyncIterator[RunningSim]:
    config = SimConfig(speculative=EAGLE3, time_scale=50, per_request_spec_decode_metrics="summary")
    async with running_sim(config) as running:
        yield running


@pytest.fixture
async def client(sim: RunningSim) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


async def test_chat_non_streaming_shape(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=40, extra_headers={"X-Request-Id": "req-1"}
    )
    assert raw.headers["x-request-id"] == "req-1"
    resp = raw.parse()
    assert resp.id == "chatcmpl-req-1" and resp.object == "chat.completion" and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 40
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 40
    spec = (resp.model_extra or {})["metrics"]["speculative_decoding"]
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{sim.url}/sim/requests/req-1?timeline=1") as r,
    ):
        truth = await r.json()
    assert truth["sent_s"] == [] and sum(truth["emit_tokens"]) == 40  # a whole body: no chunks sent
    assert spec["num_draft_tokens"] == truth["draft_tokens"] == 3 * truth["num_drafts"]
    assert spec["num_accepted_draft_tokens"] == truth["accepted_tokens"]
    assert spec["num_spec_steps"] == truth["num_drafts"] and spec["num_spec_tokens"] == 3
    assert len(spec["acceptance_histogram"]) == 4


async def test_chat_stream_one_chunk_per_step_with_usage_and_token_ids() -> None:
    config = SimConfig(speculative=EAGLE3, time_scale=2, per_request_spec_decode_metrics="detailed")
    async with (
        running_sim(config) as sim,
        openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x") as client,
    ):
        await _stream_checks(client, sim)


async def _stream_checks(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    # vLLM's extensions (continuous_usage_stats is not in the openai client's types)
    usage = {"include_usage": True, "continuous_usage_stats": True}
    stream = await _greedy_stream(
        client, 60, "req-stream", {"stream_options": usage, "return_token_ids": True}
    )
    chunks = [chunk async for chunk in stream]
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant"
    assert (first.model_extra or {})["prompt_token_ids"][0] == 128000
    content = [c for c in chunks if c.choices and (c.choices[0].model_extra or {}).get("token_ids")]
    per_chunk = [len((c.choices[0].model_extra or {})["token_ids"]) for c in content]
    assert sum(per_chunk) == 60
    cumulative = [c.usage.completion_tokens for c in content if c.usage]
    assert cumulative == sorted(cumulative) and cumulative[-1] == 60
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 60
    spec = (last.model_extra or {})["metrics"]["speculative_decoding"]
    url = f"{sim.url}/sim/requests/req-stream?timeline=1"
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        truth = await r.json()
    # The timeline: one sending per chunk with tokens, each after the step that completed it.
    assert len(truth["sent_s"]) == len(content) and truth["sent_s"] == sorted(truth["sent_s"])
    assert len(truth["emit_s"]) >= len(content) and truth["emit_s"][0] == 0
    assert all(sent >= step for sent, step in zip(truth["sent_s"], truth["emit_s"], strict=False))
    # One chunk per engine step (the prefill step's first token, then accepted drafts + the bonus token
    # per decode step); a handler that falls behind merges whole steps, as vLLM's does. So every chunk
    # ends exactly where some step ended.
    step_ends, total = {1}, 1
    for accepted in spec["per_step_accepted"]:
        total = min(60, total + accepted + 1)
        step_ends.add(total)
    chunk_ends = {c.usage.completion_tokens for c in content if c.usage}
    assert chunk_ends <= step_ends
    assert (
        len(content) <= truth["decode_steps"] + 1 and len(spec["per_step_accepted"]) == truth["decode_steps"]
    )
    assert spec["num_accepted_draft_tokens"] == truth["accepted_tokens"]
    assert content[-1].choices[0].finish_reason == "length"


async def test_completions_stream_and_logprobs(client: openai.AsyncOpenAI) -> None:
    resp = await client.completions.create(
        model=MODEL, prompt="The city energy plan", temperature=0, max_tokens=12, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 12
    assert lp.top_logprobs is not None and all(len(t) <= 3 for t in lp.top_logprobs if t)
    assert lp.text_offset == sorted(lp.text_offset or [])
    assert "".join(lp.tokens) == resp.choices[0].text
    stream = await client.completions.create(
        model=MODEL, prompt="The city energy plan", temperature=0, max_tokens=12, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == resp.choices[0].text


async def test_chat_logprobs_shape(client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == item.top_logprobs[0].logprob  # greedy takes the top-1


async def test_stop_strings_min_tokens_ignore_eos(client: openai.AsyncOpenAI) -> None:
    free = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=2000
    )
    assert free.choices[0].finish_reason == "stop"  # natural EOS
    natural = free.usage.completion_tokens  # type: ignore[union-attr]
    longer = await client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=natural + 30,
        extra_body={"ignore_eos": True},
    )
    assert longer.choices[0].finish_reason == "length"
    assert longer.usage.completion_tokens == natural + 30  # type: ignore[union-attr]
    text = free.choices[0].message.content or ""
    word = text.split()[5]
    stopped = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=2000, stop=[" " + word]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert (stopped.model_extra or {}) and stopped.choices[0].model_extra["stop_reason"] == " " + word  # type: ignore[index]
    assert text.startswith(stopped.choices[0].message.content or "\x00")
    assert " " + word not in (stopped.choices[0].message.content or "")
    forced = await client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=natural + 20,
        extra_body={"min_tokens": natural + 10},
    )
    assert forced.usage.completion_tokens >= natural + 10  # type: ignore[union-attr]


async def test_errors_in_vllm_shape(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="nope", messages=QUESTION, temperature=0)
    assert missing.value.status_code == 404
    assert "The model `nope` does not exist." in str(missing.value.body)
    with pytest.raises(openai.BadRequestError) as greedy_n:
        await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, n=2)
    assert greedy_n.value.body["message"] == "n must be 1 when using greedy sampling, got 2."  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=0)
    with pytest.raises(openai.BadRequestError) as opts:
        await client.chat.completions.create(
            model=MODEL, messages=QUESTION, stream_options={"include_usage": True}
        )
    assert "stream=True" in opts.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        # Not supported with speculative decoding.
        await client.chat.completions.create(model=MODEL, messages=QUESTION, logit_bias={"10": 1})


async def test_models_version_health(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with aiohttp.ClientSession() as session:
        async with session.get(sim.url + "/version") as r:
            assert await r.json() == {"version": "0.33.0"}
        async with session.get(sim.url + "/health") as r:
            assert r.status == 200
        async with session.post(sim.url + "/v1/chat/completions", data=b"{not json") as r:
            body = await r.json()
            assert (
                r.status == 400
                and body["error"]["code"] == 400
                and body["error"]["type"] == "BadRequestError"
            )


async def test_category_header_and_raw_sse(sim: RunningSim) -> None:
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 5, "stream": True}
    headers = {"X-Specproxy-Category": "code_edit", "X-Request-Id": "cat-1"}
    async with aiohttp.ClientSession() as session:
        async with session.post(sim.url + "/v1/chat/completions", json=body, headers=headers) as r:
            raw = await r.read()
        async with session.get(sim.url + "/sim/requests/cat-1") as r:
            truth = await r.json()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") for e in events)
    json.loads(events[0][6:])
    assert truth["category"] == "code_edit"


async def test_n_choices_when_sampling(client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0.7, n=3, max_tokens=10, seed=3
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) == 3
    assert resp.usage is not None and resp.usage.completion_tokens == 30
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0.7, n=3, max_tokens=10, seed=3, stream=True
    )
    texts = ["", "", ""]
    finishes = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == [c.message.content for c in resp.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}


async def test_malformed_fields_are_400_not_500(sim: RunningSim) -> None:
    bad_bodies = [
        {"messages": QUESTION, "stop": 5},
        {"messages": "hello"},
        {"messages": QUESTION, "max_tokens": "ten"},
        {"messages": QUESTION, "temperature": -1},
        {"messages": QUESTION, "logprobs": True, "top_logprobs": 50},
        {"messages": QUESTION, "min_tokens": 9, "max_tokens": 3},
    ]
    async with aiohttp.ClientSession() as session:
        for body in bad_bodies:
            async with session.post(sim.url + "/v1/chat/completions", json=body) as r:
                payload = await r.json()
                assert r.status == 400, body
                assert payload["error"]["type"] == "BadRequestError" and payload["error"]["message"]


async def test_stream_interval_batches_tokens(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    stream = await _greedy_stream(client, 41, "batched", {"stream_interval": 10, "return_token_ids": True})
    sizes = [
        len((c.choices[0].model_extra or {})["token_ids"])
        async for c in stream
        if c.choices and (c.choices[0].model_extra or {}).get("token_ids")
    ]
    assert sum(sizes) == 41 and len(sizes) <= 5
    assert all(size >= 10 for size in sizes[1:-1])
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{sim.url}/sim/requests/batched?timeline=1") as r,
    ):
        truth = await r.json()
    # Steps that stream_interval held back go out in one chunk: fewer sendings than steps.
    assert len(truth["sent_s"]) == len(sizes) < len(truth["emit_s"])


TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}


async def test_tools_and_response_format_answer_as_vllm_does(client: openai.AsyncOpenAI) -> None:
    # A server without --enable-auto-tool-choice answers "auto" with a plain completion, no tool calls.
    r = await client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=5,
        tools=[TOOL],
        tool_choice="auto",
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    json_mode = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, response_format={"type": "json_object"}
    )
    assert json_mode.choices[0].message.content
    refused = [
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "Invalid value for `tool_choice`: sometimes!"),
        ({"tools": [], "tool_choice": "auto"}, "`tools` must not be an empty array."),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "does not match any of the specified `tools`",
        ),
        ({"response_format": {"type": "json_schema"}}, "the 'json_schema' field must be provided."),
    ]
    for extra, message in refused:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model=MODEL, messages=QUESTION, temperature=0, extra_body=extra
            )
        assert message in err.value.body["message"]  # type: ignore[index]


async def test_each_step_is_sent_before_the_next_is_planned() -> None:
    # So fast a clock that the engine never sleeps between steps: each step's chunk still goes out
    # on its own, written before the engine plans the next step, not merged with the steps after it.
    async with (
        running_sim(SimConfig(speculative=EAGLE3, time_scale=1e6)) as sim,
        openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x") as client,
    ):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=60,
            stream=True,
            extra_headers={"X-Request-Id": "fast"},
        )
        content = [c async for c in stream if c.choices and c.choices[0].delta.content]
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{sim.url}/sim/requests/fast?timeline=1") as r,
        ):
            truth = await r.json()
    assert len(truth["emit_s"]) > 10
    assert len(truth["sent_s"]) == len(truth["emit_s"]) == len(content)
