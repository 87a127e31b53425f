"""A fast slice of tests/bench/bench_fuzz.py in the default run: generated hostile requests against a
real `specproxy serve` subprocess in front of two healthy backends.

Without the poisoned integers (values beyond the span store's columns): the span account (calls in
/metrics = rows + dropped) is checked exactly on everything else. The full benchmark adds them.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.bench.bench_fuzz import KINDS, run_fuzz, start_backends
from tests.support import free_ports


async def test_a_slice_of_the_fuzz_benchmark_meets_every_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ports = dict(zip(("healthy", "healthy2"), free_ports(2), strict=True))
    assert KINDS["healthy"] == {}
    backends = start_backends(ports)
    try:
        ok = await run_fuzz(tmp_path, ports, 400, seed=7, poison=False)
    finally:
        backends.send_signal(signal.SIGTERM)
        backends.wait(30)
    table = capsys.readouterr().out
    assert ok, table
