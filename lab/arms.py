"""The lab's arms: a baseline, its replica (the noise floor) and three speculative configurations,
started as simulators (`specproxy sim`, one per arm) through `specproxy engines`."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from specproxy.config import Arm, EngineSettings, Experiment, Role
from specproxy.engine_state import EngineError
from specproxy.engines.launch.plan import SimOptions, plan_arm
from specproxy.engines.launch.supervisor import start_arms, stop_experiment

LAB_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_PROFILE = "h100-llama3.1-8b"
REPLICA = "replica"

# The lab's arms: (name, vLLM --speculative-config or None); the first is the baseline, REPLICA a copy.
LAB_ARMS: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("baseline", None),
    (REPLICA, None),
    (
        "ngram",
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    ),
    (
        "draft_model",
        {"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct", "num_speculative_tokens": 4},
    ),
    (
        "eagle3",
        {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3},
    ),
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lab_experiment(
    out: Path, profile: str, time_scale: float, *, replica: bool = True, port_base: int = 0
) -> Experiment:
    """The lab's arms as an experiment on ports from ``port_base`` up, or free ones (state under ``out``)."""
    arms: list[Arm] = []
    for i, (name, spec) in enumerate(LAB_ARMS):
        if name == REPLICA and not replica:
            continue
        port = port_base + len(arms) if port_base else _free_port()
        role: Role = "baseline" if i == 0 else "replica" if name == REPLICA else "candidate"
        arms.append(
            Arm(
                name=name,
                url=f"http://127.0.0.1:{port}",
                role=role,
                speculative=spec or {},
                engine=EngineSettings(port=port),
                description=f"specproxy sim, profile {profile}, time scale {time_scale:g}",
            )
        )
    return Experiment(
        name="lab", arms=tuple(arms), model=LAB_MODEL, source_path=str(out.resolve() / "lab.toml")
    )


@contextlib.contextmanager
def simulated_arms(
    out: Path, profile: str, time_scale: float, seed: int, replica: bool = True, port_base: int = 0
) -> Iterator[Experiment]:
    """Start one `specproxy sim` per lab arm through `specproxy engines` (the same launch plan as
    `engines up --engine sim`); stop them all on the way out, whatever happened."""
    exp = lab_experiment(out, profile, time_scale, replica=replica, port_base=port_base)
    # Simulators left behind by a lab in this folder that was killed outright.
    stop_experiment(exp, grace_s=5.0)
    options = SimOptions(profile=profile, time_scale=time_scale, seed=seed)
    launches = [plan_arm(exp, arm, engine="sim", sim=options) for arm in exp.arms]
    try:
        # The exact simulator command goes into the run's stacks (profile, time scale, seed).
        start_arms(
            exp,
            launches,
            log_dir=out,
            health_timeout_s=60.0,
            engine="sim",
            stack_of=lambda launch: {"engine": "sim", "argv": list(launch.argv)},
            tied=True,  # the simulators stop with the lab, even when it is killed outright
        )
    except EngineError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        yield exp
    finally:
        stop_experiment(exp, grace_s=10.0)
