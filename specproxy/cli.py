"""The `specproxy` command: a thin click group; each subcommand lives with the code it drives.

Subcommands are imported only when invoked, so `specproxy --help` is fast and a command's heavy
imports (aiohttp, duckdb, numpy) never slow the others down.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from specproxy import __version__

# name -> (module, attribute, one-line help shown by `specproxy --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("specproxy.proxy.server.cli", "serve", "Run the proxy (shadow or split) and write spans."),
    "replay": ("specproxy.proxy.replay.cli", "replay", "Drive a traffic log against the arms."),
    "lab": (
        "specproxy.lab.command",
        "lab",
        "The whole evaluation in one command (simulated arms by default).",
    ),
    "analyze": ("specproxy.analysis.cli", "analyze", "The verdict table per arm and concurrency level."),
    "report": ("specproxy.analysis.cli", "report", "A self-contained HTML report with plots."),
    "sql": ("specproxy.analysis.cli", "sql", "Query the span store with SQL."),
    "export": ("specproxy.analysis.cli", "export", "Export spans (Parquet) for a warehouse."),
    "sim": ("specproxy.engines.sim.cli", "sim", "A vLLM-shaped simulated backend with speculative decoding."),
    "engines": (
        "specproxy.engines.launch.cli",
        "engines",
        "Plan, launch and stop the vLLM arms of an experiment.",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module_name, attr, _ = COMMANDS[cmd_name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                return _unavailable(cmd_name)
            raise
        command: click.Command = getattr(module, attr)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help from the table above, without importing every subcommand.
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _unavailable(name: str) -> click.Command:
    def run(**_: Any) -> None:
        raise click.ClickException(f"'specproxy {name}' is not available in this build yet")

    return click.Command(name, callback=run, help=COMMANDS[name][2])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specproxy")
def main() -> None:
    """specproxy: an OpenAI-compatible proxy that measures, on your traffic, whether speculative
    decoding pays.

    Start with `specproxy lab --quick` (simulated arms, no GPU needed), then put `specproxy serve`
    in front of your vLLM servers in shadow mode.
    """
