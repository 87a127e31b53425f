"""The analysis commands as a user runs them: real CLI subprocesses on real DuckDB files."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from specproxy.analysis import StoreError, analyze_text, write_report
from specproxy.cli import main
from specproxy.schema import migrate
from tests.spanfactory import ArmSpec, generate_sql, make_run, write_db
from tests.support import run_cli as cli

ARMS = [
    ArmSpec("baseline", "baseline", "none"),
    ArmSpec("eagle3", speedup=1.4, identical_p=0.95),
    ArmSpec("ngram", speedup=1.1),
]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """The same command in-process (the click group itself), for the many cheap checks."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    replay = make_run(ARMS, levels=(1, 8), n_per_level=80, seed=3, capture_text=True)
    live = make_run(ARMS[:2], levels=(None,), n_per_level=60, seed=4, run_id="live-1", name="shadow")
    return write_db(tmp_path_factory.mktemp("cli") / "spans.duckdb", [replay, live])


def test_analyze_formats(store: Path) -> None:
    table = cli("analyze", str(store))
    assert table.returncode == 0, table.stderr
    assert "run synthetic (run-1)" in table.stdout and "run shadow (live-1)" in table.stdout
    assert re.search(r"^live\s+eagle3\s", table.stdout, re.M)
    md = run("analyze", str(store), "--run", "shadow", "--format", "markdown")
    assert md.stdout.startswith("### run shadow") and "| live | eagle3 |" in md.stdout
    assert "synthetic" not in md.stdout
    csv_out = run("analyze", str(store), "--format", "csv", "--run", "run-1").stdout.splitlines()
    assert csv_out[0].startswith("run_id,run_name,level")
    # 2 levels × 3 arms, then 2 candidates × 2 categories × 2 levels with `category` set
    rows = list(csv.DictReader(io.StringIO("\n".join(csv_out))))
    assert len(rows) == 2 * 3 + 2 * 2 * 2
    assert [r["category"] for r in rows[:6]] == [""] * 6
    assert {(r["arm"], r["category"], r["level"]) for r in rows[6:]} == {
        (a, c, lv) for a in ("eagle3", "ngram") for c in ("chat", "code") for lv in ("1", "8")
    }
    doc = json.loads(run("analyze", str(store), "--format", "json").stdout)
    assert sorted(r["name"] for r in doc["runs"]) == ["shadow", "synthetic"]
    assert doc["settings"]["thresholds"]["min_margin"] == 0.03


def test_options_change_the_verdict(store: Path) -> None:
    strict = json.loads(
        run("analyze", str(store), "--run", "run-1", "--format", "json", "--margin", "100").stdout
    )
    assert all(r["verdict"] in (None, "NO CLEAR GAIN", "LOSS") for r in strict["runs"][0]["rows"])
    a = run("analyze", str(store), "--bootstrap-seed", "5", "--format", "csv").stdout
    b = run("analyze", str(store), "--bootstrap-seed", "5", "--format", "csv").stdout
    c = run("analyze", str(store), "--bootstrap-seed", "6", "--format", "csv").stdout
    assert a == b and a != c


def test_python_api(store: Path, tmp_path: Path) -> None:
    assert "decode speedup [95% CI]" in analyze_text([store])
    out = write_report([store], tmp_path / "sub" / "r.html", run="synthetic")
    assert out.exists() and "<svg" in out.read_text()
    with pytest.raises(StoreError, match="no run named"):
        analyze_text([store], run="nope")


def test_report_is_self_contained(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    result = cli("report", str(store), "-o", str(out))
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    for needle in (
        "Verdicts",
        "P50 decode speedup vs baseline",
        "TTFT CDF at c=8",
        "Acceptance length by category",
        "Mismatches",
        "Stacks",
        "<polygon",
        "eagle3 arm",
    ):
        assert needle in html, needle
    # nothing fetched from the network: no scripts, no external sources or stylesheets
    assert "<script" not in html
    assert not re.search(r"""(src|href)=["']?https?:""", html)
    assert re.sub(r'xmlns="http://www.w3.org/2000/svg"', "", html).count("http") == 0
    # mismatch snippets show where the candidate's captured text diverged
    assert "<mark>" in html
    for needle in ("Deploy verdict", "Verdicts by workload category", "chat: P50 decode speedup"):
        assert needle in html, needle


def test_report_keeps_one_color_and_legend_order_per_arm(store: Path, tmp_path: Path) -> None:
    """Every legend of every chart (both runs) gives an arm the same color, in the same order."""
    out = write_report([store], tmp_path / "r.html")
    html = out.read_text()
    legends = re.findall(r"<svg .*?</svg>", html, re.S)
    color_of: dict[str, set[str]] = {}
    orders = []
    for svg in legends:
        entries = re.findall(
            r'<rect x="[\d.]+" y="[\d.]+" width="12" height="12" fill="(#\w+)"/><text [^>]*>([^<]+)</text>',
            svg,
        )
        for color, arm in entries:
            color_of.setdefault(arm, set()).add(color)
        orders.append([arm for _, arm in entries])
    assert set(color_of) == {"baseline", "eagle3", "ngram"}
    assert all(len(colors) == 1 for colors in color_of.values()), color_of
    assert len({c for colors in color_of.values() for c in colors}) == 3
    rank = {"baseline": 0, "eagle3": 1, "ngram": 2}
    for order in orders:
        assert order == sorted(order, key=rank.__getitem__), order


def test_sql(store: Path) -> None:
    result = run(
        "sql",
        str(store),
        "SELECT arm, count(*) AS n FROM requests WHERE run_id = 'run-1' GROUP BY arm ORDER BY arm",
        "--format",
        "json",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [
        {"arm": "baseline", "n": 160},
        {"arm": "eagle3", "n": 160},
        {"arm": "ngram", "n": 160},
    ]
    table = run(
        "sql", str(store), "SELECT level, arm, ok FROM arm_summary WHERE run_id = 'live-1' ORDER BY arm"
    )
    assert table.stdout.splitlines()[0].split() == ["level", "arm", "ok"]
    assert table.stdout.rstrip().endswith("(2 rows)")
    csv_out = run("sql", str(store), "SELECT kind, count(*) AS n FROM pairs GROUP BY kind", "--format", "csv")
    assert csv_out.stdout.splitlines()[0] == "kind,n"
    bad = run("sql", str(store), "SELECT nope FROM requests")
    assert bad.returncode == 1 and "the query failed" in bad.stderr and "Traceback" not in bad.stderr


def test_export_parquet(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "pq"
    result = run("export", str(store), "--parquet", str(out), "--run", "shadow")
    assert result.returncode == 0, result.stderr
    with duckdb.connect() as conn:
        n = conn.execute(
            f"SELECT count(*), count(DISTINCT run_id) FROM '{out / 'requests.parquet'}'"
        ).fetchall()
        assert n == [(120, 1)]
        assert conn.execute(f"SELECT name FROM '{out / 'runs.parquet'}'").fetchall() == [("shadow",)]


def test_worker_files_and_several_dbs_are_read_as_one(tmp_path: Path) -> None:
    synth = make_run(ARMS, levels=(4,), n_per_level=60, seed=9)
    half = len(synth.spans) // 2
    first = type(synth)(synth.run_id, synth.name, synth.spans[:half], synth.metrics, synth.run_row)
    second = type(synth)(synth.run_id, synth.name, synth.spans[half:], synth.metrics, synth.run_row)
    write_db(tmp_path / "specproxy.w0.duckdb", [first])
    write_db(tmp_path / "specproxy.w1.duckdb", [second])
    whole = write_db(tmp_path / "whole" / "one.duckdb", [synth])
    split = cli("analyze", "specproxy.duckdb", "--format", "csv", cwd=tmp_path)
    assert split.returncode == 0, split.stderr
    assert split.stdout == run("analyze", str(whole), "--format", "csv").stdout
    # metrics scraped by both workers are not counted twice
    acc = run(
        "sql",
        str(tmp_path / "specproxy.duckdb"),
        "SELECT arm, drafts FROM acceptance ORDER BY arm",
        "--format",
        "json",
    )
    acc_whole = run("sql", str(whole), "SELECT arm, drafts FROM acceptance ORDER BY arm", "--format", "json")
    assert json.loads(acc.stdout) == json.loads(acc_whole.stdout)
    # two files given explicitly (two machines)
    other = write_db(tmp_path / "other.duckdb", [make_run(ARMS, levels=(1,), n_per_level=20, run_id="m2")])
    both = run(
        "sql",
        str(whole),
        str(other),
        "SELECT count(DISTINCT run_id) AS runs FROM requests",
        "--format",
        "csv",
    )
    assert both.stdout.splitlines()[1] == "2"


def test_missing_corrupt_and_foreign_files(tmp_path: Path) -> None:
    missing = cli("analyze", str(tmp_path / "nope.duckdb"))
    assert missing.returncode == 1 and "no such span store" in missing.stderr
    corrupt = tmp_path / "corrupt.duckdb"
    corrupt.write_bytes(b"not a database" * 1000)
    bad = cli("analyze", str(corrupt))
    assert bad.returncode == 1 and "is not a DuckDB file" in bad.stderr
    foreign = tmp_path / "foreign.duckdb"
    with duckdb.connect(str(foreign)) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
    other = cli("report", str(foreign), "-o", str(tmp_path / "r.html"))
    assert other.returncode == 1 and "not a specproxy span store" in other.stderr
    for result in (missing, bad, other):
        assert "Traceback" not in result.stderr


def test_empty_store_unknown_run_and_no_baseline(tmp_path: Path, store: Path) -> None:
    empty = write_db(tmp_path / "empty.duckdb", [])
    result = run("analyze", str(empty))
    assert result.returncode == 1 and "no spans yet" in result.stderr
    unknown = run("analyze", str(store), "--run", "nope")
    assert (
        unknown.returncode == 1 and "no run named 'nope'" in unknown.stderr and "synthetic" in unknown.stderr
    )
    headless = write_db(
        tmp_path / "nobase.duckdb",
        [
            make_run(
                [ArmSpec("a", "baseline", "none"), ArmSpec("b")],
                levels=(1,),
                n_per_level=10,
                run_id="r",
                name="r",
            )
        ],
    )
    with duckdb.connect(str(headless)) as conn:
        conn.execute("UPDATE requests SET arm_role = 'candidate'")
    nobase = run("analyze", str(headless))
    assert nobase.returncode == 1 and "has no baseline arm" in nobase.stderr
    assert "Traceback" not in nobase.stderr + unknown.stderr + result.stderr


def test_a_file_locked_by_a_writer_is_a_sentence(tmp_path: Path, store: Path) -> None:
    path = tmp_path / "locked.duckdb"
    shutil.copy(store, path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb, sys; c = duckdb.connect({str(path)!r}); print('ok', flush=True); "
            "sys.stdin.read()",  # holds the file until killed
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        holder.stdout.close()
        result = run("analyze", str(path))
        assert result.returncode == 1
        assert "open for writing by another process" in result.stderr and "cp " in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        holder.kill()
        holder.wait()  # its lock goes with the process
        if holder.stdin is not None:
            holder.stdin.close()
    assert run("analyze", str(path)).returncode == 0


def test_a_run_without_baseline_is_skipped_beside_good_ones(tmp_path: Path) -> None:
    good = make_run(ARMS, levels=(1,), n_per_level=20, run_id="good", name="good")
    bad = make_run(ARMS, levels=(1,), n_per_level=20, run_id="bad", name="bad")
    path = write_db(tmp_path / "mixed.duckdb", [good, bad])
    with duckdb.connect(str(path)) as conn:
        conn.execute("UPDATE requests SET arm_role = 'candidate' WHERE run_id = 'bad'")
    table = run("analyze", str(path))
    assert table.returncode == 0 and "run good" in table.stdout
    assert "skipped: run 'bad' has no baseline arm" in table.stdout
    doc = json.loads(run("analyze", str(path), "--format", "json").stdout)
    assert [r["name"] for r in doc["runs"]] == ["good"] and len(doc["skipped"]) == 1
    named = run("analyze", str(path), "--run", "bad")
    assert named.returncode == 1 and "has no baseline arm" in named.stderr


def test_same_seed_same_intervals_on_a_parallel_scan(tmp_path: Path) -> None:
    """400k spans span several DuckDB row groups, so the scan and the sample run in parallel."""
    path = generate_sql(tmp_path / "big.duckdb", 400_000, levels=(1, 8))

    def intervals() -> list[list[str]]:
        rows = list(csv.DictReader(io.StringIO(analyze_text([path], fmt="csv"))))
        keys = ("decode_speedup_low", "decode_speedup_high", "throughput_ratio_low", "throughput_ratio_high")
        return [[r[k] for k in keys] for r in rows]

    first = intervals()
    assert any(cell for row in first for cell in row)
    assert intervals() == first


def test_out_of_memory_is_a_sentence(tmp_path: Path) -> None:
    path = generate_sql(tmp_path / "big.duckdb", 400_000, levels=(1, 8))
    result = cli("analyze", str(path), env={"SPECPROXY_ANALYSIS_MEMORY": "20MB"})
    assert result.returncode == 1, result.stdout
    assert "SPECPROXY_ANALYSIS_MEMORY=8GB" in result.stderr and "Traceback" not in result.stderr


def test_sql_help_names_every_table_and_view_of_the_store() -> None:
    with duckdb.connect() as conn:
        migrate(conn)
        names = {n for (n,) in conn.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    said = " ".join(CliRunner().invoke(main, ["sql", "--help"]).output.split())
    assert [n for n in sorted(names - {"schema_version"}) if not re.search(rf"\b{n}\b", said)] == []
