"""The span writer on a disk that fills up, for real: a subprocess whose file size limit
(RLIMIT_FSIZE, SIGXFSZ ignored) makes the store's writes fail as a full disk does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]
PRELUDE = """
import logging, os, resource, signal, sys, time
from specproxy.proxy.spans.sink import SpanSink
from tests.records import full_record
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
db = sys.argv[1]
def fill_up(limit):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
"""


def run(script: str, db: Path) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code, str(db)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_full_disk_gets_one_error_line_then_a_summary_not_one_per_batch(tmp_path: Path) -> None:
    out = run(
        """
        sink = SpanSink(db, batch_size=32, flush_interval_s=0.01)
        sink.start()
        fill_up(2_000_000)
        for i in range(6000):
            sink.emit(full_record(i))
            if i % 50 == 0:
                time.sleep(0.01)  # many batches, each failing once the WAL is at the limit
        sink.close()
        print(sink.written, sink.failed)
        """,
        tmp_path / "spans.duckdb",
    )
    assert out.returncode == 0, out.stderr
    written, failed = map(int, out.stdout.split())
    assert failed > 32 * 10 and written + failed == 6000
    errors = [line for line in out.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2, errors
    assert "spans could not be written" in errors[0] and "File too large" in errors[0]
    assert "more batches" in errors[1] and "could not be written" in errors[1], errors
    assert "Traceback" not in out.stderr


def test_a_final_checkpoint_that_fails_is_said_loudly_and_the_spans_are_in_the_wal(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    out = run(
        """
        sink = SpanSink(db, batch_size=500)
        sink.start()
        for i in range(2000):
            sink.emit(full_record(i))
        assert sink.flush()
        fill_up(os.path.getsize(db) + 4096)  # the WAL is written; the checkpoint cannot grow the file
        sink.close()
        """,
        db,
    )
    assert out.returncode == 0, out.stderr
    loud = [line for line in out.stderr.splitlines() if "THE FINAL CHECKPOINT OF" in line]
    assert len(loud) == 1 and f"{db}.wal" in loud[0] and "keep that file" in loud[0], out.stderr
    with duckdb.connect(str(db)) as con:  # the WAL is replayed: no span lost
        assert con.execute("SELECT count(*) FROM requests").fetchone() == (2000,)
