"""Processes a test starts, and ending every one of them however the test ends.

Each process :func:`spawn` starts runs in its own session (so its process group is its own, and a
signal to it reaches the workers it forks) and carries a mark in its environment that every process
it starts inherits. The mark is what finds the whole tree: `specproxy lab` and `specproxy engines up`
start their simulators in sessions of their own, and a lab killed outright leaves them running with
parent 1, out of reach of its group. :func:`end` signals the group of every marked process, SIGTERM
then SIGKILL; :func:`end_left_over` does it for what a test left (conftest.py calls it after each test
and at the end of the session), and a subprocess's deadline defaults to the time the test has left
(:func:`deadline_s`), so a stuck command fails with its own output before pytest-timeout interrupts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# What Popen takes for stdin, stdout and stderr: PIPE, DEVNULL or STDOUT, a descriptor, a file.
_Stream = int | IO[Any] | None

# The environment variable that marks a test's process tree: one token per spawn, each added to the
# tokens its parent carried (``a:b``), so a process is found from every spawn above it.
MARK = "TESTS_PROCESS_TREE"  # conftest.py scrubs SPECPROXY_* from the environment of each test
# What a subprocess's default deadline keeps back from the test's own: time to stop the tree and
# report its output before pytest-timeout interrupts the test.
_MARGIN_S = 15.0
# When no pytest timeout applies (a test run by hand with --timeout 0): a stuck command's deadline.
_NO_LIMIT_DEADLINE_S = 600.0
_spawned = 0
_live: dict[int, tuple[subprocess.Popen[bytes], int]] = {}
_test_ends_at: float | None = None


def set_test_deadline(timeout_s: float | None) -> None:
    """The running test must end within ``timeout_s`` from now (pytest-timeout's limit), or None."""
    global _test_ends_at
    _test_ends_at = None if not timeout_s else time.monotonic() + timeout_s


def deadline_s(wanted: float | None = None) -> float:
    """A subprocess's deadline: ``wanted`` when given, but never past the time the test has left, less
    a margin to stop the process and report what it printed."""
    left = _NO_LIMIT_DEADLINE_S if _test_ends_at is None else _test_ends_at - time.monotonic() - _MARGIN_S
    return max(1.0, min(left, wanted) if wanted is not None else left)


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdin: _Stream = None,
    stdout: _Stream = None,
    stderr: _Stream = None,
) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv)`` in its own session, marked (module docstring); :func:`end` stops it.
    ``env`` replaces the inherited environment, as Popen's does."""
    global _spawned
    number, _spawned = _spawned, _spawned + 1
    base = os.environ if env is None else env
    proc = subprocess.Popen(
        list(argv),
        env={**base, MARK: ":".join(t for t in (base.get(MARK), _token(number)) if t)},
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )
    _live[proc.pid] = (proc, number)
    return proc


def run(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end (``subprocess.run(..., capture_output=True, text=True)``), its whole tree
    stopped at once if the wait ends otherwise: a deadline past (``subprocess.TimeoutExpired`` with
    what it printed), pytest-timeout's interruption. ``timeout`` defaults to the time the test has
    left (:func:`deadline_s`). What a command that ended leaves running on purpose (`engines up`
    starts arms that outlive it) is stopped when the test ends."""
    limit = deadline_s(timeout)
    proc = spawn(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        end(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(list(argv), limit, _text(out), _text(err)) from None
    except BaseException:
        end(proc)
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, _text(out), _text(err))


def tree(token: str) -> list[int]:
    """The live processes whose environment carries the mark ``token`` (a zombie's environment reads
    empty: it has ended)."""
    prefix = f"{MARK}=".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                variables = f.read().split(b"\0")
        except OSError:  # gone meanwhile, or not ours
            continue
        marks = [v[len(prefix) :].decode().split(":") for v in variables if v.startswith(prefix)]
        if marks and token in marks[0]:
            found.append(int(entry.name))
    return found


def tree_of(proc: subprocess.Popen[bytes]) -> list[int]:
    """The live processes below ``proc``, a process :func:`spawn` started (itself included while it
    runs), however far they moved away: their own sessions, parent 1."""
    entry = _live.get(proc.pid)
    return tree(_token(entry[1])) if entry is not None else []


def end(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Stop ``proc`` and every process of its tree: SIGTERM to each one's process group, SIGKILL to
    what is left after ``grace_s``; ``proc`` is reaped. Harmless on a process already stopped."""
    entry = _live.pop(proc.pid, None)
    token = _token(entry[1]) if entry is not None else ""
    _signal_tree(proc, token, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        if proc.returncode is not None and not (token and tree(token)):
            return
        time.sleep(0.05)
    _signal_tree(proc, token, signal.SIGKILL)
    proc.wait()


def end_left_over(since: int = 0) -> None:
    """:func:`end` every process spawned as number ``since`` or later that is still registered."""
    for proc, number in list(_live.values()):
        if number >= since:
            end(proc)


def spawned() -> int:
    """How many processes have been spawned so far (for :func:`end_left_over`)."""
    return _spawned


def _token(number: int) -> str:
    return f"{os.getpid()}-{number}"


def _text(data: bytes | None) -> str:
    return data.decode(errors="replace") if data else ""


def _signal_tree(proc: subprocess.Popen[bytes], token: str, sig: int) -> None:
    pids = ([proc.pid] if proc.returncode is None else []) + (tree(token) if token else [])
    ours = os.getpgrp()
    for pid in pids:
        try:
            group = os.getpgid(pid)
            if group != ours:
                os.killpg(group, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
