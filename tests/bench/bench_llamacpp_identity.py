"""Identity of real llama.cpp servers through specproxy: plain vs prompt lookup, with near-tie triage.

    SPECPROXY_TEST_GGUF=model.gguf PYTHONPATH=. .venv/bin/python tests/bench/bench_llamacpp_identity.py
    ... --plain http://127.0.0.1:8001 --lookup http://127.0.0.1:8002   # servers already running

Starts two llama-cpp-python servers on the GGUF (plain, and ``--draft_model prompt-lookup-decoding``),
or uses the two given. Each prompt is sent as a greedy streamed chat asking for the top-2 logprobs,
first directly to each server, then through specproxy (baseline plain, the lookup arm shadowed), one
call at a time (llama-cpp-python's server aborts a running request when the next one arrives). Prints:

- identical outputs, direct (the two servers' own answers compared) vs the proxy's spans: the counts
  must be equal, and so must the verdict per prompt;
- for every mismatch, the first divergence (character) and the baseline's top-1 minus top-2 logprob
  there: a margin ≤ 0.5 nat is a near-tie that the lookup arm's different batch shapes can flip
  (llama.cpp's numerics differ with the number of tokens evaluated at once), a larger one a real bug;
- the engine each span names, its token source and acceptance source, and how many spans' token
  counts equal the server's (the logprob entries of the direct stream, one per generated token; with
  ``SPECPROXY_TEST_GGUF`` set the arms count with the GGUF's own tokenizer, else by the text estimate).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from specproxy.proxy.upstream.calls import UpstreamState
from tests.proxies import running_proxy, spans
from tests.support import engine_servers

PROMPTS = [
    "Repeat exactly: def add(a, b):\n    return a + b",
    "Copy this list: red, green, blue, red, green, blue",
    "Say hi",
    "Rewrite in plain words: the cache holds the batch while the scheduler keeps it full.",
    "List the days of the week.",
    "Summarise: Ana lives in Lisbon, Ben lives in Boston, and Chen moved from Boston to Chengdu.",
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "Explain what a tokenizer does in two sentences.",
    "Continue the sequence: 1, 2, 3, 4, 5, 6, 7,",
    "Translate to French: good morning, my friend.",
]
LOOKUP = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
NEAR_TIE = 0.5  # nat; the report's near-tie threshold


@contextmanager
def llama_servers(gguf: str) -> Iterator[dict[str, str]]:
    """A plain llama-cpp-python server and a prompt-lookup one on ``gguf``, ready."""
    command = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "1024", "--seed", "0"]
    variants = {"plain": [], "lookup": ["--draft_model", "prompt-lookup-decoding"]}
    logs = Path(tempfile.mkdtemp(prefix="llama-bench-"))
    with engine_servers(command, variants, ready_path="/v1/models", logs=logs, timeout=300) as urls:
        yield urls


def _body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
    }


async def _text(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, int]:
    """A streamed chat's text and its tokens (logprob entries, one per generated token)."""
    parts: list[str] = []
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    parts.append((choice.get("delta") or {}).get("content") or "")
                    tokens += len((choice.get("logprobs") or {}).get("content") or ())
    return "".join(parts), tokens


async def _until_idle(state: UpstreamState, url: str) -> None:
    async with asyncio.timeout(600):
        while state.inflight.get(url, 0):
            await asyncio.sleep(0.05)


async def measure(urls: dict[str, str], max_tokens: int, gguf: str | None) -> None:
    direct: dict[tuple[str, str], tuple[str, int]] = {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for prompt in PROMPTS:
            for name in ("plain", "lookup"):
                direct[(name, prompt)] = await _text(session, urls[name], _body(prompt, max_tokens))
        arms: list[dict[str, Any]] = [
            {"name": "plain", "role": "baseline", "url": urls["plain"]},
            {"name": "lookup", "url": urls["lookup"], "speculative": LOOKUP},
        ]
        if gguf:
            arms = [{**arm, "tokenizer": gguf} for arm in arms]
        with tempfile.TemporaryDirectory() as tmp:
            async with running_proxy(Path(tmp), arms) as p:
                for prompt in PROMPTS:
                    await _text(session, p.url, _body(prompt, max_tokens))
                    await _until_idle(p.state.upstream, urls["lookup"])
            rows = spans(p.db)
    report(direct, rows)


def report(direct: dict[tuple[str, str], tuple[str, int]], rows: list[dict[str, Any]]) -> None:
    same_direct = {pr: direct[("plain", pr)][0] == direct[("lookup", pr)][0] for pr in PROMPTS}
    # One call at a time: the k-th candidate span (by start) is the k-th prompt's.
    cands = dict(zip(PROMPTS, [r for r in rows if r["arm"] == "lookup"], strict=True))
    print(f"\nplain vs prompt lookup, {len(PROMPTS)} greedy streamed chats asking top-2 logprobs")
    print(f"  identical, direct calls:      {sum(same_direct.values())}/{len(PROMPTS)}")
    print(f"  identical, the proxy's spans: {sum(bool(r['identical']) for r in cands.values())}/{len(cands)}")
    agree = sum(bool(cands[pr]["identical"]) is same for pr, same in same_direct.items() if pr in cands)
    print(f"  per prompt, span verdict = direct verdict: {agree}/{len(PROMPTS)}")
    near = gross = unknown = 0
    for pr, r in cands.items():
        if r["identical"]:
            continue
        margin = r["divergence_margin"]
        kind = (
            "margin unknown" if margin is None else "near-tie" if abs(margin) <= NEAR_TIE else "REAL MISMATCH"
        )
        near += kind == "near-tie"
        gross += kind == "REAL MISMATCH"
        unknown += margin is None
        at = r["first_divergence"]
        base = direct[("plain", pr)][0]
        shown = "—" if margin is None else f"{abs(margin):.3f}"
        where = base[max(0, at - 12) : at + 8]
        print(f"    {pr[:40]!r:<44} diverges at char {at} ({where!r}), margin {shown}: {kind}")
    print(f"  mismatches: {near} near-tie (≤ {NEAR_TIE} nat), {gross} beyond, {unknown} without a margin")
    for arm in ("plain", "lookup"):
        mine = [r for r in rows if r["arm"] == arm]
        facts = sorted({(r["engine"], r["tokens_source"], r["spec_source"]) for r in mine}, key=str)
        print(f"  {arm}: {len(mine)} spans, (engine, tokens_source, spec_source) = {facts}")
        true = [direct[(arm, pr)][1] for pr in PROMPTS]
        exact = sum(r["completion_tokens"] == t for r, t in zip(mine, true, strict=True))
        worst = max(abs(r["completion_tokens"] - t) / t for r, t in zip(mine, true, strict=True))
        print(f"    completion_tokens = the server's count: {exact}/{len(mine)} (worst error {worst:.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--plain", help="a running plain llama-cpp-python server's URL")
    parser.add_argument("--lookup", help="a running prompt-lookup llama-cpp-python server's URL")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    gguf = os.environ.get("SPECPROXY_TEST_GGUF")
    if args.plain and args.lookup:
        asyncio.run(measure({"plain": args.plain, "lookup": args.lookup}, args.max_tokens, gguf))
        return
    if not gguf:
        sys.exit("set SPECPROXY_TEST_GGUF to a GGUF model, or pass --plain and --lookup")
    with llama_servers(gguf) as urls:
        asyncio.run(measure(urls, args.max_tokens, gguf))


if __name__ == "__main__":
    main()
