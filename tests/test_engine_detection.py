"""An arm's engine, detected from what its server says about itself before the first call."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from specproxy.proxy.upstream.engines import engine_of_models
from tests.backends import serving_app
from tests.proxies import running_proxy, spans

# llama-cpp-python 0.3.36's server, as recorded: /v1/models says owned_by "me" beside a permissions
# list; answers echo the requested model, carry no engine field, and are serialized by json.dumps.
LLAMA_CPP_PYTHON_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            "object": "model",
            "owned_by": "me",
            "permissions": [],
        }
    ],
}
WORDS = ["I", "'m", " glad", " you", "'re"]


@pytest.mark.parametrize(
    ("listing", "engine"),
    [
        (LLAMA_CPP_PYTHON_MODELS, "llamacpp"),
        ({"data": [{"id": "m", "object": "model", "owned_by": "llamacpp", "meta": {}}]}, "llamacpp"),
        ({"data": [{"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 8192}]}, "vllm"),
        ({"data": [{"id": "m", "object": "model", "owned_by": "sglang"}]}, "sglang"),
        ({"data": [{"id": "m", "object": "model", "owned_by": "me"}]}, None),  # "me" alone is no proof
        ({"data": [{"id": "m", "object": "model", "owned_by": "openai"}]}, None),
        ({"data": "nonsense"}, None),
        (None, None),
    ],
)
def test_models_listing_names_the_engine_by_its_owner(listing: Any, engine: str | None) -> None:
    assert engine_of_models(listing) == engine


def _chunk(cid: str, model: str, delta: dict[str, str], finish: str | None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    body = {"id": cid, "model": model, "created": 1796170865, "object": "chat.completion.chunk"}
    return f"data: {json.dumps({**body, 'choices': [choice]})}\n\n".encode()


@asynccontextmanager
async def llama_cpp_python_fake(owner: str) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A server answering in llama-cpp-python's shapes; yields its URL and the bodies it received."""
    bodies: list[dict[str, Any]] = []
    listing = json.loads(json.dumps(LLAMA_CPP_PYTHON_MODELS))
    listing["data"][0]["owned_by"] = owner

    async def models(_: web.Request) -> web.Response:
        return web.json_response(listing, headers={"server": "uvicorn"})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        cid = f"chatcmpl-{uuid.uuid4()}"
        await resp.write(_chunk(cid, body["model"], {"role": "assistant"}, None))
        for word in WORDS:
            await resp.write(_chunk(cid, body["model"], {"content": word}, None))
        await resp.write(_chunk(cid, body["model"], {}, "length"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    async with serving_app(app) as port:
        yield f"http://127.0.0.1:{port}", bodies


@pytest.mark.parametrize(("owner", "engine"), [("me", "llamacpp"), ("someone", "unknown")])
async def test_a_llama_cpp_python_server_is_detected_before_the_first_call(
    tmp_path: Path, owner: str, engine: str
) -> None:
    async with llama_cpp_python_fake(owner) as (url, bodies):
        async with running_proxy(tmp_path, [{"name": "plain", "role": "baseline", "url": url}]) as p:
            client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            await client.close()
    assert text == "".join(WORDS)
    (row,) = spans(p.db)
    assert row["engine"] == engine and row["completion_tokens"] and row["tokens_source"] == "text_estimate"
    # A llama.cpp arm is sent the client's body as it is; an unknown one is asked for usage too.
    assert ("stream_options" in bodies[0]) is (engine == "unknown")
