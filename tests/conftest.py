"""Shared test setup: a clean environment per test, a longer hang guard for the slow tests, and no
process left behind by a test, however it ended (tests/processes.py)."""

from __future__ import annotations

import compileall
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import processes

# Variables that would change specproxy's behaviour if inherited from the developer's shell.
_SCRUBBED_PREFIXES = ("SPECPROXY_", "OTEL_", "OPENAI_")
# pytest-timeout's limit (pyproject: 120 s) guards against hangs. The slow tests repeat whole runs
# (a quick lab, 60 synthetic stores) and take minutes on a busy machine: they get more.
SLOW_TEST_TIMEOUT_S = 900
ROOT = Path(__file__).resolve().parents[1]
# The packages the CLI subprocesses import: specproxy and its subpackages (pyproject's
# subpackages), and tests (``python -m tests.backends``).
_SOURCE_DIRS = ("specproxy", "proxy", "engines", "analysis", "lab", "tests")


# The default run spreads test files over worker processes (pytest-xdist, `-n auto` in pyproject):
# one per core, as most of a test's time is its subprocesses' CPU. More than this many gains little
# and multiplies the simulators and proxies running at once.
MAX_TEST_WORKERS = 8


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_TEST_WORKERS))


def pytest_sessionstart(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller compiled before it started the workers
    # Where PYTHONDONTWRITEBYTECODE is set (containers often set it) no interpreter caches what it
    # compiles, so each of the suite's hundreds of CLI subprocesses compiled every module it imported
    # from source again (~0.2 s of an `analyze`). Bytecode compiled once here is read by all of them;
    # compileall skips what is up to date, and a source edited later is compiled afresh as usual.
    for name in _SOURCE_DIRS:
        compileall.compile_dir(ROOT / name, quiet=1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    # Subprocess deadlines default to the time the test has left (tests/processes.py).
    processes.set_test_deadline(settings.timeout)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    processes.set_test_deadline(None)


def pytest_sessionfinish(session: pytest.Session) -> None:
    processes.end_left_over()


@pytest.fixture(autouse=True)
def _no_process_left_behind() -> Iterator[None]:
    # What this test (or its function-scoped fixtures, already torn down) started and did not stop.
    # Processes of broader fixtures were spawned before this fixture and outlive the test.
    first = processes.spawned()
    yield
    processes.end_left_over(since=first)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(_SCRUBBED_PREFIXES):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    yield
