"""Launch plans: one experiment file in, one command per arm out.

A plan is pure data (:class:`ArmLaunch`): the argv, the environment it adds, the port and the health
URL. The same plan drives every way of running the arms:

- ``vllm``: ``vllm serve MODEL --port P --served-model-name NAME --speculative-config '<json>'
  --per-request-spec-decode-metrics summary`` plus the arm's ``[arms.engine]`` settings;
- ``sim``: ``specproxy sim`` with the same model name, port and speculative config (no GPU);
- the renderers in :mod:`specproxy.engines.launch.render` turn vLLM plans into a shell script, a compose
  file or Kubernetes manifests.

Example::

    exp = load_experiment("exp.toml")
    for launch in plan_experiment(exp, engine="vllm"):
        print(launch.shell_line())
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal
from urllib.parse import urlsplit

from specproxy.config import Arm, Experiment

Engine = Literal["vllm", "sim"]
ENGINES: tuple[Engine, ...] = ("vllm", "sim")

# Hosts for which `up` binds the engine to that address; anything else binds all interfaces.
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})

# Flags the plan sets itself from the experiment file; passing them in extra_args would contradict it.
MANAGED_FLAGS = frozenset(
    {
        "--port",
        "--host",
        "--served-model-name",
        "--speculative-config",
        "-sc",
        "--tensor-parallel-size",
        "-tp",
        "--max-num-seqs",
        "--gpu-memory-utilization",
        "--max-model-len",
        "--per-request-spec-decode-metrics",
    }
)


class PlanError(ValueError):
    """The experiment cannot be turned into launch commands; the message says which arm and why."""


@dataclass(frozen=True)
class SimOptions:
    """What `--engine sim` adds to each simulated arm (the simulator's own knobs)."""

    profile: str | None = None
    time_scale: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class ArmLaunch:
    """How to start one arm: a command, the variables it adds to the environment, where it listens."""

    arm: str
    engine: Engine
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = ""
    served_model_name: str = ""
    gpus: tuple[int, ...] = ()

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/health"

    def shell_line(self) -> str:
        """The command as one line a POSIX shell runs as is (environment prefix included)."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = shlex.join(self.argv)
        return f"{prefix} {cmd}" if prefix else cmd


def arm_port(arm: Arm) -> int:
    """engine.port if set, else the port in the arm's url."""
    if arm.engine.port is not None:
        return arm.engine.port
    parts = urlsplit(arm.url)
    try:
        port = parts.port
    except ValueError as exc:
        raise PlanError(f"arm {arm.name!r}: url {arm.url!r} has an invalid port") from exc
    if port is None:
        raise PlanError(
            f"arm {arm.name!r}: url {arm.url!r} names no port; add one to the url or set [arms.engine] port"
        )
    return port


def arm_bind_host(arm: Arm) -> str:
    """The address the engine listens on: the url's host when it is loopback, else all interfaces."""
    host = urlsplit(arm.url).hostname or ""
    return host if host in _LOOPBACK else "0.0.0.0"


def served_model_name(exp: Experiment) -> str:
    """Every arm serves the experiment's model under one name, so the proxy can forward requests
    unchanged to any arm."""
    if not exp.model:
        raise PlanError(
            "experiment.model is not set: engines need the model to serve "
            '(e.g. model = "meta-llama/Llama-3.1-8B-Instruct" under [experiment])'
        )
    return exp.model


def vllm_argv(exp: Experiment, arm: Arm, *, vllm_bin: str = "vllm", host: str | None = None) -> list[str]:
    """`vllm serve ...` for one arm, without the environment (see :func:`plan_arm`)."""
    model = served_model_name(exp)
    argv = [
        vllm_bin,
        "serve",
        model,
        "--host",
        host if host is not None else arm_bind_host(arm),
        "--port",
        str(arm_port(arm)),
        "--served-model-name",
        model,
    ]
    if arm.speculative:
        # Per-request acceptance reaches the proxy only with this flag; it is about speculation,
        # so the baseline does not get it.
        argv += ["--speculative-config", arm.speculative_json, "--per-request-spec-decode-metrics", "summary"]
    eng = arm.engine
    if eng.tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(eng.tensor_parallel_size)]
    if eng.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(eng.max_num_seqs)]
    if eng.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", _number(eng.gpu_memory_utilization)]
    if eng.max_model_len is not None:
        argv += ["--max-model-len", str(eng.max_model_len)]
    argv += list(eng.extra_args)
    return argv


def sim_argv(
    exp: Experiment, arm: Arm, options: SimOptions = SimOptions(), *, python: str = sys.executable
) -> list[str]:
    """`specproxy sim ...` for one arm: same model name, port and speculative config as vLLM would get."""
    model = served_model_name(exp)
    argv = [
        python,
        "-m",
        "specproxy",
        "sim",
        "--host",
        arm_bind_host(arm),
        "--port",
        str(arm_port(arm)),
        "--model",
        model,
        "--served-model-name",
        model,
    ]
    if arm.speculative:
        argv += ["--speculative-config", arm.speculative_json, "--per-request-spec-decode-metrics", "summary"]
    if arm.engine.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(arm.engine.max_num_seqs)]
    if options.profile is not None:
        argv += ["--profile", options.profile]
    if options.time_scale is not None:
        argv += ["--time-scale", _number(options.time_scale)]
    if options.seed is not None:
        argv += ["--seed", str(options.seed)]
    return argv


def plan_arm(
    exp: Experiment,
    arm: Arm,
    *,
    engine: Engine = "vllm",
    vllm_bin: str = "vllm",
    sim: SimOptions = SimOptions(),
) -> ArmLaunch:
    """The launch plan of one arm."""
    env: dict[str, str] = {}
    if engine == "vllm":
        argv = vllm_argv(exp, arm, vllm_bin=vllm_bin)
        if arm.engine.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in arm.engine.gpus)
    else:
        argv = sim_argv(exp, arm, sim)
    env.update(arm.engine.env)
    return ArmLaunch(
        arm=arm.name,
        engine=engine,
        argv=tuple(argv),
        env=MappingProxyType(env),
        host=arm_bind_host(arm),
        port=arm_port(arm),
        model=served_model_name(exp),
        served_model_name=served_model_name(exp),
        gpus=arm.engine.gpus,
    )


def plan_experiment(
    exp: Experiment,
    *,
    engine: Engine = "vllm",
    vllm_bin: str = "vllm",
    sim: SimOptions = SimOptions(),
    arms: Sequence[str] | None = None,
) -> list[ArmLaunch]:
    """The launch plan of every arm (or of the arms named in ``arms``), in file order."""
    if arms:
        unknown = sorted(set(arms) - {a.name for a in exp.arms})
        if unknown:
            known = ", ".join(a.name for a in exp.arms)
            raise PlanError(f"no arm named {unknown[0]!r} in this experiment (arms: {known})")
    chosen = [a for a in exp.arms if not arms or a.name in arms]
    return [plan_arm(exp, a, engine=engine, vllm_bin=vllm_bin, sim=sim) for a in chosen]


def _number(x: float) -> str:
    """0.45 → "0.45", 2.0 → "2" (what a person would type)."""
    return f"{x:g}"
