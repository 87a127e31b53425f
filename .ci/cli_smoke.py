"""Smoke test of an installed specproxy: every command's `--help`, a tiny lab on simulated arms, and
`sql` and `export` on the span store it wrote.

Run it with the interpreter of the environment that holds the installed package (a clean venv, the
container image), from a folder outside the source tree, so that the installed package is what
runs: it checks that the package comes from that environment. The command tree is walked, not
listed, so a new command or subcommand is covered without editing this file.
"""

from __future__ import annotations

import importlib
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import click

import specproxy
from specproxy.cli import COMMANDS
from specproxy.cli import main as specproxy_command

# The shortest lab that still starts every simulated arm, sweeps two levels and writes a verdict.
TINY_LAB = (
    "--quick", "--concurrency", "1,4", "--items", "2", "--max-tokens", "16", "--time-scale", "10",
    "--deciding-rounds", "1",
)  # fmt: skip


def command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command under `group` as its argv path, depth first."""
    paths: list[tuple[str, ...]] = []
    with click.Context(group) as ctx:
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            if command is None:
                sys.exit(f"specproxy {shlex.join((*prefix, name))}: listed but not found")
            paths.append((*prefix, name))
            if isinstance(command, click.Group):
                paths += command_paths(command, (*prefix, name))
    return paths


def run(argv: list[str], cwd: Path) -> str:
    print("$", shlex.join(argv), flush=True)
    res = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        sys.exit(f"exit code {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}")
    return res.stdout


def main() -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(specproxy.__file__).resolve()
    if not where.is_relative_to(site):
        sys.exit(f"specproxy is imported from {where}, not from this environment's {site}")
    # The command table falls back to a "not available" stub when a command's module is missing
    # from the package; importing each module directly makes that an error here.
    for module, _, _ in COMMANDS.values():
        importlib.import_module(module)
    exe = shutil.which("specproxy", path=str(Path(sys.executable).parent))
    if exe is None:
        sys.exit(f"no specproxy console script next to {sys.executable}")
    with tempfile.TemporaryDirectory(prefix="specproxy-smoke-") as tmp:
        cwd = Path(tmp)
        run([exe, "--version"], cwd)
        run([sys.executable, "-m", "specproxy", "--help"], cwd)
        paths = [(), *command_paths(specproxy_command)]
        for path in paths:
            out = run([exe, *path, "--help"], cwd)
            if not out.startswith("Usage:"):
                sys.exit(f"specproxy {' '.join(path)} --help printed no usage:\n{out}")
        lab = cwd / "lab"
        out = run([exe, "lab", *TINY_LAB, "--no-progress", "--out", str(lab)], cwd)
        if "deploy verdict" not in out or not (lab / "report.html").is_file():
            sys.exit(f"the tiny lab gave no verdict or no report:\n{out}")
        # The span store it wrote, read back by the commands that only read one.
        db = str(lab / "specproxy.duckdb")
        run([exe, "sql", db, "select count(*) from requests"], cwd)
        run([exe, "export", db, "--parquet", str(lab / "parquet")], cwd)
        if not (lab / "parquet" / "requests.parquet").is_file():
            sys.exit("specproxy export wrote no requests.parquet")
    print(f"smoke test passed: {len(paths)} commands' --help, a tiny lab, sql and export")


if __name__ == "__main__":
    main()
