"""Helpers for tests that start real servers: free ports, readiness polls, CLI subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
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
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s (last error: {last})")


def start_cli(args: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`specproxy ARGS...` as a subprocess (stdout and stderr merged into stdout)."""
    return subprocess.Popen(
        [sys.executable, "-m", "specproxy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> str:
    """SIGTERM, wait, SIGKILL if needed; returns the process's output."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is None:
        return ""
    # Close the pipe: an unclosed one is a ResourceWarning, and warnings fail tests here.
    with proc.stdout:
        return proc.stdout.read().decode(errors="replace")
