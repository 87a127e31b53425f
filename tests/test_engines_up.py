"""`specproxy engines up|status|down` as real subprocesses.

vLLM cannot run here, so the vLLM path uses a stand-in `vllm` executable (a small Python script that
records how it was started and answers /health and /version like vLLM, or crashes like a vLLM that
runs out of memory). The simulated path runs the real `specproxy sim` (see test_engines_sim_e2e.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specproxy.config import load_experiment
from specproxy.engine_state import read_state, recorded_stacks, state_path
from specproxy.engines.launch.plan import ArmLaunch
from specproxy.engines.launch.stack import capture_stack, gpu_inventory
from tests.support import free_port, free_ports, wait_until_sync
from tests.support import run_cli as _cli

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

FAKE_VLLM = textwrap.dedent("""\
    import http.server, json, os, signal, subprocess, sys, time
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1]
    record = os.environ.get("FAKE_VLLM_RECORD")
    if record:
        with open(record, "w") as f:
            json.dump({"argv": argv, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
    print("INFO starting vLLM API server", flush=True)
    if os.environ.get("FAKE_VLLM_CRASH"):
        print("ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_VLLM_HANG"):
        time.sleep(3600)
    if os.environ.get("FAKE_VLLM_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A worker process in the engine's process group, as vLLM's engine core is.
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.environ.get("FAKE_VLLM_WORKER_PID") or os.devnull, "w") as f:
        f.write(str(worker.pid))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": b"", "/version": b'{"version": "0.33.0"}'}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")
        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer((host, port), Handler).serve_forever()
""")


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "vllm"
    path.parent.mkdir()
    path.write_text(f"#!{sys.executable}\n{FAKE_VLLM}")
    path.chmod(0o755)
    return path


def _experiment(tmp_path: Path, arms: list[dict[str, Any]], name: str = "e") -> Path:
    lines = [f'[experiment]\nname = "{name}"\nmodel = "{MODEL}"\n']
    for i, arm in enumerate(arms):
        lines.append("[[arms]]")
        lines.append(f'name = "{arm["name"]}"')
        if i == 0:
            lines.append('role = "baseline"')
        lines.append(f'url = "http://127.0.0.1:{arm["port"]}"')
        if "speculative" in arm:
            lines.append(f"speculative = {arm['speculative']}")
        lines.append(f"engine = {arm.get('engine', '{}')}\n")
    path = tmp_path / "exp.toml"
    path.write_text("\n".join(lines))
    return path


def _up(path: Path, fake_vllm: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """`specproxy engines up PATH` with the fake vLLM as its --vllm-bin."""
    return _cli("engines", "up", str(path), "--vllm-bin", str(fake_vllm), *options)


@pytest.fixture
def cleanup() -> Iterator[list[Path]]:
    """Experiments whose engines must be stopped whatever the test did."""
    started: list[Path] = []
    yield started
    for path in started:
        _cli("engines", "down", str(path), "--grace", "2")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def test_up_status_down_with_vllm(tmp_path: Path, fake_vllm: Path, cleanup: list[Path]) -> None:
    p1, p2 = free_ports(2)
    record = tmp_path / "ngram-argv.json"
    worker_pid_file = tmp_path / "worker.pid"
    path = _experiment(
        tmp_path,
        [
            {"name": "baseline", "port": p1, "engine": "{ gpus = [0] }"},
            {
                "name": "ngram",
                "port": p2,
                "speculative": '{ method = "ngram", num_speculative_tokens = 4, prompt_lookup_max = 5 }',
                "engine": f'{{ gpus = [1], max_num_seqs = 32, env = {{ FAKE_VLLM_RECORD = "{record}", '
                f'FAKE_VLLM_WORKER_PID = "{worker_pid_file}" }} }}',
            },
        ],
    )
    cleanup.append(path)
    up = _up(path, fake_vllm, "--health-timeout", "30")
    assert up.returncode == 0, up.stderr
    assert "baseline is healthy" in up.stderr and "ngram is healthy" in up.stderr

    # The engine was started with exactly the plan: argv and CUDA_VISIBLE_DEVICES.
    seen = json.loads(record.read_text())
    assert seen["cuda"] == "1"
    assert seen["argv"][:2] == ["serve", MODEL]
    assert json.loads(seen["argv"][seen["argv"].index("--speculative-config") + 1]) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 5,
    }
    assert seen["argv"][seen["argv"].index("--max-num-seqs") + 1] == "32"

    # The state file next to the experiment lets another shell (and serve) find the arms and stacks.
    exp = load_experiment(path)
    assert state_path(exp) == tmp_path / ".specproxy-engines" / "e.json"
    state = read_state(exp)
    assert state is not None and [a.arm for a in state.arms] == ["baseline", "ngram"]
    stacks = recorded_stacks(exp)
    assert stacks["ngram"]["server_version"] == "0.33.0"
    assert stacks["ngram"]["engine"] == "vllm"
    assert stacks["ngram"]["engine_python"] == sys.executable
    assert any(line.lower().startswith("click==") for line in stacks["ngram"]["packages"])
    for arm in state.arms:
        assert Path(arm.log).read_text().startswith("# specproxy engines: ")

    status = _cli("engines", "status", str(path))
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.count("healthy") == 2 and "version 0.33.0" in status.stdout
    as_json = json.loads(_cli("engines", "status", str(path), "--json").stdout)
    assert [a["healthy"] for a in as_json["arms"]] == [True, True]

    # Starting again while they run is refused.
    again = _up(path, fake_vllm)
    assert again.returncode == 1
    assert "already in use" in again.stderr or "already running" in again.stderr

    worker = int(worker_pid_file.read_text())
    assert _alive(worker)
    down = _cli("engines", "down", str(path))
    assert down.returncode == 0, down.stderr
    assert "baseline (pid" in down.stdout and "stopped" in down.stdout
    assert not state_path(exp).exists()
    # The whole process group went, the engine's workers too.
    wait_until_sync(lambda: not _alive(worker), "the engine's worker to exit")
    assert all(not _alive(a.pid) for a in state.arms)

    nothing = _cli("engines", "down", str(path))
    assert nothing.returncode == 0 and "nothing to stop" in nothing.stdout
    assert "no engines recorded" in _cli("engines", "status", str(path)).stdout


def test_engine_that_crashes_on_start_is_reported_with_its_log_tail(
    tmp_path: Path, fake_vllm: Path, cleanup: list[Path]
) -> None:
    p1, p2 = free_ports(2)
    path = _experiment(
        tmp_path,
        [
            {"name": "baseline", "port": p1, "engine": "{ gpus = [0] }"},
            {
                "name": "eagle3",
                "port": p2,
                "speculative": '{ method = "eagle3", model = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" }',
                "engine": '{ gpus = [1], env = { FAKE_VLLM_CRASH = "1" } }',
            },
        ],
    )
    cleanup.append(path)
    up = _up(path, fake_vllm, "--health-timeout", "30")
    assert up.returncode == 1
    assert "arm 'eagle3' exited with code 3 while starting" in up.stderr
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in up.stderr
    assert "Traceback" not in up.stderr
    # The healthy arm started alongside was stopped again, and nothing is left recorded.
    exp = load_experiment(path)
    assert read_state(exp) is None
    log = tmp_path / ".specproxy-engines" / "logs" / "e-eagle3.log"
    assert "CUDA out of memory" in log.read_text()
    assert _cli("engines", "status", str(path)).returncode == 0


def test_health_timeout_shows_the_log_tail(tmp_path: Path, fake_vllm: Path, cleanup: list[Path]) -> None:
    path = _experiment(
        tmp_path,
        [
            {
                "name": "baseline",
                "port": free_port(),
                "engine": '{ gpus = [0], env = { FAKE_VLLM_HANG = "1" } }',
            },
        ],
    )
    cleanup.append(path)
    up = _up(path, fake_vllm, "--health-timeout", "2")
    assert up.returncode == 1
    assert "arm 'baseline' did not answer http://127.0.0.1:" in up.stderr
    assert "within 2 s (raise --health-timeout for large models)" in up.stderr
    assert "INFO starting vLLM API server" in up.stderr
    assert read_state(load_experiment(path)) is None


def test_down_kills_an_engine_that_ignores_sigterm(
    tmp_path: Path, fake_vllm: Path, cleanup: list[Path]
) -> None:
    path = _experiment(
        tmp_path,
        [
            {
                "name": "baseline",
                "port": free_port(),
                "engine": '{ gpus = [0], env = { FAKE_VLLM_IGNORE_TERM = "1" } }',
            },
        ],
    )
    cleanup.append(path)
    up = _up(path, fake_vllm, "--no-stack")
    assert up.returncode == 0, up.stderr
    state = read_state(load_experiment(path))
    assert state is not None and state.arms[0].stack is None
    down = _cli("engines", "down", str(path), "--grace", "0.5")
    assert "killed (still running 0.5 s after SIGTERM)" in down.stdout
    assert not _alive(state.arms[0].pid)


def test_status_reports_an_arm_that_died(tmp_path: Path, fake_vllm: Path, cleanup: list[Path]) -> None:
    path = _experiment(tmp_path, [{"name": "baseline", "port": free_port(), "engine": "{ gpus = [0] }"}])
    cleanup.append(path)
    assert _up(path, fake_vllm, "--no-stack").returncode == 0
    state = read_state(load_experiment(path))
    assert state is not None
    os.killpg(state.arms[0].pid, signal.SIGKILL)
    wait_until_sync(lambda: not _alive(state.arms[0].pid), "the killed engine to be gone")
    status = _cli("engines", "status", str(path))
    assert status.returncode == 1
    assert "stopped" in status.stdout
    assert recorded_stacks(load_experiment(path)) == {}
    down = _cli("engines", "down", str(path))
    assert "was not running" in down.stdout


def test_down_stops_the_workers_of_an_engine_that_died(
    tmp_path: Path, fake_vllm: Path, cleanup: list[Path]
) -> None:
    worker_pid_file = tmp_path / "worker.pid"
    path = _experiment(
        tmp_path,
        [
            {
                "name": "baseline",
                "port": free_port(),
                "engine": f'{{ gpus = [0], env = {{ FAKE_VLLM_WORKER_PID = "{worker_pid_file}" }} }}',
            },
        ],
    )
    cleanup.append(path)
    assert _up(path, fake_vllm, "--no-stack").returncode == 0
    state = read_state(load_experiment(path))
    assert state is not None
    # The API server dies alone (as after a crash); its worker keeps running in the group.
    os.kill(state.arms[0].pid, signal.SIGKILL)
    wait_until_sync(lambda: not _alive(state.arms[0].pid), "the killed engine to be gone")
    worker = int(worker_pid_file.read_text())
    assert _alive(worker)
    down = _cli("engines", "down", str(path))
    assert "had exited; its leftover worker processes were stopped" in down.stdout
    wait_until_sync(lambda: not _alive(worker), "the engine's worker to exit")


def test_stack_reads_gpus_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # nvidia-smi's answer to stack.py's query, as captured on an H200 host.
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        "echo '0, GPU-122ef966-d249-165e-83be-8b5eb3f4e8b9, NVIDIA H200, 580.159.04, 143771'\n"
        "echo '1, GPU-0b7c2a1e-0000-0000-0000-000000000001, NVIDIA H200, 580.159.04, 143771'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    inventory = gpu_inventory()
    assert inventory is not None and [g["index"] for g in inventory] == [0, 1]
    assert inventory[0] == {
        "index": 0,
        "uuid": "GPU-122ef966-d249-165e-83be-8b5eb3f4e8b9",
        "name": "NVIDIA H200",
        "driver_version": "580.159.04",
        "memory_total_mib": 143771,
    }
    launch = ArmLaunch(
        arm="eagle3", engine="vllm", argv=("vllm", "serve", MODEL), port=free_port(), gpus=(1,)
    )
    stack = capture_stack(launch, packages=["click==8.1.7"])
    assert [g["index"] for g in stack["gpus"]] == [1]
    assert stack["driver_version"] == "580.159.04"
    assert stack["server_version"] is None  # nothing listens: recorded as unknown, not an error
    assert stack["packages"] == ["click==8.1.7"]
