"""Launch-time checks: what would make an arm fail to start, or start wrong, said before anything runs.

The experiment-file loader (:mod:`specproxy.config`) already rejects what is wrong anywhere (unknown
or removed methods, k < 1, ngram min > max). These are the checks that depend on how and where the
arms are launched: a package the engine needs, a model's architecture, GPUs shared between arms,
ports, flags that fight the plan.

Each problem is a :class:`Finding` with a sentence a user can act on. Errors stop `up`; warnings
are printed and the launch goes on. `plan` prints both and never stops (the commands may be meant
for another machine).

Example::

    findings = check_experiment(exp, engine="vllm")
    errors = [f for f in findings if f.level == "error"]
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from specproxy.config import Arm, ConfigError, Experiment, validate_speculative
from specproxy.engines.launch.plan import (
    MANAGED_FLAGS,
    Engine,
    PlanError,
    arm_bind_host,
    arm_port,
    served_model_name,
)

Level = Literal["error", "warning"]

# vLLM's default --gpu-memory-utilization: an arm that does not set it takes this share of each GPU.
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# config.json keys that say a checkpoint carries multi-token-prediction heads, and the model
# families that ship them (used when the config cannot be read here).
_MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", "mtp_num_layers")
MTP_MODEL_FAMILIES = (
    "deepseek-v3",
    "deepseek-r1",
    "deepseek-v3.1",
    "deepseek-v3.2",
    "glm-4.5",
    "glm-4.6",
    "glm-4.7",
    "glm-5",
    "qwen3-next",
    "qwen3.5",
    "mimo",
    "ernie-4.5",
    "longcat",
    "step-3.5",
    "minimax-m2",
)


@dataclass(frozen=True)
class Finding:
    level: Level
    message: str
    arm: str | None = None

    def __str__(self) -> str:
        where = f"arm {self.arm!r}: " if self.arm else ""
        return f"{self.level}: {where}{self.message}"


# Whether a Python module is importable by the interpreter that runs vLLM: (vllm_bin, module) -> bool.
ModuleProbe = Callable[[str, str], bool]


def engine_python(vllm_bin: str) -> str | None:
    """The interpreter behind a `vllm` console script (its shebang), where packages must be installed."""
    path = shutil.which(vllm_bin)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            first = f.readline(4096).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    parts = first[2:].split()
    if not parts:
        return None
    # "#!/usr/bin/env python3" names the interpreter through env.
    if Path(parts[0]).name == "env" and len(parts) > 1:
        return shutil.which(parts[1])
    return parts[0]


def module_available(vllm_bin: str, module: str) -> bool:
    """Can the Python that runs `vllm_bin` import `module`? (Asks that interpreter, not ours.)"""
    python = engine_python(vllm_bin)
    if python is None:
        return False
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def check_experiment(
    exp: Experiment,
    *,
    engine: Engine = "vllm",
    local: bool = True,
    vllm_bin: str = "vllm",
    arms: Iterable[str] | None = None,
    module_probe: ModuleProbe = module_available,
) -> list[Finding]:
    """Every launch-time problem of `exp`, errors first.

    ``local`` means the arms are about to be started on this machine (`up`): then the `vllm`
    executable, its packages and free ports are checked too.
    """
    chosen = [a for a in exp.arms if arms is None or a.name in set(arms)]
    found: list[Finding] = []
    try:
        served_model_name(exp)
    except PlanError as exc:
        found.append(Finding("error", str(exc)))
    for arm in chosen:
        found += _check_arm_config(exp, arm, engine)
    found += _check_ports(chosen, local=local)
    if engine == "vllm":
        found += _check_gpu_sharing(chosen)
        have_vllm = True
        if local and shutil.which(vllm_bin) is None:
            have_vllm = False
            found.append(
                Finding(
                    "error",
                    f"{vllm_bin!r} is not on PATH: install vLLM (pip install 'specproxy[vllm]'), pass "
                    f"--vllm-bin /path/to/vllm, or try the flow on simulated arms with --engine sim",
                )
            )
        for arm in chosen:
            if arm.spec_method == "suffix":
                found += _check_suffix(arm, local=local and have_vllm, vllm_bin=vllm_bin, probe=module_probe)
            if arm.spec_method == "mtp":
                found += _check_mtp(exp, arm)
    found.sort(key=lambda f: 0 if f.level == "error" else 1)
    return found


def _check_arm_config(exp: Experiment, arm: Arm, engine: Engine) -> list[Finding]:
    out: list[Finding] = []
    # Experiments built in code skip the loader; run its speculative checks again.
    try:
        where = exp.source_path or "<experiment>"
        validate_speculative(dict(arm.speculative), where, f"{arm.name}.speculative")
    except ConfigError as exc:
        out.append(Finding("error", str(exc), arm.name))
    try:
        arm_port(arm)
    except PlanError as exc:
        out.append(Finding("error", str(exc)))
    eng = arm.engine
    for i, a in enumerate(eng.extra_args):
        flag = a.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            out.append(
                Finding(
                    "error",
                    f"engine.extra_args[{i}] sets {flag}, which the plan sets from the experiment file; "
                    f"use the [arms.engine] field (port, tensor_parallel_size, max_num_seqs, "
                    f"gpu_memory_utilization, max_model_len) or the arm's speculative table instead",
                    arm.name,
                )
            )
    if engine == "vllm" and eng.gpus:
        if len(set(eng.gpus)) != len(eng.gpus):
            out.append(Finding("error", f"engine.gpus lists a GPU twice: {list(eng.gpus)}", arm.name))
        elif len(eng.gpus) < eng.tensor_parallel_size:
            out.append(
                Finding(
                    "error",
                    f"tensor_parallel_size = {eng.tensor_parallel_size} needs "
                    f"{eng.tensor_parallel_size} GPUs, "
                    f"but engine.gpus lists {len(eng.gpus)} ({list(eng.gpus)})",
                    arm.name,
                )
            )
        elif len(eng.gpus) > eng.tensor_parallel_size and not _sets_parallelism(eng.extra_args):
            out.append(
                Finding(
                    "warning",
                    f"engine.gpus lists {len(eng.gpus)} GPUs but tensor_parallel_size = "
                    f"{eng.tensor_parallel_size}: the extra GPUs stay idle",
                    arm.name,
                )
            )
    if any(k in arm.speculative for k in ("synthetic_acceptance_rate", "synthetic_acceptance_rates")):
        out.append(
            Finding(
                "warning",
                "speculative sets synthetic_acceptance_rate(s): vLLM then forces acceptance and the outputs "
                "are NOT lossless; use it to test, never to judge a method",
                arm.name,
            )
        )
    if engine == "vllm" and arm_bind_host(arm) == "0.0.0.0":
        out.append(
            Finding(
                "warning",
                f"url {arm.url} is not a loopback address: `up` starts the engine on this machine, "
                f"listening on all interfaces",
                arm.name,
            )
        )
    return out


def _sets_parallelism(extra_args: Iterable[str]) -> bool:
    return any(
        a.split("=", 1)[0] in ("--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp")
        for a in extra_args
    )


def _check_ports(arms: list[Arm], *, local: bool) -> list[Finding]:
    out: list[Finding] = []
    by_port: dict[int, str] = {}
    for arm in arms:
        try:
            port = arm_port(arm)
        except PlanError:
            continue  # reported by _check_arm_config
        if port in by_port:
            out.append(
                Finding(
                    "error",
                    f"port {port} is also used by arm {by_port[port]!r}; give each arm its own port "
                    f"(in its url or [arms.engine] port)",
                    arm.name,
                )
            )
            continue
        by_port[port] = arm.name
        if local and _port_in_use(arm_bind_host(arm), port):
            out.append(
                Finding(
                    "error",
                    f"port {port} is already in use on this machine (an engine still running? see "
                    f"`specproxy engines status`); stop what holds it or change the arm's port",
                    arm.name,
                )
            )
    return out


def _port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: a port in TIME_WAIT from a just-stopped engine is free for the next one.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1" if host == "localhost" else host, port))
        except OSError:
            return True
    return False


def effective_gpus(arm: Arm) -> tuple[int, ...]:
    """The GPUs vLLM will use: engine.gpus, or (no CUDA_VISIBLE_DEVICES) the first tp devices."""
    return arm.engine.gpus or tuple(range(arm.engine.tensor_parallel_size))


def _check_gpu_sharing(arms: list[Arm]) -> list[Finding]:
    out: list[Finding] = []
    users: dict[int, list[Arm]] = {}
    for arm in arms:
        for g in effective_gpus(arm):
            users.setdefault(g, []).append(arm)
    reported: set[tuple[str, ...]] = set()
    for gpu, sharing in sorted(users.items()):
        if len(sharing) < 2:
            continue
        names = tuple(a.name for a in sharing)
        if names in reported:
            continue
        reported.add(names)
        unset = [a.name for a in sharing if a.engine.gpu_memory_utilization is None]
        total = sum(a.engine.gpu_memory_utilization or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION for a in sharing)
        listed = ", ".join(repr(n) for n in names)
        implicit = (
            "" if all(a.engine.gpus for a in sharing) else " (an arm without engine.gpus uses GPUs 0…tp-1)"
        )
        if unset:
            share = round(0.9 / len(sharing), 2)
            out.append(
                Finding(
                    "error",
                    f"arms {listed} share GPU {gpu}{implicit} without a memory split: each takes vLLM's "
                    f"default {VLLM_DEFAULT_GPU_MEMORY_UTILIZATION:g} of it and the second fails to start; "
                    f"set engine.gpu_memory_utilization = {share:g} on each of them, or give them "
                    f"different engine.gpus",
                )
            )
        elif total > 1.0 + 1e-9:
            out.append(
                Finding(
                    "error",
                    f"arms {listed} share GPU {gpu}{implicit} and their gpu_memory_utilization adds up to "
                    f"{total:g} > 1; lower them so the sum is at most 1 "
                    f"(leave some headroom, e.g. 0.9 in all)",
                )
            )
        else:
            out.append(
                Finding(
                    "warning",
                    f"arms {listed} share GPU {gpu}: they compete for its compute, so their speed is "
                    f"not what each would get alone; use separate GPUs for numbers you will act on",
                )
            )
    return out


def _check_suffix(arm: Arm, *, local: bool, vllm_bin: str, probe: ModuleProbe) -> list[Finding]:
    if not local:
        return [
            Finding(
                "warning",
                "method 'suffix' needs the arctic-inference package where vLLM runs "
                "(pip install arctic-inference)",
                arm.name,
            )
        ]
    if probe(vllm_bin, "arctic_inference"):
        return []
    return [
        Finding(
            "error",
            f"method 'suffix' needs the arctic-inference package, which the Python running "
            f"{vllm_bin!r} cannot import; install it there (pip install arctic-inference) or drop this arm",
            arm.name,
        )
    ]


def _check_mtp(exp: Experiment, arm: Arm) -> list[Finding]:
    model = str(arm.speculative.get("model") or exp.model or "")
    config = _read_model_config(model)
    if config is not None:
        if _config_has_mtp(config):
            return []
        why = "its config.json has no MTP layers (num_nextn_predict_layers or similar)"
    else:
        if any(family in model.lower() for family in MTP_MODEL_FAMILIES):
            return []
        why = "it is not a model family known to ship MTP heads"
    return [
        Finding(
            "warning",
            f"method 'mtp' needs a model that carries multi-token-prediction heads "
            f"(DeepSeek-V3/R1, GLM-4.5+, Qwen3-Next, MiMo, ...); {model!r} may not: {why}. "
            f"vLLM will refuse to start if it has none",
            arm.name,
        )
    ]


def _config_has_mtp(config: dict[str, Any]) -> bool:
    texts = [config, config.get("text_config") or {}]
    return any(isinstance(c, dict) and any(int(c.get(k) or 0) > 0 for k in _MTP_CONFIG_KEYS) for c in texts)


def _read_model_config(model: str) -> dict[str, Any] | None:
    """config.json of a local checkpoint folder or of a Hugging Face cache entry, if it is on disk."""
    candidates: list[Path] = [Path(model) / "config.json"]
    if "/" in model and not Path(model).exists():
        cache = _hf_hub_cache() / f"models--{model.replace('/', '--')}" / "snapshots"
        if cache.is_dir():
            candidates += sorted(cache.glob("*/config.json"))
    for path in candidates:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return data
    return None


def _hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"
