"""`specproxy lab`: the standard speculative-decoding evaluation in one command.

Without ``--config`` it starts four simulated vLLM arms (``specproxy sim`` subprocesses, one per arm,
so both cores work, launched and stopped by ``specproxy engines`` exactly as ``engines up --engine sim``
would) on free local ports — the lab's four configurations:

    baseline     no speculation
    ngram        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, ...}
    draft_model  {"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct", ...}
    eagle3       {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", ...}

then replays the built-in mixed workload (:mod:`specproxy.proxy.replay.workload`) in paired mode at
temperature 0 over a closed-loop concurrency sweep, prints the analysis table and a per-category
latency table, and writes the DuckDB span store and report.html into ``--out``. With ``--config``
it replays against the experiment's (running) arms instead.

The sweep goes to 256, not only 64: on the h100-llama3.1-8b profile (the SpecDecode-Bench fit of vLLM on
an H100) verifying k+1 tokens per request is still cheap enough at batch 64 for n-gram to pay on
copy-heavy traffic; its crossover lies near 100–130, and a sweep that stops at 64 never shows it.

Time. The simulators run on the profile's own clock by default (``--time-scale 1``): four simulators
and the client at c=64 use well under one CPU core, so the client never falls behind
and the figures are the profile's. ``--time-scale X`` runs every simulator X times faster; every arm is
scaled alike, so ratios between arms (what the verdicts use) are kept as long as the client keeps up,
while absolute tok/s are multiplied by X and times divided by it (the lab says so under its tables).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from specproxy.commandline import ConcurrencyLevels, experiment_or_none, run_async
from specproxy.config import Arm, EngineSettings, Experiment
from specproxy.engine_state import EngineError
from specproxy.engines.launch.plan import SimOptions, plan_arm
from specproxy.engines.launch.supervisor import start_arms, stop_experiment
from specproxy.proxy.replay.formats import FORMATS, FormatError, ItemSet, ReplayItem, read_items
from specproxy.proxy.replay.runner import LoadPlan, ReplayError, ReplaySettings, replay_until_stopped
from specproxy.proxy.replay.summary import print_summary
from specproxy.proxy.replay.workload import mixed_workload
from specproxy.proxy.spans.sink import SpanSinkError

LAB_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_PROFILE = "h100-llama3.1-8b"
# Above this share of busy time behind its clock, a simulator's figures are flagged as distorted.
MAX_CLOCK_LAG = 0.05

# The lab's four configurations: (arm name, vLLM --speculative-config or None).
LAB_ARMS: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("baseline", None),
    (
        "ngram",
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    ),
    (
        "draft_model",
        {"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct", "num_speculative_tokens": 4},
    ),
    (
        "eagle3",
        {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3},
    ),
)


@dataclass(frozen=True, slots=True)
class LabPlan:
    """How big a lab run is; ``quick`` is tuned to finish in under 2 minutes on 2 cores."""

    levels: tuple[int, ...]
    min_items_per_level: int
    waves_per_level: int  # items per level ≥ waves × concurrency, so each level reaches steady state
    time_scale: float
    max_tokens_scale: float

    def items_per_level(self, level: int) -> int:
        return max(self.min_items_per_level, self.waves_per_level * level)


QUICK = LabPlan(
    levels=(1, 4, 16, 64, 256),
    min_items_per_level=20,
    waves_per_level=2,
    time_scale=1.0,
    max_tokens_scale=0.5,
)
FULL = LabPlan(
    levels=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    min_items_per_level=40,
    waves_per_level=3,
    time_scale=1.0,
    max_tokens_scale=1.0,
)


# -- simulated arms ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lab_experiment(out: Path, profile: str, time_scale: float) -> Experiment:
    """The lab's four arms as an experiment on free local ports (its state lives under ``out``)."""
    arms = []
    for name, spec in LAB_ARMS:
        port = _free_port()
        arms.append(
            Arm(
                name=name,
                url=f"http://127.0.0.1:{port}",
                role="baseline" if spec is None else "candidate",
                speculative=spec or {},
                engine=EngineSettings(port=port),
                description=f"specproxy sim, profile {profile}, time scale {time_scale:g}",
            )
        )
    return Experiment(
        name="lab", arms=tuple(arms), model=LAB_MODEL, source_path=str(out.resolve() / "lab.toml")
    )


@contextlib.contextmanager
def simulated_arms(out: Path, profile: str, time_scale: float, seed: int) -> Iterator[Experiment]:
    """Start one `specproxy sim` per lab arm through `specproxy engines` (the same launch plan as
    `engines up --engine sim`); stop them all on the way out, whatever happened."""
    exp = lab_experiment(out, profile, time_scale)
    # Simulators left behind by a lab in this folder that was killed outright.
    stop_experiment(exp, grace_s=5.0)
    options = SimOptions(profile=profile, time_scale=time_scale, seed=seed)
    launches = [plan_arm(exp, arm, engine="sim", sim=options) for arm in exp.arms]
    try:
        # The exact simulator command goes into the run's stacks (profile, time scale, seed).
        start_arms(
            exp,
            launches,
            log_dir=out,
            health_timeout_s=60.0,
            engine="sim",
            stack_of=lambda launch: {"engine": "sim", "argv": list(launch.argv)},
        )
    except EngineError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        yield exp
    finally:
        stop_experiment(exp, grace_s=10.0)


class SimClocks:
    """Each simulator's clock at every phase boundary (``/sim/stats``), for the lag of each level: how
    far a simulator's real clock fell behind the profile's while busy. Above a few percent the machine
    could not keep up and that level's times are stretched."""

    def __init__(self, arms: Sequence[Arm]) -> None:
        self.arms = arms
        # phase → arm → (lag_s, ideal_busy_wall_s), both cumulative since the simulator started
        self.marks: dict[str, dict[str, tuple[float, float]]] = {}

    async def mark(self, phase: str) -> None:
        self.marks[phase] = await asyncio.to_thread(self._read)

    def _read(self) -> dict[str, tuple[float, float]]:
        clocks: dict[str, tuple[float, float]] = {}
        for arm in self.arms:
            try:
                with urllib.request.urlopen(f"{arm.url}/sim/stats", timeout=5.0) as resp:
                    stats = json.loads(resp.read())
                clocks[arm.name] = (float(stats["lag_s"]), float(stats["ideal_busy_wall_s"]))
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                continue
        return clocks

    def lag_by_level(self) -> dict[str, dict[str, float]]:
        """level label → arm → share of the level's busy time the simulator ran behind its clock."""
        out: dict[str, dict[str, float]] = {}
        for phase, after in self.marks.items():
            if not phase.endswith(":after"):
                continue
            label = phase.removesuffix(":after")
            before = self.marks.get(f"{label}:before", {})
            out[label] = {
                arm: (lag - before[arm][0]) / (busy - before[arm][1])
                for arm, (lag, busy) in after.items()
                if arm in before and busy > before[arm][1]
            }
        return out


def print_clock_lag(lag: dict[str, dict[str, float]], console: Console) -> None:
    if not lag:
        return
    cells = []
    for label, arms in lag.items():
        if arms:
            worst = max(arms, key=lambda a: arms[a])
            cells.append(f"{label} {arms[worst]:.1%} ({worst})")
    console.print(
        "simulator clock lag by level (worst arm; share of busy time behind the profile's clock): "
        + ", ".join(cells),
        highlight=False,
    )
    late = [label for label, arms in lag.items() if arms and max(arms.values()) > MAX_CLOCK_LAG]
    if late:
        console.print(
            f"[yellow]warning: at {', '.join(late)} a simulator fell more than {MAX_CLOCK_LAG:.0%} "
            "behind its clock (this machine could not keep up): those rows' times are stretched "
            "and their ratios less certain; rerun on a quieter machine or with --time-scale "
            "0.5[/yellow]"
        )


# -- results -------------------------------------------------------------------------------------


def analysis_outputs(db_path: Path, out: Path, run: str, console: Console) -> Path | None:
    """The analyze table on stdout and report.html in ``out``; None when analysis is not available."""
    try:
        from specproxy.analysis import StoreError, analyze_text, write_report
    except ImportError:
        console.print("(specproxy.analysis is not available in this build: no verdict table or report)")
        return None
    try:
        click.echo(analyze_text([db_path], run=run, fmt="table"))
        return write_report([db_path], out / "report.html", run=run)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


# -- the command ---------------------------------------------------------------------------------


def _lab_items(workload: Path | None, plan: LabPlan, seed: int) -> list[ReplayItem]:
    if workload is None:
        n = max(plan.items_per_level(c) for c in plan.levels)
        return mixed_workload(n, seed=seed, max_tokens_scale=plan.max_tokens_scale)
    try:
        return read_items(workload, "auto", seed=seed).items
    except FormatError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("lab")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Experiment file with running arms (default: start four simulated arms).",
)
@click.option(
    "--workload",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"A traffic log to use instead of the built-in mixed workload ({', '.join(FORMATS)}).",
)
@click.option(
    "--concurrency",
    "levels",
    type=ConcurrencyLevels(),
    help="Concurrency levels of the sweep (default 1,2,4,8,16,32,64,128,256; with --quick 1,4,16,64,256).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("lab-out"),
    show_default=True,
    help="Folder for the span store, report.html and the simulators' logs.",
)
@click.option("--quick", is_flag=True, help="A smaller run: under 2 minutes on a 2-core machine.")
@click.option(
    "--profile",
    default=DEFAULT_PROFILE,
    show_default=True,
    help="Simulator cost profile (hardware × model), e.g. h200-llama3.1-8b.",
)
@click.option(
    "--time-scale",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Simulated arms run this many times faster than the profile's clock (default 1); "
    "ratios between arms are kept, absolute tok/s are multiplied by it.",
)
@click.option(
    "--items",
    type=click.IntRange(min=1),
    default=None,
    help="At least this many requests per arm and level (default 40; 20 with --quick).",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Cap every answer at N tokens (default: the workload's own lengths).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the workload and simulators.")
@click.option("--no-progress", is_flag=True, help="No live progress display.")
def lab(
    config_path: Path | None,
    workload: Path | None,
    levels: tuple[int, ...] | None,
    out: Path,
    quick: bool,
    profile: str,
    time_scale: float | None,
    items: int | None,
    max_tokens: int | None,
    seed: int,
    no_progress: bool,
) -> None:
    """The whole evaluation in one command: four speculative configs, a concurrency sweep, a verdict.

    \b
    Examples:
      specproxy lab --quick                      # simulated arms, about 2 minutes
      specproxy lab --profile h200-llama3.1-8b   # the full sweep on another cost profile
      specproxy lab --config exp.toml --workload capture.jsonl --concurrency 1,8,32
    """
    console = Console(stderr=True, soft_wrap=True)
    plan = QUICK if quick else FULL
    plan = LabPlan(
        levels=levels or plan.levels,
        min_items_per_level=items or plan.min_items_per_level,
        waves_per_level=plan.waves_per_level,
        time_scale=time_scale or plan.time_scale,
        max_tokens_scale=plan.max_tokens_scale,
    )
    experiment = experiment_or_none(config_path)
    out.mkdir(parents=True, exist_ok=True)
    db_path = out / "specproxy.duckdb"
    lab_items = _lab_items(workload, plan, seed)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        simulated = experiment is None
        if experiment is None:
            console.print(
                f"starting 4 simulated arms ({profile}, time scale {plan.time_scale:g}) ...", highlight=False
            )
            experiment = stack.enter_context(simulated_arms(out, profile, plan.time_scale, seed))
        arms = experiment.arms
        clocks = SimClocks(arms) if simulated else None
        settings = ReplaySettings(
            arms=arms,
            db_path=db_path,
            run_name="lab-quick" if quick else "lab",
            mode="paired",
            load=LoadPlan(kind="closed", levels=plan.levels, items_per_level=plan.items_per_level),
            temperature=0.0,
            max_tokens=max_tokens,
            seed=seed,
            experiment=experiment,
            on_phase=clocks.mark if clocks is not None else None,
            show_progress=not no_progress,
        )
        n_calls = sum(plan.items_per_level(c) for c in plan.levels)
        console.print(
            f"sweep {','.join(map(str, plan.levels))} in paired mode, {n_calls} requests per arm",
            highlight=False,
        )
        try:
            result = run_async(replay_until_stopped(settings, ItemSet("lab", lab_items)))
        except ReplayError as exc:
            hint = "" if simulated else f" (`specproxy engines up {config_path}` starts the arms)"
            raise click.ClickException(f"{exc}{hint}") from None
        except SpanSinkError as exc:
            raise click.ClickException(str(exc)) from None
    print_summary(result, None, console)
    console.print(f"measured in {time.monotonic() - t0:.0f} s", highlight=False)
    if result.interrupted:
        console.print("interrupted: what was measured so far is analysed below", highlight=False)
    if simulated and plan.time_scale != 1:
        console.print(
            f"note: the simulated arms ran {plan.time_scale:g}x faster than the {profile} clock: "
            f"divide tok/s by {plan.time_scale:g} and multiply times by it; ratios are unaffected",
            highlight=False,
        )
    if clocks is not None:
        print_clock_lag(clocks.lag_by_level(), console)
    report = analysis_outputs(db_path, out, result.run_id, console)
    console.print(f"span store: {db_path}" + (f"   report: {report}" if report else ""), highlight=False)
    if result.interrupted:
        sys.exit(130)
