"""Opening span stores for analysis: one or several DuckDB files, read-only, as one database.

Each file is ATTACHed READ_ONLY into an in-memory DuckDB and checked against its schema version; views
``requests``, ``runs``, ``health`` and ``backend_metrics`` there are the union of the files' tables in
the current shape (a file of an older schema reads NULL for the columns it lacks), and the analysis
views of :mod:`specproxy.schema` are created on top.
`serve --workers N` writes one file per worker (``specproxy.w0.duckdb``, ...): given
``specproxy.duckdb``, its ``.w<i>`` siblings are read too.

Errors are :class:`StoreError`, a sentence a person can act on.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from specproxy import schema

# DuckDB's memory cap for an analysis; SPECPROXY_ANALYSIS_MEMORY (e.g. "8GB") overrides it.
MEMORY_LIMIT = "1536MB"
# What DuckDB may write to its spill folder (its default is 90 % of the free disk): past it a query fails
# with an error that names the limit, instead of filling /tmp.
SPILL_LIMIT = "8GiB"
_STORE_COUNTER = itertools.count()


class StoreError(Exception):
    """A span store that cannot be read, or a question it cannot answer; the message says what to do."""


def expand_paths(paths: Sequence[str | Path]) -> list[Path]:
    """The files to read: each path given, plus its worker siblings ``<stem>.w<i><suffix>``.

    A path that does not exist but has worker siblings stands for them (serve with --workers writes only
    the siblings). Duplicates (the same file twice) are read once.
    """
    out: list[Path] = []
    seen: set[Path] = set()
    for given in paths:
        path = Path(given)
        worker = re.compile(re.escape(path.stem) + r"\.w\d+" + re.escape(path.suffix) + "$")
        siblings = sorted(
            (p for p in path.parent.glob(f"{path.stem}.w*{path.suffix}") if worker.match(p.name)),
            key=lambda p: int(p.name[len(path.stem) + 2 : len(p.name) - len(path.suffix)]),
        )
        if not path.exists() and not siblings:
            raise StoreError(
                f"{path}: no such span store (and no worker files {path.stem}.w0{path.suffix}, ...); "
                "give the file that `specproxy serve` or `replay` wrote (the experiment's `db`)"
            )
        for p in ([path] if path.exists() else []) + siblings:
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


_LOCK_HOLDER = re.compile(r"Conflicting lock is held in (?P<program>.+?) \(PID (?P<pid>\d+)\)")
# DuckDB's words for a file it cannot read back: a block whose checksum fails, or a file cut short.
_DAMAGE_MARKS = ("corrupt database file", "does not match stored checksum", "could not read enough bytes")


def is_damage(text: str) -> bool:
    """Whether a DuckDB error says a file's bytes are damaged (truncated, or a checksum that fails)."""
    lowered = text.lower()
    return any(mark in lowered for mark in _DAMAGE_MARKS)


def _first_line(text: str) -> str:
    return re.sub(r"^[A-Za-z ]*Error: ", "", text.splitlines()[0] if text else "")


def _damaged(path: Path | str, text: str) -> StoreError:
    return StoreError(
        f"{path} is damaged ({_first_line(text)}); DuckDB cannot read it back: "
        "restore the file from a copy, or measure again"
    )


def _attach_error(path: Path, exc: duckdb.Error) -> StoreError:
    """DuckDB's reason for not opening a file, as what it means: locked, damaged, not DuckDB, other."""
    text = str(exc)
    if "Could not set lock" in text or "Conflicting lock" in text:
        holder = _LOCK_HOLDER.search(text)
        who = f" (PID {holder['pid']}, {holder['program']})" if holder else ""
        return StoreError(
            f"{path} is open for writing by another process{who}, and DuckDB allows one writer and no "
            f"readers beside it; stop that process (`specproxy serve`/`replay`) or analyse a copy: "
            f"cp {path} /tmp/{path.name}"
        )
    if is_damage(text):
        return _damaged(path, text)
    if "not a valid DuckDB database file" in text:
        return StoreError(
            f"{path} is not a DuckDB file; give the .duckdb file that `specproxy serve` or `replay` wrote"
        )
    if "version number" in text:
        return StoreError(f"{path} was written by another DuckDB version: {_first_line(text)}")
    return StoreError(f"cannot open {path}: {_first_line(text)}")


@dataclass
class SpanStore:
    """An in-memory DuckDB connection that sees the union of several span store files.

    ``views``: the SQL of the ``requests`` and ``backend_metrics`` views as the files hold them, which
    :meth:`leave_out_rounds` narrows.
    """

    conn: duckdb.DuckDBPyConnection
    paths: list[Path]
    spill_dir: Path | None = None
    views: dict[str, str] = field(default_factory=dict)

    def leave_out_rounds(
        self,
        rounds: Iterable[tuple[str, str, int]],
        windows: Iterable[tuple[str, str, float | None, float]] = (),
    ) -> None:
        """From now on the views read no call, and no engine counter window, of these (run_id, level,
        round), and no call of a level in flight during one of these (run_id, level, start, end)
        time windows (epoch seconds; start None: from the first call): every figure built on them
        leaves those rounds and windows out (the ``health`` table keeps them). Each call replaces the
        previous sets; empty ones read everything again.

        The filter is one anti-join under ``requests`` and ``backend_metrics`` (and one more under
        ``requests`` for windows), made only when something is left out (it would cost every scan of
        a large store something).
        """
        left_out = sorted(set(rounds))
        requests, metrics = self.views["requests"], self.views["backend_metrics"]
        if spans := sorted({(r, lv, -math.inf if a is None else a, b) for r, lv, a, b in windows}):
            self.conn.execute(
                "CREATE OR REPLACE TEMP TABLE left_out_windows "
                "(run_id VARCHAR, level VARCHAR, start_s DOUBLE, end_s DOUBLE)"
            )
            self.conn.executemany("INSERT INTO left_out_windows VALUES (?, ?, ?, ?)", spans)
            requests = f"""
                SELECT * FROM ({requests}) q WHERE NOT EXISTS (
                    SELECT 1 FROM left_out_windows x
                    WHERE x.run_id = q.run_id AND x.level = {schema.level_sql("q")}
                      AND {schema.start_s_sql("q")} < x.end_s
                      AND {schema.start_s_sql("q")} + coalesce(q.e2e_s, 0) > x.start_s)
            """
        if left_out:
            self.conn.execute(
                "CREATE OR REPLACE TEMP TABLE left_out_rounds (run_id VARCHAR, level VARCHAR, round INTEGER)"
            )
            self.conn.executemany("INSERT INTO left_out_rounds VALUES (?, ?, ?)", left_out)
            requests = f"""
                SELECT * FROM ({requests}) q WHERE NOT EXISTS (
                    SELECT 1 FROM left_out_rounds x
                    WHERE x.run_id = q.run_id AND x.round = q.round AND x.level = {schema.level_sql("q")})
            """
            # a round's window is its phase pair 'c=16 r2/3:before' / ':after' (level '16', round 2),
            # an extra round's 'c=16 r4 extra:before' / ':after'
            window = " r([0-9]+)(/[0-9]+| extra):[a-z]+$"
            metrics = f"""
                SELECT * FROM ({metrics}) m WHERE NOT EXISTS (
                    SELECT 1 FROM left_out_rounds x
                    WHERE x.run_id = m.run_id
                      AND m.phase LIKE '% r%:%'
                      AND x.round = TRY_CAST(regexp_extract(m.phase, '{window}', 1) AS INTEGER)
                      AND x.level = regexp_replace(regexp_replace(m.phase, '{window}', ''), '^c=', ''))
            """
        self.conn.execute(f"CREATE OR REPLACE VIEW requests AS {requests}")
        self.conn.execute(f"CREATE OR REPLACE VIEW backend_metrics AS {metrics}")

    def close(self) -> None:
        self.conn.close()
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)

    def __enter__(self) -> SpanStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def seal(self) -> None:
        """From now on this connection reads only what is attached: no other file, no extension, no
        setting changed (a query cannot undo this: the configuration is locked)."""
        for setting in (
            "autoinstall_known_extensions = false",
            "autoload_known_extensions = false",
            "enable_external_access = false",
            "lock_configuration = true",
        ):
            self.conn.execute(f"SET {setting}")

    def read_only_query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Column names and rows of the last statement of ``sql``, which may only read.

        Defence in depth: the statements are checked first (nothing runs if one would write), the
        connection is sealed, and the files are attached read-only. Errors are StoreError.
        """
        statements = read_only_statements(sql)
        self.seal()
        try:
            for stmt in statements:
                cur = self.conn.execute(stmt)
            names = [d[0] for d in cur.description or []]
            return names, (cur.fetchall() if names else [])
        except duckdb.PermissionException as exc:
            raise StoreError(
                f"the query failed: `specproxy sql` reads only the span store, no other file "
                f"({_first_line(str(exc))})"
            ) from exc
        except duckdb.Error as exc:
            raise query_failure(exc, self.paths, "the query") from exc

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Rows as dicts (column name → value)."""
        cur = self.conn.execute(sql, params if params is not None else [])
        names = [d[0] for d in cur.description or []]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


# Statement types `specproxy sql` runs (SELECT covers WITH, FROM-first, DESCRIBE, SHOW, SUMMARIZE and
# PIVOT with an IN list); EXPLAIN only when what it explains is one of them, as EXPLAIN ANALYZE runs it.
READ_ONLY_STATEMENTS = ("SELECT", "EXPLAIN")


def _explained(sql: str) -> str:
    """The statement an EXPLAIN statement explains: after EXPLAIN, its (options) and ANALYZE."""
    found = duckdb.tokenize(sql)
    ends = [at for at, _ in found[1:]] + [len(sql)]
    tokens = [
        (at, sql[at:end].strip().lower())
        for (at, kind), end in zip(found, ends, strict=True)
        if kind.name != "comment"
    ]
    i = 1  # tokens[0] is EXPLAIN
    if i < len(tokens) and tokens[i][1] == "(":
        depth = 0
        while i < len(tokens):
            depth += {"(": 1, ")": -1}.get(tokens[i][1], 0)
            i += 1
            if depth == 0:
                break
    if i < len(tokens) and tokens[i][1] in ("analyze", "analyse"):
        i += 1
    return sql[tokens[i][0] :] if i < len(tokens) else ""


def read_only_statements(sql: str) -> list[Any]:
    """The statements of ``sql`` if every one only reads; StoreError naming the first that does not.

    >>> [s.type.name for s in read_only_statements("SELECT 1; EXPLAIN SELECT 2")]
    ['SELECT', 'EXPLAIN']
    """
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise StoreError(f"the query failed: {_first_line(str(exc))}") from exc
    if not statements:
        raise StoreError("the query is empty; give a SELECT statement")
    for stmt in statements:
        kind = stmt.type.name
        if kind == "EXPLAIN":
            read_only_statements(_explained(stmt.query))
        elif kind not in READ_ONLY_STATEMENTS:
            raise StoreError(
                f"`specproxy sql` only reads, and this query has a {kind} statement "
                f"({stmt.query.strip()[:60]!r}); it runs SELECT, WITH, FROM, DESCRIBE, SHOW, SUMMARIZE "
                "and EXPLAIN. To change a span store file, open it with the DuckDB CLI"
            )
    return statements


def open_store(paths: Sequence[str | Path]) -> SpanStore:
    """Attach every file (and its worker siblings) read-only and build the union views.

    Each file must be a specproxy span store of this version or an older one (its tables then lack
    the newer columns, which read as NULL); anything else is a StoreError that says what the file is.

    >>> with open_store(["specproxy.duckdb"]) as store:  # doctest: +SKIP
    ...     store.query("SELECT arm, agg_tok_s FROM arm_summary")
    """
    if not paths:
        raise StoreError("give at least one span store file")
    files = expand_paths(paths)
    # DuckDB would take 80 % of RAM; the analysis is bounded instead (target: 2 GiB for 10 M spans) and
    # DuckDB spills joins and windows beyond it to a temporary directory.
    spill = _spill_dir()
    limit = os.environ.get("SPECPROXY_ANALYSIS_MEMORY") or MEMORY_LIMIT
    try:
        config: dict[str, str | bool | int | float | list[str]] = {
            "memory_limit": limit,
            "temp_directory": str(spill),
            "max_temp_directory_size": SPILL_LIMIT,
        }
        conn = duckdb.connect(":memory:", config=config)
    except duckdb.Error as exc:
        raise StoreError(f"cannot start the analysis database (memory limit {limit!r}?): {exc}") from exc
    try:
        attached: list[_StoreFile] = []
        for i, path in enumerate(files):
            alias = f"db{i}"
            try:
                conn.execute(f"ATTACH {schema.sql_literal(str(path))} AS {alias} (READ_ONLY)")
                attached.append(_inspect(conn, alias, path))
            except duckdb.Error as exc:
                raise _attach_error(path, exc) from exc
        views = _create_union_views(conn, attached)
        for stmt in schema.ANALYSIS_VIEWS:
            conn.execute(stmt)
        conn.execute(schema.SLO_CALLS_VIEW)
    except BaseException:
        conn.close()
        raise
    return SpanStore(conn, files, spill, views)


def _spill_dir() -> Path:
    """A folder of its own for each store (DuckDB creates it only if it spills; close() removes it).
    Folders left by a process that is gone (killed mid-query, so close() never ran) are removed first."""
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob("specproxy-analysis-*-*"):
        pid = old.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tmp / f"specproxy-analysis-{os.getpid()}-{next(_STORE_COUNTER)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


Columns = dict[str, dict[str, str]]  # table → column → DuckDB type, in column order


@dataclass(frozen=True, slots=True)
class _StoreFile:
    """One attached file: its alias, its schema version and the columns of its tables."""

    alias: str
    version: int
    tables: Columns


@functools.cache
def schema_columns(version: int) -> Columns:
    """The tables of a span store at schema ``version``, as its migrations create them.

    >>> schema_columns(1)["requests"]["ttft_s"]
    'DOUBLE'
    """
    conn = duckdb.connect(":memory:")
    try:
        for statements in schema.MIGRATIONS[:version]:
            for stmt in statements:
                conn.execute(stmt)
        return _table_columns(conn, "memory")
    finally:
        conn.close()


def _table_columns(conn: duckdb.DuckDBPyConnection, database: str) -> Columns:
    rows = conn.execute(
        """
        SELECT c.table_name, c.column_name, c.data_type
        FROM duckdb_columns() c
        JOIN duckdb_tables() t USING (database_name, schema_name, table_name)
        WHERE c.database_name = ? AND c.schema_name = 'main'
        ORDER BY c.table_name, c.column_index
        """,
        [database],
    ).fetchall()
    tables: Columns = {}
    for table, column, kind in rows:
        tables.setdefault(table, {})[column] = kind
    return tables


def _inspect(conn: duckdb.DuckDBPyConnection, alias: str, path: Path) -> _StoreFile:
    """The file's schema version and tables, checked against what that version's migrations made."""
    tables = _table_columns(conn, alias)
    if "schema_version" not in tables:
        found = ", ".join(sorted(tables)) or "none"
        raise StoreError(
            f"{path} is a DuckDB file but not a specproxy span store: it has no schema_version table "
            f"(its tables: {found})"
        )
    try:
        row = conn.execute(f"SELECT max(version) FROM {alias}.main.schema_version").fetchone()
        version = int(row[0] or 0) if row else 0
    except (duckdb.Error, TypeError, ValueError) as exc:
        raise StoreError(
            f"{path} is not a specproxy span store: its schema_version table cannot be read ({exc})"
        ) from exc
    if version > schema.SCHEMA_VERSION:
        raise StoreError(
            f"{path} was written by a newer specproxy (schema version {version}; this one reads up to "
            f"{schema.SCHEMA_VERSION}): upgrade specproxy to analyse it"
        )
    problems = _shape_problems(tables, schema_columns(version))
    if problems:
        raise StoreError(
            f"{path} is not a specproxy span store of schema version {version}, as it claims: "
            f"{'; '.join(problems)}. Was it changed by hand? The DuckDB CLI opens it as it is"
        )
    return _StoreFile(alias, version, tables)


def _shape_problems(have: Columns, want: Columns) -> list[str]:
    problems: list[str] = []
    for table, columns in want.items():
        if table not in have:
            problems.append(f"it has no {table} table")
            continue
        missing = [c for c in columns if c not in have[table]]
        if missing:
            problems.append(f"{table} lacks the column{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
        problems += [
            f"{table}.{c} is {have[table][c]}, not {kind}"
            for c, kind in columns.items()
            if c in have[table] and have[table][c] != kind
        ]
    return problems


def _select_current(table: str, columns: dict[str, str], source: _StoreFile | None) -> str:
    """SELECT of ``table`` in its current shape: the file's columns, NULL for those its version lacks."""
    have = source.tables.get(table, {}) if source else {}
    items = ", ".join(f'"{c}"' if c in have else f'NULL::{kind} AS "{c}"' for c, kind in columns.items())
    if source is None:
        return f"SELECT {items} WHERE false"
    return f"SELECT {items} FROM {source.alias}.main.{table}"


def _create_union_views(conn: duckdb.DuckDBPyConnection, attached: list[_StoreFile]) -> dict[str, str]:
    """The union views; returns the SQL of ``requests`` and ``backend_metrics`` (for
    :meth:`SpanStore.leave_out_rounds`)."""
    current = schema_columns(schema.SCHEMA_VERSION)
    views: dict[str, str] = {}
    for table, columns in current.items():
        if table in ("schema_version", "backend_metrics"):
            continue
        parts = [_select_current(table, columns, f) for f in attached if table in f.tables]
        # a file too old for the table: an empty one of the current shape keeps every query valid
        parts = parts or [_select_current(table, columns, None)]
        views[table] = " UNION ALL ".join(parts)
        conn.execute(f"CREATE VIEW {table} AS {views[table]}")
    # Every worker of `serve --workers N` may scrape the same backends: counters from two files are the
    # same series seen twice, so each (run, arm) takes its metrics from one file, the one with the most.
    metric_columns = current["backend_metrics"]
    metric_parts = [
        f"SELECT *, {i} AS source_file FROM ({_select_current('backend_metrics', metric_columns, f)})"
        for i, f in enumerate(attached)
        if "backend_metrics" in f.tables
    ] or [f"SELECT *, 0 AS source_file FROM ({_select_current('backend_metrics', metric_columns, None)})"]
    conn.execute("CREATE VIEW backend_metrics_all AS " + " UNION ALL ".join(metric_parts))
    views["backend_metrics"] = """
        WITH counts AS (
            SELECT run_id, arm, source_file, count(*) AS n FROM backend_metrics_all GROUP BY ALL
        ), chosen AS (
            SELECT run_id, arm, arg_max(source_file, n * 1000000 - source_file) AS source_file
            FROM counts GROUP BY ALL
        )
        SELECT m.* EXCLUDE (source_file)
        FROM backend_metrics_all m
        JOIN chosen c ON m.run_id IS NOT DISTINCT FROM c.run_id AND m.arm = c.arm
                     AND m.source_file = c.source_file
    """
    conn.execute(f"CREATE VIEW backend_metrics AS {views['backend_metrics']}")
    return views


@contextmanager
def query_errors(paths: Sequence[Path] = ()) -> Iterator[None]:
    """DuckDB errors while analysing ``paths`` become a StoreError with what to do about them."""
    try:
        yield
    except duckdb.OutOfMemoryException as exc:
        limit = os.environ.get("SPECPROXY_ANALYSIS_MEMORY") or MEMORY_LIMIT
        raise StoreError(
            f"the analysis needs more than its memory limit ({limit}) for this span store; "
            "raise it, e.g. SPECPROXY_ANALYSIS_MEMORY=8GB, or analyse one run at a time (--run)"
        ) from exc
    except duckdb.Error as exc:
        raise query_failure(exc, paths, "the analysis query") from exc


def query_failure(exc: duckdb.Error, paths: Sequence[Path], what: str) -> StoreError:
    """A query's DuckDB error as a sentence; damage is named here too, as a damaged block is often
    found only when a query first reads it."""
    text = str(exc)
    if not is_damage(text):
        return StoreError(f"{what} failed: {_first_line(text)}")
    named = [p for p in paths if str(p) in text or str(p.resolve()) in text]
    if named or len(paths) == 1:
        return _damaged((named or list(paths))[0], text)
    return StoreError(
        f"one of {', '.join(map(str, paths))} is damaged ({_first_line(text)}); "
        "analyse them one at a time to find it"
    )
