"""Replay's load generator: does the open loop keep its schedule, does the closed loop hold its level?
And how many chunks per second can it relay with 1 or N client processes?

    python tests/bench/bench_loadgen.py [--rate 2000] [--seconds 5] [--levels 1,16,64]
    python tests/bench/bench_loadgen.py --client-processes 1,2,4 [--arms 2] [--level 256] [--seconds 5]
        [--tokens 64] [--ttft-ms 20] [--itl-ms 10]

Backend: tests/backends.py in a subprocess (its own core), streaming 4 tokens with no delay — a fast
backend, so what is measured is the load generator. Every call goes through `call_arm`, the function
replay uses, so the figures include replay's real per-call work (SSE parsing, span fields).

The second form runs the whole replay (``run_replay``, paired, one closed-loop level for
``--seconds``, one round) against ``--arms`` tests/backends.py, each in its own process streaming
``--tokens`` one-token chunks ``--itl-ms`` apart (a GPU engine's pace), once per client-process
count, and prints the relayed chunks/s (every arm's chunks over the round's wall time, from the
spans in the store) with the round's loop-lag health: the worst process's loop-lag share and
whether every gate passed.

Targets: open loop at 2,000 req/s with p99 start lag behind schedule ≤ 2 ms; closed loop holds
the target concurrency exactly (the time-weighted in-flight distribution is printed: ≈ 100 % at c
while the items last, then the tail as the last calls drain).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specproxy.commandline import run_async
from specproxy.config import Arm
from specproxy.proxy.health import over_threshold
from specproxy.proxy.replay.loadgen import closed_loop, open_loop, poisson_offsets
from specproxy.proxy.replay.runner import LoadPlan, ReplaySettings, run_replay
from specproxy.proxy.upstream.calls import UpstreamState, call_arm, new_record
from specproxy.proxy.upstream.wire import UpstreamClient
from tests.support import backend_process, chat_items, query_rows

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


async def relayed(urls: list[str], processes: int, args: argparse.Namespace, db: Path) -> None:
    """One replay at ``--level`` for ``--seconds`` with ``processes`` client processes: its chunks/s."""
    arms = tuple(
        Arm(name=f"a{i}", url=url, role="baseline" if i == 0 else "candidate") for i, url in enumerate(urls)
    )
    settings = ReplaySettings(
        arms=arms,
        db_path=db,
        run_name=f"loadgen n={processes}",
        show_progress=False,
        load=LoadPlan(levels=(args.level,), rounds=1, warmup=0, duration_s=args.seconds),
        client_processes=processes,
    )
    result = await run_replay(settings, chat_items(200_000, max_tokens=args.tokens))
    ((chunks, calls, wall),) = query_rows(
        db,
        "SELECT sum(chunks), count(*), (max(t_start_ns / 1e9 + e2e_s) - min(t_start_ns / 1e9)) "
        "FROM requests WHERE run_id = ? AND status = 'ok'",
        [result.run_id],
    )
    share = max(
        (r.value or 0.0 for r in result.health if r.check_name.endswith("event_loop_lag_share")), default=0.0
    )
    failed = sorted({r.check_name for r in over_threshold(result.health)})
    print(
        f"{processes:>10}{calls:>8}{chunks / wall:>14,.0f}{share * 100:>14.2f}%  "
        + (f"failed: {', '.join(failed)}" if failed else "every gate passed")
    )


def bench_processes(args: argparse.Namespace) -> None:
    counts = [int(x) for x in args.client_processes.split(",")]
    tokens = ("--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms), "--tokens", str(args.tokens))
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        urls = [stack.enter_context(backend_process(*tokens)) for _ in range(args.arms)]
        print(
            f"relayed chunks/s: {args.arms} arms x c={args.level}, {args.tokens} one-token chunks per call, "
            f"TTFT {args.ttft_ms} ms, ITL {args.itl_ms} ms, {args.seconds:g} s"
        )
        print(f"{'processes':>10}{'calls':>8}{'chunks/s':>14}{'loop lag share':>15}  gates")
        for n in counts:
            run_async(relayed(urls, n, args, Path(tmp) / f"n{n}.duckdb"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--client-processes", metavar="N,M", help="relayed chunks/s with each count of processes")
    ap.add_argument("--arms", type=int, default=2)
    ap.add_argument("--level", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    args = ap.parse_args()
    if args.client_processes:
        bench_processes(args)
        return
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
