"""Shared test setup: a clean environment per test, free ports, and waiting for servers."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Variables that would change specproxy's behaviour if inherited from the developer's shell.
_SCRUBBED_PREFIXES = ("SPECPROXY_", "OTEL_", "OPENAI_")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(_SCRUBBED_PREFIXES):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    yield
