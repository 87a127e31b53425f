"""What `specproxy serve` loses when killed, and that a stop loses nothing: spans against /metrics.

    .venv/bin/python tests/bench/bench_span_loss.py [--kills 3] [--seconds 4] [--concurrency 16]

Two test backends (tests/backends.py, 64 tokens at 10 ms) in their own processes, serve in shadow mode
in front of them, a closed loop of streaming requests. Every fifth request carries a poisoned value
(``seed`` 2**64-1, ``max_tokens`` 2**31 or ``X-Specproxy-Concurrency-Level`` 2**31).

- ``SIGTERM`` rounds: after the load stops, calls counted in /metrics must equal rows in the store plus
  spans counted as dropped (serve's exit line), exactly.
- ``SIGKILL`` rounds: serve is killed mid-load at a random moment while /metrics is polled every
  50 ms. The store must open (DuckDB replays its write-ahead log) and hold every span /metrics last
  reported written; the loss is the calls counted but not in the store, bounded by what the last
  poll saw queued or in flight plus the calls made after it (serve writes every 2 s: one batch).

Prints one line per round and the bound. The machine is shared; the figures are counts, not rates.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import duckdb

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


from tests.support import free_port, metric_totals, start_cli, wait_http  # noqa: E402

POISON: list[tuple[dict[str, Any], dict[str, str]]] = [
    ({"seed": 2**64 - 1}, {}),
    ({"max_tokens": 2**31}, {}),
    ({}, {"X-Specproxy-Concurrency-Level": str(2**31)}),
]


def start_backend(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.backends", "--port", str(port), "--tokens", "64", "--itl-ms", "10"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def config(tmp: Path, base: str, cand: str, db: Path) -> Path:
    path = tmp / "exp.toml"
    path.write_text(
        f'[experiment]\nname = "span-loss"\nmode = "shadow"\ndb = "{db}"\nshutdown_grace_s = 10\n\n'
        f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{base}"\n\n'
        f'[[arms]]\nname = "cand"\nurl = "{cand}"\nmax_shadow_inflight = 1024\n'
    )
    return path


async def load(url: str, concurrency: int, stop: asyncio.Event) -> int:
    sent = 0

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal sent
        while not stop.is_set():
            sent += 1
            extra, headers = POISON[sent % len(POISON)] if sent % 5 == 0 else ({}, {})
            body = {"model": "m", "prompt": f"p{sent}", "stream": True, "temperature": 0} | extra
            try:
                async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                    await r.read()
            except (aiohttp.ClientError, ConnectionError):
                await asyncio.sleep(0.01)  # the proxy is gone (a kill round)

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return sent


async def poll(url: str, stop: asyncio.Event, seen: list[dict[str, float]]) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            try:
                async with s.get(url + "/metrics") as r:
                    seen.append(metric_totals(await r.text()) | {"t": time.monotonic()})
            except (aiohttp.ClientError, ConnectionError):
                return
            await asyncio.sleep(0.05)


def rows_in(db: Path) -> int:
    with duckdb.connect(str(db), read_only=True) as con:
        row = con.execute("SELECT count(*) FROM requests").fetchone()
    return int(row[0]) if row else 0


async def one_round(tmp: Path, base: str, cand: str, kill: bool, seconds: float, concurrency: int) -> str:
    db = tmp / f"round-{time.monotonic_ns()}.duckdb"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_cli(["serve", "--config", str(config(tmp, base, cand, db)), "--port", str(port)])
    await asyncio.to_thread(wait_http, url + "/health", 60.0, proc)
    stop, seen = asyncio.Event(), list[dict[str, float]]()
    loader = asyncio.create_task(load(url, concurrency, stop))
    poller = asyncio.create_task(poll(url, stop, seen))
    await asyncio.sleep(seconds * (random.uniform(0.5, 1.0) if kill else 1.0))
    if kill:
        proc.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        stop.set()
    else:
        stop.set()
        await loader
        await poller
        async with aiohttp.ClientSession() as s:
            while True:  # until the last shadow copies have finished too
                async with s.get(url + "/metrics") as r:
                    totals = metric_totals(await r.text())
                if totals.get("specproxy_inflight", 0) == 0:
                    break
                await asyncio.sleep(0.05)
        seen.append(totals | {"t": time.monotonic()})
        proc.send_signal(signal.SIGTERM)
    await asyncio.gather(loader, poller, return_exceptions=True)
    code = await asyncio.to_thread(proc.wait, 60)
    out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    rows = rows_in(db)
    last = seen[-1]
    calls = int(last.get("specproxy_requests_total", 0))
    written = int(last.get("specproxy_spans_written_total", 0))
    if not kill:
        match = re.search(r"(\d+) spans written, (\d+) dropped", out)
        dropped = int(match[2]) if match else -1
        exact = "yes" if calls == rows + dropped else "NO"
        return f"SIGTERM  exit {code}: calls {calls}, rows {rows}, dropped {dropped}; exact: {exact}"
    queued = int(last.get("specproxy_span_queue_depth", 0))
    inflight = int(last.get("specproxy_inflight", 0))
    age_ms = (t_kill - last["t"]) * 1e3
    kept = "yes" if rows >= written else "NO"
    writing = calls - written - queued  # taken by the writer, not yet inserted: at most one batch
    return (
        f"SIGKILL  store opens, rows {rows}, every span reported written kept: {kept}. Last poll, "
        f"{age_ms:.0f} ms before: calls {calls} = written {written} + queued {queued} + being written "
        f"{writing}; in flight {inflight}. Lost: {calls - rows} of those calls, plus any after the poll"
    )


async def main_async(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-span-loss-"))
    ports = free_port(), free_port()
    backends = [start_backend(p) for p in ports]
    try:
        for p, proc in zip(ports, backends, strict=True):
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{p}/health", 30.0, proc)
        base, cand = (f"http://127.0.0.1:{p}" for p in ports)
        print(
            f"serve, shadow mode, c={args.concurrency}, every 5th request poisoned; "
            f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cpus"
        )
        for kill in [False] * args.stops + [True] * args.kills:
            print(await one_round(tmp, base, cand, kill, args.seconds, args.concurrency), flush=True)
    finally:
        for proc in backends:
            proc.terminate()
            proc.wait()
    print(
        "bound after SIGKILL: the spans in the queue (at most one flush interval, 2 s of calls: one batch) "
        "plus the calls in flight"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--stops", type=int, default=1, help="SIGTERM rounds")
    ap.add_argument("--kills", type=int, default=3, help="SIGKILL rounds")
    ap.add_argument(
        "--seconds", type=float, default=4.0, help="load per round (a kill comes in its second half)"
    )
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
