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
import json
import math
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from specproxy.commandline import (
    SLO_HELP,
    ConcurrencyLevels,
    FiniteFloat,
    RequestRates,
    SloParam,
    experiment_or_none,
    run_async,
)
from specproxy.config import Arm, EngineSettings, Experiment, Role
from specproxy.engine_state import EngineError
from specproxy.engines.launch.plan import SimOptions, plan_arm
from specproxy.engines.launch.supervisor import start_arms, stop_experiment
from specproxy.engines.profiles import ProfileError, load_profile
from specproxy.lab.health_lines import (
    clock_lag_by_level,
    print_clock_lag,
    print_given_scale,
    print_health,
    print_pace,
)
from specproxy.lab.pacing import CLOCK_LIMIT, LOOP_BUSY_LIMIT, LOOP_LIMIT, SimPacer
from specproxy.lab.peak import PeakMove, judged_peak
from specproxy.proxy.replay.deciding import open_questions
from specproxy.proxy.replay.formats import FORMATS, FormatError, ItemSet, ReplayItem, read_items
from specproxy.proxy.replay.runner import LoadPlan, ReplayError, ReplaySettings, replay_until_stopped
from specproxy.proxy.replay.summary import print_rounds, print_summary
from specproxy.proxy.replay.workload import mixed_workload
from specproxy.proxy.spans.sink import SpanSinkError
from specproxy.slo import Slo

LAB_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_PROFILE = "h100-llama3.1-8b"
# Pacing never slows the simulators below this share of their starting speed (the lab's time budget).
SLOWEST_PACED_SCALE = 1 / 4
# ... and, when only the client's event loop lags (the simulators keep up), one halving further: at
# c=256 the lab's one client process reads 5 × 256 streams.
SLOWEST_CLIENT_PACED_SCALE = 1 / 8
REPLICA = "replica"
PORT_BASE_HELP = "The simulated arms listen on ports N, N+1, ... (default 0: free ports the system picks)."
# Rounds a level may add when too few of its rounds passed every health check. At c=256 of a quick lab
# on two loaded cores one to three of five rounds failed while the others were fine; three extras can
# make up even for four failed rounds when the machine calms down, and none runs where they could not
# make enough. A c=256 round of a quick lab (three waves) takes about 17 s at time scale 1/4, where one
# or two of its five rounds fail with a clock lag of 2.1-3.0 % on two cores: the quick lab starts none
# past its time budget (a lower level's round costs 1-3.5 s at full speed).
EXTRA_ROUNDS = 3
# Rounds the top level may add while a verdict the deploy verdict reads there reaches across a margin
# line (draft_model's throughput at c=256 of a quick lab, 0.957x against a 3 % margin, came out LOSS in
# one lab and NO CLEAR GAIN in five, in rounds of one wave). Each costs a round of the top level (about
# 17 s at c=256 of a quick lab at time scale 1/4, so the quick lab's budget leaves room for one at most)
# and a look at the verdicts so far (a copy of the store and its analysis, 1-2 s).
DECIDING_ROUNDS = 12
# The quick lab starts no extra or deciding round that would end after it has run this long: with the
# analysis and the report after the sweep (5-10 s), it stays within 3 minutes. Its planned rounds take
# 140-146 s on two cores (c=256 at 1/4), so this leaves room for one more round of c=256 (about 17 s).
QUICK_TIME_BUDGET_S = 160.0
# ... and, on a machine so busy that its planned rounds would run longer, cuts the rounds of a level
# (never below the 3 it can be judged on) that would end after this: with the analysis and the report
# it stays within 3 minutes. On a quiet machine the planned rounds end by 140-155 s and none is cut.
QUICK_ROUNDS_BUDGET_S = 170.0

# The lab's arms: (name, vLLM --speculative-config or None); the first is the baseline, REPLICA a copy.
LAB_ARMS: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("baseline", None),
    (REPLICA, None),
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
    """How big a lab run is."""

    levels: tuple[int, ...]
    min_items_per_level: int  # over all rounds
    waves_per_level: int  # items per level ≥ waves × concurrency, so each level reaches steady state
    time_scale: float
    max_tokens_scale: float
    rounds: int
    # The highest concurrency level's rounds (None: ``rounds``). The deploy verdict reads the peak's
    # throughput there, and with 3 rounds that interval is mostly the drift between rounds times a t
    # quantile on 4-7 degrees of freedom (3.5-4.6 for a 99 % interval): a true ratio a few percent from
    # the margin's line lands on either side of it from run to run. More rounds shrink both factors.
    top_rounds: int | None = None
    # Waves each round of the highest level sends at least (items ≥ waves × concurrency). The deploy
    # verdict reads the peak's throughput there; a round of one wave is mostly the drain of its longest
    # calls (draft_model/baseline 0.960x over one wave of the quick lab's c=256, 0.995x over three, on
    # the simulator's lag-free clock), not the sustained rate a peak runs at.
    top_waves: int = 1
    # Rounds a level may add when too few of its rounds passed every health check (a loaded machine
    # fails a round now and then while the rounds around it are fine); each costs one round's time.
    extra_rounds: int = 0
    # Rounds the top level may add while a verdict read there is unsettled (:mod:`.analysis.settled`),
    # none starting that would end after the lab has run ``time_budget_s`` (None: no limit).
    deciding_rounds: int = 0
    time_budget_s: float | None = None
    # No level's planned rounds beyond what ends within this (None: no limit; see QUICK_ROUNDS_BUDGET_S).
    rounds_budget_s: float | None = None
    # Open-loop sweeps: default rates as shares of the baseline's estimated capacity, and how many
    # seconds of arrivals a rate level sends per round.
    rate_shares: tuple[float, ...] = (1 / 32, 1 / 8, 1 / 2, 1.0)
    rate_window_s: float = 4.0

    def level_rounds(self, level: int) -> int:
        if self.top_rounds is not None and level == max(self.levels):
            return self.top_rounds
        return self.rounds

    def items_per_round(self, level: int) -> int:
        """A level's items split over its rounds; every round fills the level's slots at least once,
        the top level's ``top_waves`` times."""
        waves = self.top_waves if level == max(self.levels) else 1
        return max(waves * level, self._split_items(level))

    def _split_items(self, level: int) -> int:
        total = max(self.min_items_per_level, self.waves_per_level * level)
        return max(level, -(-total // self.level_rounds(level)))

    def arrivals_per_round(self, rate: float) -> int:
        """A rate level's arrivals per round: ``rate_window_s`` seconds of them, at least the level's
        share of ``min_items_per_level`` and at most one wave of the top concurrency level's rounds."""
        low = -(-self.min_items_per_level // self.rounds)
        high = max(low, self._split_items(max(self.levels)))
        return min(high, max(low, math.ceil(rate * self.rate_window_s)))


QUICK = LabPlan(
    levels=(1, 4, 16, 64, 256),
    min_items_per_level=20,
    waves_per_level=2,
    time_scale=1.0,
    max_tokens_scale=0.5,
    rounds=3,
    top_rounds=5,
    top_waves=3,
    extra_rounds=EXTRA_ROUNDS,
    deciding_rounds=DECIDING_ROUNDS,
    time_budget_s=QUICK_TIME_BUDGET_S,
    rounds_budget_s=QUICK_ROUNDS_BUDGET_S,
)
FULL = LabPlan(
    levels=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    min_items_per_level=40,
    waves_per_level=3,
    time_scale=1.0,
    max_tokens_scale=1.0,
    rounds=3,
    rate_shares=(1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0),
    rate_window_s=8.0,
    top_waves=3,
    extra_rounds=EXTRA_ROUNDS,
    deciding_rounds=DECIDING_ROUNDS,
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lab_experiment(
    out: Path, profile: str, time_scale: float, *, replica: bool = True, port_base: int = 0
) -> Experiment:
    """The lab's arms as an experiment on ports from ``port_base`` up, or free ones (state under ``out``)."""
    arms: list[Arm] = []
    for i, (name, spec) in enumerate(LAB_ARMS):
        if name == REPLICA and not replica:
            continue
        port = port_base + len(arms) if port_base else _free_port()
        role: Role = "baseline" if i == 0 else "replica" if name == REPLICA else "candidate"
        arms.append(
            Arm(
                name=name,
                url=f"http://127.0.0.1:{port}",
                role=role,
                speculative=spec or {},
                engine=EngineSettings(port=port),
                description=f"specproxy sim, profile {profile}, time scale {time_scale:g}",
            )
        )
    return Experiment(
        name="lab", arms=tuple(arms), model=LAB_MODEL, source_path=str(out.resolve() / "lab.toml")
    )


@contextlib.contextmanager
def simulated_arms(
    out: Path, profile: str, time_scale: float, seed: int, replica: bool = True, port_base: int = 0
) -> Iterator[Experiment]:
    """Start one `specproxy sim` per lab arm through `specproxy engines` (the same launch plan as
    `engines up --engine sim`); stop them all on the way out, whatever happened."""
    exp = lab_experiment(out, profile, time_scale, replica=replica, port_base=port_base)
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
            tied=True,  # the simulators stop with the lab, even when it is killed outright
        )
    except EngineError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        yield exp
    finally:
        stop_experiment(exp, grace_s=10.0)


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
    so, when the top level could not be measured soundly); None when analysis is not available."""
    try:
        from specproxy.analysis import Settings, StoreError, analyze_text, write_report
    except ImportError:
        console.print("(specproxy.analysis is not available in this build: no verdict table or report)")
        return None
    settings = Settings(peak_concurrency=peak.level, peak_source=peak.label) if peak else None
    if peak is not None:
        click.echo(f"lab: {peak.label} ({peak.why}); `analyze --peak-concurrency {peak.level}` judges it so")
    try:
        click.echo(analyze_text([db_path], run=run, fmt="table", settings=settings))
        return write_report([db_path], out / "report.html", run=run, settings=settings)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def _check_rate_options(
    rates: tuple[float, ...] | None,
    levels: tuple[int, ...] | None,
    experiment: Experiment | None,
    at_rate: float | None,
    peak_rate: float | None,
) -> None:
    """The user's mistakes with --rates, as sentences."""
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


def _lab_items(workload: Path | None, plan: LabPlan, seed: int) -> list[ReplayItem]:
    if workload is None:
        n = max(plan.items_per_round(c) for c in plan.levels)
        return mixed_workload(n, seed=seed, max_tokens_scale=plan.max_tokens_scale)
    try:
        return read_items(workload, "auto", seed=seed).items
    except FormatError as exc:
        raise click.ClickException(str(exc)) from None


def _with_operating_point(
    exp: Experiment,
    at: int | None,
    peak: int | None,
    note: str,
    *,
    at_rate: float | None = None,
    peak_rate: float | None = None,
) -> Experiment:
    """The experiment as the run records it: the operating point given on the command line wins."""
    description = "; ".join(x for x in (exp.description, note) if x)
    return dataclasses.replace(
        exp,
        at_concurrency=at if at is not None else exp.at_concurrency,
        peak_concurrency=peak if peak is not None else exp.peak_concurrency,
        at_rate=at_rate if at_rate is not None else exp.at_rate,
        peak_rate=peak_rate if peak_rate is not None else exp.peak_rate,
        description=description,
    )


# -- open-loop sweeps ----------------------------------------------------------------------------


def estimated_capacity(
    profile: str, time_scale: float, items: Sequence[ReplayItem], batch: int, max_tokens: int | None
) -> float:
    """The baseline's requests/s with ``batch`` calls in flight, from the cost profile: ``batch`` tokens
    per decode step over the workload's mean answer length, at ``time_scale``. Prefill and early stops
    are left out: a rough figure, good for placing a sweep, not for a verdict."""
    try:
        cost = load_profile(profile)
    except ProfileError as exc:
        raise click.ClickException(str(exc)) from None
    answers = [float(max_tokens or it.body.get("max_tokens") or 256) for it in items]
    answer = sum(answers) / len(answers)
    # Context per call: the prompt (about 4 characters a token) and half the answer, on average.
    prompt = sum(len(json.dumps(it.body.get("messages") or it.body.get("prompt"))) / 4 for it in items)
    kv_tokens = int(batch * (prompt / len(items) + answer / 2))
    batch = min(batch, cost.max_num_seqs)
    return batch / cost.step_time(batch, kv_tokens) / answer * time_scale


def default_rates(capacity: float, shares: Sequence[float]) -> tuple[float, ...]:
    """The shares of ``capacity``, each to two significant digits (labels people can read: r=6.6)."""
    return tuple(sorted({float(f"{capacity * share:.2g}") for share in shares}))


def _load_plan(
    plan: LabPlan, rates: tuple[float, ...] | None, started: float, pacer: SimPacer | None
) -> LoadPlan:
    """The replay's load for the lab's plan; ``started``: when the lab began (``time.monotonic()``);
    a level the ``pacer`` skipped gets no rounds, and none that would end past the rounds' budget."""
    until = None if plan.time_budget_s is None else started + plan.time_budget_s
    rounds_until = None if plan.rounds_budget_s is None else started + plan.rounds_budget_s
    if rates is None:
        return LoadPlan(
            kind="closed",
            levels=plan.levels,
            items_per_level=plan.items_per_round,
            rounds=plan.rounds,
            rounds_per_level=plan.level_rounds
            if pacer is None
            else lambda c: pacer.rounds(
                c, plan.level_rounds(c), waves=plan.items_per_round(c) / c, until=rounds_until
            ),
            extra_rounds=plan.extra_rounds,
            deciding_rounds=plan.deciding_rounds,
            added_until=until,
            warm_fresh_prompts=True,
        )
    return LoadPlan(
        kind="rate",
        rates=rates,
        items_per_rate=plan.arrivals_per_round,
        rounds=plan.rounds,
        extra_rounds=plan.extra_rounds,
        deciding_rounds=plan.deciding_rounds,
        added_until=until,
        warm_fresh_prompts=True,
    )


def _sweep_sentence(plan: LabPlan, rates: tuple[float, ...] | None) -> str:
    if rates is None:
        n_calls = sum(plan.level_rounds(c) * plan.items_per_round(c) for c in plan.levels)
        levels = ",".join(map(str, plan.levels))
        top = max(plan.levels)
        at_top = [f"{plan.level_rounds(top)} at c={top}"] if plan.level_rounds(top) != plan.rounds else []
        if plan.items_per_round(top) > top:
            at_top.append(f"{plan.items_per_round(top)} calls a round at c={top}")
        if at_top:
            levels += f" in paired mode, {plan.rounds} rounds per level ({', '.join(at_top)})"
            return f"sweep {levels}, {n_calls} requests per arm"
    else:
        n_calls = plan.rounds * sum(plan.arrivals_per_round(r) for r in rates)
        levels = "open-loop rates " + ",".join(f"{r:g}" for r in rates) + " req/s"
    return f"sweep {levels} in paired mode, {plan.rounds} rounds per level, {n_calls} requests per arm"


def _extra_sentence(plan: LabPlan) -> str:
    parts = []
    if plan.extra_rounds:
        parts.append(
            f"; up to {plan.extra_rounds} extra round{'s' if plan.extra_rounds > 1 else ''} at a level "
            "whose rounds leave too few that pass every health check"
        )
    if plan.deciding_rounds:
        parts.append(
            f"; up to {plan.deciding_rounds} deciding round{'s' if plan.deciding_rounds > 1 else ''} at the "
            "top level while a verdict read there is unsettled"
            + (f", within {plan.time_budget_s:.0f} s of the lab's start" if plan.time_budget_s else "")
        )
    return "".join(parts)


def _with_slo(exp: Experiment, slo: Slo | None, gpu_hour_usd: float | None) -> Experiment:
    """The experiment as the run records it: the SLO and GPU price given on the command line win (the
    analysis reads them back from the run)."""
    return dataclasses.replace(
        exp,
        slo=slo or exp.slo,
        gpu_hour_usd=gpu_hour_usd if gpu_hour_usd is not None else exp.gpu_hour_usd,
    )


@click.command("lab")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Experiment file with running arms (default: start five simulated arms).",
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
    "--rates",
    type=RequestRates(auto=True),
    metavar="LIST|auto",
    help="Open loop instead: a sweep of Poisson request rates (req/s), e.g. 1,2,4,8; auto: shares of "
    "the baseline's capacity estimated from the simulators' speed.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Measure each level in N rounds, the arms' order rotated each round (default 3; with --quick "
    "the highest concurrency level 5, where the peak throughput is read).",
)
@click.option(
    "--extra-rounds",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help=f"Add up to N rounds to a level whose rounds left too few that passed every health check "
    f"(3 once one failed), one at a time at the same pace (default {EXTRA_ROUNDS}).",
)
@click.option(
    "--deciding-rounds",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="Add up to N rounds to the top level while a figure the deploy verdict reads there (the peak's "
    "throughput, by default) has an interval reaching across a margin line, so that a ratio near the "
    f"margin gets the same verdict every run (default {DECIDING_ROUNDS}; with --quick none starts that "
    f"would end after the lab has run {QUICK_TIME_BUDGET_S:.0f} s; 0: never).",
)
@click.option(
    "--at-concurrency",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="The concurrency you run at: the deploy verdict answers there (default: the experiment's).",
)
@click.option(
    "--peak-concurrency",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Your peak concurrency: throughput must not drop there (default: the experiment's).",
)
@click.option(
    "--at-rate",
    type=FiniteFloat(min=0, min_open=True),
    metavar="R",
    help="With --rates: the request rate you run at (req/s); the deploy verdict answers there.",
)
@click.option(
    "--peak-rate",
    type=FiniteFloat(min=0, min_open=True),
    metavar="R",
    help="With --rates: your peak request rate (req/s); throughput must not drop there, and the fleet "
    "at the SLO is sized for it.",
)
@click.option("--slo", type=SloParam(), default=None, help=SLO_HELP)
@click.option(
    "--gpu-hour-usd",
    type=FiniteFloat(0, min_open=True),
    default=None,
    metavar="X",
    help="Price of one GPU-hour: the fleet's cost at the peak (default: the experiment's).",
)
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
@click.option("--no-progress", is_flag=True, help="No live progress display.")
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
    console = Console(stderr=True, soft_wrap=True)
    base = QUICK if quick else FULL
    plan = LabPlan(
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
    experiment = experiment_or_none(config_path)
    if at_concurrency is not None and peak_concurrency is not None and peak_concurrency < at_concurrency:
        raise click.BadParameter(
            f"must be ≥ --at-concurrency ({peak_concurrency} < {at_concurrency})",
            param_hint="--peak-concurrency",
        )
    _check_rate_options(rates, levels, experiment, at_rate, peak_rate)
    out.mkdir(parents=True, exist_ok=True)
    db_path = out / "specproxy.duckdb"
    lab_items = _lab_items(workload, plan, seed)
    t0 = time.monotonic()
    scale_note = ""
    pacer: SimPacer | None = None
    with contextlib.ExitStack() as stack:
        simulated = experiment is None
        if experiment is None:
            n = len(LAB_ARMS) - (1 if no_replica else 0)
            starting = f"starting {n} simulated arms ({profile}, time scale {plan.time_scale:g}) ..."
            console.print(starting, highlight=False)
            experiment = stack.enter_context(
                simulated_arms(out, profile, plan.time_scale, seed, not no_replica, port_base)
            )
            # A rate level's load is relative to the engines' speed, so a rate sweep keeps one time scale.
            if time_scale is None and rates is None:
                slowest = plan.time_scale * SLOWEST_PACED_SCALE
                pacer = SimPacer(
                    experiment.arms,
                    plan.time_scale,
                    slowest,
                    console,
                    slowest_for_client=plan.time_scale * SLOWEST_CLIENT_PACED_SCALE,
                    skip_unmeasurable=peak_concurrency is None,  # a peak or operating point you gave
                    never_skip=(at_concurrency,) if at_concurrency else (),  # is always measured
                )
            scale_note = pace_note(pacer, plan.time_scale, given=time_scale is not None)
            click.echo(f"lab: {scale_note}")
        if rates == ():
            top = max(plan.levels)
            capacity = estimated_capacity(profile, plan.time_scale, lab_items, top, max_tokens)
            rates = default_rates(capacity, plan.rate_shares)
            click.echo(
                f"lab: rates {', '.join(f'{r:g}' for r in rates)} req/s: shares of the baseline's estimated "
                f"capacity at c={top}, {capacity:.3g} req/s at time scale {plan.time_scale:g}"
            )
        experiment = _with_operating_point(
            experiment,
            at_concurrency,
            peak_concurrency,
            f"lab: {scale_note}" if scale_note else "",
            at_rate=at_rate,
            peak_rate=peak_rate,
        )
        experiment = _with_slo(experiment, slo, gpu_hour_usd)
        settings = ReplaySettings(
            arms=experiment.arms,
            db_path=db_path,
            run_name="lab-quick" if quick else "lab",
            mode="paired",
            load=_load_plan(plan, rates, t0, pacer),
            temperature=0.0,
            max_tokens=max_tokens,
            seed=seed,
            experiment=experiment,
            show_progress=not no_progress,
            pacer=pacer,
            decider=open_questions,
        )
        console.print(_sweep_sentence(plan, rates) + _extra_sentence(plan), highlight=False)
        try:
            result = run_async(replay_until_stopped(settings, ItemSet("lab", lab_items)))
        except ReplayError as exc:
            hint = "" if simulated else f" (`specproxy engines up {config_path}` starts the arms)"
            raise click.ClickException(f"{exc}{hint}") from None
        except SpanSinkError as exc:
            raise click.ClickException(str(exc)) from None
    print_summary(result, None, console, compact=True)
    print_health(result.health, result.levels, console)
    console.print(f"measured in {time.monotonic() - t0:.0f} s", highlight=False)
    if result.interrupted:
        console.print("interrupted: what was measured so far is analysed below", highlight=False)
    if pacer is not None:
        print_pace(pacer, profile, console)
    elif simulated and plan.time_scale != 1:
        print_given_scale(plan.time_scale, profile, rates is not None, console)
    print_rounds(result.levels, console, say_none=plan.extra_rounds > 0 or plan.deciding_rounds > 0)
    print_clock_lag(clock_lag_by_level(result.health), console)
    moved = (
        judged_peak(plan.levels, result.levels, pacer)
        if rates is None and not experiment.peak_concurrency
        else None
    )
    report = analysis_outputs(db_path, out, result.run_id, console, moved)
    console.print(f"span store: {db_path}" + (f"   report: {report}" if report else ""), highlight=False)
    if result.interrupted:
        sys.exit(130)
