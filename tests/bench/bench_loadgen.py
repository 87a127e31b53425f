"""Replay's load generator: does the open loop keep its schedule, does the closed loop hold its level?

    python tests/bench/bench_loadgen.py [--rate 2000] [--seconds 5] [--levels 1,16,64]

Backend: tests/backends.py in a subprocess (its own core), streaming 4 tokens with no delay — a fast
backend, so what is measured is the load generator. Every call goes through `call_arm`, the function
replay uses, so the figures include replay's real per-call work (SSE parsing, span fields).

Targets: open loop at 2,000 req/s with p99 start lag behind schedule ≤ 2 ms; closed loop holds
the target concurrency exactly (the time-weighted in-flight distribution is printed: ≈ 100 % at c
while the items last, then the tail as the last calls drain).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specproxy.config import Arm
from specproxy.proxy.replay.loadgen import closed_loop, open_loop, poisson_offsets
from specproxy.proxy.upstream.calls import UpstreamState, call_arm, new_record
from specproxy.proxy.upstream.wire import UpstreamClient
from tests.support import backend_process

BODY = {
    "model": "test-model",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "temperature": 0,
    "stream": True,
}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def bench(url: str, rate: float, seconds: float, levels: list[int]) -> None:
    arm = Arm(name="fast", url=url, role="baseline")
    state = UpstreamState()
    failures = 0
    async with UpstreamClient() as session:

        async def send(i: int) -> None:
            nonlocal failures
            rec = new_record(
                "bench", f"r{i}", arm, BODY, endpoint="chat", routed_as="replay", source="replay"
            )
            result = await call_arm(session, arm, BODY, endpoint="chat", record=rec, state=state)
            failures += not result.ok

        async def nothing(i: int) -> None:
            await asyncio.sleep(0)

        # warm the connection pool
        await closed_loop(list(range(200)), 32, send)

        print(f"open loop, Poisson, {seconds:g} s (lag = start time behind schedule)")
        print(
            f"{'backend':<22}{'target/s':>9}{'achieved/s':>11}{'p50 lag ms':>11}{'p99 lag ms':>11}"
            f"{'max ms':>8}{'peak in-flight':>15}{'failed':>7}"
        )
        for name, fn, r in (("none (scheduler only)", nothing, rate), ("tests/backends.py", send, rate)):
            n = int(r * seconds)
            offsets = poisson_offsets(n, r, seed=1)
            failures = 0
            t0 = time.perf_counter()
            stats = await open_loop(list(range(n)), offsets, fn)
            wall = time.perf_counter() - t0
            lags_ms = [x * 1000 for x in stats.lag_s]
            print(
                f"{name:<22}{r:>9.0f}{n / offsets[-1]:>11.0f}{pct(lags_ms, 0.5):>11.3f}"
                f"{pct(lags_ms, 0.99):>11.3f}{max(lags_ms):>8.2f}{stats.gauge.peak:>15}{failures:>7}"
            )
            assert wall > 0

        print("\nclosed loop against tests/backends.py (share of time at each in-flight count)")
        print(f"{'target c':>9}{'calls':>7}{'req/s':>8}{'at target':>10}  distribution (top 4)")
        for c in levels:
            n = max(40 * c, 400)
            stats = await closed_loop(list(range(n)), c, send)
            dist = stats.gauge.distribution()
            # The drain at the end (fewer than c left) is part of any closed loop; show it separately.
            top = sorted(dist.items(), key=lambda kv: -kv[1])[:4]
            print(
                f"{c:>9}{n:>7}{n / stats.wall_s:>8.0f}{dist.get(c, 0.0) * 100:>9.1f}%  "
                + ", ".join(f"{k}: {v * 100:.1f}%" for k, v in top)
            )
            assert stats.gauge.peak == c, f"closed loop exceeded its level: {stats.gauge.peak} > {c}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--levels", default="1,16,64")
    args = ap.parse_args()
    with backend_process("--ttft-ms", "0", "--itl-ms", "0", "--tokens", "4") as url:
        try:
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:
            runner = asyncio.Runner()
        with runner:
            runner.run(bench(url, args.rate, args.seconds, [int(x) for x in args.levels.split(",")]))


if __name__ == "__main__":
    main()
