"""The `specproxy lab` examples in specproxy/README.md and the root README parse as the command's own
options, and specproxy/README.md's option table names exactly the options the command has."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from specproxy.lab import lab

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "specproxy" / "README.md"


def _section(readme: Path, start: str, end: str) -> str:
    text = readme.read_text(encoding="utf-8")
    return text[text.index(start) : text.index(end)]


def _lab_section() -> str:
    return _section(README, "## `specproxy lab`", "## The layout")


@pytest.mark.parametrize(
    ("section", "examples"),
    [(_lab_section(), 5), (_section(ROOT / "README.md", "## What the lab runs", "## Reading a verdict"), 2)],
    ids=["specproxy/README.md", "README.md"],
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
