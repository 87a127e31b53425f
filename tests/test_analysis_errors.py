"""The analysis commands on files that are not a healthy, readable span store: one sentence, exit 1.

Real DuckDB files damaged the way disks and copies damage them, a real second process holding the
write lock, and the attacks a read-only query tool must refuse.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from specproxy import schema
from specproxy.cli import main
from tests.spanfactory import ArmSpec, make_run, write_db
from tests.support import run_cli as cli

ARMS = [ArmSpec("baseline", "baseline", "none"), ArmSpec("eagle3", speedup=1.3)]


def failed_with(result: subprocess.CompletedProcess[str], *phrases: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = make_run(ARMS, levels=(1, 4), n_per_level=400, seed=5)
    return write_db(tmp_path_factory.mktemp("errors") / "spans.duckdb", [run])


def test_a_truncated_file_is_damaged_not_locked(store: Path, tmp_path: Path) -> None:
    data = store.read_bytes()
    cut = tmp_path / "cut.duckdb"
    cut.write_bytes(data[: len(data) // 2])
    for args in (("analyze",), ("sql", "SELECT sum(ttft_s) FROM requests")):
        result = cli(args[0], str(cut), *args[1:])
        failed_with(result, f"{cut} is damaged")
        assert "open for writing" not in result.stderr


def test_a_checksum_error_is_damaged_not_locked(store: Path, tmp_path: Path) -> None:
    # The second header block: DuckDB checks it when attaching ("... in block at location 4096").
    data = bytearray(store.read_bytes())
    data[4096:4200] = bytes(104)
    bad = tmp_path / "checksum.duckdb"
    bad.write_bytes(bytes(data))
    for command in (("analyze",), ("sql", "SELECT 1"), ("report", "-o", str(tmp_path / "r.html"))):
        args = [command[0], str(bad), *command[1:]]
        result = cli(*args)
        failed_with(result, f"{bad} is damaged", "checksum")
        assert "open for writing" not in result.stderr


def test_garbage_is_not_a_duckdb_file(tmp_path: Path) -> None:
    garbage = tmp_path / "notes.duckdb"
    garbage.write_bytes(b"this is a text file, not a database\n" * 200)
    empty = tmp_path / "empty.duckdb"
    empty.write_bytes(b"")
    failed_with(cli("analyze", str(garbage)), f"{garbage} is not a DuckDB file")
    failed_with(cli("sql", str(empty), "SELECT 1"), f"{empty} is not a DuckDB file")


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    failed_with(cli("analyze", str(tmp_path / "nope.duckdb")), "no such span store")


def test_a_locked_file_names_the_process_holding_it(store: Path, tmp_path: Path) -> None:
    path = tmp_path / "locked.duckdb"
    path.write_bytes(store.read_bytes())
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb, sys; c = duckdb.connect({str(path)!r}); print('ok', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        result = cli("analyze", str(path))
        failed_with(result, "open for writing", f"PID {holder.pid}", f"cp {path}")
        assert "damaged" not in result.stderr
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
        assert holder.stdout is not None
        holder.stdout.close()
    assert cli("analyze", str(path)).returncode == 0


def _store_of_version(path: Path, version: int, source: Path) -> Path:
    """A span store of an older schema ``version`` holding ``source``'s rows (in the columns it has)."""
    with duckdb.connect(str(path)) as conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER, applied_at TIMESTAMPTZ)")
        for v, statements in enumerate(schema.MIGRATIONS[:version], 1):
            for stmt in statements:
                conn.execute(stmt)
            conn.execute("INSERT INTO schema_version VALUES (?, now())", [v])
        conn.execute(f"ATTACH '{source}' AS src (READ_ONLY)")
        for table in ("requests", "runs", "backend_metrics"):
            names = [r[0] for r in conn.execute(f"DESCRIBE {table}").fetchall()]
            cols = ", ".join(f'"{n}"' for n in names)
            conn.execute(f"INSERT INTO {table} SELECT {cols} FROM src.main.{table}")
    return path


def _reading_commands(db: Path, tmp_path: Path, query: str) -> list[tuple[str, ...]]:
    """The arguments of analyze, sql (running ``query``) and report on ``db``: each command that reads a
    span store."""
    return [
        ("analyze", str(db)),
        ("sql", str(db), query),
        ("report", str(db), "-o", str(tmp_path / "r.html")),
    ]


def test_a_foreign_requests_table_is_not_a_span_store(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.duckdb"
    with duckdb.connect(str(foreign)) as conn:
        conn.execute("CREATE TABLE requests (id INTEGER, url VARCHAR)")
        conn.execute("INSERT INTO requests VALUES (1, 'http://example')")
    for args in _reading_commands(foreign, tmp_path, "SELECT count(*) FROM arm_summary"):
        failed_with(cli(*args), f"{foreign} is a DuckDB file but not a specproxy span store", "requests")


def test_a_requests_table_of_the_wrong_shape_is_named(store: Path, tmp_path: Path) -> None:
    mangled = tmp_path / "mangled.duckdb"
    mangled.write_bytes(store.read_bytes())
    with duckdb.connect(str(mangled)) as conn:
        conn.execute("ALTER TABLE requests DROP COLUMN ttft_s")
        conn.execute("ALTER TABLE requests ALTER COLUMN e2e_s TYPE VARCHAR")
    for args in _reading_commands(mangled, tmp_path, "SELECT 1"):
        failed_with(
            cli(*args),
            f"schema version {schema.SCHEMA_VERSION}",
            "requests lacks the column ttft_s",
            "requests.e2e_s is VARCHAR, not DOUBLE",
        )


def test_a_store_from_a_newer_specproxy_asks_for_an_upgrade(store: Path, tmp_path: Path) -> None:
    newer = tmp_path / "newer.duckdb"
    newer.write_bytes(store.read_bytes())
    with duckdb.connect(str(newer)) as conn:
        conn.execute("INSERT INTO schema_version VALUES (?, now())", [schema.SCHEMA_VERSION + 1])
    failed_with(cli("analyze", str(newer)), "written by a newer specproxy", "upgrade specproxy")


def test_an_older_schema_reads_null_for_the_columns_it_lacks(store: Path, tmp_path: Path) -> None:
    """Schema 7 appended columns to requests and a health table; a schema 6 file is still analysed."""
    old = _store_of_version(tmp_path / "v6.duckdb", 6, store)
    expected = cli("analyze", str(store), "--format", "csv")
    assert expected.returncode == 0, expected.stderr
    result = cli("analyze", str(old), "--format", "csv")
    assert result.returncode == 0, result.stderr
    # the same figures; only where the token counts came from is not recorded in the old file
    old_rows = list(csv.DictReader(io.StringIO(result.stdout)))
    new_rows = list(csv.DictReader(io.StringIO(expected.stdout)))
    assert {r["tokens_source"] for r in old_rows if r["ok"]} == {"not recorded"}
    assert {r["tokens_source"] for r in new_rows if r["ok"]} == {"usage"}
    assert [r | {"tokens_source": ""} for r in old_rows] == [r | {"tokens_source": ""} for r in new_rows]
    probe = cli(
        "sql",
        str(old),
        "SELECT count(*) AS n, count(round) AS rounds, count(engine) AS engines, "
        "(SELECT count(*) FROM health) AS checks FROM requests",
        "--format",
        "json",
    )
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == [{"n": 1600, "rounds": 0, "engines": 0, "checks": 0}]
    # an old file and a current one read as one store
    mixed = cli("sql", str(old), str(store), "SELECT count(*) AS n FROM requests", "--format", "csv")
    assert mixed.returncode == 0 and mixed.stdout.splitlines()[1] == "3200", mixed.stderr


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """`specproxy ARGS` in-process (the click group itself), for the many cheap checks."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def _fingerprint(path: Path) -> tuple[str, int]:
    with duckdb.connect(str(path), read_only=True) as conn:
        row = conn.execute("SELECT count(*) FROM requests").fetchone()
    return hashlib.sha256(path.read_bytes()).hexdigest(), row[0] if row else -1


def test_sql_cannot_change_the_store_or_touch_other_files(store: Path, tmp_path: Path) -> None:
    target = tmp_path / "target.duckdb"
    target.write_bytes(store.read_bytes())
    before = _fingerprint(target)
    out = tmp_path / "out"
    attacks = [
        f"DETACH db0; ATTACH '{target}' AS w; DROP TABLE w.main.requests",
        f"ATTACH '{target}' AS w; DELETE FROM w.main.requests",
        f"ATTACH '{tmp_path / 'new.duckdb'}' AS n",
        f"COPY (SELECT * FROM requests) TO '{out}.csv'",
        f"COPY requests TO '{out}.parquet' (FORMAT parquet)",
        f"EXPORT DATABASE '{out}'",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "RESET lock_configuration",
        "PRAGMA memory_limit = '64GB'",
        "PRAGMA force_checkpoint",
        "CHECKPOINT",
        "CREATE TABLE copy AS SELECT * FROM requests",
        "INSERT INTO requests SELECT * FROM requests",
        "UPDATE requests SET arm = 'x'",
        "DELETE FROM requests",
        "DROP VIEW arm_summary",
        "EXPLAIN ANALYZE CREATE TABLE z AS SELECT 1",
        "/* a comment */ EXPLAIN ANALYZE CREATE TABLE y AS SELECT 1",
        "EXPLAIN (FORMAT json, ANALYZE) -- a comment\nDROP VIEW requests",
        "EXPLAIN/**/ANALYZE CREATE TABLE z AS SELECT 1",
        "SELECT 1 AS first; DROP VIEW requests",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/hostname')",
        "SELECT * FROM glob('/etc/*')",
    ]
    for attack in attacks:
        result = run("sql", str(target), attack)
        assert result.returncode == 1, (attack, result.stdout)
        assert "Traceback" not in result.stderr and result.stdout == "", (attack, result.stderr)
        assert "only reads" in result.stderr or "reads only the span store" in result.stderr, (
            attack,
            result.stderr,
        )
    headline = cli("sql", str(target), attacks[0])
    failed_with(headline, "only reads", "DETACH", "DuckDB CLI")
    assert _fingerprint(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target.duckdb"]


def test_sql_still_answers_every_kind_of_read(store: Path) -> None:
    reads = {
        "DESCRIBE requests": "column_name",
        "SHOW TABLES": "name",
        "SUMMARIZE SELECT ttft_s FROM requests": "column_name",
        "EXPLAIN SELECT count(*) FROM requests": "explain_key",
        "/* how */ EXPLAIN ANALYZE SELECT count(*) FROM requests": "explain_key",
        "WITH a AS (SELECT 1 AS x) SELECT x FROM a": "x",
        "FROM runs SELECT count(*) AS n": "n",
        "SELECT 1 AS one; SELECT arm, count(*) AS n FROM requests GROUP BY arm ORDER BY arm": "arm",
    }
    for query, header in reads.items():
        result = run("sql", str(store), query, "--format", "csv")
        assert result.returncode == 0, (query, result.stderr)
        assert result.stdout.splitlines()[0].split(",")[0] == header, (query, result.stdout)
    assert "read-only" in run("sql", "--help").stdout
    assert "DuckDB CLI" in run("sql", "--help").stdout


@pytest.mark.parametrize(
    "option, value",
    [
        ("--confidence", "nan"),
        ("--identity-min", "nan"),
        ("--win-threshold", "nan"),
        ("--identity-min", "101"),
        ("--near-tie-margin", "inf"),
    ],
)
def test_verdict_options_must_be_finite_numbers_in_range(store: Path, option: str, value: str) -> None:
    result = run("analyze", str(store), option, value)
    assert result.returncode == 2 and option in result.stderr, result.stderr
