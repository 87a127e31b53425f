"""What every command shares: running a coroutine on uvloop, option types, the options several commands
take (declared once here, so their help reads the same in every command), loading the experiment file."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click

from specproxy.config import ConfigError, Experiment, load_experiment
from specproxy.slo import Slo, SloError, parse_slo

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop where it is installed (it is on Linux and macOS), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


# More calls in flight than any one machine can hold open; also keeps a level within a span's INTEGER.
MAX_CONCURRENCY = 1_000_000


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,4,16,64"`` → (1, 4, 16, 64); ValueError with a sentence otherwise."""
    try:
        levels = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"concurrency must be a comma-separated list of integers, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"concurrency levels must be integers ≥ 1, got {text!r}")
    if any(c > MAX_CONCURRENCY for c in levels):
        raise ValueError(f"concurrency levels must be at most {MAX_CONCURRENCY:,}, got {text!r}")
    return levels


# (click ≥ 8.2 makes ParamType generic for type checkers; subscripting it would break click 8.1.)
class ConcurrencyLevels(click.ParamType):  # type: ignore[type-arg]
    """``1,4,16,64`` on the command line → ``(1, 4, 16, 64)``."""

    name = "LIST"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return parse_levels(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def parse_rates(text: str) -> tuple[float, ...]:
    """``"1,2,4,8"`` → (1.0, 2.0, 4.0, 8.0) requests/s; ValueError with a sentence otherwise."""
    parts = [x for x in text.replace(" ", "").split(",") if x]
    try:
        rates = tuple(float(x) for x in parts)
    except ValueError:
        raise ValueError(
            f"rates must be a comma-separated list of numbers (requests/s), got {text!r}"
        ) from None
    if not rates or any(not math.isfinite(r) or r <= 0 for r in rates):
        raise ValueError(f"rates must be finite numbers > 0 (requests/s), got {text!r}")
    if len(set(rates)) < len(rates):
        raise ValueError(
            f"each rate once: a level is measured in --rounds, not by repeating it; got {text!r}"
        )
    return rates


class RequestRates(click.ParamType):  # type: ignore[type-arg]
    """``1,2,4.5`` on the command line → ``(1.0, 2.0, 4.5)`` requests/s; with ``auto=True`` also the
    word ``auto`` → ``()`` (the command picks the rates)."""

    name = "LIST"

    def __init__(self, *, auto: bool = False) -> None:
        self.auto = auto
        if auto:
            self.name = "LIST|auto"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[float, ...]:
        if isinstance(value, tuple):
            return value
        if self.auto and str(value).strip().lower() == "auto":
            return ()
        try:
            return parse_rates(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class SloParam(click.ParamType):  # type: ignore[type-arg]
    """``ttft_p95=500ms,itl_p99=80ms`` on the command line → :class:`~specproxy.slo.Slo`."""

    name = "TARGETS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Slo:
        if isinstance(value, Slo):
            return value
        try:
            return parse_slo(str(value))
        except SloError as exc:
            self.fail(str(exc), param, ctx)


SLO_HELP = (
    "Latency SLO, e.g. ttft_p95=500ms,itl_p99=80ms,e2e_p95=20s (metrics ttft, tpot, itl, e2e; "
    "percentiles p50..p99.9; ms or s): goodput per level, capacity at the SLO and the fleet at the peak "
    "(default: the experiment file's [slo])."
)


class FiniteFloat(click.FloatRange):
    """A float option in an optional range that must also be a finite number.

    click's FloatRange compares with < and >, which NaN always passes, and accepts infinity.

    >>> FiniteFloat(min=0, min_open=True).convert("2.5", None, None)
    2.5
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name = "float" if self.min is None and self.max is None else "float range"

    def _describe_range(self) -> str:
        return "" if self.min is None and self.max is None else super()._describe_range()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


def operating_point_options(func: F) -> F:
    """Where the deploy verdict answers and what the fleet is sized for: --at-concurrency,
    --peak-concurrency, --at-rate, --peak-rate, --slo and --gpu-hour-usd."""
    options = [
        click.option(
            "--at-concurrency",
            type=click.IntRange(1),
            metavar="N",
            help="The concurrency you run at: the deploy verdict answers there (default: the experiment "
            "file's at_concurrency, else the lowest tested level, said so).",
        ),
        click.option(
            "--peak-concurrency",
            type=click.IntRange(1),
            metavar="N",
            help="Your peak concurrency: throughput there must not be lower, and the fleet at the SLO "
            "is sized for it (default: the experiment file's peak_concurrency, else the highest "
            "tested level, said so; a level that failed its health checks makes the deploy verdict "
            "UNRELIABLE).",
        ),
        click.option(
            "--at-rate",
            type=FiniteFloat(min=0, min_open=True),
            metavar="R",
            help="For a sweep of request rates (replay or lab --rates): the rate you run at, in requests/s "
            "(default: the experiment file's at_rate, else the lowest tested rate, said so).",
        ),
        click.option(
            "--peak-rate",
            type=FiniteFloat(min=0, min_open=True),
            metavar="R",
            help="For a sweep of request rates: your peak, in requests/s; the fleet at the SLO is sized "
            "for it (default: the experiment file's peak_rate, else the highest tested rate, said so).",
        ),
        click.option("--slo", type=SloParam(), default=None, help=SLO_HELP),
        click.option(
            "--gpu-hour-usd",
            type=FiniteFloat(0, min_open=True),
            metavar="X",
            help="Price of one GPU-hour: the fleet's cost per hour and per million output tokens "
            "(default: the experiment file's gpu_hour_usd).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def listen_options(port_note: str = "") -> Callable[[F], F]:
    """--host and --port of a command that serves HTTP (serve, sim); ``port_note`` ends --port's help."""

    def decorate(func: F) -> F:
        host = click.option(
            "--host",
            default="127.0.0.1",
            show_default=True,
            help="Address to listen on (0.0.0.0 for every interface).",
        )
        port = click.option(
            "--port",
            default=8000,
            show_default=True,
            type=click.IntRange(0, 65535),
            help=f"Port to listen on{port_note}.",
        )
        return host(port(func))

    return decorate


def config_option(help: str) -> Callable[[F], F]:
    """--config FILE: an experiment file, optional; the parameter is ``config_path`` (a Path or None)."""
    return click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), help=help)


# The span store a command writes; the parameter is ``db_path``.
db_option = click.option(
    "--db",
    "db_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Span store (default: the experiment's db, else specproxy.duckdb).",
)
no_progress_option = click.option("--no-progress", is_flag=True, help="No live progress display.")
# Replay and lab: a sweep's calls spread over client processes (proxy/replay/clients.py).
client_processes_option = click.option(
    "--client-processes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Spread each round's calls (a closed loop's slots) over N client processes, each with its own event "
    "loop and health rows, for engines that stream faster than one process reads: about one per "
    "30,000 chunks/s of the arms together (five GPU arms at c=256: 4), at most one per free core.",
)


# A sweep's rounds (replay, lab): one declaration each, the command adding what differs (its default,
# what a round of it is) in ``note`` (and, for --rounds, after the reason in ``tail``).
def _round_count(flag: str, minimum: int, default: int | None, help: str) -> Callable[[F], F]:
    return click.option(
        flag,
        type=click.IntRange(min=minimum),
        default=default,
        show_default=default is not None,
        metavar="N",
        help=help,
    )


def rounds_option(default: int | None, note: str = "", tail: str = "") -> Callable[[F], F]:
    """--rounds N: each level measured N times."""
    return _round_count(
        "--rounds",
        1,
        default,
        "Measure each level" + note + " N times, the arms' order rotated and the items shuffled each "
        "round; the analysis reads the spread between rounds (a level measured once gets no WIN or LOSS "
        "on speed: one round cannot see the drift between runs)" + tail + ".",
    )


def extra_rounds_option(default: int | None, note: str = "") -> Callable[[F], F]:
    """--extra-rounds N: rounds added to a level whose rounds too often failed a health check."""
    return _round_count(
        "--extra-rounds",
        0,
        default,
        "Add up to N rounds to a level whose rounds left too few that passed every health check "
        "(3 once one failed), one at a time at the same pace" + note + ".",
    )


def deciding_rounds_option(default: int | None, note: str = "") -> Callable[[F], F]:
    """--deciding-rounds N: rounds added to the top level while a deploy-verdict figure is unsettled."""
    return _round_count(
        "--deciding-rounds",
        0,
        default,
        "Add up to N rounds to the top level (the highest concurrency or rate) while a figure the "
        "deploy verdict reads there has an interval reaching across a margin line; each look copies the "
        "span store and analyses the run so far" + note + ".",
    )


def experiment_or_none(path: Path | None) -> Experiment | None:
    """The experiment file, loaded; a mistake in it becomes the user's error sentence."""
    if path is None:
        return None
    try:
        return load_experiment(path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
