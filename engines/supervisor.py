"""Running the arms: start as supervised subprocesses, wait for health, record, stop.

Each arm runs in its own process group (its own session), writes stdout and stderr to one log file,
and outlives the `up` command: what `up` started is written to a state file next to the experiment,

    <experiment dir>/.specproxy-engines/<experiment name>.json

so `status` and `down` work from another shell, and `serve`/`replay` can read each arm's stack
(:func:`recorded_stacks`). A process is identified by its pid *and* its start time, so a recycled
pid is never signalled. `down` sends SIGTERM to each arm's whole process group (vLLM's engine core
and workers are children of the API server) and SIGKILL to what is left after the grace period.

Errors are one tree::

    EngineError
    ├── EngineStartError   an arm exited or never answered /health; carries its log tail
    └── StateError         the state file is unreadable, or engines of this experiment already run
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from specproxy.config import Experiment

from .plan import ArmLaunch

STATE_DIR_NAME = ".specproxy-engines"
LOG_TAIL_LINES = 40


class EngineError(Exception):
    """Base of the engines' errors; the message is a sentence for the user."""


class EngineStartError(EngineError):
    def __init__(self, message: str, arm: str, log_tail: str) -> None:
        super().__init__(message)
        self.arm = arm
        self.log_tail = log_tail


class StateError(EngineError):
    pass


@dataclass
class ArmProcess:
    """One started arm, as kept in the state file."""

    arm: str
    pid: int
    port: int
    url: str
    health_url: str
    log: str
    argv: list[str]
    env: dict[str, str]
    engine: str
    started_at: str
    # Field 22 of /proc/<pid>/stat: with the pid, identifies the process across pid reuse.
    start_ticks: int | None = None
    stack: dict[str, Any] | None = None


@dataclass
class EngineState:
    experiment: str
    config_path: str | None
    engine: str
    created_at: str
    arms: list[ArmProcess] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> EngineState:
        data = json.loads(text)
        arms = [ArmProcess(**a) for a in data.pop("arms", [])]
        return cls(arms=arms, **data)


def state_dir(exp: Experiment) -> Path:
    """Where `up` keeps its state and (by default) the arms' logs: next to the experiment file."""
    base = Path(exp.source_path).resolve().parent if exp.source_path else Path.cwd()
    return base / STATE_DIR_NAME


def state_path(exp: Experiment) -> Path:
    return state_dir(exp) / f"{exp.name}.json"


def read_state(exp: Experiment) -> EngineState | None:
    path = state_path(exp)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read the engines state file {path}: {exc.strerror or exc}") from exc
    try:
        return EngineState.from_json(text)
    except (ValueError, TypeError) as exc:
        raise StateError(f"the engines state file {path} is damaged ({exc}); delete it after checking "
                         f"no engine of this experiment still runs") from exc


def write_state(exp: Experiment, state: EngineState) -> Path:
    path = state_path(exp)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(state.to_json())
    os.replace(tmp, path)  # atomic: a concurrent `status` never reads half a file
    return path


def recorded_stacks(exp: Experiment) -> dict[str, dict[str, Any]]:
    """Each running arm's stack as `engines up` captured it ({} when the arms were not started by
    `specproxy engines`). For the run record's ``stacks_json``.

    Example::

        stacks = recorded_stacks(exp)   # {"eagle3": {"vllm_version": "0.33.0", "gpus": [...], ...}}
    """
    try:
        state = read_state(exp)
    except StateError:
        return {}
    if state is None:
        return {}
    return {a.arm: a.stack for a in state.arms if a.stack is not None and is_running(a)}


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat split into fields (the command name, which may hold spaces, folded into one)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, _, tail = raw.rpartition(")")
    pid_part, _, comm = head.partition(" (")
    return [pid_part, comm, *tail.split()]


def process_start_ticks(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[21]) if fields and len(fields) > 21 else None


def _alive(pid: int) -> bool:
    fields = _proc_stat(pid)
    if fields is not None:
        return fields[2] not in ("Z", "X")  # a zombie has exited; it only waits to be reaped
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_running(proc: ArmProcess) -> bool:
    """Is this arm's process still the one `up` started, and alive?"""
    if not _alive(proc.pid):
        return False
    if proc.start_ticks is not None:
        return process_start_ticks(proc.pid) == proc.start_ticks
    return True


def _group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (Linux /proc; elsewhere just the leader if alive)."""
    proc_root = Path("/proc")
    if not proc_root.is_dir():
        return [pgid] if _alive(pgid) else []
    members = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _proc_stat(int(entry.name))
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
) -> EngineState:
    """Start every arm, wait until each answers /health, capture stacks, record the state.

    If any arm exits or does not become healthy within ``health_timeout_s``, every arm started here
    is stopped again and :class:`EngineStartError` carries the failing arm's log tail.
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
            proc = _spawn(launch, log_path)
            popens[launch.arm] = proc
            state.arms.append(ArmProcess(
                arm=launch.arm, pid=proc.pid, port=launch.port, url=launch.base_url,
                health_url=launch.health_url, log=str(log_path), argv=list(launch.argv),
                env=dict(launch.env), engine=engine, started_at=_now(),
                start_ticks=process_start_ticks(proc.pid),
            ))
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


def _spawn(launch: ArmLaunch, log_path: Path) -> subprocess.Popen[bytes]:
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
            )
        except OSError as exc:
            raise EngineStartError(
                f"arm {launch.arm!r} could not be started: {launch.argv[0]}: {exc.strerror or exc}",
                launch.arm, "",
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
                    name, tail,
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
                name, tail,
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
        elif not _alive(arm.pid) and _group_members(arm.pid):
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
        rows.append(ArmStatus(
            arm=a.arm, pid=a.pid, running=running, healthy=running and _health_ok(a.health_url), url=a.url,
            log=a.log, started_at=a.started_at,
            server_version=(a.stack or {}).get("server_version"),
        ))
    return state, rows
