"""Per-call latency in the span: chunk gaps, inter-token latency percentiles, TPOT, tokens per chunk."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from specproxy.config import Arm
from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.server import running_sim
from specproxy.proxy.upstream.calls import new_record, upstream_request_id
from specproxy.proxy.upstream.figures import record_latency
from specproxy.proxy.upstream.latency import chunk_latency, quantile
from specproxy.proxy.upstream.sse import CompletionTap
from tests.proxies import running_proxy, spans, wait_for_calls

SPEC = {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}


def test_quantiles_are_numpys_linear_method() -> None:
    values = sorted([0.3, 0.01, 0.02, 0.5, 0.04, 0.011, 0.07])
    # statistics' "inclusive" method is the same interpolation (type 7), one percentile per cut
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for q in (0.5, 0.95, 0.99):
        assert abs(quantile(values, q) - cuts[round(q * 100) - 1]) < 1e-12
    assert quantile([4.0], 0.99) == 4.0


def test_gaps_percentiles_and_tokens_of_known_arrivals() -> None:
    times = [10.0, 10.010, 10.030, 10.030, 10.100]
    lat = chunk_latency(times, [1, 3, 2, 1, 4], tokens_exact=True)
    assert lat.gaps_us == "10000,20000,0,70000"
    assert lat.tokens == "1,3,2,1,4"
    assert lat.max_s is not None and abs(lat.max_s - 0.070) < 1e-9
    assert lat.p50_s is not None and abs(lat.p50_s - 0.015) < 1e-9  # between 10 ms and 20 ms
    assert lat.p95_s is not None and abs(lat.p95_s - (0.020 + 0.050 * 0.85)) < 1e-9
    assert chunk_latency(times, [1, 1, 1, 1, 1], tokens_exact=False).tokens is None
    one = chunk_latency([3.0], [5], tokens_exact=True)
    assert (one.gaps_us, one.p50_s, one.max_s, one.tokens) == (None, None, None, "5")


def test_the_tap_times_only_chunks_that_carry_output() -> None:
    tap = CompletionTap("chat")
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None}
    tap.feed_data(orjson.dumps(role), 1.0)
    for i, t in enumerate((2.0, 2.5, 4.0)):
        chunk = {"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
        tap.feed_data(orjson.dumps(chunk), t)
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    tap.feed_data(orjson.dumps(usage), 5.0)
    tap.feed_data(b"[DONE]", 5.0)
    assert tap.chunk_times == [2.0, 2.5, 4.0]
    assert len(tap.chunk_times) == len(tap.tokens_per_chunk) == tap.chunks


def _gaps(row: dict[str, Any]) -> list[int]:
    return [int(g) for g in row["chunk_gaps_us"].split(",")]


def _assert_latency_consistent(row: dict[str, Any]) -> None:
    gaps = sorted(_gaps(row))
    assert len(gaps) == row["chunks"] - 1
    assert abs(row["itl_max_s"] - gaps[-1] / 1e6) <= 1e-6
    seconds = [g / 1e6 for g in gaps]
    for col, q in (("itl_p50_s", 0.5), ("itl_p95_s", 0.95), ("itl_p99_s", 0.99)):
        assert abs(row[col] - quantile(seconds, q)) <= 1e-6, col
    assert row["itl_p50_s"] <= row["itl_p95_s"] <= row["itl_p99_s"] <= row["itl_max_s"]
    expected_tpot = (row["e2e_s"] - row["ttft_s"]) / (row["completion_tokens"] - 1)
    assert abs(row["tpot_s"] - expected_tpot) < 1e-9


async def test_simulated_vllm_through_the_proxy_fills_latency_columns(tmp_path: Path) -> None:
    # real time: steps of several milliseconds, so a stream's chunks arrive apart
    cand_cfg = SimConfig(time_scale=1, speculative=SpeculativeConfig.from_dict(dict(SPEC)))
    async with running_sim(SimConfig(time_scale=1)) as base, running_sim(cand_cfg) as cand:
        arms: list[dict[str, Any]] = [
            {"name": "base", "role": "baseline", "url": base.url},
            {"name": "eagle3", "url": cand.url, "speculative": SPEC},
        ]
        async with running_proxy(tmp_path, arms) as p:
            client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
            model = (await client.models.list()).data[0].id
            for i in range(3):
                stream = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"Tell me about caches, part {i}"}],
                    temperature=0,
                    max_tokens=24,
                    stream=True,
                    extra_headers={"X-Request-Id": f"s{i}"},
                )
                assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Not streamed"}],
                temperature=0,
                max_tokens=20,
                extra_headers={"X-Request-Id": "whole"},
            )
            await client.close()
            await wait_for_calls(p, 8)
            async with aiohttp.ClientSession() as s:
                truths = {}
                for i in range(3):
                    url = f"{cand.url}/sim/requests/{upstream_request_id(f's{i}')}?timeline=1"
                    async with s.get(url) as r:
                        truths[f"s{i}"] = await r.json()
    rows = spans(p.db)
    streamed = [r for r in rows if r["request_id"] != "whole"]
    assert len(streamed) == 6 and all(r["status"] == "ok" for r in rows)
    for row in streamed:
        _assert_latency_consistent(row)
    for row in (r for r in streamed if r["arm"] == "eagle3"):
        # continuous usage gives the candidate's tokens per chunk exactly; each chunk is one or more
        # of the engine's steps, so the chunks never outnumber the steps that gave tokens
        sizes = [int(n) for n in row["chunk_tokens"].split(",")]
        truth = truths[row["request_id"]]
        assert len(sizes) == row["chunks"] and sum(sizes) == row["completion_tokens"]
        assert sum(truth["emit_tokens"]) == truth["completion_tokens"] == row["completion_tokens"]
        assert truth["emit_s"][0] == 0 and truth["emit_s"] == sorted(truth["emit_s"])
        assert len(truth["emit_s"]) == len(truth["emit_tokens"])
        assert row["chunks"] <= len(truth["emit_tokens"])
        assert max(sizes) > 1  # speculation gives bursts
    for row in (r for r in streamed if r["arm"] == "base"):
        assert row["chunk_tokens"] is None  # one token per chunk is assumed there, not reported
    for row in (r for r in rows if r["request_id"] == "whole"):
        assert row["tpot_s"] is None and row["chunk_gaps_us"] is None and row["itl_p50_s"] is None


def test_a_stream_answered_in_one_chunk_has_no_tpot_or_itl() -> None:
    arm = Arm(name="base", role="baseline", url="http://127.0.0.1:9")
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    record = new_record("run", "r1", arm, body, endpoint="chat", routed_as="primary")
    tap = CompletionTap("chat")
    whole = {"choices": [{"index": 0, "delta": {"content": "a b c d"}, "token_ids": [1, 2, 3, 4]}]}
    tap.feed_data(orjson.dumps(whole), 10.2)
    record.e2e_s, record.ttft_s, record.completion_tokens = 0.5, 0.2, 4
    record_latency(record, tap)
    assert record.tpot_s is None and record.chunk_gaps_us is None and record.itl_p50_s is None
    assert record.chunk_tokens == "4"
    tap.feed_data(orjson.dumps(whole), 10.4)  # a second chunk: now the time between tokens is seen
    record.completion_tokens = 8
    record_latency(record, tap)
    assert record.tpot_s == pytest.approx(0.3 / 7) and record.chunk_gaps_us == "200000"
