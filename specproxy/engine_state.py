"""The engines state file: what `specproxy engines up` started, read back by `down`, `status`,
`serve` and `replay`.

It sits next to the experiment file,

    <experiment dir>/.specproxy-engines/<experiment name>.json

and is the one contract between the launcher (which writes it) and the proxy (which reads each arm's
captured stack from it for the run record). A process is identified by its pid *and* its start time,
so a recycled pid is never taken for an arm.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specproxy.config import Experiment

STATE_DIR_NAME = ".specproxy-engines"


class EngineError(Exception):
    """Base of the engines' errors; the message is a sentence for the user."""


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
        raise StateError(
            f"the engines state file {path} is damaged ({exc}); delete it after checking "
            f"no engine of this experiment still runs"
        ) from exc


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


def proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat split into fields (the command name, which may hold spaces, folded into one)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, _, tail = raw.rpartition(")")
    pid_part, _, comm = head.partition(" (")
    return [pid_part, comm, *tail.split()]


def process_start_ticks(pid: int) -> int | None:
    fields = proc_stat(pid)
    return int(fields[21]) if fields and len(fields) > 21 else None


def pid_alive(pid: int) -> bool:
    fields = proc_stat(pid)
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
    if not pid_alive(proc.pid):
        return False
    if proc.start_ticks is not None:
        return process_start_ticks(proc.pid) == proc.start_ticks
    return True
