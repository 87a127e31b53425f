"""The front door at production speed: what specproxy adds in front of a streaming backend, beside nginx.

    python tests/bench/bench_front_door.py --out /tmp/front-door                  # the default run
    python tests/bench/bench_front_door.py --out DIR --levels 1,64,256 --workers 4 --scaling 1,2,4,8

Needs only the installed specproxy (its aiohttp/uvloop) and, for the nginx column, Debian's nginx on
PATH (`apt-get install -y nginx`; without it that column is skipped, and the output says so). Everything
else is in this file, in subprocesses of it:

- the backend: a minimal streaming server (asyncio.Protocol, keep-alive, chunked SSE) with a 20 ms TTFT,
  10 ms per token, 64 tokens (``--tokens``), one token per chunk; ``--backend-procs`` processes share
  each port (SO_REUSEPORT); the baseline's port and, for shadow, the candidate's. Every response the
  same length on a timer of its own makes a closed loop's streams end, and their clients send again,
  in lockstep cohorts (the worst case for a relay); ``--tokens-spread S`` scatters the lengths,
  ``--engine-steps`` sends every running stream's next token in one pass per step, as an engine's
  continuous batching does;
- the load generator: ``--client-procs`` processes, closed loop (c streams always in flight, spread
  over the processes), a raw HTTP/1.1 client with one keep-alive connection per stream: the first
  content chunk's arrival is the TTFT, every ``data: {`` event a relayed chunk;
- the targets: ``direct`` (the backend), ``nginx`` (one worker, upstream keepalive,
  ``proxy_buffering off``, a temp config in a temp dir), ``split`` and ``shadow`` (``specproxy serve``,
  one process), ``split-wN`` / ``shadow-wN`` (``--workers N``), and on request ``pipe``: a bare byte
  relay on uvloop in this file (one upstream connection per client connection, no HTTP parsing, no
  record), the least CPU any Python relay on uvloop spends, to tell the runtime's cost from specproxy's.

For each round, level and target (the order rotates every round) the load runs ``--warmup`` + ``--duration``
seconds. Per target and level it prints the medians over rounds (>= 2) of: added p50 TTFT against
direct (the target's p50 minus direct's of the same round), p99 TTFT, relayed chunks/s, and CPU per
request of the target's processes (nginx: master + worker; specproxy: the serve process and its
workers; from /proc) with the share of it spent in the kernel (the relay's system calls, which nginx
makes too). ``--scaling 1,2,4,8`` then measures relayed chunks/s of split with N workers at
``--scaling-concurrency`` streams with a faster backend (``--scaling-itl-ms``, sent as a request header
the proxy relays), the load that saturates one worker, beside 0.8 x N x one worker's.

``--scaling-load wrk`` drives the scaling run with native tools instead: wrk (``apt-get install -y wrk``)
as the load generator and nginx's echo module (Debian's nginx-light has it) as the backend, streaming
the same bytes. The Python ones spend several times a worker's CPU per chunk together, so on 16 cores
they cannot saturate 8 workers; wrk and nginx spend a fraction of it. wrk counts bytes, so relayed
chunks/s are its bytes over one response's (checked to hold all its events) times the tokens; each
row also says how many cores the backend and wrk kept busy.

``--tokens N`` sets the chunks per response (64): CPU per request measured at two counts (8 and 64)
splits into a part per request and a part per relayed chunk (the difference over the chunks between).

Validity: the load generator, backends and targets share the machine's cores. On a machine with few
cores the figures say how the targets compare within one run, not what each costs alone; the JSON
records the cores, the load average before the run, and each figure's spread over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOKENS = 64
EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" w"},"logprobs":null,"finish_reason":null}]}\n\n'
)
LAST = EVENT.replace(b'"finish_reason":null', b'"finish_reason":"length"')
DONE = b"data: [DONE]\n\n"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
ITL_HEADER = b"X-Bench-Itl-Ms"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _header_value(head: bytes, name: bytes) -> bytes | None:
    """A header's value in a lower-cased request head that ends with CRLF (None: absent)."""
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    return head[start : head.index(b"\r\n", start)].strip()


class ResponseLengths:
    """How many tokens each response of a backend process has: ``tokens`` every time, or with ``spread``
    (0 < spread < 1) drawn uniformly from tokens x [1 - spread, 1 + spread], from a seeded generator."""

    def __init__(self, tokens: int, spread: float = 0.0, seed: int = 0) -> None:
        self.low = max(1, round(tokens * (1 - spread)))
        self.high = max(self.low, round(tokens * (1 + spread)))
        self._rng = random.Random(seed)

    def next(self) -> int:
        return self.low if self.low == self.high else self._rng.randint(self.low, self.high)


class EngineSteps:
    """One engine's step clock (``--engine-steps``): every ``itl_s`` each running stream sends its next
    token, all in one pass, as vLLM's continuous batching ends each step with one chunk for every running
    request. A stream's first token still goes ``ttft_s`` after its request on a timer of its own, so that
    the TTFT a target adds is not rounded up to a whole step (a request that a relay delays past a step's
    start would otherwise wait for the next one); its later tokens go with the steps. Without this clock
    each stream keeps its own timer for every token."""

    def __init__(self, itl_s: float) -> None:
        self.itl_s = itl_s
        self.running: list[BackendStream] = []
        self.timer: asyncio.TimerHandle | None = None

    def add(self, stream: BackendStream) -> None:
        self.running.append(stream)
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.itl_s, self._step)

    def _step(self) -> None:
        self.running = [s for s in self.running if s.send_next()]
        self.timer = asyncio.get_running_loop().call_later(self.itl_s, self._step) if self.running else None


class BackendStream(asyncio.Protocol):
    """One client connection of the minimal backend: a POST gets a stream of ``lengths.next()`` tokens,
    a GET a 200."""

    def __init__(
        self, ttft_s: float, itl_s: float, lengths: ResponseLengths, steps: EngineSteps | None = None
    ) -> None:
        self.ttft_s, self.itl_s, self.lengths, self.steps = ttft_s, itl_s, lengths, steps
        self.tokens = lengths.low
        self.sent = 0
        self.buf = b""
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not an asyncio.Transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower() + b"\r\n"
        length = int(_header_value(head, b"content-length") or 0)
        if len(self.buf) < end + 4 + length:
            return
        self.buf = self.buf[end + 4 + length :]
        assert self.transport is not None
        if not head.startswith(b"post"):
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
            )
            return
        itl = _header_value(head, ITL_HEADER.lower())
        itl_s = float(itl) / 1000 if itl else self.itl_s
        self.transport.write(STREAM_HEAD)
        self.tokens, self.sent = self.lengths.next(), 0
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.ttft_s, self._token, itl_s, loop)

    def send_next(self) -> bool:
        """Writes the stream's next token (the last one with the stream's end); False once it has ended."""
        assert self.transport is not None
        if self.transport.is_closing():
            return False
        if self.sent < self.tokens - 1:
            self.transport.write(_chunk(EVENT))
            self.sent += 1
            return True
        self.transport.write(_chunk(LAST) + _chunk(DONE) + b"0\r\n\r\n")
        return False

    def _token(self, itl_s: float, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        if not self.send_next():
            return
        if self.steps is not None:
            self.steps.add(self)  # (the first token sent: the rest go with the engine's steps)
        else:
            self.timer = loop.call_later(itl_s, self._token, itl_s, loop)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


async def serve_backend(
    port: int, ttft_s: float, itl_s: float, lengths: ResponseLengths, steps: bool = False
) -> None:
    clock = EngineSteps(itl_s) if steps else None
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: BackendStream(ttft_s, itl_s, lengths, clock), "127.0.0.1", port, reuse_port=True, backlog=4096
    )
    async with server:
        await server.serve_forever()


class PipeDownstream(asyncio.Protocol):
    """A client's connection to the ``pipe`` target: its bytes go to its own upstream connection as they
    are, and the upstream's come back the same way. No HTTP parsing, no record: the least CPU a relay on
    Python and uvloop can spend per relayed chunk (a read callback and a write), the floor under
    specproxy's figures."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.transport: asyncio.Transport | None = None
        self.upstream: PipeUpstream | None = None
        self.early: list[bytes] = []  # what the client sent before the upstream connection was up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not an asyncio.Transport)
        loop = asyncio.get_running_loop()
        self.connecting = loop.create_task(self._connect(loop))  # (held: the loop keeps only a weak ref)

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            _, upstream = await loop.create_connection(
                lambda: PipeUpstream(self), "127.0.0.1", self.upstream_port
            )
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.upstream = upstream
        assert upstream.transport is not None
        upstream.transport.write(b"".join(self.early))
        self.early = []

    def data_received(self, data: bytes) -> None:
        if self.upstream is None or self.upstream.transport is None:
            self.early.append(data)
        else:
            self.upstream.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()


class PipeUpstream(asyncio.Protocol):
    """The ``pipe`` target's connection to the backend, one per client connection."""

    def __init__(self, downstream: PipeDownstream) -> None:
        self.downstream = downstream
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.downstream.transport is not None:
            self.downstream.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.downstream.transport is not None:
            self.downstream.transport.close()


async def serve_pipe(port: int, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: PipeDownstream(upstream_port), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


@dataclass
class LoadResult:
    ttfts: list[float] = field(default_factory=list)
    chunks: int = 0  # relayed chunks received inside the measured window
    requests: int = 0  # completed inside the measured window
    all_requests: int = 0  # completed, warm-up included (for CPU per request)
    errors: int = 0
    duration: float = 0.0


class ClientStream(asyncio.Protocol):
    """One closed-loop stream: sends a request, reads its answer to the end, sends the next."""

    def __init__(
        self, request: bytes, res: LoadResult, window: tuple[float, float], done: asyncio.Future[None]
    ):
        self.request, self.res, self.window, self.done = request, res, window, done
        self.transport: asyncio.Transport | None = None
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not an asyncio.Transport)
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        now = time.perf_counter()
        if now >= self.window[1]:
            self.transport.close()
            return
        self.t0, self.first, self.tail, self.head_seen = now, 0.0, b"", False
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        seen = self.tail + data
        if not self.head_seen:
            if not seen.startswith(b"HTTP/1.1 200"):
                self.res.errors += 1
                assert self.transport is not None
                self.transport.close()
                return
            self.head_seen = True
        events = seen.count(b"data: {") - self.tail.count(b"data: {")
        if events and not self.first:
            self.first = now
        if self.window[0] <= now < self.window[1]:
            self.res.chunks += events
        self.tail = seen[-24:]
        if seen.endswith(b"0\r\n\r\n") and b"[DONE]" in seen[-40:]:  # the last event, then the last chunk
            self._finished(now)

    def _finished(self, now: float) -> None:
        self.res.all_requests += 1
        if self.window[0] <= self.t0 and now < self.window[1]:
            self.res.requests += 1
            self.res.ttfts.append(self.first - self.t0)
        self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


def _stream_factory(
    request: bytes, res: LoadResult, window: tuple[float, float], done: asyncio.Future[None]
) -> Callable[[], ClientStream]:
    return lambda: ClientStream(request, res, window, done)


async def run_clients(
    host: str, port: int, streams: int, warmup: float, duration: float, itl_ms: float
) -> LoadResult:
    body = b'{"model":"m","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"hello"}]}'
    extra = b"%b: %g\r\n" % (ITL_HEADER, itl_ms) if itl_ms else b""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: %b:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%b\r\n%b" % (host.encode(), port, len(body), extra, body)
    )
    res = LoadResult()
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    window = (start + warmup, start + warmup + duration)
    dones: list[asyncio.Future[None]] = []
    for _ in range(streams):
        done = loop.create_future()
        dones.append(done)
        try:
            await loop.create_connection(_stream_factory(request, res, window, done), host, port)
        except OSError:
            res.errors += 1
            done.set_result(None)
    try:
        await asyncio.wait_for(asyncio.gather(*dones), warmup + duration + 30)
    except TimeoutError:
        res.errors += 1
    res.duration = duration
    return res


def _use_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


def role_main(args: argparse.Namespace) -> None:
    """A subprocess of the bench: a backend process, or one load generator process (JSON on stdout)."""
    _use_uvloop()
    if args.role == "backend":
        lengths = ResponseLengths(args.tokens, args.tokens_spread, args.seed)
        ttft_s, itl_s = args.ttft_ms / 1000, args.itl_ms / 1000
        asyncio.run(serve_backend(args.port, ttft_s, itl_s, lengths, args.engine_steps))
        return
    if args.role == "pipe":
        asyncio.run(serve_pipe(args.port, args.upstream))
        return
    res = asyncio.run(
        run_clients("127.0.0.1", args.port, args.streams, args.warmup, args.duration, args.itl_ms)
    )
    # Through a buffered binary writer: under PYTHONUNBUFFERED the text layer writes straight to the
    # raw pipe and drops what a partial write leaves over (results are often larger than a pipe's 64 KiB).
    with os.fdopen(sys.stdout.fileno(), "wb", closefd=False) as out:
        out.write(json.dumps(asdict(res)).encode() + b"\n")


NGINX_CONF = """worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fcgi;
    uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
    upstream backend {{ server 127.0.0.1:{upstream}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


# The scaling run's native stack (``--scaling-load wrk``): wrk (C) as the load generator and nginx's
# echo module as the backend. The Python load generator and backend of this file together spend several
# times a worker's CPU per chunk, so on 16 cores they cannot feed 8 workers; these spend a fraction.
ECHO_CONF = """load_module {module};
worker_processes {procs};
worker_rlimit_nofile 200000;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 65536; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fcgi;
    uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
    server {{
        listen 127.0.0.1:{port} backlog=8192 reuseport;
        keepalive_requests 1000000;
        location = /health {{ return 200 "{{}}"; }}
        location / {{
            default_type text/event-stream;
            echo_read_request_body;
            {stream}
        }}
    }}
}}
"""

# wrk reports its totals from Lua: one JSON line after the run.
WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '{"model":"m","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"hello"}]}'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK {"requests":%d,"bytes":%d,"duration_us":%d,"errors":%d,"p50_us":%d}\\n',
    summary.requests, summary.bytes, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50)))
end
"""


def _echo_string(data: bytes) -> str:
    """``data`` as a double-quoted nginx config string (the echo module writes it as is)."""
    text = data.decode().replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def echo_stream(ttft_ms: float, itl_ms: float, tokens: int) -> str:
    """The echo module's directives for one stream: the same bytes as :class:`BackendStream` sends."""
    steps = [f"echo_sleep {ttft_ms / 1000:g};"]
    for _ in range(tokens - 1):
        steps += [f"echo -n {_echo_string(EVENT)};", "echo_flush;", f"echo_sleep {itl_ms / 1000:g};"]
    steps.append(f"echo -n {_echo_string(LAST + DONE)};")
    return " ".join(steps)


def native_tool(name: str, nginx_exe: str | None) -> str | None:
    """wrk, or the echo module's .so, from PATH / Debian's folder or beside a carried nginx binary."""
    beside = Path(nginx_exe).resolve().parent.parent if nginx_exe else None
    if name == "wrk":
        found = shutil.which("wrk")
        candidates = [Path(found)] if found else []
        candidates += [beside / "bin" / "wrk"] if beside else []
    else:
        candidates = [Path("/usr/lib/nginx/modules") / name]
        candidates += [beside / "modules" / name] if beside else []
    return next((str(c) for c in candidates if c.exists()), None)


def _nginx_exe() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60, log: Path | None = None
) -> None:
    """Until ``port`` answers /health; SystemExit where ``proc`` exits first (with the end of its
    ``log``, nginx's error log, which says why) or nothing answers in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = log.read_text(errors="replace").strip().splitlines()[-5:] if log and log.exists() else []
            raise SystemExit(
                f"a target exited while starting ({proc.args!r}): exit status {proc.returncode}"
                + "".join(f"\n  {line}" for line in said)
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing answered on port {port} within {timeout_s:g} s")


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss_mb(pids: list[int]) -> float:
    """Resident memory of the processes, MiB: a target whose memory grows round after round keeps
    something per request."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total / 1024


def cpu_s(pids: list[int]) -> tuple[float, float]:
    """User and system (kernel) CPU seconds the processes have used so far."""
    user = system = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        user += int(fields[11])
        system += int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    return user / tick, system / tick


@dataclass
class Target:
    name: str
    port: int
    proc: subprocess.Popen[bytes] | None  # None: the backend itself (direct)

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid) if self.proc is not None else []


class Bench:
    """Owns every process of a run; :meth:`close` stops them all (also on Ctrl-C or an error)."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.notes: list[str] = []
        self.echo: Target | None = None  # the native backend, once started

    def spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        # In the run's temp folder: `python -m specproxy` started in a checkout's root would import the
        # checkout's specproxy/ folder (the current directory comes first), not the installed package.
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.tmp,
        )
        self.procs.append(proc)
        return proc

    def backend(self, port: int) -> None:
        a = self.args
        for _ in range(a.backend_procs):
            self.spawn(
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "backend",
                    "--port",
                    str(port),
                    "--ttft-ms",
                    str(a.ttft_ms),
                    "--itl-ms",
                    str(a.itl_ms),
                    "--tokens",
                    str(a.tokens),
                    "--tokens-spread",
                    str(a.tokens_spread),
                    "--seed",
                    str(a.seed * 1000 + len(self.procs)),  # each process its own stream of lengths
                    *(["--engine-steps"] if a.engine_steps else []),
                ]
            )

    def nginx(self, upstream: int) -> Target | None:
        exe = _nginx_exe()
        if exe is None:
            self.notes.append("nginx is not installed (apt-get install -y nginx): its column is skipped")
            return None
        port, conf_dir = free_port(), self.tmp / "nginx"
        conf_dir.mkdir()
        (conf_dir / "nginx.conf").write_text(NGINX_CONF.format(dir=conf_dir, upstream=upstream, port=port))
        proc = self.spawn(
            [exe, "-p", str(conf_dir), "-c", str(conf_dir / "nginx.conf"), "-e", str(conf_dir / "error.log")]
        )
        wait_ready(port, proc, log=conf_dir / "error.log")
        return Target("nginx", port, proc)

    def echo_backend(self) -> int:
        """The native backend for ``--scaling-load wrk``; its port (SystemExit where a tool is missing)."""
        a, exe = self.args, _nginx_exe()
        module = native_tool("ngx_http_echo_module.so", exe)
        if exe is None or module is None:
            raise SystemExit(
                "--scaling-load wrk needs nginx and its echo module (apt-get install -y nginx-light wrk)"
            )
        port, conf_dir = free_port(), self.tmp / "echo"
        conf_dir.mkdir()
        stream = echo_stream(a.ttft_ms, a.scaling_itl_ms, a.tokens)
        conf = ECHO_CONF.format(module=module, procs=a.backend_procs, dir=conf_dir, port=port, stream=stream)
        (conf_dir / "nginx.conf").write_text(conf)
        proc = self.spawn(
            [exe, "-p", str(conf_dir), "-c", str(conf_dir / "nginx.conf"), "-e", str(conf_dir / "error.log")]
        )
        wait_ready(port, proc, log=conf_dir / "error.log")
        self.echo = Target("echo-backend", port, proc)
        return port

    def pipe(self, upstream: int) -> Target:
        port = free_port()
        proc = self.spawn(
            [sys.executable, __file__, "--role", "pipe", "--port", str(port), "--upstream", str(upstream)]
        )
        wait_ready(port, proc)
        return Target("pipe", port, proc)

    def specproxy(self, name: str, mode: str, base: int, cand: int, workers: int) -> Target:
        port = free_port()
        weight = "weight = 1\n" if mode == "split" else ""
        config = self.tmp / f"{name}.toml"
        config.write_text(
            f'[experiment]\nname = "bench-{name}"\nmode = "{mode}"\nspan_queue_size = 1000000\n\n'
            f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "http://127.0.0.1:{base}"\n{weight}\n'
            f'[[arms]]\nname = "cand"\nurl = "http://127.0.0.1:{base if mode == "split" else cand}"\n'
            f"max_shadow_inflight = 4096\n{weight}"
        )
        argv = [
            sys.executable,
            "-m",
            "specproxy",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
            "--db",
            str(self.tmp / f"{name}.duckdb"),
            "--log-level",
            "warning",
            "--no-scrape",
        ]
        proc = self.spawn(argv + (["--workers", str(workers)] if workers > 1 else []))
        wait_ready(port, proc)
        return Target(name, port, proc)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def measure(target: Target, streams: int, args: argparse.Namespace, itl_ms: float = 0) -> dict[str, Any]:
    """One closed-loop load on ``target``: ``streams`` spread over the client processes."""
    procs = max(1, min(args.client_procs, streams))
    shares = [streams // procs + (1 if i < streams % procs else 0) for i in range(procs)]
    pids = target.pids()
    cpu0 = cpu_s(pids)
    started = time.monotonic()
    clients = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                "client",
                "--port",
                str(target.port),
                "--streams",
                str(n),
                "--warmup",
                str(args.warmup),
                "--duration",
                str(args.duration),
                "--itl-ms",
                str(itl_ms),
            ],
            stdout=subprocess.PIPE,
        )
        for n in shares
    ]
    results = [json.loads(c.communicate()[0]) for c in clients]
    user1, system1 = cpu_s(pids)
    elapsed = time.monotonic() - started
    cpu, system = user1 + system1 - sum(cpu0), system1 - cpu0[1]
    ttfts = sorted(t for r in results for t in r["ttfts"])
    all_requests = sum(r["all_requests"] for r in results)
    return {
        "p50_ttft_ms": statistics.median(ttfts) * 1000 if ttfts else float("nan"),
        "p99_ttft_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1000 if ttfts else float("nan"),
        "chunks_per_s": sum(r["chunks"] for r in results) / args.duration,
        "requests": sum(r["requests"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "cpu_ms_per_request": cpu / all_requests * 1000 if pids and all_requests else float("nan"),
        "kernel_share": system / cpu if pids and cpu else float("nan"),
        # Cores the target kept busy over the load (warm-up included): one saturated process reads ~1.
        "busy_cores": cpu / elapsed if pids else float("nan"),
        "rss_mb": rss_mb(pids) if pids else float("nan"),
    }


def start_targets(bench: Bench, base: int, cand: int) -> list[Target]:
    a = bench.args
    wanted = a.targets.split(",")
    targets = [Target("direct", base, None)]
    if "nginx" in wanted:
        nginx = bench.nginx(base)
        targets += [nginx] if nginx is not None else []
    if "pipe" in wanted:
        targets.append(bench.pipe(base))
    for mode in ("split", "shadow"):
        if mode in wanted:
            targets.append(bench.specproxy(mode, mode, base, cand, 1))
        if f"{mode}-w" in wanted and a.workers > 1:
            targets.append(bench.specproxy(f"{mode}-w{a.workers}", mode, base, cand, a.workers))
    return targets


def rounds(bench: Bench, targets: list[Target]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every round, level and target (the order rotated each round): ``out[level][target]`` = rounds."""
    a = bench.args
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in range(a.rounds):
        for level in (int(c) for c in a.levels.split(",")):
            k = r % len(targets)
            for target in targets[k:] + targets[:k]:
                fig = measure(target, level, a)
                out.setdefault(str(level), {}).setdefault(target.name, []).append(fig)
                print(
                    f"  round {r + 1} c={level} {target.name}: p50 {fig['p50_ttft_ms']:.2f} ms, "
                    f"{fig['chunks_per_s']:.0f} chunks/s, CPU {fig['cpu_ms_per_request']:.2f} ms/request "
                    f"({fig['kernel_share']:.0%} kernel), "
                    f"RSS {fig['rss_mb']:.0f} MiB, {fig['errors']} errors",
                    file=sys.stderr,
                )
    return out


def summarize(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Medians over rounds; the added p50 TTFT pairs each round with direct's of the same round."""
    med = statistics.median
    out: dict[str, dict[str, dict[str, float]]] = {}
    for level, per_target in raw.items():
        direct = [f["p50_ttft_ms"] for f in per_target["direct"]]
        for name, figs in per_target.items():
            added = [f["p50_ttft_ms"] - d for f, d in zip(figs, direct, strict=True)]
            out.setdefault(level, {})[name] = {
                "added_p50_ttft_ms": med(added),
                "added_p50_ttft_ms_spread": max(added) - min(added),
                "p50_ttft_ms": med(f["p50_ttft_ms"] for f in figs),
                "p99_ttft_ms": med(f["p99_ttft_ms"] for f in figs),
                "chunks_per_s": med(f["chunks_per_s"] for f in figs),
                "cpu_ms_per_request": med(f["cpu_ms_per_request"] for f in figs),
                "kernel_share": med(f["kernel_share"] for f in figs),
                "errors": sum(f["errors"] for f in figs),
            }
    return out


# Figures of the target's processes: direct has none.
PROCESS_FIGURES = ("cpu_ms_per_request", "kernel_share")


def table(summary: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    names = list(next(iter(summary.values())))
    lines = []
    for title, key, fmt in (
        ("added p50 TTFT vs direct, ms", "added_p50_ttft_ms", "{:+.2f}"),
        ("relayed chunks/s", "chunks_per_s", "{:.0f}"),
        ("CPU per request, ms (the target's processes)", "cpu_ms_per_request", "{:.2f}"),
        ("of which in the kernel", "kernel_share", "{:.0%}"),
        ("p99 TTFT, ms", "p99_ttft_ms", "{:.1f}"),
    ):
        lines += [f"{title}:", "  " + f"{'c':>5}" + "".join(f"{n:>14}" for n in names)]
        for level, per in summary.items():
            cells = "".join(
                f"{'-' if n == 'direct' and key in PROCESS_FIGURES else fmt.format(per[n][key]):>14}"
                for n in names
            )
            lines.append("  " + f"{level:>5}" + cells)
    errors = {
        f"c={lv} {n}": f["errors"] for lv, per in summary.items() for n, f in per.items() if f["errors"]
    }
    lines.append(f"errors: {errors or 'none'}")
    return lines


def response_bytes(port: int, tokens: int) -> int | None:
    """The bytes one streamed response through ``port`` takes on the wire, head and chunk framing
    included; None where it lacks some of its ``tokens`` events."""
    body = b'{"model":"m","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"hello"}]}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (port, len(body), body)
    )
    seen = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(request)
        while not seen.endswith(b"0\r\n\r\n"):
            data = conn.recv(65536)
            if not data:
                break
            seen += data
    return len(seen) if seen.count(b"data: {") == tokens else None


def measure_wrk(bench: Bench, target: Target, streams: int) -> dict[str, Any]:
    """One closed-loop load on ``target`` from wrk (``streams`` connections over ``--client-procs``
    threads). Relayed chunks/s are the bytes wrk read over one response's bytes, times its tokens:
    partly read responses count for their part (at c=2048 a slow target's streams all start at once
    and finish together, so counting whole responses would count a few waves)."""
    a = bench.args
    wire = response_bytes(target.port, a.tokens)
    if wire is None:
        raise SystemExit(f"{target.name}: a response lacked some of its {a.tokens} events")
    assert bench.echo is not None
    script = bench.tmp / "load.lua"
    script.write_text(WRK_SCRIPT)
    url = f"http://127.0.0.1:{target.port}/v1/chat/completions"
    wrk = [native_tool("wrk", _nginx_exe()) or "wrk", f"-t{max(1, min(a.client_procs, streams))}"]
    wrk += [f"-c{streams}", "--timeout", "30s", "-s", str(script)]
    subprocess.run([*wrk, f"-d{max(1, round(a.warmup))}s", url], stdout=subprocess.DEVNULL, check=True)
    pids, backend = target.pids(), bench.echo.pids()
    cpu0, backend0 = sum(cpu_s(pids)), sum(cpu_s(backend))
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    run = [*wrk, f"-d{max(1, round(a.duration))}s", url]
    out = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    elapsed = time.monotonic() - started
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = json.loads(next(line[4:] for line in out.splitlines() if line.startswith("WRK ")))
    loadgen = children1.ru_utime + children1.ru_stime - children0.ru_utime - children0.ru_stime
    return {
        "chunks_per_s": res["bytes"] / wire * a.tokens / (res["duration_us"] / 1e6),
        "responses_per_s": res["requests"] / (res["duration_us"] / 1e6),
        "p50_ttft_ms": float("nan"),  # wrk times whole responses
        "p50_response_ms": res["p50_us"] / 1000,
        "busy_cores": (sum(cpu_s(pids)) - cpu0) / elapsed if pids else float("nan"),
        "backend_cores": (sum(cpu_s(backend)) - backend0) / elapsed,
        "loadgen_cores": loadgen / elapsed,
        "errors": res["errors"],
    }


def scaling(bench: Bench, base: int) -> dict[str, Any]:
    """Relayed chunks/s of split with N workers at a load that saturates one worker."""
    a = bench.args
    native = a.scaling_load == "wrk"
    if native:
        base = bench.echo_backend()
    out: dict[str, Any] = {
        "concurrency": a.scaling_concurrency,
        "itl_ms": a.scaling_itl_ms,
        "load": a.scaling_load,
        "workers": {},
    }

    def load(target: Target) -> dict[str, Any]:
        if native:
            return measure_wrk(bench, target, a.scaling_concurrency)
        return measure(target, a.scaling_concurrency, a, itl_ms=a.scaling_itl_ms)

    for n in (int(w) for w in a.scaling.split(",")):
        target = bench.specproxy(f"scale-w{n}", "split", base, base, n)
        figs = [load(target) for _ in range(a.rounds)]
        out["workers"][str(n)] = {
            key: statistics.median(f[key] for f in figs) for key in figs[0] if key != "errors"
        } | {"errors": sum(f["errors"] for f in figs)}
        if target.proc is not None:
            os.killpg(target.proc.pid, signal.SIGTERM)
            target.proc.wait(timeout=60)
        print(
            f"  scaling: {n} workers: {out['workers'][str(n)]['chunks_per_s']:.0f} chunks/s", file=sys.stderr
        )
    out["direct_chunks_per_s"] = load(Target("direct", base, None))["chunks_per_s"]
    return out


def scaling_lines(result: dict[str, Any]) -> list[str]:
    """The scaling table, each row with the cores its workers kept busy, and a note where N workers did
    not keep N x one worker's cores busy: then the backend or the load generator, which share the
    machine, set the figure, not the proxy."""
    workers = result["workers"]
    one = workers.get("1", {})
    lines = [
        f"--workers N, split, c={result['concurrency']}, backend {result['itl_ms']:g} ms/token, "
        f"load from {result['load']} "
        f"(direct: {result['direct_chunks_per_s']:.0f} chunks/s):"
    ]
    for n, fig in workers.items():
        goal = ""
        if one and n != "1":
            goal = f"  target >= {0.8 * int(n) * one['chunks_per_s']:.0f}"
            if fig["busy_cores"] < 0.8 * int(n) * one["busy_cores"]:
                goal += " (workers not saturated: the machine's backend or load generator set this figure)"
        # Under wrk, the cores the backend and wrk kept busy (wrk's latencies leave out the streams
        # still open at the end, the slowest at a saturating load, so they are not printed).
        latency = (
            f"backend {fig['backend_cores']:.1f} cores, wrk {fig['loadgen_cores']:.1f} cores"
            if "backend_cores" in fig
            else f"p50 TTFT {fig['p50_ttft_ms']:.1f} ms"
        )
        lines.append(
            f"  {n:>2} workers: {fig['chunks_per_s']:>9.0f} chunks/s  {fig['busy_cores']:4.1f} cores busy"
            f"  {latency}{goal}"
        )
    return lines


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for results.json and results.txt")
    ap.add_argument("--levels", default="1,64,256", help="concurrency levels (streams in flight)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per level and target (medians over them)")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per target, level, round")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measurement")
    ap.add_argument(
        "--targets",
        default="nginx,split,shadow,split-w,shadow-w",
        help="beside direct; also: pipe (a bare byte relay on uvloop, the floor for a Python relay)",
    )
    ap.add_argument("--workers", type=int, default=4, help="N of the split-wN / shadow-wN targets")
    ap.add_argument(
        "--scaling", default="", help="worker counts for the scaling run, e.g. 1,2,4,8 (empty: none)"
    )
    ap.add_argument("--scaling-concurrency", type=int, default=1024)
    ap.add_argument(
        "--scaling-itl-ms", type=float, default=2.0, help="the backend's ms per token in the scaling run"
    )
    ap.add_argument(
        "--scaling-load",
        choices=["python", "wrk"],
        default="python",
        help="the scaling run's load generator and backend: this file's (Python), or wrk and nginx's "
        "echo module (C: a fraction of the CPU per chunk, so that 8 workers can be saturated on 16 cores)",
    )
    cores = os.cpu_count() or 2
    ap.add_argument("--client-procs", type=int, default=max(1, cores // 4), help="load generator processes")
    ap.add_argument(
        "--backend-procs", type=int, default=max(1, cores // 8), help="processes per backend port"
    )
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument(
        "--tokens",
        type=int,
        default=TOKENS,
        help="tokens (chunks) per response; two runs at different "
        "counts split CPU per request into a part per request and a part per chunk",
    )
    ap.add_argument(
        "--tokens-spread",
        type=float,
        default=0.0,
        help="each response's tokens drawn uniformly from tokens x [1 - S, 1 + S] (0 <= S < 1); 0 (the "
        "default): every response the same length, so streams end and clients send again in lockstep "
        "cohorts, the worst case for a relay that handles a burst one request at a time (the Python "
        "backend only: --scaling-load wrk's streams keep --tokens)",
    )
    ap.add_argument("--seed", type=int, default=0, help="the response lengths' seed (with --tokens-spread)")
    ap.add_argument(
        "--engine-steps",
        action="store_true",
        help="the Python backend sends tokens on one step clock per process, every running stream's "
        "next token in the same pass (vLLM's continuous batching), instead of a timer per stream; "
        "the scaling run's faster pace does not apply to it",
    )
    ap.add_argument("--role", choices=["backend", "client", "pipe"], help=argparse.SUPPRESS)
    ap.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.role is not None:
        role_main(args)
        return
    if args.out is None:
        raise SystemExit("--out DIR is required")
    if not 0 <= args.tokens_spread < 1:
        raise SystemExit("--tokens-spread must be at least 0 and below 1")
    if args.engine_steps and args.scaling and args.scaling_load == "python":
        raise SystemExit("--engine-steps keeps the backend's --itl-ms pace: run --scaling without it")
    args.out.mkdir(parents=True, exist_ok=True)
    loadavg = os.getloadavg()
    meta: dict[str, Any] = {
        "cores": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        try:
            base, cand = free_port(), free_port()
            bench.backend(base)
            bench.backend(cand)
            for port in (base, cand):
                wait_ready(port, bench.procs[0])
            targets = start_targets(bench, base, cand)
            raw = rounds(bench, targets) if args.levels else {}
            summary = summarize(raw) if raw else {}
            scale = scaling(bench, base) if args.scaling else None
        finally:
            bench.close()
    meta["loadavg_after"] = os.getloadavg()
    lines = [
        f"bench_front_door: {meta['cores']} cores, load average before {loadavg[0]:.1f}, "
        f"{args.rounds} rounds x {args.duration:g} s (+{args.warmup:g} s warm-up), medians over rounds"
    ]
    lines += [f"note: {n}" for n in bench.notes]
    lines += table(summary) if summary else []
    lines += scaling_lines(scale) if scale else []
    text = "\n".join(lines)
    print(text)
    (args.out / "results.txt").write_text(text + "\n")
    (args.out / "results.json").write_text(
        json.dumps(
            {"meta": meta, "levels": summary, "rounds": raw, "scaling": scale, "notes": bench.notes}, indent=2
        )
    )


if __name__ == "__main__":
    main()
