"""Fuzz and fault benchmark: `specproxy serve` under hostile clients and broken backends.

    .venv/bin/python tests/bench/bench_fuzz.py [--requests 10000] [--rounds 3] [--seconds 3]

Three parts, each printing a table; the process exits non-zero when a target is missed.

1. **Fuzz.** ``--requests`` generated requests (a seeded grammar: methods, paths, header sets with
   undecodable bytes, encodings, Expect, Transfer-Encoding; JSON bodies with wrong types, huge numbers,
   nesting up to 1,100 deep, invalid UTF-8, over-size bodies; raw junk such as TLS hellos and cut-off
   request heads), each on its own raw socket, through one proxy in shadow mode over two healthy test
   backends; every 10th request is a good one (streaming chat or plain completions) that must be
   answered in full. Targets: 0 responses 5xx that are not an upstream's own, 0 error answers that are
   not JSON, 0 tracebacks or ERROR lines in the proxy's log, 0 hangs (no answer and no close within
   30 s), every good request answered; and the span account: after SIGTERM, the calls counted in
   ``/metrics`` equal the rows in the store plus the spans the proxy said it dropped.
2. **Faulty candidates.** One proxy per kind of candidate (healthy, dead, 10x slow, stalling, dropping
   connections, HTTP 500, garbage SSE, wrong content type, wrong JSON shape), the same healthy
   baseline behind each. In ``--rounds`` interleaved rounds (the order rotates) each proxy gets a closed
   loop of 4 streaming clients for ``--seconds``. Targets: primary p50 TTFT at most 5 % above the
   healthy-candidate run (paired by round; a broken candidate that spares the machine the copy's work
   may make it faster), 0 client errors.
3. **Faulty baselines.** The same kinds as the baseline: a streaming and a plain request each; the
   status the client gets and what the span says. Targets: 502/504 (or the upstream's own 500, or a
   stream ended by an error event) and a span whose status says what happened.
4. **Slowloris.** ``--slowloris`` connections (1,100) each send a header byte every 2 s, replaced on
   the next tick when closed, against a proxy whose file limit is 1024; a good request every 0.2 s
   for 20 s must be answered. Targets: every good request answered, no traceback or ERROR line.

5. **An endless event.** ``--mode huge-event`` runs only this part (``all``, the default, runs 1-4):
   a proxy whose shadow candidate sends, after two chunks, 20 MB of one ``data:`` event without its
   end, against one whose candidate is healthy, in ``--rounds`` interleaved rounds of 4 streaming
   clients for ``--seconds``, /health probed every 50 ms meanwhile. Targets: the baseline's p50 TTFT
   at most 10 % above the healthy-candidate run (paired by round), 0 client errors, the copies cut as
   ``event over 16777216 bytes``, 0 tracebacks.

Backends (tests/backends.py) run in one helper process, proxies in their own processes, the load
generator here: all share this machine, so TTFTs are noisy; read them against the same run's healthy
row. Say what the load was (``uptime``) with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import duckdb
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support import free_port, wait_http  # noqa: E402

GOOD_CHUNK = b'{"choices": [{"index": 0, "delta": {"content": " w1"}, "finish_reason": null}]}'
TTFT_S, ITL_S, TOKENS = 0.03, 0.005, 16
# Kinds of backend: BackendConfig fields (None: nothing listens on the port).
KINDS: dict[str, dict[str, Any] | None] = {
    "healthy": {},
    "dead": None,
    "slow10x": {"ttft_s": 10 * TTFT_S, "itl_s": 10 * ITL_S},
    "stalling": {"fail": "stall"},
    "dropping": {"fail": "reset"},
    "http500": {"fail": "http500"},
    "garbage_sse": {"script": (GOOD_CHUNK, b'{"choices": "abc"}')},
    "wrong_type": {"script": (b"<html>oops</html>",), "content_type": "text/html"},
    "wrong_shape": {"script": (b'{"choices": [null]}',)},
    "endless_event": {"fail": "endless_event"},
}


def kind_of(name: str) -> str:
    return "healthy" if name == "healthy2" else name  # (a second healthy backend, for shadow copies)


# -- the backends' process --------------------------------------------------------------------------


def host_backends(spec: str) -> None:
    """``kind=port,...``: serve each kind on its port until SIGTERM (run in its own process)."""
    from aiohttp import web

    from tests.backends import STATS, BackendConfig, make_backend_app

    async def serve() -> None:
        runners = []
        for item in spec.split(","):
            name, port = item.split("=")
            fields = KINDS[kind_of(name)]
            assert fields is not None
            config = {"ttft_s": TTFT_S, "itl_s": ITL_S, "tokens": TOKENS, **fields}
            app = make_backend_app(BackendConfig(**config))
            app[STATS].keep_requests = False
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", int(port)).start()
            runners.append(runner)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        for runner in runners:
            await runner.cleanup()

    import uvloop

    uvloop.run(serve())


# -- processes ----------------------------------------------------------------------------------------


def start_backends(ports: dict[str, int]) -> subprocess.Popen[bytes]:
    spec = ",".join(f"{k}={p}" for k, p in ports.items() if KINDS[kind_of(k)] is not None)
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__)), "--host-backends", spec],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    for kind, port in ports.items():
        if KINDS[kind_of(kind)] is not None:
            wait_http(f"http://127.0.0.1:{port}/health", 60.0, proc)
    return proc


@dataclass
class Proxy:
    name: str
    port: int
    db: Path
    log: Path
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_proxy(
    workdir: Path, name: str, base: str, cand: str | None, *, fd_limit: int | None = None, **experiment: Any
) -> Proxy:
    cfg = workdir / f"{name}.toml"
    text = f'[experiment]\nname = "{name}"\nmode = "shadow"\n'
    text += "".join(f"{k} = {v}\n" for k, v in experiment.items())
    text += f'\n[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{base}"\n'
    if cand:
        text += f'\n[[arms]]\nname = "cand"\nurl = "{cand}"\n'
        text += 'speculative = { method = "ngram", num_speculative_tokens = 3 }\n'
    cfg.write_text(text)
    port, db, log = free_port(), workdir / f"{name}.duckdb", workdir / f"{name}.log"
    argv = [sys.executable, "-m", "specproxy", "serve", "--config", str(cfg), "--port", str(port)]
    argv += ["--db", str(db), "--no-scrape", "--log-level", "info"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit)))
            if fd_limit
            else None,
        )
    return Proxy(name, port, db, log, proc)


def stop_proxy(p: Proxy) -> tuple[int, int]:
    """SIGTERM, wait; (spans written, spans dropped) from its exit line."""
    p.proc.send_signal(signal.SIGTERM)
    try:
        p.proc.wait(120)
    except subprocess.TimeoutExpired:
        p.proc.kill()
        p.proc.wait()
    m = re.search(rb"(\d+) spans written, (\d+) dropped", p.log.read_bytes())
    return (int(m[1]), int(m[2])) if m else (-1, -1)


def log_problems(log: Path) -> tuple[int, int]:
    """(tracebacks, ERROR lines) in a proxy's log."""
    text = log.read_bytes()
    return text.count(b"Traceback (most recent call last)"), len(re.findall(rb" ERROR ", text))


def first_problem(log: Path) -> str:
    """The first ERROR line of a proxy's log and the end of its traceback (for the report)."""
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if " ERROR " in line:
            tail = [ln for ln in lines[i + 1 : i + 40] if ln and not ln.startswith(" ")][:2]
            return " | ".join([line[:200], *tail])[:600]
    return ""


async def metrics_calls(url: str) -> tuple[float, float]:
    """(calls finished, calls in flight) from the proxy's /metrics."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    done = sum(float(v) for v in re.findall(r"^specproxy_requests_total\{[^}]*\} (\S+)$", text, re.M))
    inflight = sum(float(v) for v in re.findall(r"^specproxy_inflight\{[^}]*\} (\S+)$", text, re.M))
    return done, inflight


def store_rows(db: Path) -> int:
    with duckdb.connect(str(db), read_only=True) as con:
        row = con.execute("SELECT count(*) FROM requests").fetchone()
    return int(row[0]) if row else 0


# -- the request grammar ----------------------------------------------------------------------------

JUNK_STRINGS = [
    "",
    "日本",
    "é",
    "\u2028",
    "a" * 5000,
    "<script>",
    "\x00",
    "%00",
    "../../etc/passwd",
    "🙂" * 50,
]
JUNK_BYTES = [b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", "日本".encode(), b"\xe9", b"a\tb", b"x" * 3000]
# Integers a client may send; the poisoned ones do not fit the span store's columns (the proxy must
# still account for every call: a row, or a span counted as dropped).
POISONED_INTS = [2**64 - 1, 2**63, -(2**63) - 1, 2**31, 10**30]
PLAIN_INTS = [-1, 0, 7, 4096]


def rand_value(rng: random.Random, ints: list[int], depth: int = 0) -> Any:
    r = rng.random()
    if depth > 6 or r < 0.45:
        scalars: list[Any] = [None, True, False, rng.randint(-5, 5), rng.choice(ints), 1.5e308, -0.0, 3.7]
        return rng.choice(scalars + JUNK_STRINGS)
    if r < 0.7:
        return [rand_value(rng, ints, depth + 1) for _ in range(rng.randint(0, 4))]
    return {
        rng.choice(FIELDS + ["x", "", "日本"]): rand_value(rng, ints, depth + 1)
        for _ in range(rng.randint(0, 4))
    }


FIELDS = [
    "model", "messages", "prompt", "stream", "max_tokens", "max_completion_tokens", "temperature", "seed",
    "n", "stream_options", "logprobs", "top_logprobs", "return_token_ids", "user", "stop", "metrics",
]  # fmt: skip


def to_json(value: Any) -> bytes:
    # (the standard library's: orjson refuses integers beyond 64 bits, which a client may send)
    return json.dumps(value, ensure_ascii=False).encode()


def rand_body(rng: random.Random, endpoint: str, ints: list[int]) -> bytes:
    r = rng.random()
    if r < 0.05:
        return b"".join(
            rng.choice([b"{", b"}", b"[", b"]", b'"', b":", b",", b"1", b"\xff", b" "]) for _ in range(40)
        )
    if r < 0.09:
        depth = rng.choice([100, 129, 255, 600, 1024, 1100])
        return b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"1" + b"]" * depth + b"}]}"
    if r < 0.12:
        return to_json(rand_value(rng, ints))
    if r < 0.14:
        return b'{"prompt": "' + b"x" * (1_100_000) + b'"}'
    body: dict[str, Any] = {}
    if endpoint == "chat":
        body["messages"] = rng.choice(
            [
                [{"role": "user", "content": "hi"}],
                [{"role": "user", "content": rand_value(rng, ints)}],
                rand_value(rng, ints),
            ]
        )
    else:
        body["prompt"] = rng.choice(["hello", rand_value(rng, ints)])
    for key in rng.sample(FIELDS, rng.randint(0, 6)):
        body[key] = rand_value(rng, ints)
    if rng.random() < 0.5:
        body["max_tokens"] = rng.choice([4, 8, -3, "abc", None, *ints])
    raw = to_json(body)
    if rng.random() < 0.05:  # invalid UTF-8 inside a string
        raw = raw.replace(b"hi", b"h\xffi", 1).replace(b"hello", b"he\xc3llo", 1)
    return raw


def rand_headers(rng: random.Random) -> list[bytes]:
    pool: list[Callable[[], bytes]] = [
        lambda: b"X-Request-Id: " + rng.choice(JUNK_BYTES + [b"ok-1"]),
        lambda: b"X-Specproxy-Category: " + rng.choice(JUNK_BYTES + [b"chat"]),
        lambda: (
            b"X-Specproxy-Concurrency-Level: "
            + rng.choice([b"4", b"0", b"-1", b"1_0", "٣".encode(), b"2147483648", b"99999999999", b"x"])
        ),
        lambda: (
            b"Content-Encoding: " + rng.choice([b"gzip", b"deflate", b"br", b"zstd", b"identity", b"\xff"])
        ),
        lambda: (
            b"Content-Type: " + rng.choice([b"text/plain", b"application/json; charset=latin-1", b"\xff"])
        ),
        lambda: b"Authorization: " + rng.choice([b"Bearer \xff\xfe", b"Basic x", b"Bearer " + b"k" * 4000]),
        lambda: (
            b"traceparent: " + rng.choice([b"00-" + b"f" * 32 + b"-" + b"1" * 16 + b"-01", b"junk", b"\xff"])
        ),
        lambda: b"Expect: " + rng.choice([b"100-continue", b"something"]),
        lambda: b"X-Big: " + b"a" * rng.choice([100, 9000, 20000]),
        lambda: b"".join(b"X-H%d: v\r\n" % i for i in range(rng.choice([10, 200])))[:-2],
        lambda: b"Connection: " + rng.choice([b"upgrade", b"keep-alive, Upgrade", b"\xff"]),
        lambda: b"Upgrade: " + rng.choice([b"websocket", b"h2c"]),
    ]
    return [rng.choice(pool)() for _ in range(rng.randint(0, 4))]


def fuzz_request(rng: random.Random, ints: list[int]) -> bytes:
    r = rng.random()
    if r < 0.03:
        return rng.choice(
            [
                bytes.fromhex("16030100c4010000c00303") + bytes(rng.randrange(256) for _ in range(60)),
                bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))),
                b"GET /health HTTP/1.1\r\nHost: x\r\n",  # a head that never ends: the header timeout
                b"GET /health HTTP/1.0\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                b'Connection: close\r\n\r\n5\r\n{"pro\r\nzz\r\n',
            ]
        )
    method = rng.choices(
        [b"POST", b"GET", b"PUT", b"DELETE", b"OPTIONS", b"HEAD", b"F\xffO"], [80, 8, 3, 3, 2, 2, 2]
    )[0]
    path = rng.choices(
        [b"/v1/chat/completions", b"/v1/completions", b"/v1/models", b"/health", b"/metrics", b"/v1/x",
         b"/v1/chat/completions?x=%ff", b"/" + b"a" * 9000, b"*", b"/v1/%2e%2e/completions"],
        [40, 30, 3, 3, 3, 3, 3, 2, 1, 2],
    )[0]  # fmt: skip
    endpoint = "chat" if b"chat" in path else "completions"
    body = rand_body(rng, endpoint, ints) if method == b"POST" or rng.random() < 0.1 else b""
    head = [method + b" " + path + b" HTTP/1.1", b"Host: proxy", b"Connection: close"]
    if rng.random() < 0.97:
        head.append(b"Content-Length: %d" % len(body))
    head += rand_headers(rng)
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def good_request(i: int) -> tuple[bytes, bool]:
    stream = i % 2 == 0
    if stream:
        body = {"model": "m", "messages": [{"role": "user", "content": f"good {i}"}], "stream": True}
        path = b"/v1/chat/completions"
    else:
        body, path = {"model": "m", "prompt": f"good {i}", "max_tokens": 8}, b"/v1/completions"
    raw = orjson.dumps(body)
    head = (
        b"POST %b HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\nContent-Type: application/json\r\n" % path
    )
    return head + b"Content-Length: %d\r\n\r\n" % len(raw) + raw, stream


# -- part 1: fuzz -------------------------------------------------------------------------------------


@dataclass
class FuzzResult:
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    closed_silently: int = 0
    hangs: int = 0
    proxy_5xx: list[bytes] = field(default_factory=list)
    upstream_5xx: int = 0
    not_json: list[bytes] = field(default_factory=list)
    good: int = 0
    good_failed: list[bytes] = field(default_factory=list)


async def exchange(url: str, request: bytes, timeout: float) -> bytes | None:
    """Everything the server sent until it closed; None: it neither answered nor closed in time."""
    host, port = url.removeprefix("http://").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        return b""
    out = b""
    try:
        writer.write(request)
        async with asyncio.timeout(timeout):
            while data := await reader.read(65536):
                out += data
    except TimeoutError:
        return None if not out else out
    except OSError:
        pass
    finally:
        writer.close()
    return out


def classify(res: FuzzResult, out: bytes) -> None:
    while out.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
        out = out[len(b"HTTP/1.1 100 Continue\r\n\r\n") :]
    if not out.startswith(b"HTTP/1."):
        res.closed_silently += 1
        return
    head, _, body = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    res.statuses[status] += 1
    lower = head.lower()
    # An arm's own answer passed through (the arm's header, not the proxy's wording) is as the arm sent it.
    passed_through = b"x-specproxy-arm:" in lower and b"specproxy" not in body
    if status >= 400 and b"content-type: application/json" not in lower and not passed_through:
        res.not_json.append(out[:300])
    if status >= 500:
        # An upstream's own: its answer passed through, or the proxy's 502/504 naming the upstream.
        named = status in (502, 504) and b'"message":"upstream ' in body
        if passed_through or named:
            res.upstream_5xx += 1
        else:
            res.proxy_5xx.append(out[:400])


async def fuzz(url: str, n: int, seed: int, *, poison: bool = True, concurrency: int = 32) -> FuzzResult:
    rng = random.Random(seed)
    ints = PLAIN_INTS + (POISONED_INTS if poison else [])
    plan: list[tuple[bytes, bool | None]] = []
    for i in range(n):
        plan.append(good_request(i) if i % 10 == 0 else (fuzz_request(rng, ints), None))
    res = FuzzResult()
    queue = iter(plan)

    async def worker() -> None:
        for request, stream in queue:
            out = await exchange(url, request, 30.0)
            res.sent += 1
            if out is None:
                res.hangs += 1
                continue
            if stream is not None:
                res.good += 1
                complete = out.startswith(b"HTTP/1.1 200") and (
                    out.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") if stream else out.endswith(b"}")
                )
                if not complete:
                    res.good_failed.append(out[:300])
            classify(res, out)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return res


async def run_fuzz(workdir: Path, ports: dict[str, int], n: int, seed: int, *, poison: bool = True) -> bool:
    """Part 1; prints its table, True when every target is met."""
    p = start_proxy(
        workdir,
        "fuzz",
        f"http://127.0.0.1:{ports['healthy']}",
        f"http://127.0.0.1:{ports['healthy2']}",
        max_body_bytes=1_000_000,
        client_header_timeout_s=5,
        upstream_read_timeout_s=10,
        shadow_timeout_s=15,
    )
    try:
        await asyncio.to_thread(wait_http, p.url + "/health", 60.0, p.proc)
        t0 = time.perf_counter()
        res = await fuzz(p.url, n, seed, poison=poison)
        elapsed = time.perf_counter() - t0
        for _ in range(600):  # calls still running (shadow copies) finish
            counted, inflight = await metrics_calls(p.url)
            if inflight == 0:
                break
            await asyncio.sleep(0.1)
    finally:
        written, dropped = stop_proxy(p)
    rows = store_rows(p.db)
    tracebacks, errors = log_problems(p.log)
    top = ", ".join(f"{s}: {c}" for s, c in sorted(res.statuses.items()))
    poisoned = "with" if poison else "without"
    print(f"\n## Fuzz: {res.sent} requests in {elapsed:.0f} s ({res.sent / elapsed:.0f}/s), seed {seed}, "
          f"{poisoned} poisoned integers")  # fmt: skip
    print(f"statuses  {top}; closed without an answer (junk): {res.closed_silently}")
    checks = [
        ("5xx not an upstream's own", len(res.proxy_5xx), 0),
        ("5xx that are an upstream's own (passed through / named)", res.upstream_5xx, None),
        ("error answers that are not JSON", len(res.not_json), 0),
        ("hangs (no answer, no close in 30 s)", res.hangs, 0),
        ("tracebacks in the proxy log", tracebacks, 0),
        ("ERROR lines in the proxy log", errors, 0),
        (f"good requests not answered in full (of {res.good})", len(res.good_failed), 0),
        (
            f"calls in /metrics {counted:.0f} - rows {rows} - dropped {dropped}",
            int(counted) - rows - dropped,
            0,
        ),
    ]
    ok = print_checks(checks)
    for sample in (res.proxy_5xx + res.not_json + res.good_failed)[:3]:
        print("   e.g.", sample[:300])
    if errors:
        print("   first log problem:", first_problem(p.log))
    return ok


def print_checks(checks: list[tuple[str, int, int | None]]) -> bool:
    ok = True
    print(f"{'figure':<62} {'value':>8}  target  met")
    for name, value, target in checks:
        met = target is None or value == target
        ok = ok and met
        print(f"{name:<62} {value:>8}  {'' if target is None else target:>6}  {'yes' if met else 'NO'}")
    return ok


# -- part 2: faulty candidates ---------------------------------------------------------------------


async def closed_loop(url: str, seconds: float, clients: int, tag: str) -> tuple[list[float], int]:
    ttfts: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:

        async def client(c: int) -> None:
            nonlocal errors
            i = 0
            while time.perf_counter() < deadline:
                i += 1
                body = {
                    "model": "m",
                    "stream": True,
                    "messages": [{"role": "user", "content": f"{tag} {c} {i}"}],
                }
                t0 = time.perf_counter()
                first = None
                try:
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        data = b""
                        async for piece in r.content.iter_any():
                            if first is None and b'"content":" ' in piece:
                                first = time.perf_counter()
                            data += piece
                    if r.status != 200 or not data.endswith(b"data: [DONE]\n\n") or b'"error"' in data:
                        errors += 1
                    elif first is not None:
                        ttfts.append(first - t0)
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1

        await asyncio.gather(*(client(c) for c in range(clients)))
    return ttfts, errors


async def run_candidates(workdir: Path, ports: dict[str, int], rounds: int, seconds: float) -> bool:
    base = f"http://127.0.0.1:{ports['healthy']}"
    proxies = {
        kind: start_proxy(
            workdir, f"cand_{kind}", base, f"http://127.0.0.1:{ports[kind]}", upstream_read_timeout_s=3,
            shadow_timeout_s=5,
        )
        for kind in KINDS
    }  # fmt: skip
    ttfts: dict[str, list[float]] = {k: [] for k in KINDS}
    medians: dict[str, list[float]] = {k: [] for k in KINDS}
    errors: Counter[str] = Counter()
    try:
        for p in proxies.values():
            await asyncio.to_thread(wait_http, p.url + "/health", 90.0, p.proc)
        kinds = list(KINDS)
        for r in range(rounds):
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            for kind in order:
                await closed_loop(proxies[kind].url, 0.3, 1, "warm")
                t, e = await closed_loop(proxies[kind].url, seconds, 4, f"r{r}")
                ttfts[kind] += t
                if t:
                    medians[kind].append(statistics.median(t))
                errors[kind] += e
    finally:
        problems = {}
        for kind, p in proxies.items():
            stop_proxy(p)
            problems[kind] = log_problems(p.log)
    healthy = statistics.median(ttfts["healthy"])
    print(
        f"\n## Faulty candidates: {rounds} interleaved rounds x {seconds:g} s x 4 streaming clients per kind"
    )
    print(f"{'candidate':<12} {'requests':>8} {'p50 TTFT ms':>11} {'vs healthy':>10} {'paired':>8} "
          f"{'client errors':>13} {'tracebacks':>10}  met")  # fmt: skip
    ok = True
    for kind in KINDS:
        p50 = statistics.median(ttfts[kind]) if ttfts[kind] else float("nan")
        ratio = p50 / healthy - 1
        # Paired: the median over rounds of (this kind's round median / healthy's round median - 1).
        paired = statistics.median(
            m / h - 1 for m, h in zip(medians[kind], medians["healthy"], strict=False)
        ) if medians[kind] else float("nan")  # fmt: skip
        # One-sided: a broken candidate that costs the machine less than a healthy one (no copy to
        # generate) may leave the primary faster; the target is that it never makes it slower.
        met = paired <= 0.05 and errors[kind] == 0 and problems[kind][0] == 0
        ok = ok and met
        print(
            f"{kind:<12} {len(ttfts[kind]):>8} {p50 * 1000:>11.2f} {ratio * 100:>+9.1f}% "
            f"{paired * 100:>+7.1f}% {errors[kind]:>13} {problems[kind][0]:>10}  {'yes' if met else 'NO'}"
        )
    print(
        "   (paired: median over rounds of the round's p50 / healthy's p50 - 1; target: at most +5 %, "
        "0 client errors, 0 tracebacks)"
    )
    return ok


# -- part 3: faulty baselines ------------------------------------------------------------------------

EXPECTED_BASELINE = {  # kind -> (plain status, stream outcome, span statuses)
    "healthy": ("200", "200 [DONE]", {"ok"}),
    "dead": ("502", "502", {"upstream_error"}),
    "slow10x": ("200", "200 [DONE]", {"ok"}),
    "stalling": ("200", "200 error event", {"ok", "timeout"}),
    "dropping": ("200", "200 error event", {"ok", "upstream_error"}),
    "http500": ("500", "500", {"http_error"}),
    "garbage_sse": ("502", "200 error event", {"upstream_error"}),
    "wrong_type": ("502", "502", {"upstream_error"}),
    "wrong_shape": ("502", "200 error event", {"upstream_error"}),
    "endless_event": ("200", "200 error event", {"ok", "upstream_error"}),
}


async def run_baselines(workdir: Path, ports: dict[str, int]) -> bool:
    proxies = {
        kind: start_proxy(
            workdir, f"base_{kind}", f"http://127.0.0.1:{ports[kind]}", None, upstream_read_timeout_s=2
        )
        for kind in KINDS
    }
    seen: dict[str, tuple[str, str]] = {}
    try:
        for p in proxies.values():
            await asyncio.to_thread(wait_http, p.url + "/health", 90.0, p.proc)
        for kind, p in proxies.items():
            plain = await exchange(p.url, good_request(1)[0], 30.0) or b""
            stream = await exchange(p.url, good_request(2)[0], 30.0) or b""
            s_plain = plain[9:12].decode() if plain.startswith(b"HTTP/1.1") else "none"
            s_stream = stream[9:12].decode() if stream.startswith(b"HTTP/1.1") else "none"
            if s_stream == "200":
                s_stream += (
                    " error event"
                    if b'data: {"error"' in stream
                    else " [DONE]"
                    if b"[DONE]" in stream
                    else ""
                )
            seen[kind] = (s_plain, s_stream)
    finally:
        for p in proxies.values():
            stop_proxy(p)
    print("\n## Faulty baselines: one plain and one streaming request each")
    print(f"{'baseline':<12} {'plain':>6} {'stream':>16}  {'spans (status: error)':<70} met")
    ok = True
    for kind, p in proxies.items():
        with duckdb.connect(str(p.db), read_only=True) as con:
            spans = con.execute(
                "SELECT stream, status, http_status, error FROM requests ORDER BY stream"
            ).fetchall()
        want_plain, want_stream, want_status = EXPECTED_BASELINE[kind]
        statuses = {s for _, s, _, _ in spans}
        tracebacks = log_problems(p.log)[0]
        met = seen[kind] == (want_plain, want_stream) and statuses <= want_status and len(spans) == 2
        met = met and tracebacks == 0
        ok = ok and met
        said = "; ".join(f"{s}: {(e or '')[:28]}" for _, s, _, e in spans)
        print(f"{kind:<12} {seen[kind][0]:>6} {seen[kind][1]:>16}  {said:<70} {'yes' if met else 'NO'}")
    return ok


# -- part 4: slowloris ---------------------------------------------------------------------------------


async def run_slowloris(workdir: Path, ports: dict[str, int], attackers: int, seconds: float) -> bool:
    """``attackers`` connections each sending one header byte every 2 s (replaced on the next tick when
    closed), the proxy under a file limit of 1024; a good request every 0.2 s must be answered."""
    p = start_proxy(workdir, "slowloris", f"http://127.0.0.1:{ports['healthy']}", None, fd_limit=1024)
    host, port = "127.0.0.1", p.port
    stop = asyncio.Event()
    closed = 0

    async def attacker() -> None:
        # Like the slowloris tool: every tick (2 s) one more header byte on each connection, and a new
        # connection in place of one the server closed.
        nonlocal closed
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-")
                while not stop.is_set():
                    try:
                        if await asyncio.wait_for(reader.read(100), 2.0) == b"":
                            break
                    except TimeoutError:
                        writer.write(b"a")
                closed += 1
                writer.close()
            except OSError:
                pass
            await asyncio.sleep(2.0)

    latencies: list[float] = []
    failed = 0
    try:
        await asyncio.to_thread(wait_http, p.url + "/health", 60.0, p.proc)
        tasks = [asyncio.create_task(attacker()) for _ in range(attackers)]
        await asyncio.sleep(3)  # the attack is under way
        deadline = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < deadline:
            i += 1
            t0 = time.perf_counter()
            out = await exchange(p.url, good_request(i)[0], 10.0)
            if out and out.startswith(b"HTTP/1.1 200") and out.rstrip().endswith((b"}", b"0")):
                latencies.append(time.perf_counter() - t0)
            else:
                failed += 1
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        stop_proxy(p)
    tracebacks, errors = log_problems(p.log)
    notices = p.log.read_bytes().count(b"client connections at the limit")
    print(f"\n## Slowloris: {attackers} connections dribbling header bytes, proxy under a file limit of 1024")
    p50 = statistics.median(latencies) * 1000 if latencies else float("nan")
    print(f"good requests answered {len(latencies)} (p50 {p50:.0f} ms), attacker connections closed {closed}")
    return print_checks(
        [
            ("good requests not answered during the attack", failed, 0),
            ("'at the limit' log lines (one per 10 s at most)", notices, None),
            ("tracebacks in the proxy log", tracebacks, 0),
            ("ERROR lines in the proxy log", errors, 0),
        ]
    )


# -- part 5: a candidate sending one endless event -------------------------------------------------


async def health_probe(url: str, stop: asyncio.Event) -> list[float]:
    """/health latencies, one probe every 50 ms until ``stop``."""
    out: list[float] = []
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            t0 = time.perf_counter()
            async with s.get(url + "/health") as r:
                await r.read()
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)
    return out


async def run_huge_event(workdir: Path, ports: dict[str, int], rounds: int, seconds: float) -> bool:
    """The healthy baseline's streaming calls and /health with a shadow candidate that sends 20 MB of
    one event without its end, against the same with a healthy candidate (interleaved rounds)."""
    base = f"http://127.0.0.1:{ports['healthy']}"
    kinds = ("healthy2", "endless_event")
    proxies = {
        k: start_proxy(workdir, f"huge_{k}", base, f"http://127.0.0.1:{ports[k]}", shadow_timeout_s=30)
        for k in kinds
    }
    ttfts: dict[str, list[float]] = {k: [] for k in kinds}
    medians: dict[str, list[float]] = {k: [] for k in kinds}
    health: dict[str, list[float]] = {k: [] for k in kinds}
    errors: Counter[str] = Counter()
    try:
        for p in proxies.values():
            await asyncio.to_thread(wait_http, p.url + "/health", 90.0, p.proc)
        for r in range(rounds):
            for k in kinds[r % 2 :] + kinds[: r % 2]:
                await closed_loop(proxies[k].url, 0.3, 1, "warm")
                stop = asyncio.Event()
                probe = asyncio.create_task(health_probe(proxies[k].url, stop))
                t, e = await closed_loop(proxies[k].url, seconds, 4, f"h{r}")
                stop.set()
                health[k] += await probe
                ttfts[k] += t
                medians[k].append(statistics.median(t) if t else float("nan"))
                errors[k] += e
    finally:
        for p in proxies.values():
            stop_proxy(p)
    with duckdb.connect(str(proxies["endless_event"].db), read_only=True) as con:
        row = con.execute("SELECT count(*) FROM requests WHERE error LIKE 'event over % bytes'").fetchone()
    cut = int(row[0]) if row else 0
    print(f"\n## A shadow candidate sending 20 MB of one endless event: {rounds} rounds x {seconds:g} s")
    print(f"{'candidate':<14} {'calls':>6} {'p50 TTFT ms':>11} {'/health p50 ms':>14} {'/health max ms':>14}")
    for k in kinds:
        h = health[k] or [float("nan")]
        print(f"{k:<14} {len(ttfts[k]):>6} {statistics.median(ttfts[k]) * 1000:>11.2f} "
              f"{statistics.median(h) * 1000:>14.2f} {max(h) * 1000:>14.2f}")  # fmt: skip
    pairs = zip(medians["endless_event"], medians["healthy2"], strict=True)
    paired = statistics.median(m / h - 1 for m, h in pairs)
    print(f"paired p50 TTFT vs the healthy candidate: {paired * 100:+.1f} % (target at most +10 %)")
    return print_checks(
        [
            ("p50 TTFT above the clean run by more than 10 %", int(paired > 0.10), 0),
            ("client errors", errors["endless_event"] + errors["healthy2"], 0),
            (f"no shadow span cut as 'event over N bytes' ({cut} were)", int(cut == 0), 0),
            ("tracebacks in the proxy logs", sum(log_problems(p.log)[0] for p in proxies.values()), 0),
        ]
    )


# -- main ---------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> bool:
    ports = {k: free_port() for k in KINDS} | {"healthy2": free_port()}
    backends = start_backends(ports)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_fuzz_") as tmp:
            workdir = Path(args.workdir or tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            if args.mode == "huge-event":
                return await run_huge_event(workdir, ports, args.rounds or 3, args.seconds)
            ok = await run_fuzz(workdir, ports, args.requests, args.seed, poison=not args.no_poison)
            if args.rounds:
                ok = await run_candidates(workdir, ports, args.rounds, args.seconds) and ok
                ok = await run_baselines(workdir, ports) and ok
            if args.slowloris:
                ok = await run_slowloris(workdir, ports, args.slowloris, 20.0) and ok
    finally:
        backends.send_signal(signal.SIGTERM)
        backends.wait(30)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000, help="generated requests in the fuzz part")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds per faulty candidate (0: skip 2, 3)"
    )
    ap.add_argument("--seconds", type=float, default=3.0, help="closed-loop seconds per candidate per round")
    ap.add_argument("--slowloris", type=int, default=1100, help="slowloris connections in part 4 (0: skip)")
    ap.add_argument(
        "--no-poison", action="store_true", help="no integers beyond the span store's columns in bodies"
    )
    ap.add_argument(
        "--mode",
        choices=("all", "huge-event"),
        default="all",
        help="huge-event: only part 5 (a shadow candidate sending one endless 20 MB event)",
    )
    ap.add_argument("--workdir", default=None, help="keep configs, logs and span stores here")
    ap.add_argument("--host-backends", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.host_backends:
        host_backends(args.host_backends)
        return
    print(f"bench_fuzz: {time.strftime('%Y-%m-%d %H:%M:%S')}, load {os.getloadavg()[0]:.2f}")
    ok = asyncio.run(run(args))
    print(f"\nall targets met: {'yes' if ok else 'NO'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
