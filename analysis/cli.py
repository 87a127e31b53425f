"""The click commands `analyze`, `report`, `sql`, `export`: parse options, call the library, print.

Every failure a user can cause (a missing, corrupt or locked file, an unknown run, bad SQL) becomes a
ClickException: one sentence and exit status 1.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import signal
import threading
from collections.abc import Callable, Sequence
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import click
import duckdb

from specproxy import schema
from specproxy.analysis.render.columns import BY_KEY, WIDE, parse_columns
from specproxy.analysis.render.table import FORMATS
from specproxy.analysis.store import SpanStore, StoreError, expand_paths, open_store, query_failure
from specproxy.analysis.verdicts.evaluation import Settings
from specproxy.analysis.verdicts.rules import Thresholds
from specproxy.commandline import FiniteFloat, operating_point_options

DEFAULT_DB = "specproxy.duckdb"
DEFAULT_SQL_TIMEOUT_S = 300.0
F = TypeVar("F", bound=Callable[..., Any])


def _dbs(paths: Sequence[str]) -> list[str]:
    return list(paths) or [DEFAULT_DB]


def _percent_option(flag: str, default: float, help: str) -> Callable[[F], F]:
    return click.option(flag, type=FiniteFloat(0, 100), default=default, show_default=True, help=help)


def settings_options(func: F) -> F:
    """The operating point, verdict and bootstrap options shared by analyze and report."""
    options = [
        _percent_option(
            "--margin",
            3.0,
            "Smallest difference, in percent, a WIN or LOSS must clear; a replica arm's measured "
            "noise floor raises it.",
        ),
        _percent_option(
            "--identity-min",
            99.0,
            "Identical outputs needed, in percent (LOSS when the mismatch rate is surely above "
            "100 minus this).",
        ),
        click.option(
            "--near-tie-margin",
            type=FiniteFloat(),
            default=0.5,
            show_default=True,
            help="A mismatch whose logprob margin (top-1 minus top-2, nats) is at most this is a near-tie.",
        ),
        click.option(
            "--confidence",
            type=FiniteFloat(0.5, 0.999),
            default=0.95,
            show_default=True,
            help="Confidence level of the intervals, jointly over the levels each arm's deploy verdict reads "
            "(those around the operating point and the peak; Bonferroni); crossovers and other levels' "
            "verdicts read the same intervals, not corrected further.",
        ),
        click.option(
            "--bootstrap-iterations",
            type=click.IntRange(100, 100_000),
            default=1000,
            show_default=True,
            help="Bootstrap resamples per interval.",
        ),
        click.option(
            "--bootstrap-seed",
            type=int,
            default=0,
            show_default=True,
            help="Seed of the bootstrap (same seed, same intervals).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    func = operating_point_options(func)
    run = click.option(
        "--run", "run", metavar="NAME", help="Only this run (its name or run_id); default: every run."
    )
    return run(func)


# The options that are Settings fields of the same name and value.
_SETTINGS_AS_GIVEN = (
    "near_tie_margin",
    "confidence",
    "bootstrap_iterations",
    "bootstrap_seed",
    "at_concurrency",
    "peak_concurrency",
    "at_rate",
    "peak_rate",
    "slo",
    "gpu_hour_usd",
)


def _settings(kw: dict[str, Any]) -> Settings:
    # The same rule as the experiment file's and the lab's: a peak below the operating point is a typo.
    for at, peak, unit in (("at_concurrency", "peak_concurrency", ""), ("at_rate", "peak_rate", " req/s")):
        if kw[at] is not None and kw[peak] is not None and kw[peak] < kw[at]:
            raise click.BadParameter(
                f"must be ≥ --{at.replace('_', '-')} ({kw[peak]:g}{unit} < {kw[at]:g}{unit})",
                param_hint=f"--{peak.replace('_', '-')}",
            )
    return Settings(
        thresholds=Thresholds(min_margin=kw["margin"] / 100.0, identity_min=kw["identity_min"] / 100.0),
        **{name: kw[name] for name in _SETTINGS_AS_GIVEN},
    )


def _columns(wide: bool, columns: str | None) -> tuple[str, ...]:
    if wide and columns is not None:
        raise click.UsageError("--wide shows every column; --columns names some: choose one")
    if columns is None:
        return WIDE if wide else ()
    try:
        return parse_columns(columns)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--columns") from None


@click.command()
@click.argument("dbs", nargs=-1, metavar="[DB]...")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="table",
    show_default=True,
    help="Output format (csv and json carry full precision).",
)
@click.option(
    "--latency",
    is_flag=True,
    help="Also print the latency table: TPOT, inter-token latency and the largest stall, E2E, queueing "
    "and tokens per chunk, per arm and level (json and csv always carry these figures).",
)
@click.option(
    "--wide",
    is_flag=True,
    help="Every column of the table that holds a figure: tok/s, TTFT, acceptance, rounds, margin, load "
    "(the default shows level, arm, calls, identity, the two ratios and the verdict, in 120 columns).",
)
@click.option(
    "--columns",
    metavar="LIST",
    help=f"The table's columns, comma-separated, from: {', '.join(BY_KEY)} (level and arm always).",
)
@settings_options
def analyze(
    dbs: tuple[str, ...], fmt: str, latency: bool, wide: bool, columns: str | None, **kw: Any
) -> None:
    """The verdict table: per run, arm and level (a concurrency, or a request rate); then by workload
    category, and each arm's deploy verdict at your operating point (aggregate throughput at your peak
    not lower).
    Exits 1 when an arm's every call failed (its first error is printed).

    DB files default to specproxy.duckdb; each file's worker siblings (specproxy.w0.duckdb, ...) are
    read too, and several files (machines) are analysed as one store. Files are opened read-only.
    """
    from specproxy.analysis import analyze as analyze_stores

    try:
        settings = dataclasses.replace(_settings(kw), latency_table=latency, columns=_columns(wide, columns))
        result = analyze_stores(_dbs(dbs), kw["run"], fmt, settings)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(result.text, nl=False)
    if result.failed_arms:
        # the table is printed for what it holds; a failed arm is an error of the run, said last
        raise click.ClickException("; ".join(result.failed_arms))


@click.command()
@click.argument("dbs", nargs=-1, metavar="[DB]...")
@click.option(
    "-o",
    "--output",
    "out",
    type=click.Path(dir_okay=False),
    default="report.html",
    show_default=True,
    help="Where to write the HTML file.",
)
@settings_options
def report(dbs: tuple[str, ...], out: str, **kw: Any) -> None:
    """A self-contained HTML report (inline SVG plots; opens without network)."""
    from specproxy.analysis import write_report

    try:
        path = write_report(_dbs(dbs), out, kw["run"], _settings(kw))
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc.strerror or exc}") from exc
    click.echo(f"wrote {path}")


def _cell(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bytes):
        return value.hex()
    return value


def format_result(names: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str) -> str:
    """A query result as an aligned table, CSV or JSON (a list of objects)."""
    if fmt == "json":
        return (
            json.dumps(
                [{n: _cell(v) for n, v in zip(names, r, strict=True)} for r in rows],
                indent=2,
                default=str,
                ensure_ascii=False,
            )
            + "\n"
        )
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(names)
        writer.writerows([["" if v is None else _cell(v) for v in r] for r in rows])
        return buf.getvalue()
    text = [[("NULL" if v is None else str(_cell(v))) for v in r] for r in rows]
    widths = [max([len(n), *(len(t[i]) for t in text)]) for i, n in enumerate(names)]
    header = "  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True))
    lines = [header, "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip() for t in text]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("args", nargs=-1, required=True, metavar="[DB]... QUERY")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(("table", "csv", "json")),
    default="table",
    show_default=True,
    help="Output format.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_SQL_TIMEOUT_S,
    show_default=True,
    help="Stop the query after this many seconds.",
)
def sql(args: tuple[str, ...], fmt: str, timeout: float) -> None:
    """Run QUERY (the last argument) on the span store(s), read-only.

    Tables requests, runs, health, backend_metrics and views arm_summary, pairs, identity, acceptance,
    slo_calls, latency are available; several DB files are queried as their union. Example:

        specproxy sql specproxy.duckdb "SELECT arm, level, agg_tok_s FROM arm_summary"

    Only SELECT-style statements run (SELECT, WITH, FROM, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN), and
    the query reads no file but the span store: it is read-only. Use the DuckDB CLI to change the file.
    A query stops after --timeout seconds; what it spills to disk is bounded (8 GiB) and removed.
    """
    *dbs, query = args
    try:
        with open_store(_dbs(dbs)) as store:
            names, rows = _limited_query(store, query, timeout)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_result(names, rows, fmt), nl=False)


def _limited_query(store: SpanStore, query: str, timeout: float) -> tuple[list[str], list[tuple[Any, ...]]]:
    """``store.read_only_query(query)``, interrupted after ``timeout`` seconds. It runs in a thread so
    that this one stays free to take signals: SIGTERM ends the command as Ctrl-C does, the query is
    interrupted and the store closed, which removes its spill folder."""
    out: list[tuple[list[str], list[tuple[Any, ...]]]] = []
    failed: list[BaseException] = []
    # (An event, not Thread.join: a join that a signal interrupts marks the thread stopped while it runs.)
    done = threading.Event()

    def work() -> None:
        try:
            out.append(store.read_only_query(query))
        except BaseException as exc:  # handed to the main thread
            failed.append(exc)
        finally:
            done.set()

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        threading.Thread(target=work, name="specproxy-sql", daemon=True).start()
        if not done.wait(timeout):
            store.conn.interrupt()
            done.wait()
            raise click.ClickException(
                f"the query was stopped after its time limit of {timeout:g} s (--timeout to change it)"
            )
    except KeyboardInterrupt:
        store.conn.interrupt()
        done.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failed:
        raise failed[0]
    return out[0]


@click.command()
@click.argument("dbs", nargs=-1, metavar="[DB]...")
@click.option(
    "--parquet",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory for requests.parquet, runs.parquet, backend_metrics.parquet.",
)
@click.option("--run", "run", metavar="NAME", help="Only this run (its name or run_id).")
def export(dbs: tuple[str, ...], out_dir: str, run: str | None) -> None:
    """Export spans, runs and metrics as Parquet files, for a warehouse."""
    from specproxy.analysis.verdicts.evaluation import select_runs

    target = Path(out_dir)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.ClickException(f"cannot create {target}: {exc.strerror or exc}") from exc
    try:
        with open_store(_dbs(dbs)) as store:
            run_ids = [r["run_id"] for r in select_runs(store, run)] if run else None
            for table in ("requests", "runs", "backend_metrics"):
                path = target / f"{table}.parquet"
                where = ""
                if run_ids is not None:
                    where = " WHERE run_id IN (" + ", ".join(schema.sql_literal(r) for r in run_ids) + ")"
                n = store.conn.execute(f"SELECT count(*) FROM {table}{where}").fetchone()
                store.conn.execute(
                    f"COPY (SELECT * FROM {table}{where}) TO {schema.sql_literal(str(path))} "
                    "(FORMAT parquet, COMPRESSION zstd)"
                )
                click.echo(f"{path}: {n[0] if n else 0} rows")
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    except duckdb.Error as exc:
        raise click.ClickException(str(query_failure(exc, expand_paths(_dbs(dbs)), "export"))) from exc
