"""The client gets from the proxy what it would get from the backend directly.

Each arm option (vLLM's extensions on or off, return_token_ids, speculation) meets each client option
(stream or not, include_usage asked or not, return_token_ids asked or not, chat and completions), and
the official openai SDK's ``model_dump()`` of the direct and the proxied response must be equal, ids and
timestamps aside. Backends: the vLLM simulator, and a llama-server-shaped backend (``timings`` on its
last chat chunk, ``usage`` next to ``choices`` on its last completions chunk, ``charset=utf-8``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.server import running_sim
from tests.backends import JSON_UTF8, BackendConfig, running_backend
from tests.proxies import running_proxy, spans
from tests.transparency import ARM_OPTIONS, PROMPT, SPEC, sdk_responses


@pytest.mark.parametrize("arm_options", ARM_OPTIONS)
async def test_sim_responses_through_the_proxy_equal_direct_ones(
    tmp_path: Path, arm_options: dict[str, Any]
) -> None:
    spec = SpeculativeConfig.from_dict(dict(SPEC)) if "speculative" in arm_options else None
    async with running_sim(SimConfig(time_scale=1000, speculative=spec)) as sim:
        arms = [{"name": "arm", "role": "baseline", "url": sim.url, **arm_options}]
        async with running_proxy(tmp_path, arms) as p:
            direct = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
            proxied = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
            model = (await direct.models.list()).data[0].id
            want = await sdk_responses(direct, model)
            got = await sdk_responses(proxied, model)
            await direct.close()
            await proxied.close()
    assert len(got) == len(want) == 12
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"client option combination {i}"
    rows = spans(p.db)
    assert {r["tokens_source"] for r in rows} == {"usage"} and {r["engine"] for r in rows} == {"vllm"}


async def test_llama_server_shaped_responses_keep_timings_usage_and_charset(tmp_path: Path) -> None:
    cfg = BackendConfig(llama_server=True, vllm=False, tokens=7, spec_metrics=True)
    async with running_backend(cfg) as backend:
        arms = [{"name": "arm", "role": "baseline", "url": backend.url}]
        async with running_proxy(tmp_path, arms) as p:
            direct = openai.AsyncOpenAI(base_url=backend.url + "/v1", api_key="unused", max_retries=0)
            proxied = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
            # The first call meets an arm of unknown engine (the proxy asks for include_usage), the
            # later ones an arm known to be llama.cpp (it asks for nothing): both must be identical.
            for _ in range(2):
                want = await sdk_responses(direct, "m")
                got = await sdk_responses(proxied, "m")
                assert got == want
                last_chat_chunk = want[0][-1]
                assert last_chat_chunk["timings"]["predicted_n"] == 12
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": PROMPT, "max_tokens": 3}
                async with s.post(p.url + "/v1/completions", json=body) as r:
                    assert r.headers["Content-Type"] == JSON_UTF8
            await direct.close()
            await proxied.close()
    rows = spans(p.db)
    assert {r["engine"] for r in rows} == {"llamacpp"}
    assert {r["tokens_source"] for r in rows} == {"usage"}
    assert {r["completion_tokens"] for r in rows} == {12, 3}
    # llama-server reports its drafts in timings: the spans carry them, marked as reported.
    assert {r["spec_source"] for r in rows} == {"llamacpp_timings"}
    assert all(r["draft_tokens"] == 2 * r["completion_tokens"] for r in rows)


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    async def start(self, status: int, content_type: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        pass

    def send(self, data: bytes) -> bool:
        self.data += data
        return False

    async def drain(self) -> None:
        pass


def test_a_held_finish_chunk_goes_out_before_done_when_no_usage_chunk_follows() -> None:
    """A backend that ignores include_usage: the finishing chunk held for its timings is released
    by the next event, [DONE], even when [DONE] arrives in a read of its own."""
    from specproxy.proxy.upstream.extras import Strip
    from specproxy.proxy.upstream.relay import StreamConsumer
    from specproxy.proxy.upstream.sse import CompletionTap

    sink = _Sink()
    consumer = StreamConsumer(CompletionTap("chat"), sink, Strip(usage=True))
    content = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}]}\n\n'
    finish = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n'
    for read in (content, finish, b"data: [DONE]\n\n"):
        consumer(read)
    consumer.flush()
    assert bytes(sink.data) == content + finish + b"data: [DONE]\n\n"
