"""Shared test setup: a clean environment per test, and a longer hang guard for the slow tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Variables that would change specproxy's behaviour if inherited from the developer's shell.
_SCRUBBED_PREFIXES = ("SPECPROXY_", "OTEL_", "OPENAI_")
# pytest-timeout's limit (pyproject: 120 s) guards against hangs. The slow tests repeat whole runs
# (a quick lab, 60 synthetic stores) and take minutes on a busy machine: they get more.
SLOW_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(_SCRUBBED_PREFIXES):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    yield
