"""What the proxy costs: direct vs specproxy split vs specproxy shadow, side by side in one run.

    .venv/bin/python tests/bench/bench_proxy.py [--duration 20] [--levels 1,64,256]
    .venv/bin/python tests/bench/bench_proxy.py --memory-soak 300     # memory over a 5-minute run
    .venv/bin/python tests/bench/bench_proxy.py --before /tmp/old     # a change's cost, side by side

Backend: tests/backends.py in its own process (TTFT 20 ms, 10 ms between tokens, 64 tokens, one token
per chunk). Three targets, each measured for ``--duration`` seconds per concurrency level, in turn:

- ``direct``: the load generator talks to the backend;
- ``direct+m``: the same, and the load generator also sends each request to the second backend at the same
  moment (read to the end, discarded): the machine load of a shadow run without the proxy, the fair
  reference for ``shadow`` when both backends share the machine (``shadow`` rows also show ``% d+m``);
- ``bare``: a bare aiohttp passthrough (forwards bytes, no parsing, no spans): the floor any Python
  relay costs on the machine running the bench, for scale;
- ``split``: through ``specproxy serve`` in split mode (two arms, both the same backend, weights 1:1);
- ``shadow``: through ``specproxy serve`` in shadow mode, the baseline on that backend and one candidate
  on a second backend process (so the machine also serves the mirrored copy: the real cost of a shadow
  whose candidate shares the machine).

``--before DIR`` adds ``split-b``: the split proxy of another source tree (an earlier commit, unpacked
with ``git archive COMMIT | tar -x -C DIR``), measured in the same rounds, and prints the difference
in relay CPU per relayed chunk (the backend sends one token per chunk). Before the load runs it also
times, in a subprocess per tree, alternating, the proxy's own per-chunk code without sockets (the
read callback's parse and tap for 64 one-token chunks, then the span's finish): a CPU figure per
chunk that other load on the machine barely moves (``--tap-only``: just that).

``--repeats N`` measures every target N times, round-robin within each level, and prints the median of
each figure (p99: the largest).

Concurrency 1 is measured in paired rounds instead (``--c1-rounds``): each round gives each of direct,
bare, split and shadow in turn (the order rotates every round) a short closed loop of one request at a
time: one warm-up request, then ``--c1-block`` measured ones, each read to its end. The added TTFT is
the median over rounds of (target's block median - direct's block median of the same round): at c=1 the
backend's timer jitter (~1 ms) is larger than a relay's cost, pairing cancels the drift that comparing
two separate runs keeps, and the warm-up keeps a relay that sat idle while the others were measured
from paying for cold caches that a c=1 client sending back to back would not see.
 The load generator is closed-loop (``c`` requests always in flight,
streaming chat completions) and counts tokens as content chunks. It prints per target and level: p50/p99
TTFT, relayed tokens/s, the proxy-added p50 TTFT and throughput as % of direct, and the relay process's
CPU time per relayed token (the figure other load on the machine disturbs least; shadow's includes reading the
mirrored copy); then the proxies' RSS before/after. Targets: added p50 TTFT ≤ 1 ms at c=1 and
≤ 5 ms at c=64; throughput ≥ 90 % of direct at c=64 and 256; memory flat. Load generator, backends and
proxy share the machine's cores: numbers are noisy, compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support import free_port, wait_http  # noqa: E402

BODY_TEMPLATE = {"model": "m", "stream": True, "temperature": 0, "max_tokens": 64}


@dataclass
class CaseResult:
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    duration: float = 0.0

    def p(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        xs = sorted(self.ttfts)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.duration if self.duration else 0.0


def content_chunks(data: bytes) -> int:
    """Chunks with non-empty content in a read of a chat stream (the role chunk's content is "")."""
    return data.count(b'"content":"') - data.count(b'"content":""')


async def one_ttft(s: aiohttp.ClientSession, url: str, i: int) -> float | None:
    """One streaming request read to its end; its TTFT (first content chunk), None if it failed."""
    body = {**BODY_TEMPLATE, "messages": [{"role": "user", "content": f"round {i} hello"}]}
    t0 = time.perf_counter()
    first: float | None = None
    try:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return None
            async for data in r.content.iter_any():
                if first is None and content_chunks(data):
                    first = time.perf_counter()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return None if first is None else first - t0


async def paired_rounds(targets: dict[str, str], rounds: int, block: int) -> dict[str, list[list[float]]]:
    """Concurrency 1, paired: per round a warm-up and ``block`` requests to each target in turn."""
    names = list(targets)
    out: dict[str, list[list[float]]] = {n: [] for n in names}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for k in range(rounds):
            order = names[k % len(names) :] + names[: k % len(names)]
            for name in order:
                await one_ttft(s, targets[name], -1)
                ttfts = [await one_ttft(s, targets[name], k * block + i) for i in range(block)]
                out[name].append([t for t in ttfts if t is not None])
    return out


def print_paired(res: dict[str, list[list[float]]], cpu: dict[str, float], block: int) -> None:
    med = statistics.median
    direct = [med(b) if b else None for b in res["direct"]]
    for name, blocks in res.items():
        ok = [t for b in blocks for t in b]
        diffs = [med(b) - d for b, d in zip(blocks, direct, strict=True) if b and d is not None]
        added = med(diffs) * 1000 if name != "direct" and diffs else 0.0
        p50 = med(ok) * 1000 if ok else float("nan")
        p99 = max(ok) * 1000 if ok else float("nan")
        print(
            f"{1:>4} {name:<8} {len(ok):>6} {len(blocks) * block - len(ok):>4} {p50:>12.2f} {p99:>12.2f} "
            f"{added:>13.2f} {'':>9} {'':>9} {'':>7} {cpu.get(name, float('nan')):>17.1f}"
        )
    print(
        f"     (c=1: {len(direct)} paired rounds of {block} requests per target; added = median over "
        "rounds of the block median minus direct's; p99 column: the largest)"
    )


async def run_load(url: str, concurrency: int, duration: float, mirror: str | None = None) -> CaseResult:
    """Closed loop: ``concurrency`` workers, each sending streaming requests back to back. ``mirror``:
    also send each request there at the same moment (read to the end and discarded, not waited for)."""
    res = CaseResult()
    connector = aiohttp.TCPConnector(limit=0)
    deadline = time.perf_counter() + duration
    mirrored: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def copy(body: dict[str, object]) -> None:
            assert mirror is not None
            try:
                async with s.post(mirror + "/v1/chat/completions", json=body) as r:
                    async for _ in r.content.iter_any():
                        pass
            except (aiohttp.ClientError, TimeoutError):
                pass

        async def worker(w: int) -> None:
            i = 0
            while time.perf_counter() < deadline:
                i += 1
                body = {**BODY_TEMPLATE, "messages": [{"role": "user", "content": f"w{w} r{i} hello"}]}
                t0 = time.perf_counter()
                if mirror is not None:
                    task = asyncio.create_task(copy(body))
                    mirrored.add(task)
                    task.add_done_callback(mirrored.discard)
                first: float | None = None
                chunks = 0
                try:
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        if r.status != 200:
                            res.errors += 1
                            await r.read()
                            continue
                        async for data in r.content.iter_any():
                            n = content_chunks(data)
                            if n and first is None:
                                first = time.perf_counter()
                            chunks += n
                except (aiohttp.ClientError, TimeoutError):
                    res.errors += 1
                    continue
                if first is not None:
                    res.ttfts.append(first - t0)
                res.tokens += chunks
                res.requests += 1

        t_start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        res.duration = time.perf_counter() - t_start
        await asyncio.gather(*mirrored)
    return res


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds a process has used so far."""
    if pid is None:
        return float("nan")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def start(argv: list[str], tree: Path = ROOT) -> subprocess.Popen[bytes]:
    """A process running the specproxy source in ``tree`` (this checkout unless told otherwise)."""
    return subprocess.Popen(
        argv,
        cwd=tree,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )


def backend(port: int) -> subprocess.Popen[bytes]:
    return start(
        [
            sys.executable,
            "-m",
            "tests.backends",
            "--port",
            str(port),
            "--ttft-ms",
            "20",
            "--itl-ms",
            "10",
            "--tokens",
            "64",
        ]
    )


BARE_PASSTHROUGH = """
import sys, aiohttp, uvloop
from aiohttp import web
upstream, port = sys.argv[1], int(sys.argv[2])
async def ctx(app):
    app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app["s"].close()
async def handle(request):
    body = await request.read()
    async with request.app["s"].post(upstream + request.path, data=body,
                                     headers={"Content-Type": "application/json"}) as up:
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
        await resp.prepare(request)
        async for data in up.content.iter_any():
            await resp.write(data)
        await resp.write_eof()
        return resp
async def health(request):
    return web.Response(text="ok")
app = web.Application()
app.cleanup_ctx.append(ctx)
app.router.add_post("/v1/chat/completions", handle)
app.router.add_get("/health", health)
uvloop.install()
web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
"""


# The per-chunk work of one relayed stream in the proxy's process, without sockets: the read callback
# (parse, tap) for each of 64 one-token chunk reads, then the span's finish. Prints CPU ns per chunk.
TAP_COST = """
import sys, time
import orjson
from specproxy.config import Arm
from specproxy.proxy.upstream import calls
try:
    from specproxy.proxy.upstream import extras, figures, relay
    Consumer, Strip, finish_record = relay.StreamConsumer, extras.Strip, figures.finish_record
    engine_facts, record_latency = figures.record_engine_facts, figures.record_latency
except ImportError:  # a tree from before calls.py was split in three
    Consumer, Strip, finish_record = calls._StreamConsumer, calls._Strip, calls._finish_record
    engine_facts, record_latency = calls._record_engine_facts, getattr(calls, "_record_latency", None)
tokens, streams = 64, int(sys.argv[1])
head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
def event(delta, finish=None):
    obj = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(obj) + b"\\n\\n"
reads = [event({"role": "assistant", "content": ""})]
reads += [event({"content": f" w{i}"}, "length" if i == tokens - 1 else None) for i in range(tokens)]
usage = {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens}
tail = b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\\n\\n"
reads += [tail, b"data: [DONE]\\n\\n"]
arm = Arm(name="base", role="baseline", url="http://127.0.0.1:1")
body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
state = calls.UpstreamState()
def one():
    rec = calls.new_record("r", "q", arm, body, endpoint="chat", routed_as="split")
    tap = calls.CompletionTap("chat")
    consumer = Consumer(tap, None, Strip())
    t0 = time.perf_counter()
    for raw in reads:
        consumer(raw)
    consumer.flush()
    finish_record(rec, arm, tap, t0, time.perf_counter(), False)
    engine_facts(rec, arm, tap, state)
    if record_latency is not None:
        record_latency(rec, tap)
for _ in range(200):
    one()
best = []
for _ in range(5):
    c0 = time.process_time()
    for _ in range(streams):
        one()
    best.append((time.process_time() - c0) / (streams * tokens) * 1e9)
print(min(best))
"""


def tap_cost(tree: Path, streams: int) -> float:
    """CPU ns per relayed chunk of the read callback and the span's finish, in ``tree``'s code."""
    out = subprocess.run(
        [sys.executable, "-c", TAP_COST, str(streams)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


def print_tap_costs(before: Path, rounds: int = 5, streams: int = 2000) -> None:
    """This tree's and ``before``'s per-chunk CPU cost, alternating, ``rounds`` times each."""
    mine: list[float] = []
    theirs: list[float] = []
    for _ in range(rounds):
        mine.append(tap_cost(ROOT, streams))
        theirs.append(tap_cost(before.resolve(), streams))
    med = statistics.median
    diffs = [a - b for a, b in zip(mine, theirs, strict=True)]
    print(
        f"read callback + span finish, CPU per relayed chunk (64-chunk streams, best of 5 x {streams} "
        f"streams, {rounds} alternating rounds, medians): this tree {med(mine):.0f} ns, before "
        f"{med(theirs):.0f} ns, difference {med(diffs):+.0f} ns (rounds: "
        f"{', '.join(f'{d:+.0f}' for d in diffs)}); load average {os.getloadavg()[0]:.2f}\n"
    )


def bare(upstream: str, port: int) -> subprocess.Popen[bytes]:
    """A bare aiohttp passthrough (no parsing, no spans): the floor a Python relay costs here."""
    return start([sys.executable, "-c", BARE_PASSTHROUGH, upstream, str(port)])


def proxy(config: Path, port: int, db: Path, tree: Path = ROOT) -> subprocess.Popen[bytes]:
    return start(
        [
            sys.executable,
            "-m",
            "specproxy",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
            "--db",
            str(db),
            "--log-level",
            "warning",
            "--no-scrape",
        ],
        tree,
    )


def write_config(path: Path, mode: str, base: str, other: str) -> Path:
    weight = "weight = 1\n" if mode == "split" else ""
    path.write_text(
        f'[experiment]\nname = "bench-{mode}"\nmode = "{mode}"\nspan_queue_size = 1000000\n\n'
        f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{base}"\n{weight}\n'
        f'[[arms]]\nname = "cand"\nurl = "{other}"\nmax_shadow_inflight = 1024\n{weight}'
    )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per target and level")
    ap.add_argument("--levels", default="1,64,256", help="concurrency levels")
    ap.add_argument("--repeats", type=int, default=1, help="measurements per target and level (medians)")
    ap.add_argument(
        "--c1-rounds",
        type=int,
        default=8,
        help="paired rounds at c=1 (a round: 1 + c1-block requests per target, ~0.7 s each)",
    )
    ap.add_argument("--c1-block", type=int, default=4, help="measured requests per target and round at c=1")
    ap.add_argument(
        "--memory-soak",
        type=float,
        default=0.0,
        help="instead: run the shadow proxy at c=64 this many seconds, printing its RSS",
    )
    ap.add_argument(
        "--before",
        type=Path,
        help="another specproxy source tree (e.g. `git archive COMMIT | tar -x -C DIR`): its split proxy "
        "is measured beside this one's as `split-b`, to give a change's cost side by side in one run",
    )
    ap.add_argument(
        "--tap-only",
        action="store_true",
        help="with --before: only the per-chunk CPU cost of the read callback and span finish, no sockets",
    )
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.before is not None:
        print_tap_costs(args.before)
        if args.tap_only:
            return

    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    b1, b2, p_split, p_shadow, p_bare = (free_port() for _ in range(5))
    procs = [backend(b1), backend(b2)]
    base, cand = f"http://127.0.0.1:{b1}", f"http://127.0.0.1:{b2}"
    try:
        for b in (base, cand):
            wait_http(b + "/health", 20)
        split_cfg = write_config(tmp / "split.toml", "split", base, base)
        shadow_cfg = write_config(tmp / "shadow.toml", "shadow", base, cand)
        split_proc = proxy(split_cfg, p_split, tmp / "split.duckdb")
        shadow_proc = proxy(shadow_cfg, p_shadow, tmp / "shadow.duckdb")
        bare_proc = bare(base, p_bare)
        procs += [split_proc, shadow_proc, bare_proc]
        pids: dict[str, int | None] = {
            "direct": None,
            "direct+m": None,
            "bare": bare_proc.pid,
            "split": split_proc.pid,
            "shadow": shadow_proc.pid,
        }
        targets = {
            "direct": base,
            "direct+m": base,
            "bare": f"http://127.0.0.1:{p_bare}",
            "split": f"http://127.0.0.1:{p_split}",
            "shadow": f"http://127.0.0.1:{p_shadow}",
        }
        if args.before is not None:
            p_before = free_port()
            before_proc = proxy(split_cfg, p_before, tmp / "split-b.duckdb", args.before.resolve())
            procs.append(before_proc)
            pids["split-b"] = before_proc.pid
            targets["split-b"] = f"http://127.0.0.1:{p_before}"
        for url in targets.values():
            wait_http(url + "/health", 30)
        for name in ("split", "split-b"):
            if name in targets:
                asyncio.run(run_load(targets[name], 4, 1.0))  # warm up connections and code paths
        asyncio.run(run_load(targets["shadow"], 4, 1.0))

        if args.memory_soak:
            soak(targets["shadow"], shadow_proc.pid, args.memory_soak)
            return

        rss0 = {"split": rss_mb(split_proc.pid), "shadow": rss_mb(shadow_proc.pid)}
        print(
            f"backend: TTFT 20 ms, 10 ms/token, 64 tokens; {args.duration:.0f} s per target and level, "
            f"x{args.repeats} round-robin (medians); {os.cpu_count()} cores shared by all processes; "
            f"load average before: {os.getloadavg()[0]:.2f}\n"
        )
        header = (
            f"{'c':>4} {'target':<8} {'reqs':>6} {'err':>4} {'p50 TTFT ms':>12} {'p99 TTFT ms':>12} "
            f"{'added p50 ms':>13} {'tok/s':>9} {'% direct':>9} {'% d+m':>7} {'relay CPU us/tok':>17}"
        )
        print(header)
        print("-" * len(header))
        runs = [(name, url, base if name == "direct+m" else None) for name, url in targets.items()]
        for c in levels:
            if c == 1:
                names = ("direct", "bare", "split", "split-b", "shadow")
                paired = {n: targets[n] for n in names if n in targets}
                cpu_before = {n: cpu_s(pids[n]) for n in paired}
                res = asyncio.run(paired_rounds(paired, args.c1_rounds, args.c1_block))
                tokens = 64 * args.c1_rounds * (args.c1_block + 1)
                print_paired(
                    res, {n: 1e6 * (cpu_s(pids[n]) - cpu_before[n]) / tokens for n in paired}, args.c1_block
                )
                continue
            samples: dict[str, list[tuple[CaseResult, float]]] = {name: [] for name in targets}
            for _ in range(args.repeats):
                for name, url, mirror in runs:
                    before = cpu_s(pids[name])
                    r = asyncio.run(run_load(url, c, args.duration, mirror=cand if mirror else None))
                    samples[name].append((r, cpu_s(pids[name]) - before))
            fig = {name: _figures(rs) for name, rs in samples.items()}
            d, dm = fig["direct"], fig["direct+m"]
            for name, f in fig.items():
                added = (f["p50"] - d["p50"]) * 1000 if name != "direct" else 0.0
                pct = 100 * f["tok_s"] / d["tok_s"] if d["tok_s"] else float("nan")
                pct_m = f"{100 * f['tok_s'] / dm['tok_s']:>6.1f}%" if name == "shadow" else f"{'':>7}"
                print(
                    f"{c:>4} {name:<8} {f['reqs']:>6.0f} {f['err']:>4.0f} {f['p50'] * 1000:>12.2f} "
                    f"{f['p99'] * 1000:>12.2f} {added:>13.2f} {f['tok_s']:>9.0f} {pct:>8.1f}% {pct_m} "
                    f"{f['cpu_us_tok']:>17.1f}"
                )
            vs_m = (fig["shadow"]["p50"] - dm["p50"]) * 1000
            print(
                f"     (shadow vs direct+m: added p50 TTFT {vs_m:.2f} ms; "
                f"load average {os.getloadavg()[0]:.2f})"
            )
            if "split-b" in fig:
                diff = fig["split"]["cpu_us_tok"] - fig["split-b"]["cpu_us_tok"]
                print(f"     (split minus split-b: {diff:+.2f} us of relay CPU per relayed chunk)")
        rss1 = {"split": rss_mb(split_proc.pid), "shadow": rss_mb(shadow_proc.pid)}
        print()
        for name in rss0:
            print(f"{name} proxy RSS: {rss0[name]:.0f} MB before, {rss1[name]:.0f} MB after")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def _figures(runs: list[tuple[CaseResult, float]]) -> dict[str, float]:
    """Medians over repeated measurements of one target at one level (p99: the largest)."""
    med = statistics.median
    return {
        "reqs": med(r.requests for r, _ in runs),
        "err": sum(r.errors for r, _ in runs),
        "p50": med(r.p(0.5) for r, _ in runs),
        "p99": max(r.p(0.99) for r, _ in runs),
        "tok_s": med(r.tok_s for r, _ in runs),
        "cpu_us_tok": med(1e6 * cpu / r.tokens if r.tokens else float("nan") for r, cpu in runs),
    }


def soak(url: str, pid: int, seconds: float) -> None:
    """RSS of the shadow proxy every tenth of the run, at c=64."""
    step = seconds / 10
    print(f"memory soak: shadow proxy at c=64 for {seconds:.0f} s")
    print(f"{'t s':>6} {'RSS MB':>8} {'tok/s':>8}")
    print(f"{0:>6.0f} {rss_mb(pid):>8.1f} {'':>8}")
    samples = []
    for i in range(10):
        r = asyncio.run(run_load(url, 64, step))
        samples.append(rss_mb(pid))
        print(f"{(i + 1) * step:>6.0f} {samples[-1]:>8.1f} {r.tok_s:>8.0f}")
    half = len(samples) // 2
    print(
        f"\nRSS median, first half: {statistics.median(samples[:half]):.1f} MB; "
        f"second half: {statistics.median(samples[half:]):.1f} MB"
    )


if __name__ == "__main__":
    main()
