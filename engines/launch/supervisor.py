"""Running the arms: start as supervised subprocesses, wait for health, record, stop.

Each arm runs in its own process group (its own session), writes stdout and stderr to one log file,
and outlives the `up` command: what `up` started is written to a state file next to the experiment,

    <experiment dir>/.specproxy-engines/<experiment name>.json

so `status` and `down` work from another shell, and `serve`/`replay` can read each arm's stack
(:mod:`specproxy.engine_state` holds that file's shape). A process is identified by its pid *and*
its start time, so a recycled pid is never signalled. `down` sends SIGTERM to each arm's whole
process group (vLLM's engine core and workers are children of the API server) and SIGKILL to what
is left after the grace period.

Errors are one tree::

    EngineError
    ├── EngineStartError   an arm exited or never answered /health; carries its log tail
    └── StateError         the state file is unreadable, or engines of this experiment already run
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from specproxy.config import Experiment
from specproxy.engine_state import (
    ArmProcess,
    EngineError,
    EngineState,
    StateError,
    is_running,
    pid_alive,
    proc_stat,
    process_start_ticks,
    read_state,
    state_path,
    write_state,
)
from specproxy.engines.launch.plan import ArmLaunch

LOG_TAIL_LINES = 40


class EngineStartError(EngineError):
    def __init__(self, message: str, arm: str, log_tail: str) -> None:
        super().__init__(message)
        self.arm = arm
        self.log_tail = log_tail


def _group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (Linux /proc; elsewhere just the leader if alive)."""
    proc_root = Path("/proc")
    if not proc_root.is_dir():
        return [pgid] if pid_alive(pgid) else []
    members = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        fields = proc_stat(int(entry.name))
        if fields and len(fields) > 4 and fields[4] == str(pgid) and fields[2] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:]) or "(the log is empty)"


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return bool(200 <= resp.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _now() -> str:
    return datetime.now(UTC).isoformat()


Report = Callable[[str], None]


def start_arms(
    exp: Experiment,
    launches: Sequence[ArmLaunch],
    *,
    log_dir: Path,
    health_timeout_s: float,
    engine: str,
    report: Report = lambda _msg: None,
    stack_of: Callable[[ArmLaunch], dict[str, Any]] | None = None,
    tied: bool = False,
) -> EngineState:
    """Start every arm, wait until each answers /health, capture stacks, record the state.

    If any arm exits or does not become healthy within ``health_timeout_s``, every arm started here
    is stopped again and :class:`EngineStartError` carries the failing arm's log tail. ``tied`` arms
    get SIGTERM when this process dies, even by SIGKILL (Linux), as the lab's simulators do; others
    outlive it, as `engines up` means them to.
    """
    existing = read_state(exp)
    if existing is not None:
        running = [a for a in existing.arms if is_running(a)]
        if running:
            names = ", ".join(f"{a.arm} (pid {a.pid})" for a in running)
            raise StateError(
                f"engines of experiment {exp.name!r} are already running: {names}; "
                f"stop them with `specproxy engines down` first"
            )
    # Absolute, so `status` and `down` from another directory find the logs.
    log_dir = log_dir.resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    state = EngineState(experiment=exp.name, config_path=exp.source_path, engine=engine, created_at=_now())
    popens: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for launch in launches:
            log_path = log_dir / f"{exp.name}-{launch.arm}.log"
            proc = _spawn(launch, log_path, tied)
            popens[launch.arm] = proc
            state.arms.append(
                ArmProcess(
                    arm=launch.arm,
                    pid=proc.pid,
                    port=launch.port,
                    url=launch.base_url,
                    health_url=launch.health_url,
                    log=str(log_path),
                    argv=list(launch.argv),
                    env=dict(launch.env),
                    engine=engine,
                    started_at=_now(),
                    start_ticks=process_start_ticks(proc.pid),
                )
            )
            report(f"started {launch.arm} (pid {proc.pid}) on port {launch.port}, log {log_path}")
        # Written before the wait, so `down` from another shell can stop arms that hang in start-up.
        write_state(exp, state)
        _wait_healthy(state, popens, health_timeout_s, report)
        if stack_of is not None:
            for arm_proc, launch in zip(state.arms, launches, strict=True):
                arm_proc.stack = stack_of(launch)
        write_state(exp, state)
        return state
    except BaseException:
        # A failed or interrupted start leaves nothing behind.
        stop_arms(state.arms, grace_s=10.0, popens=popens)
        state_path(exp).unlink(missing_ok=True)
        raise


def _stop_with_parent() -> None:
    """In the child, before it runs the engine: SIGTERM when the process that started it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


_PR_SET_PDEATHSIG = 1


def _spawn(launch: ArmLaunch, log_path: Path, tied: bool = False) -> subprocess.Popen[bytes]:
    log: IO[bytes]
    with open(log_path, "wb") as log:
        log.write(f"# specproxy engines: {launch.shell_line()}\n".encode())
        log.flush()
        try:
            return subprocess.Popen(
                list(launch.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **launch.env},
                # Own session and process group: survives this command, and `down` can signal the
                # engine together with the worker processes it forks.
                start_new_session=True,
                # (a preexec_fn is safe while no other thread runs: the lab starts its arms first)
                preexec_fn=_stop_with_parent if tied else None,
            )
        except OSError as exc:
            raise EngineStartError(
                f"arm {launch.arm!r} could not be started: {launch.argv[0]}: {exc.strerror or exc}",
                launch.arm,
                "",
            ) from exc


def _wait_healthy(
    state: EngineState,
    popens: Mapping[str, subprocess.Popen[bytes]],
    timeout_s: float,
    report: Report,
) -> None:
    deadline = time.monotonic() + timeout_s
    pending = {a.arm: a for a in state.arms}
    while pending:
        for name, arm in list(pending.items()):
            code = popens[name].poll()
            if code is not None:
                tail = log_tail(arm.log)
                raise EngineStartError(
                    f"arm {name!r} exited with code {code} while starting; "
                    f"the last lines of {arm.log}:\n{tail}",
                    name,
                    tail,
                )
            if _health_ok(arm.health_url):
                report(f"{name} is healthy at {arm.url}")
                del pending[name]
        if not pending:
            return
        if time.monotonic() > deadline:
            name, arm = next(iter(pending.items()))
            tail = log_tail(arm.log)
            raise EngineStartError(
                f"arm {name!r} did not answer {arm.health_url} within {timeout_s:g} s "
                f"(raise --health-timeout for large models); the last lines of {arm.log}:\n{tail}",
                name,
                tail,
            )
        time.sleep(0.2)


@dataclass(frozen=True)
class StopResult:
    arm: str
    pid: int
    how: str  # "SIGTERM", "SIGKILL", "orphans" (leader gone, its workers stopped) or "not running"


def stop_arms(
    arms: Sequence[ArmProcess],
    *,
    grace_s: float,
    popens: Mapping[str, subprocess.Popen[bytes]] | None = None,
) -> list[StopResult]:
    """SIGTERM each running arm's process group, SIGKILL what is left after ``grace_s``."""
    popens = popens or {}
    results: dict[str, str] = {}
    targets: list[ArmProcess] = []
    for arm in arms:
        if is_running(arm):
            targets.append(arm)
            _signal_group(arm.pid, signal.SIGTERM)
            results[arm.arm] = "SIGTERM"
        elif not pid_alive(arm.pid) and _group_members(arm.pid):
            # The API server died but workers of its group live on (holding GPU memory). The group id
            # is the dead leader's pid, which no other process can own while the group exists.
            targets.append(arm)
            _signal_group(arm.pid, signal.SIGTERM)
            results[arm.arm] = "orphans"
        else:
            results[arm.arm] = "not running"
    deadline = time.monotonic() + grace_s
    while targets and time.monotonic() < deadline:
        for arm in targets:
            if arm.arm in popens:
                popens[arm.arm].poll()  # reap our own child so it does not linger as a zombie
        targets = [a for a in targets if _group_members(a.pid)]
        if targets:
            time.sleep(0.1)
    for arm in targets:
        _signal_group(arm.pid, signal.SIGKILL)
        if results[arm.arm] == "SIGTERM":
            results[arm.arm] = "SIGKILL"
    for arm in arms:
        if arm.arm in popens:
            try:
                popens[arm.arm].wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    return [StopResult(a.arm, a.pid, results[a.arm]) for a in arms]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_experiment(exp: Experiment, *, grace_s: float) -> list[StopResult] | None:
    """`down`: stop what the state file lists and remove it; None when nothing was recorded."""
    state = read_state(exp)
    if state is None:
        return None
    results = stop_arms(state.arms, grace_s=grace_s)
    state_path(exp).unlink(missing_ok=True)
    return results


@dataclass(frozen=True)
class ArmStatus:
    arm: str
    pid: int
    running: bool
    healthy: bool
    url: str
    log: str
    started_at: str
    server_version: str | None


def experiment_status(exp: Experiment) -> tuple[EngineState, list[ArmStatus]] | None:
    state = read_state(exp)
    if state is None:
        return None
    rows = []
    for a in state.arms:
        running = is_running(a)
        rows.append(
            ArmStatus(
                arm=a.arm,
                pid=a.pid,
                running=running,
                healthy=running and _health_ok(a.health_url),
                url=a.url,
                log=a.log,
                started_at=a.started_at,
                server_version=(a.stack or {}).get("server_version"),
            )
        )
    return state, rows
