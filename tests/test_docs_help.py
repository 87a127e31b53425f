"""Every `--help` block in the repository's README files is the command's real, current output."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from specproxy.cli import main
from specproxy.engines.calibrate.measure import main as calibrate_main

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("*/README.md")), *sorted(ROOT.glob("tests/*/README.md"))]
# A help block is a ```text block whose first line is click's usage line.
HELP_BLOCK = re.compile(
    r"```text\n(Usage: (specproxy [a-z ]+?|python -m specproxy\.engines\.calibrate) \[.*?)```", re.S
)
PROGRAMS: dict[str, click.Command] = {"python -m specproxy.engines.calibrate": calibrate_main}


def _help_blocks() -> list[tuple[str, str, str]]:
    blocks = []
    for readme in READMES:
        for match in HELP_BLOCK.finditer(readme.read_text(encoding="utf-8")):
            blocks.append((str(readme.relative_to(ROOT)), match.group(2), match.group(1)))
    return blocks


def test_the_docs_have_help_blocks() -> None:
    commands = {command for _, command, _ in _help_blocks()}
    assert {"specproxy serve", "specproxy analyze", "python -m specproxy.engines.calibrate"} <= commands


@pytest.mark.parametrize(("readme", "command", "block"), _help_blocks(), ids=lambda value: value[:40])
def test_a_help_block_is_the_real_help(readme: str, command: str, block: str) -> None:
    if command in PROGRAMS:
        cli, args, prog = PROGRAMS[command], ["--help"], command
    else:
        cli, args, prog = main, [*shlex.split(command)[1:], "--help"], "specproxy"
    result = CliRunner().invoke(cli, args, prog_name=prog, terminal_width=80)
    assert result.exit_code == 0, result.output
    assert result.output == block, f"{readme}: the `{command} --help` block is out of date"
