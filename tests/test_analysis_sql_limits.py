"""`specproxy sql` bounds what a query can take: a time limit (`--timeout`), a bounded spill folder
that is removed however the command ends (an error, SIGTERM, or a kill, cleaned by the next run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.spanfactory import ArmSpec, make_run, write_db
from tests.support import wait_until_sync

ROOT = Path(__file__).resolve().parents[1]
RUNAWAY = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"
# A sort far over the memory limit below: DuckDB spills it to the store's temporary folder.
SPILLING = "SELECT count(*) FROM (SELECT i, hash(i)::VARCHAR AS h FROM range(40000000) t(i) ORDER BY h)"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = make_run([ArmSpec("baseline", "baseline", "none"), ArmSpec("e", speedup=1.2)], levels=(1,), seed=1)
    return write_db(tmp_path_factory.mktemp("sql") / "spans.duckdb", [run])


def sql(tmp: Path, *args: str, memory: str | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "TMPDIR": str(tmp)}
    if memory:
        env["SPECPROXY_ANALYSIS_MEMORY"] = memory
    argv = [sys.executable, "-m", "specproxy", "sql", *args]
    pipe = subprocess.PIPE
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=pipe, stderr=pipe, text=True)


def test_a_runaway_query_stops_at_the_time_limit_with_a_sentence(store: Path, tmp_path: Path) -> None:
    proc = sql(tmp_path, str(store), "--timeout", "1", RUNAWAY)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == "", err
    assert "the query was stopped after its time limit of 1 s (--timeout to change it)" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_the_default_time_limit_is_shown_and_a_bad_one_refused(store: Path, tmp_path: Path) -> None:
    help_out, _ = sql(tmp_path, "--help").communicate(timeout=60)
    assert "--timeout" in help_out and "300" in help_out
    proc = sql(tmp_path, str(store), "--timeout", "0", "SELECT 1")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--timeout" in err


def test_sigterm_mid_spill_removes_the_spill_folder(store: Path, tmp_path: Path) -> None:
    proc = sql(tmp_path, str(store), SPILLING, memory="64MB")
    try:
        wait_until_sync(lambda: any(p.rglob("*") for p in tmp_path.iterdir()), "a spill file", 60)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_spill_folder_left_by_a_killed_run_is_removed_by_the_next(store: Path, tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / f"specproxy-analysis-{gone.pid}-0"
    (left / "duckdb_temp_storage").mkdir(parents=True)
    (left / "duckdb_temp_storage" / "block").write_bytes(b"x" * 4096)
    mine = tmp_path / f"specproxy-analysis-{os.getpid()}-7"  # a live process's: kept
    mine.mkdir()
    proc = sql(tmp_path, str(store), "SELECT 1 AS one")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not left.exists() and mine.exists()
