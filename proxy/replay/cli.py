"""`specproxy replay LOGS`: the click layer over :mod:`specproxy.proxy.replay.runner`; it parses and calls."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specproxy.commandline import (
    ConcurrencyLevels,
    FiniteFloat,
    RequestRates,
    client_processes_option,
    config_option,
    db_option,
    deciding_rounds_option,
    experiment_or_none,
    extra_rounds_option,
    no_progress_option,
    rounds_option,
    run_async,
)
from specproxy.config import Arm, Experiment
from specproxy.proxy.replay.console import Console
from specproxy.proxy.replay.deciding import open_questions
from specproxy.proxy.replay.formats import FORMATS, FormatError, ItemSet, read_items

if TYPE_CHECKING:
    from specproxy.proxy.replay.runner import ReplaySettings


@click.command("replay")
@click.argument("logs", type=click.Path(dir_okay=False, path_type=Path))
@config_option("Experiment file: replay directly against its arms.")
@click.option(
    "--target",
    metavar="URL",
    help="Replay through a running specproxy (or any OpenAI-compatible "
    "server) at URL instead of the arms of --config.",
)
@click.option(
    "--format",
    "fmt",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", *FORMATS]),
    help="Input format; auto detects it from the first record.",
)
@click.option(
    "--concurrency",
    "levels",
    type=ConcurrencyLevels(),
    default="1,4,16,64",
    show_default=True,
    help="Closed loop: the concurrency levels of the sweep, one phase each.",
)
@click.option(
    "--rates",
    type=RequestRates(),
    help="Open loop: a sweep of Poisson arrival rates in requests/s, one level each (e.g. 1,2,4,8).",
)
@click.option(
    "--rate",
    type=FiniteFloat(min=0, min_open=True),
    metavar="R",
    help="Open loop: Poisson arrivals at R requests/s (a sweep of one rate).",
)
@click.option("--timed", is_flag=True, help="Open loop at the log's recorded timestamps.")
@click.option(
    "--speedup",
    type=FiniteFloat(min=0, min_open=True),
    default=1.0,
    show_default=True,
    metavar="X",
    help="With --timed: replay X times faster than recorded.",
)
@click.option(
    "--mode",
    type=click.Choice(["paired", "split"]),
    default="paired",
    show_default=True,
    help="paired: every item to every arm at once; split: each item to one arm by weight.",
)
@click.option(
    "--temperature",
    type=FiniteFloat(min=0),
    default=0.0,
    show_default=True,
    help="Temperature sent with every request (0 keeps outputs comparable for identity).",
)
@click.option("--keep-temperature", is_flag=True, help="Send each record's own temperature instead.")
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    metavar="N",
    help="Override every request's max_tokens (default: as recorded, else 256).",
)
@click.option("--limit", type=click.IntRange(min=1), metavar="N", help="Replay only the first N items.")
@click.option(
    "--duration",
    type=FiniteFloat(min=0, min_open=True),
    metavar="S",
    help="Stop sending after S seconds (per level of a sweep; a rate level sends arrivals for S "
    "seconds, cycling the items).",
)
@rounds_option(3, note=" (or the timed loop)")
@extra_rounds_option(0, note="; a --timed loop is never rerun")
@deciding_rounds_option(0)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    metavar="N",
    help="Unrecorded calls per arm before each level (default: one per slot, one per rate level; "
    "none with --target, where the proxy would record them).",
)
@db_option
@click.option("--run-name", default=None, help="Name of the run in the span store (default: the log's name).")
@click.option("--model", default=None, help="Model name to send (default: each arm's first served model).")
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed for Poisson arrivals, split assignment and synthesized prompts.",
)
@click.option(
    "--on-error",
    type=click.Choice(["stop", "skip"]),
    default="stop",
    show_default=True,
    help="A bad input record: stop with file:line, or skip it and count it.",
)
@click.option("--capture-output", is_flag=True, help="Store each response's text in the span store.")
@client_processes_option
@no_progress_option
def replay(
    logs: Path,
    config_path: Path | None,
    target: str | None,
    fmt: str,
    levels: tuple[int, ...],
    rates: tuple[float, ...] | None,
    rate: float | None,
    timed: bool,
    speedup: float,
    mode: str,
    temperature: float,
    keep_temperature: bool,
    max_tokens: int | None,
    limit: int | None,
    duration: float | None,
    rounds: int,
    extra_rounds: int,
    deciding_rounds: int,
    warmup: int | None,
    db_path: Path | None,
    run_name: str | None,
    model: str | None,
    seed: int,
    on_error: str,
    capture_output: bool,
    client_processes: int,
    no_progress: bool,
) -> None:
    """Drive a traffic log against the arms and write one span per upstream call.

    LOGS is a specproxy capture file or a public trace (OpenAI Batch JSONL, vLLM bench custom JSONL,
    Spec-Bench question.jsonl, ShareGPT JSON, Mooncake JSONL, Azure or BurstGPT CSV).

    \b
    Examples:
      specproxy replay capture.jsonl --config exp.toml --concurrency 1,4,16,64 --rounds 3
      specproxy replay question.jsonl --config exp.toml --rates 1,2,4,8 --duration 60 --rounds 3
      specproxy replay mooncake.jsonl --target http://127.0.0.1:8000 --timed --speedup 10
    """
    console = Console()
    experiment, arms = _experiment_and_arms(config_path, target, mode)
    rates = _swept_rates(rate, rates, timed)
    items = _read(logs, fmt, on_error, limit, seed)
    # The runner's imports (aiohttp, numpy: ~0.5 s) once the inputs are read: a mistake there is said at once
    from specproxy.proxy.replay.runner import LoadPlan, ReplaySettings

    load = LoadPlan(
        kind="rate" if rates is not None else "timed" if timed else "closed",
        levels=levels,
        rates=rates or (),
        speedup=speedup,
        duration_s=duration,
        warmup=0 if warmup is None and target is not None else warmup,
        rounds=rounds,
        extra_rounds=extra_rounds,
        deciding_rounds=deciding_rounds,
    )
    settings = ReplaySettings(
        arms=tuple(arms),
        db_path=db_path or Path(experiment.db if experiment else "specproxy.duckdb"),
        run_name=run_name or logs.stem,
        mode="split" if mode == "split" else "paired",
        load=load,
        temperature=None if keep_temperature else temperature,
        max_tokens=max_tokens,
        seed=seed,
        model=model,
        experiment=experiment,
        capture_output=capture_output,
        show_progress=not no_progress,
        through_proxy=target is not None,
        decider=open_questions,
        client_processes=client_processes,
    )
    console.print(
        f"replaying {len(items.items)} {items.format} items from {logs} against "
        f"{', '.join(a.name for a in arms)} ({mode})",
    )
    _run(settings, items, console)


def _swept_rates(
    rate: float | None, rates: tuple[float, ...] | None, timed: bool
) -> tuple[float, ...] | None:
    """The open loop's rates (--rate is a sweep of one); UsageError for load shapes that exclude each
    other."""
    if rate is not None and rates is not None:
        raise click.UsageError("--rate R is a sweep of one rate: give --rate or --rates, not both")
    if rate is not None:
        rates = (rate,)
    if rates is not None and timed:
        raise click.UsageError("--rates and --timed are two different load shapes; choose one")
    return rates


def _experiment_and_arms(
    config_path: Path | None, target: str | None, mode: str
) -> tuple[Experiment | None, tuple[Arm, ...]]:
    """The experiment of --config and its arms, or none and the one arm of --target."""
    if (config_path is None) == (target is None):
        raise click.UsageError("give exactly one of --config exp.toml (the arms) or --target URL (a proxy)")
    experiment = experiment_or_none(config_path)
    return experiment, tuple(experiment.arms) if experiment is not None else _target_arms(target, mode)


def _target_arms(target: str | None, mode: str) -> tuple[Arm, ...]:
    """The one arm of --target: the proxy (or server) at its URL."""
    assert target is not None
    if not target.startswith(("http://", "https://")):
        raise click.BadParameter(
            f"must start with http:// or https://, got {target!r}", param_hint="--target"
        )
    if mode == "split":
        raise click.UsageError("--mode split needs the arms of --config; a --target proxy splits by itself")
    return (Arm(name="target", url=target.rstrip("/"), role="baseline"),)


def _read(logs: Path, fmt: str, on_error: str, limit: int | None, seed: int) -> ItemSet:
    try:
        return read_items(
            logs, fmt, on_error="skip" if on_error == "skip" else "stop", limit=limit, seed=seed
        )
    except FormatError as exc:
        raise click.ClickException(str(exc)) from None


def _run(settings: ReplaySettings, items: ItemSet, console: Console) -> None:
    """Run the replay, print its summary; exit 130 when it was interrupted."""
    from specproxy.proxy.replay.runner import ReplayError, replay_until_stopped
    from specproxy.proxy.replay.summary import print_rounds, print_summary
    from specproxy.proxy.spans.sink import SpanSinkError

    try:
        result = run_async(replay_until_stopped(settings, items))
    except (ReplayError, SpanSinkError) as exc:
        raise click.ClickException(str(exc)) from None
    print_summary(result, items, console)
    print_rounds(result.levels, console)
    if result.interrupted:
        console.print("interrupted: the spans measured so far are kept")
        sys.exit(130)
