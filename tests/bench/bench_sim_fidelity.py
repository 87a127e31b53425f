"""Fidelity of `specproxy sim` against published numbers, one column per cost profile.

    .venv/bin/python tests/bench/bench_sim_fidelity.py            # everything (~2-3 min)
    .venv/bin/python tests/bench/bench_sim_fidelity.py --no-http  # virtual-time checks only (~30 s)

Checks (targets from published measurements):
  (1) fixed alpha, gamma=4, zero draft cost: mean tokens per step within 2 % of (1-a^(g+1))/(1-a);
  (2) EAGLE3 chain 3 on MT-bench-like chat: throughput vs no speculation at batch 2/8/32/64 within
      +-20 % of EAGLE-3 Table 3 (1.81/1.62/1.32/1.38); plain decode at batch 1 within +-15 % of 140-158 tok/s;
  (3) n-gram on summarization: >= 1.5x per-user decode at concurrency 1 and < 1.0x aggregate at the
      highest concurrency (vLLM blog, 2024-10-17); on open chat < 1.2x;
  (4) one simulator process, 512 concurrent streams, real time: clock lag <= 5 %.

(1)-(3) drive the engine model on a virtual clock (exact, fast: `specproxy.engines.sim.virtual`);
the HTTP section re-measures batch-1 plain decode and the batch-8 EAGLE3 ratio through a real
`specproxy sim` subprocess and the real clock, and runs (4). The published targets are H100 numbers:
they are pass/fail for h100 profiles and shown for reference beside the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from specproxy.engines.profiles import load_profile, profile_names
from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.virtual import chat_workload, run_closed_loop, summarization_workload

EAGLE3 = {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}
# The vLLM blog's n-gram setup: 5 speculative tokens, lookup up to 4 tokens back, any match length.
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
TABLE3 = {2: 1.81, 8: 1.62, 32: 1.32, 64: 1.38}
HIGHEST_CONCURRENCY = 256


@dataclass
class Row:
    check: str
    target: str
    passes: Callable[[float], bool] | None
    values: dict[str, float]
    fmt: str = "{:.2f}"


def within(expected: float, rel: float) -> Callable[[float], bool]:
    """Passes values within ``rel`` (a fraction) of ``expected``."""
    return lambda v: abs(v / expected - 1) <= rel


def _config(profile: str, spec: dict[str, Any] | None, **kw: Any) -> SimConfig:
    return SimConfig(profile=profile, speculative=SpeculativeConfig.from_dict(spec) if spec else None, **kw)


def virtual_rows(profiles: list[str]) -> list[Row]:
    chat = chat_workload(96)
    summ = summarization_workload(64)
    rows: list[Row] = []
    for alpha, expected in ((0.8, (1 - 0.8**5) / 0.2), (0.5, (1 - 0.5**5) / 0.5)):
        spec = {
            "method": "draft_model",
            "model": "x",
            "num_speculative_tokens": 4,
            "synthetic_acceptance_rate": alpha,
        }
        values = {}
        for p in profiles:
            r = run_closed_loop(
                _config(p, spec), chat, concurrency=8, num_requests=64, max_tokens=400, ignore_eos=True
            )
            values[p] = r.acceptance_length
        rows.append(
            Row(
                f"(1) tokens/step, alpha={alpha}, gamma=4",
                f"{expected:.3f} +-2%",
                within(expected, 0.02),
                values,
                "{:.3f}",
            )
        )
    values = {}
    for p in profiles:
        r = run_closed_loop(_config(p, None), chat, concurrency=1, num_requests=8)
        values[p] = r.mean_decode_tok_s
    rows.append(
        Row(
            "(2) plain decode, batch 1 (tok/s)",
            "140-158 +-15%",
            lambda v: 140 * 0.85 <= v <= 158 * 1.15,
            values,
            "{:.1f}",
        )
    )
    for batch, ref in TABLE3.items():
        values = {}
        for p in profiles:
            n = max(3 * batch, 24)
            base = run_closed_loop(_config(p, None), chat, concurrency=batch, num_requests=n)
            eagle = run_closed_loop(_config(p, EAGLE3), chat, concurrency=batch, num_requests=n)
            values[p] = eagle.output_tok_s / base.output_tok_s
        rows.append(
            Row(
                f"(2) EAGLE3 k=3 chat, batch {batch}: x baseline",
                f"{ref:.2f} +-20%",
                within(ref, 0.20),
                values,
            )
        )
    low: dict[str, float] = {}
    high: dict[str, float] = {}
    open_chat: dict[str, float] = {}
    for p in profiles:
        base1 = run_closed_loop(_config(p, None), summ, concurrency=1, num_requests=12)
        ngram1 = run_closed_loop(_config(p, NGRAM), summ, concurrency=1, num_requests=12)
        low[p] = ngram1.mean_decode_tok_s / base1.mean_decode_tok_s
        n = 2 * HIGHEST_CONCURRENCY
        baseh = run_closed_loop(_config(p, None), summ, concurrency=HIGHEST_CONCURRENCY, num_requests=n)
        ngramh = run_closed_loop(_config(p, NGRAM), summ, concurrency=HIGHEST_CONCURRENCY, num_requests=n)
        high[p] = ngramh.output_tok_s / baseh.output_tok_s
        basec = run_closed_loop(_config(p, None), chat, concurrency=1, num_requests=12)
        ngramc = run_closed_loop(_config(p, NGRAM), chat, concurrency=1, num_requests=12)
        open_chat[p] = ngramc.mean_decode_tok_s / basec.mean_decode_tok_s
    rows.append(Row("(3) n-gram summarization, conc 1: per-user x", ">= 1.5", lambda v: v >= 1.5, low))
    rows.append(
        Row(
            f"(3) n-gram summarization, conc {HIGHEST_CONCURRENCY}: aggregate x",
            "< 1.0",
            lambda v: v < 1.0,
            high,
        )
    )
    rows.append(Row("(3) n-gram open chat, conc 1: per-user x", "< 1.2", lambda v: v < 1.2, open_chat))
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SimProcess:
    def __init__(self, profile: str, spec: dict[str, Any] | None, *extra: str) -> None:
        self.port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "specproxy",
            "sim",
            "--port",
            str(self.port),
            "--profile",
            profile,
            *extra,
        ]
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("simulator did not come up")

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/sim/stats", timeout=5) as resp:
            result: dict[str, Any] = json.loads(resp.read())
            return result

    def cpu_s(self) -> float:
        """User + system CPU seconds the simulator process has used (Linux /proc)."""
        fields = open(f"/proc/{self.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _stream(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[int, float]:
    """(tokens, decode seconds) for one streamed chat request, counted from continuous usage."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    first = last = 0.0
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or {}
            if chunk.get("choices") and usage.get("completion_tokens", 0) > tokens:
                now = time.monotonic()
                if tokens == 0:
                    first = now
                last = now
                tokens = usage["completion_tokens"]
    return tokens, last - first


async def _closed_loop(url: str, concurrency: int, requests: int, max_tokens: int) -> tuple[float, float]:
    """(aggregate tok/s, mean per-user decode tok/s) over HTTP."""
    prompts = [f"Question {i}: tell me about the market and the energy plan for the city." for i in range(64)]
    connector = aiohttp.TCPConnector(limit=0)
    rates: list[float] = []
    total = 0
    issued = 0

    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:

        async def worker() -> None:
            nonlocal issued, total
            while issued < requests:
                i = issued
                issued += 1
                tokens, decode_s = await _stream(session, url, prompts[i % len(prompts)], max_tokens)
                total += tokens
                if decode_s > 0:
                    rates.append((tokens - 1) / decode_s)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - start
    return total / elapsed, sum(rates) / len(rates)


async def _capacity(url: str, streams: int, seconds: float) -> int:
    """`streams` concurrent streams, each re-issued until `seconds` pass; returns chunks read."""
    chunks = 0
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:

        async def worker(i: int) -> None:
            nonlocal chunks
            body = {
                "messages": [{"role": "user", "content": f"Stream {i}: describe the data system."}],
                "temperature": 0,
                "max_tokens": 256,
                "ignore_eos": True,
                "stream": True,
            }
            while time.monotonic() < deadline:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    async for _ in resp.content.iter_any():
                        chunks += 1

        await asyncio.gather(*(worker(i) for i in range(streams)))
    return chunks


def http_rows(profiles: list[str], streams: int, seconds: float) -> list[Row]:
    decode: dict[str, float] = {}
    ratio8: dict[str, float] = {}
    lag: dict[str, float] = {}
    duty: dict[str, float] = {}
    load: dict[str, float] = {}
    for p in profiles:
        sim = SimProcess(p, None)
        try:
            _, decode[p] = asyncio.run(_closed_loop(sim.url, 1, 3, 256))
            base8, _ = asyncio.run(_closed_loop(sim.url, 8, 16, 256))
        finally:
            sim.stop()
        sim = SimProcess(p, EAGLE3)
        try:
            spec8, _ = asyncio.run(_closed_loop(sim.url, 8, 16, 256))
        finally:
            sim.stop()
        ratio8[p] = spec8 / base8
        sim = SimProcess(p, None, "--max-num-seqs", str(streams))
        try:
            cpu0 = sim.cpu_s()
            asyncio.run(_capacity(sim.url, streams, seconds))
            stats = sim.stats()
            lag[p] = stats["clock_lag_ratio"]
            # CPU the simulator spent per modelled second: below 1 it could keep its clock given one core.
            duty[p] = (sim.cpu_s() - cpu0) / stats["ideal_busy_wall_s"]
            load[p] = os.getloadavg()[0]
        finally:
            sim.stop()
    return [
        Row(
            "HTTP (2) plain decode, batch 1 (tok/s)",
            "140-158 +-15%",
            lambda v: 140 * 0.85 <= v <= 158 * 1.15,
            decode,
            "{:.1f}",
        ),
        Row(
            "HTTP (2) EAGLE3 k=3, batch 8: x baseline",
            "1.62 +-20%",
            lambda v: abs(v / 1.62 - 1) <= 0.2,
            ratio8,
        ),
        Row(f"HTTP (4) {streams} streams, real time: clock lag", "<= 5%", lambda v: v <= 0.05, lag, "{:.1%}"),
        Row(f"HTTP (4) {streams} streams: sim CPU s / modelled s", "< 1 (info)", None, duty, "{:.2f}"),
        Row("HTTP (4) machine load average (1 min)", f"<= {os.cpu_count()} (info)", None, load, "{:.1f}"),
    ]


def print_table(rows: list[Row], profiles: list[str]) -> bool:
    reference = [p for p in profiles if p.startswith("h100")]
    width = max(len(r.check) for r in rows) + 2
    header = f"{'check':<{width}}{'target':<16}" + "".join(f"{p:>24}" for p in profiles)
    print(header)
    print("-" * len(header))
    ok = True
    for row in rows:
        cells = []
        for p in profiles:
            value = row.values.get(p)
            if value is None:
                cells.append(f"{'-':>24}")
                continue
            mark = ""
            if row.passes is not None:
                good = row.passes(value)
                if p in reference or not row.check.startswith("(2)") and "HTTP (2)" not in row.check:
                    mark = " ok" if good else " FAIL"
                    ok = ok and good
                else:
                    mark = " (ref)" if good else " (off)"
            cells.append(f"{row.fmt.format(value) + mark:>24}")
        print(f"{row.check:<{width}}{row.target:<16}" + "".join(cells))
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-http", action="store_true", help="only the virtual-time checks")
    parser.add_argument("--streams", type=int, default=512, help="concurrent streams for the capacity check")
    parser.add_argument("--seconds", type=float, default=15.0, help="duration of the capacity check")
    parser.add_argument("--profile", action="append", help="only these profiles (default: all found)")
    args = parser.parse_args()
    profiles = args.profile or profile_names()
    for p in profiles:
        load_profile(p)
    print(f"specproxy sim fidelity — profiles: {', '.join(profiles)}; cpu count {os.cpu_count()}")
    print("virtual clock (engine model, exact):")
    rows = virtual_rows(profiles)
    ok = print_table(rows, profiles)
    if not args.no_http:
        print("\nreal clock, over HTTP (a `specproxy sim` subprocess per point):")
        ok = print_table(http_rows(profiles, args.streams, args.seconds), profiles) and ok
    print("\nALL TARGETS MET" if ok else "\nSOME TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
