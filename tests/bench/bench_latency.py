"""Per-request ITL and TPOT as the proxy records them, against the simulator's own step timeline.

    .venv/bin/python tests/bench/bench_latency.py [--levels 1,4,16,64] [--time-scale 0.25]

One `specproxy sim` (EAGLE3, k = 3) behind `specproxy serve` in split mode with two arms on it: `plain`
(no speculative config: the proxy asks for the final usage only, tokens per chunk unknown) and
`eagle3` (the proxy asks vLLM's continuous usage: tokens per chunk exact). A closed loop sends
streaming chat requests at each concurrency level (``--requests-per-level`` x c, at least 16), each
with its own X-Request-Id. Then the proxy is stopped (its span store complete) and each span is
joined with the simulator's truth for that request (``/sim/requests?timeline=1``): when each engine
step that gave the request tokens landed, and how many it gave.

Per request and level it compares, as relative errors proxy / truth - 1:
- TPOT: the span's ``tpot_s`` vs (last step - first step) / (completion_tokens - 1);
- ITL: the per-call mean gap, ``itl_p50_s``, ``itl_p95_s``, ``itl_p99_s``, ``itl_max_s`` vs the same
  statistics (same percentile method) of the gaps between the request's steps.
It prints the median and 90th percentile of |error|, the share of requests within 2 % (the target), how
many streams arrived with one chunk per step (a client or proxy that reads two steps at once sees one
chunk: a gap of 0 and a doubled one, a true difference in what was delivered, not a timing error), the
simulator's clock lag at the level and the load average: the machine keeps up when the lag is at most
1 % and the load average at most the number of cores (a busy machine delays the proxy's and the
simulator's socket work, which shows first in the per-request tails, P95 to max).

The error against the steps has two parts, printed apart: the proxy's measurement (its figures vs
the same figures from when the simulator handed each chunk to its socket, the timeline's ``sent_s``)
and the simulator's own delivery (sent vs the steps: waking each stream's handler and formatting its
chunk behind the other streams of the step). Then, gap by gap, the differences proxy - sent and
sent - step in milliseconds: a per-request P99 or largest gap is one gap, and carries its noise whole.
``--save FILE`` writes the joined spans and truths as JSON.

``--time-scale`` < 1 slows the simulated engine (its steps take longer in real time) so that a busy
machine's scheduling jitter, a fraction of a millisecond, is small beside a step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import duckdb

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from specproxy.proxy.upstream.calls import upstream_request_id  # noqa: E402
from specproxy.proxy.upstream.latency import quantile  # noqa: E402
from tests.support import free_port, start_cli, stop, wait_http  # noqa: E402

EAGLE3 = {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}
QUESTIONS = (
    "Explain how a cache works and when it is a bad idea to use one.",
    "Write a short story about a team that updates a city energy plan.",
    "Help me plan a three day trip to a country with mountains and lakes.",
    "What are the main differences between a market economy and a planned one?",
)
TARGET = 0.02
METRICS = ("tpot", "itl mean", "itl p50", "itl p95", "itl p99", "itl max")


def write_config(path: Path, sim_url: str) -> Path:
    spec = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in EAGLE3.items()) + " }"
    path.write_text(
        '[experiment]\nname = "bench-latency"\nmode = "split"\n\n'
        f'[[arms]]\nname = "plain"\nrole = "baseline"\nurl = "{sim_url}"\nweight = 1\n\n'
        f'[[arms]]\nname = "eagle3"\nurl = "{sim_url}"\nweight = 1\nspeculative = {spec}\n'
    )
    return path


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


async def closed_loop(url: str, level: int, n: int, max_tokens: int) -> int:
    """``n`` streaming requests, ``level`` at a time, each read to its end; returns the failures."""
    queue = list(range(n))
    failures = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def worker() -> None:
            nonlocal failures
            while queue:
                i = queue.pop()
                body = {
                    "model": "meta-llama/Llama-3.1-8B-Instruct",
                    "messages": [
                        {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({level}-{i})"}
                    ],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                }
                headers = {"X-Request-Id": f"lat-c{level}-{i}", "X-Specproxy-Concurrency-Level": str(level)}
                async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    async for _ in r.content.iter_any():
                        pass
                    failures += r.status != 200

        await asyncio.gather(*(worker() for _ in range(level)))
    return failures


def timeline_figures(times: list[float], completion_tokens: int) -> dict[str, float] | None:
    """ITL and TPOT figures from one request's times (the steps' landings, or the chunks' sending)."""
    if len(times) < 2 or completion_tokens < 2:
        return None
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return {
        "tpot": (times[-1] - times[0]) / (completion_tokens - 1),
        "itl mean": (times[-1] - times[0]) / len(gaps),
        "itl p50": quantile(gaps, 0.5),
        "itl p95": quantile(gaps, 0.95),
        "itl p99": quantile(gaps, 0.99),
        "itl max": gaps[-1],
    }


def truth_figures(truth: dict[str, Any]) -> dict[str, float] | None:
    """The request's ITL and TPOT figures from the simulator's step timeline."""
    return timeline_figures(truth.get("emit_s") or [], truth["completion_tokens"])


def sent_figures(truth: dict[str, Any]) -> dict[str, float] | None:
    """The same figures from when the simulator handed each chunk to its socket."""
    return timeline_figures(truth.get("sent_s") or [], truth["completion_tokens"])


def span_figures(span: dict[str, Any]) -> dict[str, float] | None:
    if span["tpot_s"] is None or span["chunk_gaps_us"] is None:
        return None
    gaps = [int(g) / 1e6 for g in span["chunk_gaps_us"].split(",")]
    return {
        "tpot": span["tpot_s"],
        "itl mean": sum(gaps) / len(gaps),
        "itl p50": span["itl_p50_s"],
        "itl p95": span["itl_p95_s"],
        "itl p99": span["itl_p99_s"],
        "itl max": span["itl_max_s"],
    }


def print_level(
    level: int, rows: list[tuple[dict[str, Any], dict[str, Any]]], lag: float, load: float
) -> None:
    one_per_step = sum(1 for span, truth in rows if span["chunks"] == len(truth["emit_s"]))
    sizes_ok = sum(
        1
        for span, truth in rows
        if span["chunk_tokens"] is not None
        and [int(n) for n in span["chunk_tokens"].split(",")] == truth["emit_tokens"]
    )
    sized = sum(1 for span, _ in rows if span["chunk_tokens"] is not None)
    cores = os.cpu_count() or 1
    keeps_up = "yes" if lag <= 0.01 and load <= cores else "NO"
    print(
        f"c={level}: {len(rows)} requests compared; one chunk per step in {one_per_step}; tokens per chunk "
        f"equal to the steps' in {sizes_ok} of {sized} with counts; sim clock lag {lag:.2%}; load {load:.2f} "
        f"on {cores} cores; the machine keeps up (lag <= 1 %, load <= cores): {keeps_up}"
    )
    print("  proxy vs the steps (the target)")
    print_errors([(span_figures(span), truth_figures(truth)) for span, truth in rows])
    print("  proxy vs the chunks as the simulator sent them (the proxy's measurement)")
    print_errors([(span_figures(span), sent_figures(truth)) for span, truth in rows])
    print("  sent vs the steps (the simulator's own delivery)")
    print_errors([(sent_figures(truth), truth_figures(truth)) for _, truth in rows])
    print_gap_noise(rows)


def print_gap_noise(rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Gap by gap, how far the proxy's gaps are from the sent chunks' and those from the steps' (ms):
    the noise that a per-request P99 or largest gap, a single gap, carries whole."""
    proxy_sent: list[float] = []
    sent_step: list[float] = []
    for span, truth in rows:
        steps, sent = truth["emit_s"], truth.get("sent_s") or []
        if span["chunk_gaps_us"] is None or not span["chunks"] == len(sent) == len(steps):
            continue
        proxy_gaps = [int(g) / 1e6 for g in span["chunk_gaps_us"].split(",")]
        for i, gap in enumerate(proxy_gaps):
            sent_gap, step_gap = sent[i + 1] - sent[i], steps[i + 1] - steps[i]
            proxy_sent.append((gap - sent_gap) * 1000)
            sent_step.append((sent_gap - step_gap) * 1000)
    for name, diffs in (("proxy - sent", proxy_sent), ("sent - step", sent_step)):
        if diffs:
            diffs.sort()
            print(
                f"   gap {name:<12} ms: p1 {quantile(diffs, 0.01):+6.2f}  p50 {quantile(diffs, 0.5):+6.2f}  "
                f"p99 {quantile(diffs, 0.99):+6.2f}  sd {statistics.pstdev(diffs):5.2f}  ({len(diffs)} gaps)"
            )


def print_errors(pairs: list[tuple[dict[str, float] | None, dict[str, float] | None]]) -> None:
    """Per metric: the median, 90th percentile and largest |error| over the requests, and the share
    within the target."""
    usable = [(p, t) for p, t in pairs if p is not None and t is not None]
    for metric in METRICS:
        errors = sorted(abs(p[metric] / t[metric] - 1) for p, t in usable if t[metric] > 0)
        if not errors:
            continue
        within = sum(e <= TARGET for e in errors) / len(errors)
        print(
            f"   {metric:<9} |error| median {statistics.median(errors):7.3%}  "
            f"p90 {quantile(errors, 0.9):7.3%}  max {errors[-1]:7.3%}  within 2 %: {within:6.1%}   "
            f"reference median {statistics.median(t[metric] for _, t in usable) * 1000:7.2f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,4,16,64", help="concurrency levels")
    ap.add_argument("--time-scale", type=float, default=0.25, help="the simulator's --time-scale")
    ap.add_argument("--requests-per-level", type=int, default=2, help="requests per level, times c (min 16)")
    ap.add_argument("--max-tokens", type=int, default=96, help="max_tokens of each request")
    ap.add_argument("--save", type=Path, help="write each level's spans and truths here (JSON)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    sim_port, proxy_port = free_port(), free_port()
    sim_url, proxy_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{proxy_port}"
    sim = start_cli(
        ["sim", "--port", str(sim_port), "--time-scale", str(args.time_scale), "-sc", json.dumps(EAGLE3)]
    )
    serve = None
    lags: dict[int, float] = {}
    loads: dict[int, float] = {}
    try:
        wait_http(sim_url + "/health", 60, sim)
        db = tmp / "spans.duckdb"
        config = write_config(tmp / "exp.toml", sim_url)
        serve = start_cli(
            ["serve", "--config", str(config), "--port", str(proxy_port), "--db", str(db), "--no-scrape"]
        )
        wait_http(proxy_url + "/health", 60, serve)
        print(
            f"simulator: EAGLE3 k=3, h100-llama3.1-8b, time scale {args.time_scale}; proxy: split, "
            f"arms plain and eagle3 on it; {os.cpu_count()} cores; "
            f"load average before {os.getloadavg()[0]:.2f}\n"
        )
        for level in levels:
            before = get_json(sim_url + "/sim/stats")
            n = max(16, args.requests_per_level * level)
            t0 = time.perf_counter()
            failed = asyncio.run(closed_loop(proxy_url, level, n, args.max_tokens))
            after = get_json(sim_url + "/sim/stats")
            busy = after["ideal_busy_wall_s"] - before["ideal_busy_wall_s"]
            lags[level] = (after["lag_s"] - before["lag_s"]) / busy if busy else 0.0
            loads[level] = os.getloadavg()[0]
            print(f"c={level}: {n} requests in {time.perf_counter() - t0:.1f} s, {failed} failed")
        truths = {
            t["request_id"]: t
            for t in get_json(sim_url + "/sim/requests?timeline=1&limit=100000")["requests"]
        }
    finally:
        if serve is not None:
            stop(serve, 60)
        stop(sim)
    with duckdb.connect(str(db), read_only=True) as con:
        rel = con.execute("SELECT * FROM requests WHERE status = 'ok' AND stream ORDER BY t_start_ns")
        names = [d[0] for d in rel.description]
        spans = [dict(zip(names, row, strict=True)) for row in rel.fetchall()]
    print()
    saved: dict[int, list[dict[str, Any]]] = {}
    for level in levels:
        rows = [
            (s, truths[upstream_request_id(s["request_id"])])
            for s in spans
            if s["concurrency_level"] == level and upstream_request_id(s["request_id"]) in truths
        ]
        print_level(level, rows, lags[level], loads[level])
        saved[level] = [{"span": span, "truth": truth} for span, truth in rows]
    if args.save is not None:
        args.save.write_text(json.dumps(saved, default=str))


if __name__ == "__main__":
    main()
