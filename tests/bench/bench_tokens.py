"""Token counts and acceptance estimates against the simulator's truth; direct vs proxied responses.

    PYTHONPATH=. .venv/bin/python tests/bench/bench_tokens.py                 # ~30 s on 2 busy cores
    PYTHONPATH=. .venv/bin/python tests/bench/bench_tokens.py --requests 48 --max-tokens 128

Prints three tables:

(1) completion_tokens against the simulator's own count, per speculative method, three ways: the
    backend's usage (what a span records when the engine sends it), the model's tokenizer on the
    streamed text (what it records without usage when a tokenizer.json is given; the simulator's
    word-level tokenizer, engines/sim/tokenizer.py), and the documented text estimate (without
    either). Exact share, mean and worst error.
(1b) with llama-cpp-python installed and ``SPECPROXY_TEST_GGUF`` naming a GGUF model: the text estimate
    against that model's own tokenizer on 150-word windows of this repository's Markdown and Python.
(2) the stream-shape acceptance estimate against the simulator's truth at c=1 and c=16 for eagle3,
    draft_model and ngram (the simulator reports nothing per request here, so the estimate is what a
    span gets): mean acceptance length estimated vs true, its error, and the share of spans the
    estimator marked reliable (``stream_shape``) rather than ``stream_shape_unreliable``. Each call to a
    speculating arm is shadowed by one to a plain arm under the same load, as in shadow mode.
(3) the openai SDK's model_dump() of direct and proxied responses over every arm option and client
    option (tests/test_transparency.py's matrix): how many are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any, cast

import aiohttp
import openai

from specproxy.config import Arm
from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.server import RunningSim, running_sim
from specproxy.engines.sim.tokenizer import write_tokenizer_json
from specproxy.proxy.upstream.calls import UpstreamState, call_arm, new_record
from specproxy.proxy.upstream.tokens import TEXT_ESTIMATE_ERROR, end_tokens, estimate_tokens, load_tokenizer
from specproxy.proxy.upstream.wire import UpstreamClient
from tests.proxies import running_proxy
from tests.transparency import ARM_OPTIONS, SPEC, sdk_responses

METHODS: dict[str, dict[str, Any]] = {
    "eagle3": {
        "method": "eagle3",
        "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "num_speculative_tokens": 3,
    },
    "draft_model": {
        "method": "draft_model",
        "model": "meta-llama/Llama-3.2-1B-Instruct",
        "num_speculative_tokens": 4,
    },
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}
PROMPTS = [
    "Summarise this report: the cache holds the batch and the server answers each request quickly, "
    "while the scheduler keeps the batch full. The cache holds the batch.",
    "Rewrite this function: def area(width, height): return width * height  # area of a rectangle",
    "What is a good plan for a small team that wants to ship a new feature next month?",
    "Extract every name and city: Ana lives in Lisbon, Ben in Boston, and Chen moved to Chengdu.",
]


async def _truth(session: aiohttp.ClientSession, sim: RunningSim, request_id: str) -> dict[str, Any]:
    async with session.get(f"{sim.url}/sim/requests/{request_id}") as r:
        return dict(await r.json())


async def run_level(
    sims: dict[str, RunningSim], method: str, level: int, requests: int, max_tokens: int
) -> list[dict[str, Any]]:
    """``requests`` streamed chats to the method's arm, each shadowed to the plain arm, ``level`` at once."""
    state = UpstreamState()
    base = Arm(name="base", url=sims["plain"].url, role="baseline")
    # Token ids let the n-gram estimate replay the prompt lookup (count drafts only where it matched).
    cand = Arm(name=method, url=sims[method].url, speculative=METHODS[method], return_token_ids=True)
    queue = list(range(requests))
    rows: list[dict[str, Any]] = []
    async with UpstreamClient() as client, aiohttp.ClientSession() as session:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                body = {
                    "model": "meta-llama/Llama-3.1-8B-Instruct",
                    "messages": [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} ({i})"}],
                    "temperature": 0,
                    "max_tokens": max_tokens,
                    "stream": True,
                }
                rid = uuid.uuid4().hex
                calls = []
                for arm in (base, cand):
                    rec = new_record(
                        "bench", rid, arm, body, endpoint="chat", routed_as="shadow", source="replay"
                    )
                    calls.append(call_arm(client, arm, body, endpoint="chat", record=rec, state=state))
                _, result = await asyncio.gather(*calls)
                truth = await _truth(session, sims[method], rid)
                rows.append({"record": result.record, "text": result.text, "truth": truth})

        await asyncio.gather(*(worker() for _ in range(level)))
    return rows


def token_table(rows: dict[str, list[dict[str, Any]]], tokenizer_path: Path) -> None:
    tokenizer = load_tokenizer(str(tokenizer_path))
    print("\n(1) completion_tokens vs the simulator's count (streamed chat, all levels)")
    print(f"  {'method':<12} {'source':<14} {'exact':>7} {'mean err':>9} {'worst':>7}")
    for method, items in rows.items():
        truth = [r["truth"]["completion_tokens"] for r in items]
        sources = {
            "usage": [r["record"].completion_tokens for r in items],
            # What a span records without usage: the text's ids plus the end token it stopped on.
            "tokenizer": [tokenizer.count(r["text"]) + end_tokens(r["record"].finish_reason) for r in items],
            "text_estimate": [estimate_tokens(r["text"]) for r in items],
        }
        for source, counts in sources.items():
            errors = [abs(c - t) / t for c, t in zip(counts, truth, strict=True) if t]
            exact = sum(c == t for c, t in zip(counts, truth, strict=True))
            print(
                f"  {method:<12} {source:<14} {exact:>3}/{len(truth):<3} {statistics.mean(errors):>8.1%} "
                f"{max(errors):>7.1%}"
            )
        used = {r["record"].tokens_source for r in items}
        stopped = sum(r["record"].finish_reason == "stop" for r in items)
        recorded = ", ".join(sorted(str(u) for u in used))
        print(f"  {'':<12} (spans recorded tokens_source = {recorded}; {stopped} of {len(items)} ended on")
        print(f"  {'':<12}  the end token, finish_reason stop, which the tokenizer path counts as +1)")
    print(f"  stated error of the text estimate: {TEXT_ESTIMATE_ERROR:.0%}")


def real_tokenizer_table() -> None:
    """The text estimate against a real BPE tokenizer (a GGUF's, through llama-cpp-python)."""
    gguf = os.environ.get("SPECPROXY_TEST_GGUF")
    if not gguf or importlib.util.find_spec("llama_cpp") is None:
        print("\n(1b) skipped: set SPECPROXY_TEST_GGUF and install llama-cpp-python for a real tokenizer")
        return
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, vocab_only=True, verbose=False)
    root = Path(__file__).resolve().parents[2]
    print(f"\n(1b) text estimate vs {Path(gguf).name}'s tokenizer, 150-word windows")
    print(f"  {'files':<10} {'windows':>8} {'mean':>7} {'mean abs':>9} {'p90 abs':>8}")
    for label, pattern in (("Markdown", "**/*.md"), ("Python", "**/*.py")):
        errors = []
        for path in root.glob(pattern):
            if ".venv" in path.parts:
                continue
            words = path.read_text(errors="replace").split(" ")
            for i in range(0, len(words) - 150, 150):
                text = " " + " ".join(words[i : i + 150])
                true = len(llm.tokenize(text.encode(), add_bos=False, special=False))
                errors.append((estimate_tokens(text) - true) / true)
        absolute = sorted(abs(e) for e in errors)
        p90 = absolute[int(0.9 * len(absolute))]
        mean_abs = statistics.mean(absolute)
        print(f"  {label:<10} {len(errors):>8} {statistics.mean(errors):>+7.1%} {mean_abs:>9.1%} {p90:>8.1%}")


def _mean_error(items: list[dict[str, Any]]) -> float | None:
    est = [r["record"].acceptance_length for r in items if r["record"].acceptance_length is not None]
    true = [r["truth"]["acceptance_length"] for r in items if r["truth"]["acceptance_length"] is not None]
    if not est or not true:
        return None
    return float((statistics.mean(est) - statistics.mean(true)) / statistics.mean(true))


def shape_table(results: dict[tuple[str, int], list[dict[str, Any]]]) -> None:
    print("\n(2) stream-shape acceptance length vs truth (mean over the level; 'reliable': spans marked")
    print("    stream_shape, and the error of their mean)")
    head = f"  {'method':<12} {'c':>3} {'estimated':>10} {'true':>7} {'error':>7}"
    print(f"{head} {'reliable':>9} {'its error':>10}  verdict")
    for (method, level), items in results.items():
        err = _mean_error(items)
        trusted = [r for r in items if r["record"].spec_source == "stream_shape"]
        trusted_err = _mean_error(trusted) if trusted else None
        est = statistics.mean(r["record"].acceptance_length or 0.0 for r in items)
        true = statistics.mean(r["truth"]["acceptance_length"] or 0.0 for r in items)
        if err is None:
            print(f"  {method:<12} {level:>3} {'—':>10}")
            continue
        if trusted_err is not None and abs(trusted_err) > 0.10:
            verdict = "RELIABLE SPANS OFF BY MORE THAN 10 %"
        elif abs(err) <= 0.10:
            verdict = "within 10 %"
        else:
            verdict = "off, flagged unreliable"
        share = f"{len(trusted)}/{len(items)}"
        shown = f"{trusted_err:+.1%}" if trusted_err is not None else "—"
        line = f"  {method:<12} {level:>3} {est:>10.2f} {true:>7.2f} {err:>+7.1%}"
        print(f"{line} {share:>9} {shown:>10}  {verdict}")


async def transparency_count() -> tuple[int, int]:
    same = total = 0
    spec = SpeculativeConfig.from_dict(dict(SPEC))
    for param in ARM_OPTIONS:
        options = dict(cast(dict[str, Any], param.values[0]))
        sim_spec = spec if "speculative" in options else None
        async with running_sim(SimConfig(time_scale=1000, speculative=sim_spec)) as sim:
            with tempfile.TemporaryDirectory() as tmp:
                arms = [{"name": "arm", "role": "baseline", "url": sim.url, **options}]
                async with running_proxy(Path(tmp), arms) as p:
                    direct = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
                    proxied = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
                    model = (await direct.models.list()).data[0].id
                    want, got = await sdk_responses(direct, model), await sdk_responses(proxied, model)
                    await direct.close()
                    await proxied.close()
        same += sum(g == w for g, w in zip(got, want, strict=True))
        total += len(want)
    return same, total


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32, help="requests per method and level")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--time-scale", type=float, default=4.0, help="simulator speed-up over real time")
    args = parser.parse_args()
    configs = {"plain": None, **{m: SpeculativeConfig.from_dict(dict(s)) for m, s in METHODS.items()}}
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    async with running_sim(SimConfig(time_scale=args.time_scale)) as plain:
        sims: dict[str, RunningSim] = {"plain": plain}
        for method, spec in configs.items():
            if spec is None:
                continue
            async with running_sim(SimConfig(time_scale=args.time_scale, speculative=spec)) as sim:
                sims[method] = sim
                for level in (1, 16):
                    results[(method, level)] = await run_level(
                        sims, method, level, args.requests, args.max_tokens
                    )
    by_method: dict[str, list[dict[str, Any]]] = {}
    for (method, _), items in results.items():
        by_method.setdefault(method, []).extend(items)
    with tempfile.TemporaryDirectory() as tmp:
        token_table(by_method, write_tokenizer_json(Path(tmp) / "sim-tokenizer.json"))
    real_tokenizer_table()
    shape_table(results)
    same, total = await transparency_count()
    print(
        f"\n(3) openai SDK model_dump() direct vs proxied: {same}/{total} identical (ids, timestamps aside)"
    )


if __name__ == "__main__":
    asyncio.run(main())
