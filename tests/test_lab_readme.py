"""The `specproxy lab` examples in lab/README.md and the root README parse as the command's own
options, and lab/README.md's option table names exactly the options the command has."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from specproxy.analysis.render.columns import BY_KEY, DEFAULT_COLUMNS, HEADERS
from specproxy.lab.command import lab

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "lab" / "README.md"


def _section(readme: Path, start: str, end: str | None) -> str:
    text = readme.read_text(encoding="utf-8")
    return text[text.index(start) : text.index(end) if end else len(text)]


def _lab_section() -> str:
    return _section(README, "## `specproxy lab`", None)


@pytest.mark.parametrize(
    ("section", "examples"),
    [(_lab_section(), 5), (_section(ROOT / "README.md", "## What the lab runs", "## Reading a verdict"), 2)],
    ids=["lab/README.md", "README.md"],
)
def test_readme_lab_examples_parse(section: str, examples: int) -> None:
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the lab section has no examples"
    commands = [shlex.split(line.split("#", 1)[0]) for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == examples and all(argv[:2] == ["specproxy", "lab"] for argv in commands)
    for argv in commands:
        # Parses and converts every value as `specproxy lab` would (a typo is a UsageError); runs nothing.
        with lab.make_context("lab", argv[2:]) as ctx:
            assert ctx.params["quick"] == ("--quick" in argv), argv


def test_readme_lab_option_table_names_every_option() -> None:
    first_cells = [line.split(" | ")[0] for line in _lab_section().splitlines() if line.startswith("| `--")]
    documented = set(re.findall(r"`(--[a-z0-9-]+)", "\n".join(first_cells)))
    options = {opt for param in lab.params for opt in param.opts if opt.startswith("--")}
    assert documented == options


def _excerpt_headers() -> list[tuple[str, list[str]]]:
    """(where, header cells) of each verdict table quoted in the READMEs (`...` marks left-out columns)."""
    out = []
    for readme in (ROOT / "README.md", ROOT / "analysis" / "README.md"):
        for line in readme.read_text(encoding="utf-8").splitlines():
            if line.startswith("level  arm "):
                out.append((str(readme.relative_to(ROOT)), re.split(r"\s{2,}", line.strip())))
    return out


@pytest.mark.parametrize(("where", "cells"), _excerpt_headers(), ids=lambda x: str(x)[:30])
def test_quoted_tables_have_the_columns_the_table_prints(where: str, cells: list[str]) -> None:
    """A quoted table names the printed columns in their order: the default table's (which leaves
    the others to --wide), and `...` wherever one of those was left out: a reader never takes a
    shortened table for the whole."""
    shown = {BY_KEY[k].header for k in DEFAULT_COLUMNS}  # the rounds and loads join only where they differ
    at = 0
    for i, cell in enumerate(cells):
        if cell == "...":
            continue
        assert cell in HEADERS[at:], f"{where}: {cell!r} is not a column after {HEADERS[at - 1]!r}"
        found = HEADERS.index(cell, at)
        skipped = [h for h in HEADERS[at:found] if h in shown]
        assert not skipped or (i > 0 and cells[i - 1] == "..."), (
            f"{where}: columns before {cell!r} left out unmarked"
        )
        at = found + 1
    left = [h for h in HEADERS[at:] if h in shown]
    assert not left or cells[-1] == "...", f"{where}: the last columns are left out unmarked"
