"""What an arm ran on: engine and version, GPUs and driver, and every installed package.

A speedup is a fact about a stack, not about a method: the same EAGLE3 head gives different numbers
on another vLLM, driver or GPU. `specproxy engines up` captures this for each arm once it is healthy
and keeps it in the engines state file, where `serve` and `replay` pick it up for the run's
``stacks_json`` (see :func:`specproxy.engines.launch.supervisor.recorded_stacks`).

Example::

    stack = capture_stack(launch, python="/opt/vllm/bin/python")
    stack["vllm_version"], stack["gpus"][0]["name"]
"""

from __future__ import annotations

import json
import platform
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import UTC, datetime
from typing import Any

from specproxy import __version__
from specproxy.engines.launch.plan import ArmLaunch

_FREEZE = (
    "import importlib.metadata as m\n"
    "names = {f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions() if d.metadata['Name']}\n"
    "print('\\n'.join(sorted(names, key=str.lower)))\n"
)
_VERSION_OF = (
    "import importlib.metadata as m, sys\ntry: print(m.version(sys.argv[1]))\nexcept Exception: pass\n"
)


def _run(argv: list[str], timeout: float = 30.0) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def installed_packages(python: str) -> list[str]:
    """`pip freeze` of an interpreter, as ``name==version`` lines (read from its metadata, so it
    works in environments without pip, and takes a tenth of the time)."""
    out = _run([python, "-c", _FREEZE], timeout=60)
    return [line for line in (out or "").splitlines() if line.strip()]


def package_version(python: str, name: str) -> str | None:
    out = _run([python, "-c", _VERSION_OF, name])
    return (out or "").strip() or None


def gpu_inventory() -> list[dict[str, Any]] | None:
    """Every GPU nvidia-smi reports (index, uuid, name, driver, memory), or None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = _run(
        [smi, "--query-gpu=index,uuid,name,driver_version,memory.total", "--format=csv,noheader,nounits"]
    )
    if out is None:
        return None
    gpus: list[dict[str, Any]] = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 5:
            continue
        try:
            index, memory = int(cells[0]), int(float(cells[4]))
        except ValueError:
            continue
        gpus.append(
            {
                "index": index,
                "uuid": cells[1],
                "name": cells[2],
                "driver_version": cells[3],
                "memory_total_mib": memory,
            }
        )
    return gpus


def server_version(base_url: str, timeout: float = 5.0) -> str | None:
    """The running server's own answer to GET /version (vLLM: {"version": "0.33.0"})."""
    try:
        with urllib.request.urlopen(f"{base_url}/version", timeout=timeout) as resp:
            data = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return str(version) if version is not None else None


def capture_stack(
    launch: ArmLaunch,
    *,
    python: str | None = None,
    gpus: list[dict[str, Any]] | None = None,
    packages: list[str] | None = None,
) -> dict[str, Any]:
    """The stack of one launched (and healthy) arm.

    ``python`` is the interpreter that runs the engine (the `vllm` script's; ours for the simulator).
    ``gpus`` and ``packages`` let a caller capture the machine-wide facts once for all arms.
    """
    python = python or sys.executable
    inventory = gpus if gpus is not None else gpu_inventory()
    visible: list[dict[str, Any]] | None = None
    if inventory is not None:
        wanted = set(launch.gpus) if launch.gpus else None
        visible = [g for g in inventory if wanted is None or g["index"] in wanted]
    return {
        "engine": launch.engine,
        "argv": list(launch.argv),
        "env": dict(launch.env),
        "model": launch.model,
        "url": launch.base_url,
        "server_version": server_version(launch.base_url),
        "vllm_version": package_version(python, "vllm") if launch.engine == "vllm" else None,
        "engine_python": python,
        "python_version": (
            _run([python, "-c", "import platform; print(platform.python_version())"]) or ""
        ).strip()
        or None,
        "gpus": visible,
        "driver_version": visible[0]["driver_version"] if visible else None,
        "packages": packages if packages is not None else installed_packages(python),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "specproxy_version": __version__,
        "captured_at": datetime.now(UTC).isoformat(),
    }
