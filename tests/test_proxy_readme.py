"""proxy/README.md's `serve` walkthrough works: its experiment file, its request and its SQL query."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import aiohttp
import duckdb
import orjson
import pytest
from click.testing import CliRunner

from specproxy.cli import main
from specproxy.config import ConfigError, load_experiment
from tests.backends import BackendConfig, running_backend
from tests.proxies import running_proxy
from tests.support import run_cli, simulators

README = Path(__file__).resolve().parents[1] / "proxy" / "README.md"


def _section() -> str:
    text = README.read_text()
    return text[text.index("<!-- section: serve -->") : text.index("<!-- /section: serve -->")]


def _find(pattern: str, text: str) -> str:
    match = re.search(pattern, text, re.S)
    assert match, f"README serve section no longer has {pattern!r}"
    return match.group(1)


async def test_readme_shadow_walkthrough(tmp_path: Path) -> None:
    section = _section()
    toml_text = _find(r"cat > shadow.toml <<'EOF'\n(.*?)\nEOF", section)
    curl = _find(r"(curl -s localhost:8000/v1/chat/completions.*?)\n\n", section)
    body = orjson.loads(shlex.split(curl.replace("\\\n", " "))[-1])
    sql = _find(r'specproxy sql shadow.duckdb "(.*?)"', section)

    doc = tomllib.loads(toml_text)
    assert doc["experiment"]["mode"] == "shadow" and [a["name"] for a in doc["arms"]] == ["baseline", "ngram"]
    async with (
        running_backend(BackendConfig(tokens=64)) as b1,
        running_backend(BackendConfig(tokens=64, tokens_per_chunk=3)) as b2,
    ):
        arms = [{**doc["arms"][0], "url": b1.url}, {**doc["arms"][1], "url": b2.url}]
        async with running_proxy(tmp_path, arms, **doc["experiment"]) as p, aiohttp.ClientSession() as s:
            async with s.post(
                p.url + "/v1/chat/completions", json=body, headers={"X-Specproxy-Category": "code"}
            ) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
    with duckdb.connect(str(p.db), read_only=True) as con:
        rows = con.execute(sql).fetchall()
    assert [(r[0], r[1], r[2], r[5], r[7], r[8]) for r in rows] == [
        ("baseline", "primary", "ok", 64, "none", None),
        ("ngram", "shadow", "ok", 64, "stream_shape_unreliable", True),
    ]


def test_readme_shows_the_real_serve_help() -> None:
    block = _find(r"`specproxy serve --help`:\n\n```text\n(.*?)```", _section())
    result = CliRunner().invoke(main, ["serve", "--help"], prog_name="specproxy", terminal_width=80)
    assert result.exit_code == 0 and block == result.output


def test_readme_experiment_file_loads_and_its_mistake_reads_as_shown(tmp_path: Path) -> None:
    text = README.read_text()
    section = text[text.index("## The experiment file") : text.index("<!-- section: serve -->")]
    toml_text = _find(r"```toml\n(.*?)```", section)
    exp = load_experiment(_write(tmp_path / "exp.toml", toml_text))
    assert exp.baseline.name == "baseline" and [a.name for a in exp.candidates] == ["eagle3"]
    assert exp.arm("eagle3").spec_method == "eagle3" and exp.arm("eagle3").num_speculative_tokens == 3
    assert exp.slo is not None
    mistake = _find(r"A mistake names the file, the arm and the field:\n`(.*?)`", section)
    bad = toml_text.replace("num_speculative_tokens = 3", "num_speculative_tokens = 0")
    with pytest.raises(ConfigError) as err:
        load_experiment(_write(tmp_path / "exp.toml", bad))
    assert str(err.value) == mistake.replace("exp.toml", str(tmp_path / "exp.toml"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _replay_section() -> str:
    text = README.read_text()
    return text[text.index("<!-- section: replay -->") : text.index("<!-- /section: replay -->")]


def test_readme_replay_example_prints_what_it_shows(tmp_path: Path) -> None:
    """The replay section's command against two simulators (one with --method eagle3) prints the
    README's lines, the run id aside."""
    section = _replay_section()
    command = _find(r"```bash\n(specproxy replay .*?)\n```", section)
    shown = _find(r"```bash\n.*?\n```\n```\n(.*?)```", section)
    argv = shlex.split(command)
    assert argv[:3] == ["specproxy", "replay", "question.jsonl"] and "--config" in argv
    (tmp_path / "question.jsonl").write_text(
        "".join(
            orjson.dumps(
                {"question_id": i, "category": "writing", "turns": [f"Write about item {i}"]}
            ).decode()
            + "\n"
            for i in range(4)
        )
    )
    # The simulators' clock runs 4x: the same calls and tokens, sooner.
    with simulators(
        baseline=["--time-scale", "4"], eagle3=["--time-scale", "4", "--method", "eagle3"]
    ) as urls:
        (tmp_path / argv[argv.index("--config") + 1]).write_text(
            f'[[arms]]\nname = "baseline"\nrole = "baseline"\nurl = "{urls["baseline"]}"\n\n'
            f'[[arms]]\nname = "eagle3"\nurl = "{urls["eagle3"]}"\n'
            'speculative = { method = "eagle3", model = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", '
            "num_speculative_tokens = 3 }\n"
        )
        done = run_cli(*argv[1:], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # each line shown, in that order: progress lines come between them (on a terminal, a live display)
    # and, on a busy machine, health lines (a simulator behind its clock in a round)
    run_id = re.compile(r"replay-[0-9a-f]{12}")
    printed = iter(run_id.sub("replay-ID", done.stderr).splitlines())
    missing = [line for line in run_id.sub("replay-ID", shown).splitlines() if line not in printed]
    assert missing == [], done.stderr
