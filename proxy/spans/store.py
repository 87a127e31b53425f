"""Opening the span store for writing (DuckDB's errors become a sentence), and the rows the sink
writes on its main connection rather than its writer thread: a run's ``runs`` row, ``health`` rows,
and a copy of the whole store."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb

from specproxy import __version__, schema
from specproxy.proxy.spans.rows import HealthRow

# DuckDB's own default is 80 % of the machine's RAM, and it keeps what it writes cached up to that: a
# proxy running for days would grow without bound. 256 MB holds a checkpoint's worth of spans (64 MB of
# WAL) several times over; beyond it DuckDB evicts written blocks (and spills to <db>.tmp if it must).
DEFAULT_MEMORY_LIMIT = "256MB"
# WAL size at which DuckDB folds new rows into the file (its default is 16MB); see open_store().
DEFAULT_CHECKPOINT_THRESHOLD = "64MB"


class SpanSinkError(RuntimeError):
    """The span store cannot be opened or written; the message says why and what to do."""


class SpanStoreLocked(SpanSinkError):
    """Another process holds the DuckDB file open for writing (DuckDB allows one writer per file)."""


_LOCK_PID = re.compile(r"\(PID (\d+)\)")


def open_store(
    path: Path,
    *,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    checkpoint_threshold: str = DEFAULT_CHECKPOINT_THRESHOLD,
) -> Any:
    """Open (or create) a span store for writing, with the sink's settings, and migrate its schema.

    ``memory_limit`` caps DuckDB's memory on this connection (a DuckDB size: ``"256MB"``, ``"1GB"``).
    DuckDB's errors become :class:`SpanSinkError` / :class:`SpanStoreLocked` with a sentence.
    """
    try:
        conn = duckdb.connect(str(path))
    except duckdb.IOException as exc:
        text = str(exc)
        if "lock" in text.lower():
            pid = _LOCK_PID.search(text)
            holder = f"process {pid.group(1)}" if pid else "another process"
            raise SpanStoreLocked(
                f"the span store {path} is open for writing in {holder}; DuckDB allows one writer per "
                f"file: stop that process, or give this one another file (--db)"
            ) from exc
        raise SpanSinkError(f"cannot open the span store {path}: {text}") from exc
    except duckdb.Error as exc:
        raise SpanSinkError(
            f"cannot open the span store {path} ({exc}); is it a DuckDB file written by specproxy?"
        ) from exc
    try:
        # DuckDB checkpoints its WAL into the file every 16 MB by default, each time rewriting the last,
        # partly filled row group; at bulk span rates (replay, ingest) that is most of the writer's time.
        # 64 MB (~130k spans held in memory until checkpointed) makes sustained ingest ~40% faster;
        # close() checkpoints. serve, at a few hundred spans/s, uses a small threshold instead: memory
        # stays flat rather than climbing for the minutes it takes to reach 64 MB.
        conn.execute("SET checkpoint_threshold = ?", [checkpoint_threshold])
        try:
            conn.execute("SET memory_limit = ?", [memory_limit])
        except duckdb.Error as exc:
            raise SpanSinkError(
                f"span store memory limit {memory_limit!r} is not a DuckDB size such as '256MB' or '1GB' "
                f"({exc})"
            ) from exc
        schema.migrate(conn)
    except RuntimeError as exc:
        conn.close()
        raise SpanSinkError(str(exc)) from exc
    except duckdb.Error as exc:
        conn.close()
        raise SpanSinkError(f"cannot set up the schema of the span store {path}: {exc}") from exc
    return conn


class RunRows:
    """The sink's main connection to its store: the ``runs`` and ``health`` rows, written at once on
    the caller's thread (a lock keeps callers apart), and copies of the store."""

    def __init__(self, conn: Any, db_path: Path) -> None:
        self.conn = conn
        self.db_path = db_path
        self._lock = threading.Lock()

    def begin_run(
        self, run_id: str, *, name: str, mode: str, source: str, config_json: str, stacks_json: str
    ) -> None:
        with self._lock:
            cur = self.conn.cursor()
            try:
                cur.execute(
                    "INSERT INTO runs (run_id, name, mode, source, started_at, config_json, stacks_json, "
                    "host, specproxy_version) VALUES (?, ?, ?, ?, now(), ?, ?, ?, ?)",
                    [run_id, name, mode, source, config_json, stacks_json, socket.gethostname(), __version__],
                )
            except duckdb.ConstraintException as exc:
                raise SpanSinkError(f"run {run_id!r} is already in {self.db_path}; use a new run id") from exc
            finally:
                cur.close()

    def end_run(self, run_id: str) -> None:
        with self._lock:
            cur = self.conn.cursor()
            try:
                cur.execute("UPDATE runs SET ended_at = now() WHERE run_id = ?", [run_id])
            finally:
                cur.close()

    def write_health(self, rows: Sequence[HealthRow]) -> None:
        with self._lock:
            cur = self.conn.cursor()
            try:
                cur.executemany(
                    "INSERT INTO health (run_id, arm, concurrency_level, round, check_name, value, "
                    "threshold, measured_at, offered_rate) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [list(r) for r in rows],
                )
            finally:
                cur.close()

    def copy_to(self, dest: str | Path) -> None:
        """Copy the whole store to a new file ``dest``; SpanSinkError when the copy fails."""
        with self._lock:
            cur = self.conn.cursor()
            try:
                (name,) = cur.execute("SELECT current_database()").fetchone()
                cur.execute(f"ATTACH {schema.sql_literal(str(dest))} AS specproxy_snapshot")
                try:
                    cur.execute(f'COPY FROM DATABASE "{name}" TO specproxy_snapshot')
                finally:
                    cur.execute("DETACH specproxy_snapshot")
            except duckdb.Error as exc:
                raise SpanSinkError(f"cannot copy the span store {self.db_path} to {dest}: {exc}") from exc
            finally:
                cur.close()

    def close(self) -> None:
        self.conn.close()
