"""analysis/README.md: its SQL queries and its Python example run on a real span store."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from specproxy.cli import main
from tests.spanfactory import ArmSpec, make_run, write_db

README = Path(__file__).resolve().parents[1] / "analysis" / "README.md"


def _section() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- section: analysis -->(.*)<!-- /section: analysis -->", text, re.S)
    assert match, "README has no analysis section"
    return match.group(1)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    arms = [
        ArmSpec("baseline", "baseline", "none"),
        ArmSpec("eagle3", speedup=1.5, identical_p=0.9),
        ArmSpec("replica", "replica", "none"),
    ]
    run = make_run(arms, levels=(1, 8), n_per_level=40, seed=5)
    for span in run.spans:
        span.inflight_at_start = hash(span.request_id) % 20
    return write_db(tmp_path_factory.mktemp("readme") / "specproxy.duckdb", [run])


def test_the_six_queries_run(store: Path) -> None:
    queries = re.findall(r"```sql\n(.*?)```", _section(), re.S)
    assert len(queries) == 6
    for query in queries:
        result = CliRunner().invoke(main, ["sql", str(store), query, "--format", "csv"])
        assert result.exit_code == 0, (query, result.output)
        assert len(result.stdout.splitlines()) >= 2, query  # a header and at least one row


def test_the_python_example_runs(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (example,) = re.findall(r"```python\n(.*?)```", _section(), re.S)
    other = tmp_path / "other-machine.duckdb"
    write_db(
        other,
        [
            make_run(
                [ArmSpec("baseline", "baseline", "none"), ArmSpec("ngram")],
                levels=(1,),
                n_per_level=10,
                run_id="m2",
                name="m2",
            )
        ],
    )
    (tmp_path / "specproxy.duckdb").write_bytes(store.read_bytes())
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(example, "README.md", "exec"), namespace)  # the README's own example
    assert os.path.exists("report.html")
    assert len(namespace["runs"]) == 2  # type: ignore[arg-type]


def test_the_options_block_is_the_real_help() -> None:
    block = re.search(r"`specproxy analyze --help`.*?```text\n(.*?)```", _section(), re.S)
    assert block, "README lacks the analyze --help block"
    result = CliRunner().invoke(main, ["analyze", "--help"], prog_name="specproxy", terminal_width=80)
    assert result.stdout.strip() == block.group(1).strip()
