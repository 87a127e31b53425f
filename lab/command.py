"""`specproxy lab`: the standard speculative-decoding evaluation in one command.

Without ``--config`` it starts five simulated vLLM arms (``specproxy sim`` subprocesses, one per arm,
so both cores work, launched and stopped by ``specproxy engines`` exactly as ``engines up --engine sim``
would) on free local ports — the lab's four configurations and a replica of the baseline:

    baseline     no speculation
    replica      no speculation either (role "replica"): its spread against the baseline is the
                 noise floor a real difference must clear (``--no-replica`` leaves it out)
    ngram        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, ...}
    draft_model  {"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct", ...}
    eagle3       {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", ...}

then replays the built-in mixed workload (:mod:`specproxy.proxy.replay.workload`) in paired mode at
temperature 0 over a closed-loop concurrency sweep (or, with ``--rates``, an open-loop sweep of Poisson
request rates), each level in ``--rounds`` rounds (the arms' order rotated each round), prints the
analysis table and a per-category latency table, and writes the DuckDB span store and report.html into
``--out``. With ``--config`` it replays against the experiment's (running) arms instead.

The sweep goes to 256, not only 64: on the h100-llama3.1-8b profile (the SpecDecode-Bench fit of vLLM on
an H100) verifying k+1 tokens per request is still cheap enough at batch 64 for n-gram to pay on
copy-heavy traffic; its crossover lies near 100–130, and a sweep that stops at 64 never shows it.

Rates. ``--rates auto`` picks the open-loop levels from the simulators' speed: shares (``rate_shares``)
of the baseline's capacity at the top concurrency, estimated from the cost profile (batch over step
time over the workload's mean answer length) at the chosen time scale, so the sweep runs from a nearly
idle engine (where speculation's faster steps show) to one near saturation (where its extra
verification work costs capacity and queues build). A rate level sends ``rate_window_s`` seconds of
arrivals per round, at least its share of ``--items`` and at most what the top concurrency level sends
in a round, so it keeps the closed-loop sweep's time budget.

Time. ``--time-scale X`` runs every simulator X times faster than the profile's clock; every arm is
scaled alike, so ratios between arms (what the verdicts use) are kept as long as the machine keeps up,
while absolute tok/s are multiplied by X and times divided by it (the lab says so under its tables).
A simulator that cannot keep its clock (too many streams for the cores it gets) stretches every time
it reports, and the level's health says so. Without ``--time-scale`` the lab paces each level
(:mod:`specproxy.lab.pacing`): one unrecorded wave at the level first, and while the machine does not keep
up with it the simulators are slowed to half speed (down to 1/4, or 1/8 when only the client's event
loop lags) and the wave is sent again. It prints what each level ran at and why, records the scale
with each level's health, and the run's experiment description says how the scale was chosen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from specproxy.commandline import (
    ConcurrencyLevels,
    RequestRates,
    client_processes_option,
    config_option,
    deciding_rounds_option,
    experiment_or_none,
    extra_rounds_option,
    no_progress_option,
    operating_point_options,
    rounds_option,
    run_async,
)
from specproxy.config import Experiment
from specproxy.lab.arms import DEFAULT_PROFILE, LAB_ARMS, simulated_arms
from specproxy.lab.health_lines import (
    clock_lag_by_level,
    print_clock_lag,
    print_given_scale,
    print_health,
    print_pace,
)
from specproxy.lab.pacing import CLOCK_LIMIT, LOOP_BUSY_LIMIT, LOOP_LIMIT, SimPacer
from specproxy.lab.peak import PeakMove, judged_peak, peak_judge, record_move
from specproxy.lab.plan import (
    DECIDING_ROUNDS,
    EXTRA_ROUNDS,
    FULL,
    QUICK,
    QUICK_TIME_BUDGET_S,
    LabPlan,
    default_rates,
    estimated_capacity,
    extra_sentence,
    load_plan,
    sweep_sentence,
)
from specproxy.proxy.replay.console import Console
from specproxy.proxy.replay.deciding import open_questions
from specproxy.proxy.replay.formats import FORMATS, FormatError, ItemSet, ReplayItem, read_items
from specproxy.proxy.replay.runner import (
    LoadPlan,
    ReplayError,
    ReplayResult,
    ReplaySettings,
    replay_until_stopped,
)
from specproxy.proxy.replay.summary import print_rounds, print_summary
from specproxy.proxy.replay.workload import mixed_workload
from specproxy.proxy.spans.sink import SpanSinkError
from specproxy.slo import Slo

# Pacing never slows the simulators below this share of their starting speed (the lab's time budget).
SLOWEST_PACED_SCALE = 1 / 4
# ... and, when only the client's event loop lags (the simulators keep up), one halving further: at
# c=256 the lab's one client process reads 5 × 256 streams.
SLOWEST_CLIENT_PACED_SCALE = 1 / 8
PORT_BASE_HELP = "The simulated arms listen on ports N, N+1, ... (default 0: free ports the system picks)."


def pace_note(pacer: SimPacer | None, time_scale: float, *, given: bool = True) -> str:
    """How the simulators' time scale was chosen, for the run's experiment description."""
    if pacer is None:
        if given:
            return f"time scale {time_scale:g} (given)"
        return f"time scale {time_scale:g} (a sweep of rates is not paced: a rate's load is relative to it)"
    return (
        f"time scale paced per level from {time_scale:g} down to {time_scale * SLOWEST_PACED_SCALE:g}: "
        f"halved while a wave at the level saw a simulator over {CLOCK_LIMIT:.0%} behind its clock, "
        f"the client's loop lag over {LOOP_LIMIT:.2%} of decode or its loop over {LOOP_BUSY_LIMIT:.1%} busy "
        f"(down to {time_scale * SLOWEST_CLIENT_PACED_SCALE:g} for the loop lag alone; health check "
        "sim_time_scale)"
    )


# -- results -------------------------------------------------------------------------------------


def analysis_outputs(
    db_path: Path, out: Path, run: str, console: Console, peak: PeakMove | None
) -> Path | None:
    """The analyze table on stdout and report.html in ``out`` (the peak judged at ``peak``'s level, said
    so, when the top level could not be measured soundly: recorded with the run, so a later ``analyze``
    reads the same); None when analysis is not available."""
    if peak is not None:
        record_move(db_path, run, peak)
    try:
        from specproxy.analysis import StoreError, analyze_text, write_report
    except ImportError:
        console.print("(specproxy.analysis is not available in this build: no verdict table or report)")
        return None
    if peak is not None:
        click.echo(
            f"lab: {peak.label} ({peak.why}); recorded with the run: `analyze` judges the peak there too "
            "(--peak-concurrency N at another level)"
        )
    try:
        click.echo(analyze_text([db_path], run=run, fmt="table"))
        return write_report([db_path], out / "report.html", run=run)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


@dataclass(frozen=True, slots=True)
class GivenPoint:
    """The operating point, SLO and GPU price given on the command line (None: the experiment's)."""

    at_concurrency: int | None
    peak_concurrency: int | None
    at_rate: float | None
    peak_rate: float | None
    slo: Slo | None
    gpu_hour_usd: float | None

    def recorded(self, exp: Experiment, note: str) -> Experiment:
        """The experiment as the run records it: what the command line gives wins (the analysis reads
        it back from the run), and ``note`` joins the description."""
        description = "; ".join(x for x in (exp.description, note) if x)
        return dataclasses.replace(
            exp,
            at_concurrency=self.at_concurrency if self.at_concurrency is not None else exp.at_concurrency,
            peak_concurrency=self.peak_concurrency
            if self.peak_concurrency is not None
            else exp.peak_concurrency,
            at_rate=self.at_rate if self.at_rate is not None else exp.at_rate,
            peak_rate=self.peak_rate if self.peak_rate is not None else exp.peak_rate,
            description=description,
            slo=self.slo or exp.slo,
            gpu_hour_usd=self.gpu_hour_usd if self.gpu_hour_usd is not None else exp.gpu_hour_usd,
        )


def _check_options(
    given: GivenPoint,
    rates: tuple[float, ...] | None,
    levels: tuple[int, ...] | None,
    experiment: Experiment | None,
) -> None:
    """The user's mistakes with the operating point and --rates, as sentences."""
    at, peak = given.at_concurrency, given.peak_concurrency
    if at is not None and peak is not None and peak < at:
        raise click.BadParameter(
            f"must be ≥ --at-concurrency ({peak} < {at})", param_hint="--peak-concurrency"
        )
    at_rate, peak_rate = given.at_rate, given.peak_rate
    if rates is not None and levels is not None:
        raise click.UsageError("--concurrency and --rates are two different sweeps; choose one")
    if rates is None and (at_rate is not None or peak_rate is not None):
        raise click.UsageError("--at-rate and --peak-rate answer a sweep of rates: give --rates too")
    if rates == () and experiment is not None:
        raise click.BadParameter(
            "auto picks rates from the simulated arms' speed; with --config give the rates, e.g. 1,2,4,8",
            param_hint="--rates",
        )
    if at_rate is not None and peak_rate is not None and peak_rate < at_rate:
        raise click.BadParameter(
            f"must be ≥ --at-rate ({peak_rate:g} < {at_rate:g})", param_hint="--peak-rate"
        )


def _lab_plan(
    quick: bool,
    levels: tuple[int, ...] | None,
    items: int | None,
    time_scale: float | None,
    rounds: int | None,
    extra_rounds: int | None,
    deciding_rounds: int | None,
) -> LabPlan:
    """The quick or full plan, with what the command line gives instead."""
    base = QUICK if quick else FULL
    return LabPlan(
        levels=levels or base.levels,
        min_items_per_level=items or base.min_items_per_level,
        waves_per_level=base.waves_per_level,
        time_scale=time_scale or base.time_scale,
        max_tokens_scale=base.max_tokens_scale,
        rounds=rounds or base.rounds,
        # --rounds N measures every level in N rounds
        top_rounds=None if rounds else base.top_rounds,
        top_waves=base.top_waves,
        extra_rounds=base.extra_rounds if extra_rounds is None else extra_rounds,
        deciding_rounds=base.deciding_rounds if deciding_rounds is None else deciding_rounds,
        time_budget_s=base.time_budget_s,
        rounds_budget_s=base.rounds_budget_s,
    )


def _lab_items(workload: Path | None, plan: LabPlan, seed: int) -> list[ReplayItem]:
    if workload is None:
        n = max(plan.items_per_round(c) for c in plan.levels)
        return mixed_workload(n, seed=seed, max_tokens_scale=plan.max_tokens_scale)
    try:
        return read_items(workload, "auto", seed=seed).items
    except FormatError as exc:
        raise click.ClickException(str(exc)) from None


def _start_simulated(
    stack: contextlib.ExitStack,
    out: Path,
    plan: LabPlan,
    console: Console,
    profile: str,
    seed: int,
    replica: bool,
    port_base: int,
    paced: bool,
    given: GivenPoint,
) -> tuple[Experiment, SimPacer | None]:
    """The simulated arms, started on ``stack``, and their pacer (None: the time scale stays)."""
    n = len(LAB_ARMS) - (0 if replica else 1)
    starting = f"starting {n} simulated arms ({profile}, time scale {plan.time_scale:g}) ..."
    console.print(starting)
    experiment = stack.enter_context(simulated_arms(out, profile, plan.time_scale, seed, replica, port_base))
    if not paced:
        return experiment, None
    return experiment, SimPacer(
        experiment.arms,
        plan.time_scale,
        plan.time_scale * SLOWEST_PACED_SCALE,
        console,
        slowest_for_client=plan.time_scale * SLOWEST_CLIENT_PACED_SCALE,
        skip_unmeasurable=given.peak_concurrency is None,  # a peak or operating point you gave
        never_skip=(given.at_concurrency,) if given.at_concurrency else (),  # is always measured
    )


def _auto_rates(
    profile: str, plan: LabPlan, items: Sequence[ReplayItem], max_tokens: int | None
) -> tuple[float, ...]:
    """``--rates auto``: shares of the baseline's estimated capacity at the top concurrency level."""
    top = max(plan.levels)
    capacity = estimated_capacity(profile, plan.time_scale, items, top, max_tokens)
    rates = default_rates(capacity, plan.rate_shares)
    click.echo(
        f"lab: rates {', '.join(f'{r:g}' for r in rates)} req/s: shares of the baseline's estimated "
        f"capacity at c={top}, {capacity:.3g} req/s at time scale {plan.time_scale:g}"
    )
    return rates


def _lab_settings(
    experiment: Experiment,
    load: LoadPlan,
    pacer: SimPacer | None,
    db_path: Path,
    quick: bool,
    max_tokens: int | None,
    seed: int,
    show_progress: bool,
) -> ReplaySettings:
    """The replay the lab runs: its arms in paired mode at temperature 0, the load of its ``plan``."""
    return ReplaySettings(
        arms=experiment.arms,
        db_path=db_path,
        run_name="lab-quick" if quick else "lab",
        mode="paired",
        load=load,
        temperature=0.0,
        max_tokens=max_tokens,
        seed=seed,
        experiment=experiment,
        show_progress=show_progress,
        pacer=pacer,
        decider=open_questions,
        judged_peak=peak_judge(load.levels, pacer) if not experiment.peak_concurrency else None,
    )


def _replay(settings: ReplaySettings, items: list[ReplayItem], config_path: Path | None) -> ReplayResult:
    """The sweep; its failures as the user's error sentences (``config_path``: the arms' experiment,
    None for simulated arms)."""
    try:
        return run_async(replay_until_stopped(settings, ItemSet("lab", items)))
    except ReplayError as exc:
        hint = "" if config_path is None else f" (`specproxy engines up {config_path}` starts the arms)"
        raise click.ClickException(f"{exc}{hint}") from None
    except SpanSinkError as exc:
        raise click.ClickException(str(exc)) from None


def _print_measured(
    result: ReplayResult,
    plan: LabPlan,
    pacer: SimPacer | None,
    console: Console,
    started: float,
    profile: str,
    simulated: bool,
    rate_sweep: bool,
) -> None:
    """What the sweep measured, and how the machine kept up, on stderr."""
    print_summary(result, None, console, compact=True)
    print_health(result.health, result.levels, console)
    console.print(f"measured in {time.monotonic() - started:.0f} s")
    if result.interrupted:
        console.print("interrupted: what was measured so far is analysed below")
    if pacer is not None:
        print_pace(pacer, profile, console)
    elif simulated and plan.time_scale != 1:
        print_given_scale(plan.time_scale, profile, rate_sweep, console)
    print_rounds(result.levels, console, say_none=plan.extra_rounds > 0 or plan.deciding_rounds > 0)
    print_clock_lag(clock_lag_by_level(result.health), console)


@click.command("lab")
@config_option("Experiment file with running arms (default: start five simulated arms).")
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
    "--rates",
    type=RequestRates(auto=True),
    metavar="LIST|auto",
    help="Open loop instead: a sweep of Poisson request rates (req/s), e.g. 1,2,4,8; auto: shares of "
    "the baseline's capacity estimated from the simulators' speed.",
)
@rounds_option(
    None,
    tail="; default 3, with --quick 5 at the highest concurrency level, where the peak throughput is read",
)
@extra_rounds_option(None, note=f" (default {EXTRA_ROUNDS})")
@deciding_rounds_option(
    None,
    note=f" (default {DECIDING_ROUNDS}; with --quick none starts that would end after the lab has run "
    f"{QUICK_TIME_BUDGET_S:.0f} s; 0: never)",
)
@operating_point_options
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("lab-out"),
    show_default=True,
    help="Folder for the span store, report.html and the simulators' logs.",
)
@click.option("--quick", is_flag=True, help="A smaller run: fewer levels and requests.")
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
    help="Simulated arms run this many times faster than the profile's clock (default: paced per level, "
    "from 1 down to 1/4, 1/8 when only the client lags, halved while a wave at the level shows the "
    "machine not keeping up); ratios between arms are kept, absolute tok/s are multiplied by it.",
)
@click.option("--no-replica", is_flag=True, help="Do not start the baseline's replica (the noise floor).")
@click.option("--port-base", type=click.IntRange(0, 65530), default=0, metavar="N", help=PORT_BASE_HELP)
@click.option(
    "--items",
    type=click.IntRange(min=1),
    default=None,
    help="At least this many requests per arm and level, over all rounds (default 40; 20 with --quick).",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Cap every answer at N tokens (default: the workload's own lengths).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the workload and simulators.")
@client_processes_option
@no_progress_option
def lab(
    config_path: Path | None,
    workload: Path | None,
    levels: tuple[int, ...] | None,
    rates: tuple[float, ...] | None,
    rounds: int | None,
    extra_rounds: int | None,
    deciding_rounds: int | None,
    at_concurrency: int | None,
    peak_concurrency: int | None,
    at_rate: float | None,
    peak_rate: float | None,
    slo: Slo | None,
    gpu_hour_usd: float | None,
    out: Path,
    quick: bool,
    profile: str,
    time_scale: float | None,
    no_replica: bool,
    port_base: int,
    items: int | None,
    max_tokens: int | None,
    seed: int,
    client_processes: int,
    no_progress: bool,
) -> None:
    """The whole evaluation: three speculative configs and a baseline replica, a sweep in rounds, verdicts.

    \b
    Examples:
      specproxy lab --quick                      # simulated arms
      specproxy lab --quick --slo ttft_p95=500ms,e2e_p95=20s   # capacity at your SLO
      specproxy lab --profile h200-llama3.1-8b   # the full sweep on another cost profile
      specproxy lab --config exp.toml --workload capture.jsonl --concurrency 1,8,32
      specproxy lab --quick --rates auto         # open-loop request rates instead
    """
    console = Console()
    plan = _lab_plan(quick, levels, items, time_scale, rounds, extra_rounds, deciding_rounds)
    experiment = experiment_or_none(config_path)
    given = GivenPoint(at_concurrency, peak_concurrency, at_rate, peak_rate, slo, gpu_hour_usd)
    _check_options(given, rates, levels, experiment)
    out.mkdir(parents=True, exist_ok=True)
    db_path = out / "specproxy.duckdb"
    lab_items = _lab_items(workload, plan, seed)
    t0 = time.monotonic()
    scale_note = ""
    pacer: SimPacer | None = None
    with contextlib.ExitStack() as stack:
        simulated = experiment is None
        if experiment is None:
            # A rate level's load is relative to the engines' speed, so a rate sweep keeps one time scale.
            paced = time_scale is None and rates is None
            experiment, pacer = _start_simulated(
                stack, out, plan, console, profile, seed, not no_replica, port_base, paced, given
            )
            scale_note = pace_note(pacer, plan.time_scale, given=time_scale is not None)
            click.echo(f"lab: {scale_note}")
        if rates == ():
            rates = _auto_rates(profile, plan, lab_items, max_tokens)
        experiment = given.recorded(experiment, f"lab: {scale_note}" if scale_note else "")
        load = load_plan(plan, rates, t0, pacer)
        settings = _lab_settings(experiment, load, pacer, db_path, quick, max_tokens, seed, not no_progress)
        settings = dataclasses.replace(settings, client_processes=client_processes)
        console.print(sweep_sentence(plan, rates) + extra_sentence(plan))
        result = _replay(settings, lab_items, None if simulated else config_path)
    _print_measured(result, plan, pacer, console, t0, profile, simulated, rates is not None)
    moved = (
        judged_peak(plan.levels, result.levels, pacer)
        if rates is None and not experiment.peak_concurrency
        else None
    )
    report = analysis_outputs(db_path, out, result.run_id, console, moved)
    console.print(f"span store: {db_path}" + (f"   report: {report}" if report else ""))
    if result.interrupted:
        sys.exit(130)
