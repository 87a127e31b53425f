"""`specproxy engines plan|up|status|down`: from one experiment file to running arms and back.

A thin click layer: plans come from :mod:`.plan`, checks from :mod:`.validate`, deploy files from
:mod:`.render`, processes from :mod:`.supervisor`, stacks from :mod:`.stack`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from specproxy.commandline import F
from specproxy.config import ConfigError, Experiment, load_experiment
from specproxy.engine_state import EngineError, state_dir, state_path
from specproxy.engines.launch.plan import ENGINES, ArmLaunch, Engine, PlanError, SimOptions, plan_experiment
from specproxy.engines.launch.render import FORMATS, render_compose, render_k8s, render_shell
from specproxy.engines.launch.stack import capture_stack, gpu_inventory, installed_packages
from specproxy.engines.launch.supervisor import (
    experiment_status,
    start_arms,
    stop_experiment,
)
from specproxy.engines.launch.validate import Finding, check_experiment, engine_python

_EXPERIMENT = click.argument("experiment", type=click.Path(dir_okay=False, path_type=Path))


def _load(path: Path) -> Experiment:
    try:
        return load_experiment(path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


_ENGINE = click.option(
    "--engine",
    type=click.Choice(ENGINES),
    default="vllm",
    show_default=True,
    help="vllm: real vLLM servers; sim: `specproxy sim` arms from the same plan (no GPU needed).",
)
_ARMS = click.option(
    "--arm",
    "arms",
    multiple=True,
    metavar="NAME",
    help="Only this arm (repeat for several); default: every arm.",
)
_VLLM_BIN = click.option(
    "--vllm-bin",
    default="vllm",
    show_default=True,
    metavar="PATH",
    help="The vllm executable to run (another virtualenv's, for example).",
)


def _seconds_option(flag: str, default: float, minimum: float, help: str) -> Callable[[F], F]:
    return click.option(
        flag, type=click.FloatRange(min=minimum), default=default, show_default=True, metavar="S", help=help
    )


def _report_findings(findings: list[Finding], *, fatal: bool) -> None:
    for f in findings:
        if f.level == "warning" or not fatal:
            click.echo(str(f), err=True)
    errors = [f for f in findings if f.level == "error"]
    if fatal and errors:
        listed = "\n  ".join(str(f) for f in errors)
        raise click.ClickException(f"the experiment cannot be launched as written:\n  {listed}")


@click.group()
def engines() -> None:
    """Plan, launch and stop the arms of an experiment: one `vllm serve` per arm, each with its
    speculative config, or simulated arms with --engine sim.

    \b
    specproxy engines plan exp.toml                   # the commands, checked
    specproxy engines plan exp.toml --format compose  # deploy files for this experiment
    specproxy engines up exp.toml [--engine sim]      # start, wait for /health, record stacks
    specproxy engines status exp.toml
    specproxy engines down exp.toml
    """


@engines.command()
@_EXPERIMENT
@_ENGINE
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="shell",
    show_default=True,
    help="shell: the commands; compose: a docker compose file; k8s: Kubernetes manifests.",
)
@_ARMS
@_VLLM_BIN
@click.option("--namespace", default=None, help="k8s: put every object in this namespace.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    help="Write to this file instead of standard output.",
)
def plan(
    experiment: Path,
    engine: Engine,
    fmt: str,
    arms: tuple[str, ...],
    vllm_bin: str,
    namespace: str | None,
    output: Path | None,
) -> None:
    """Print the launch command of every arm (or deploy files with --format), after checking them.

    Problems are printed to standard error and never stop the plan: the commands may be meant for
    another machine. `up` runs the same checks and stops on errors.
    """
    exp = _load(experiment)
    if fmt == "k8s" and engine == "sim":
        raise click.ClickException(
            "--format k8s renders vLLM arms only; simulated arms need no cluster "
            "(use --format compose --engine sim)"
        )
    findings = check_experiment(exp, engine=engine, local=False, vllm_bin=vllm_bin, arms=arms or None)
    _report_findings(findings, fatal=False)
    try:
        if arms:
            exp = _only(exp, arms)
        if fmt == "shell":
            text = render_shell(plan_experiment(exp, engine=engine, vllm_bin=vllm_bin))
        elif fmt == "compose":
            text = render_compose(exp, engine=engine)
        else:
            text = render_k8s(exp, namespace=namespace)
    except PlanError as exc:
        raise click.ClickException(str(exc)) from exc
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)
        click.echo(f"wrote {output}", err=True)


def _only(exp: Experiment, arms: tuple[str, ...]) -> Experiment:
    names = {a.name for a in exp.arms}
    unknown = [a for a in arms if a not in names]
    if unknown:
        raise click.ClickException(
            f"no arm named {unknown[0]!r} in {experiment_label(exp)} "
            f"(arms: {', '.join(a.name for a in exp.arms)})"
        )
    return dataclasses.replace(exp, arms=tuple(a for a in exp.arms if a.name in arms))


def experiment_label(exp: Experiment) -> str:
    return exp.source_path or exp.name


@engines.command()
@_EXPERIMENT
@_ENGINE
@_ARMS
@_VLLM_BIN
@_seconds_option(
    "--health-timeout",
    900.0,
    1,
    "Seconds each arm gets to answer /health (loading a large model takes minutes).",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where each arm's log goes  [default: .specproxy-engines/logs next to the experiment].",
)
@click.option(
    "--sim-profile", default=None, metavar="NAME", help="--engine sim: the simulator's cost profile."
)
@click.option(
    "--sim-time-scale",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="X",
    help="--engine sim: run the simulated engine clock X times faster than the profile's.",
)
@click.option("--sim-seed", type=int, default=None, metavar="N", help="--engine sim: random seed.")
@click.option(
    "--stack/--no-stack",
    "capture",
    default=True,
    show_default=True,
    help="Record each arm's stack (engine version, GPUs and driver, installed packages).",
)
def up(
    experiment: Path,
    engine: Engine,
    arms: tuple[str, ...],
    vllm_bin: str,
    health_timeout: float,
    log_dir: Path | None,
    sim_profile: str | None,
    sim_time_scale: float | None,
    sim_seed: int | None,
    capture: bool,
) -> None:
    """Start every arm as a background process, wait until each answers /health, record its stack.

    The arms keep running after this command returns; `status` and `down` find them through
    .specproxy-engines/<experiment name>.json next to the experiment file. If an arm exits or never
    becomes healthy, the arms started here are stopped again and its log tail is shown.
    """
    exp = _load(experiment)
    findings = check_experiment(exp, engine=engine, local=True, vllm_bin=vllm_bin, arms=arms or None)
    _report_findings(findings, fatal=True)
    sim = SimOptions(profile=sim_profile, time_scale=sim_time_scale, seed=sim_seed)
    try:
        launches = plan_experiment(exp, engine=engine, vllm_bin=vllm_bin, sim=sim, arms=arms or None)
    except PlanError as exc:
        raise click.ClickException(str(exc)) from exc
    logs = log_dir or state_dir(exp) / "logs"

    stack_of = None
    if capture:
        python = (engine_python(vllm_bin) if engine == "vllm" else None) or sys.executable
        gpus = gpu_inventory()
        packages = installed_packages(python)

        def stack_of(launch: ArmLaunch) -> dict[str, Any]:
            return capture_stack(launch, python=python, gpus=gpus, packages=packages)

    try:
        state = start_arms(
            exp,
            launches,
            log_dir=logs,
            health_timeout_s=health_timeout,
            engine=engine,
            report=lambda msg: click.echo(msg, err=True),
            stack_of=stack_of,
        )
    except EngineError as exc:  # EngineStartError carries the failing arm's log tail in its message
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        raise click.ClickException("interrupted: the arms started here were stopped") from None
    for a in state.arms:
        version = (a.stack or {}).get("server_version") or (a.stack or {}).get("vllm_version") or "?"
        click.echo(f"{a.arm}\t{a.url}\tpid {a.pid}\tversion {version}\tlog {a.log}")
    click.echo(
        f"state: {state_path(exp)}\nnext: specproxy serve --config {experiment}   "
        f"(stop the arms with: specproxy engines down {experiment})",
        err=True,
    )


@engines.command()
@_EXPERIMENT
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(experiment: Path, as_json: bool) -> None:
    """Show each arm that `up` started: process alive, /health answering, url, log.

    Exits with status 1 when an arm has stopped or does not answer /health.
    """
    exp = _load(experiment)
    try:
        found = experiment_status(exp)
    except EngineError as exc:
        raise click.ClickException(str(exc)) from exc
    if found is None:
        if as_json:
            click.echo(json.dumps({"experiment": exp.name, "running": False, "arms": []}))
        else:
            click.echo(f"no engines recorded for experiment {exp.name!r} (no {state_path(exp)})")
        return
    state, rows = found
    if as_json:
        click.echo(
            json.dumps(
                {
                    "experiment": state.experiment,
                    "engine": state.engine,
                    "state_file": str(state_path(exp)),
                    "arms": [row.__dict__ for row in rows],
                },
                indent=2,
            )
        )
    else:
        click.echo(f"experiment {state.experiment!r} ({state.engine}), started {state.created_at}")
        width = max(len(r.arm) for r in rows)
        for r in rows:
            state_word = "healthy" if r.healthy else "running, /health failing" if r.running else "stopped"
            click.echo(
                f"  {r.arm:<{width}}  {state_word:<24}  pid {r.pid:<7}  {r.url}  "
                f"version {r.server_version or '?'}  log {r.log}"
            )
    if not all(r.healthy for r in rows):
        sys.exit(1)


@engines.command()
@_EXPERIMENT
@_seconds_option("--grace", 30.0, 0, "Seconds between SIGTERM and SIGKILL.")
def down(experiment: Path, grace: float) -> None:
    """Stop the arms that `up` started (SIGTERM to each engine and its workers, SIGKILL after --grace)."""
    exp = _load(experiment)
    try:
        results = stop_experiment(exp, grace_s=grace)
    except EngineError as exc:
        raise click.ClickException(str(exc)) from exc
    if results is None:
        click.echo(f"nothing to stop: no engines recorded for experiment {exp.name!r}")
        return
    for r in results:
        verb = {
            "SIGTERM": "stopped",
            "SIGKILL": f"killed (still running {grace:g} s after SIGTERM)",
            "orphans": "had exited; its leftover worker processes were stopped",
            "not running": "was not running",
        }[r.how]
        click.echo(f"{r.arm} (pid {r.pid}) {verb}")
