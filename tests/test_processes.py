"""No process outlives a test, however the test ends: pytest run in a subprocess on a generated test
file whose tests start `specproxy lab` or `specproxy engines up` (each starts its simulators in
sessions of their own) through the helpers, then time out under pytest-timeout, fail an assertion,
or pass a command's deadline."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import processes
from tests.support import http_ok, start_cli, stop, wait_until_sync

ROOT = Path(__file__).resolve().parents[1]
# Each generated test runs its own lab, four simulated arms (--no-replica) on ports from its base.
ARMS = 4
NAMES = ("timed_out", "failed", "deadline")

GENERATED = r"""
import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests import processes
from tests.support import http_ok, run_cli, start_cli, wait_until_sync

HERE = Path(__file__).parent
PORTS = json.loads((HERE / "ports.json").read_text())


def lab(name, *options):
    return ["lab", "--quick", "--no-progress", "--no-replica", "--port-base", str(PORTS[name]),
            "--out", str(HERE / name), *options]


def started(name):
    # A quick lab runs for minutes; it started when its simulators answer.
    proc = start_cli(lab(name))
    urls = [f"http://127.0.0.1:{PORTS[name] + i}/health" for i in range(ARMS)]
    wait_until_sync(lambda: all(http_ok(u) for u in urls), "the lab's simulators", timeout=90)
    (HERE / f"{name}.pids").write_text(json.dumps(processes.tree_of(proc)))
    return proc


def test_timed_out():
    proc = started("timed_out")
    # pytest-timeout's own alarm, brought forward now that the simulators answer: its handler fails
    # the test inside the wait below, as it does a test stuck past --timeout.
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    proc.wait()


def test_failed():
    # `engines up` returns with its arms running in sessions of their own, by design: only the mark
    # they inherited finds them once the command has ended.
    arms = [f'[[arms]]\nname = "a{i}"\nurl = "http://127.0.0.1:{PORTS["failed"] + i}"\n' for i in range(ARMS)]
    arms[0] += 'role = "baseline"\n'
    experiment = '[experiment]\nname = "failed"\nmodel = "meta-llama/Llama-3.1-8B-Instruct"\n\n'
    (HERE / "failed.toml").write_text(experiment + "\n".join(arms))
    up = run_cli("engines", "up", str(HERE / "failed.toml"), "--engine", "sim")
    if up.returncode != 0:
        pytest.skip(f"engines up failed: {up.stderr}")
    state = json.loads((HERE / ".specproxy-engines" / "failed.json").read_text())
    (HERE / "failed.pids").write_text(json.dumps([arm["pid"] for arm in state["arms"]]))
    assert False, "a failing test with engines still running"


def test_deadline():
    # 10 s: the lab has started its simulators by then even on a busy machine, and runs for minutes
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_cli(*lab("deadline"), timeout=10)
    assert "starting 4 simulated arms" in caught.value.stderr
"""


def _port_runs(runs: int, length: int) -> list[int]:
    """The first ports of ``runs`` runs of ``length`` ports each that nothing listens on, below the
    system's ephemeral range (where the ports it hands out for connections come from)."""
    bases: list[int] = []
    rng = random.Random()
    while len(bases) < runs:
        base = rng.randrange(20000, 30000, 16)
        if base not in bases and not any(_listening(p) for p in range(base, base + length)):
            bases.append(base)
    return bases


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: it only waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(420)
def test_no_process_survives_a_test_that_timed_out_failed_or_passed_its_deadline(tmp_path: Path) -> None:
    ports = dict(zip(NAMES, _port_runs(len(NAMES), ARMS), strict=True))
    (tmp_path / "ports.json").write_text(json.dumps(ports))
    (tmp_path / "test_generated.py").write_text(f"ARMS = {ARMS}\n" + GENERATED)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    argv += ["--timeout", "120", "--rootdir", str(tmp_path), str(tmp_path / "test_generated.py")]
    argv += ["-n", "1"]  # in a worker process, as the default run's tests are (pyproject: -n auto)
    inner = processes.spawn(
        argv,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out = inner.communicate(timeout=processes.deadline_s())[0].decode(errors="replace")
        # Checked before this test's own cleanup, which would stop what the inner one left.
        pid_files = [tmp_path / f"{name}.pids" for name in NAMES[:2]]
        started = [pid for f in pid_files if f.exists() for pid in json.loads(f.read_text())]
        survivors = [pid for pid in started if _alive(pid)]
        listening = [p for base in ports.values() for p in range(base, base + ARMS) if _listening(p)]
        left = [pid for pid in processes.tree_of(inner) if pid != inner.pid]
    finally:
        processes.end(inner)
    assert "FAILED test_generated.py::test_timed_out - Failed: Timeout" in out, out
    assert "FAILED test_generated.py::test_failed - AssertionError" in out, out
    assert "1 passed" in out, out
    # the lab and its four simulators, the four engines, each in a session of its own
    assert len(set(started)) == 1 + ARMS + ARMS, (started, out)
    assert (survivors, listening, left) == ([], [], [])


def test_a_lab_killed_outright_takes_its_simulators_with_it(tmp_path: Path) -> None:
    """SIGKILL leaves the lab no time to stop anything: the kernel stops its simulators (each in a
    session of its own) when it dies. Checked before this test's own cleanup would stop them."""
    (base,) = _port_runs(1, ARMS)
    argv = ["lab", "--quick", "--no-progress", "--no-replica", "--port-base", str(base)]
    lab = start_cli([*argv, "--out", str(tmp_path / "lab")])
    urls = [f"http://127.0.0.1:{base + i}/health" for i in range(ARMS)]
    wait_until_sync(lambda: all(http_ok(u) for u in urls), "the lab's simulators", timeout=90)
    simulators = [pid for pid in processes.tree_of(lab) if pid != lab.pid]
    assert len(simulators) == ARMS, simulators
    lab.kill()
    lab.wait()
    wait_until_sync(lambda: not any(_alive(pid) for pid in simulators), "the simulators to stop")
    assert [p for p in range(base, base + ARMS) if _listening(p)] == []
    stop(lab)
