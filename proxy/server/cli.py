"""`specproxy serve`: parse options, build :class:`~specproxy.proxy.server.app.ProxySettings`, run the app.

One process by default. ``--workers N`` starts N worker processes on the same port (SO_REUSEPORT:
the kernel spreads connections over them); each writes its own span store ``<stem>.w<i><suffix>``
next to the configured one (DuckDB allows one writer per file), all under one run id.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specproxy.commandline import db_option, listen_options, run_async
from specproxy.config import ConfigError, Experiment, load_experiment

if TYPE_CHECKING:
    from specproxy.proxy.server.app import ProxySettings

log = logging.getLogger("specproxy.serve")


def worker_path(path: str, index: int) -> str:
    """``specproxy.duckdb`` → ``specproxy.w0.duckdb``: the file of worker ``index``."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.w{index}{p.suffix}"))


@click.command("serve")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="The experiment file (TOML): mode, arms, timeouts.",
)
@listen_options()
@db_option
@click.option(
    "--capture",
    default=None,
    type=click.Path(dir_okay=False),
    help="Append every client request to this JSONL file (the format `specproxy replay` reads).",
)
@click.option(
    "--capture-responses", is_flag=True, help="With --capture: also keep the text each client received."
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Worker processes sharing the port (SO_REUSEPORT); worker i writes <db stem>.w<i>.duckdb.",
)
@click.option("--run-id", default=None, help="Run id for the span store (default: a new one).")
@click.option("--no-scrape", is_flag=True, help="Do not scrape the arms' /metrics into backend_metrics.")
@click.option(
    "--db-memory",
    default="256MB",
    show_default=True,
    help="Memory cap of the span writer's DuckDB connection (DuckDB size: 256MB, 1GB); per worker.",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Log verbosity (stderr).",
)
@click.option("--worker-index", default=None, type=int, hidden=True)
@click.option("--parent-pid", default=None, type=int, hidden=True)
def serve(
    config_path: str,
    host: str,
    port: int,
    db_path: Path | None,
    capture: str | None,
    capture_responses: bool,
    workers: int,
    run_id: str | None,
    no_scrape: bool,
    db_memory: str,
    log_level: str,
    worker_index: int | None,
    parent_pid: int | None,
) -> None:
    """Run the proxy in front of the experiment's arms (shadow or split mode) and write a span per
    upstream call to the DuckDB span store.

    Clients talk to it as to any OpenAI-compatible server (POST /v1/chat/completions, /v1/completions;
    GET /v1/models, /health, /metrics). SIGTERM, SIGHUP or Ctrl-C: stop accepting, let in-flight
    requests finish (shutdown_grace_s), write every span, exit.

    Example: specproxy serve --config exp.toml --port 8000
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        exp = load_experiment(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    for arm in exp.arms:
        if arm.api_key_env and not os.environ.get(arm.api_key_env):
            click.echo(
                f"warning: arm {arm.name!r}: environment variable {arm.api_key_env} is not set; "
                "calls go without an API key",
                err=True,
            )
    db = str(db_path) if db_path is not None else exp.db
    run_id = run_id or uuid.uuid4().hex
    if workers > 1:
        if port == 0:
            raise click.ClickException("--workers needs a fixed --port (with 0 each worker gets its own)")
        _run_workers(
            config_path,
            host,
            port,
            db,
            capture,
            capture_responses,
            workers,
            run_id,
            no_scrape,
            log_level,
            db_memory,
        )
        return
    _run_one(
        exp,
        host,
        port,
        db,
        capture,
        capture_responses,
        run_id,
        no_scrape,
        worker_index,
        db_memory,
        parent_pid,
    )


# The signals a proxy gets in normal operation (a supervisor's stop, Ctrl-C, a closed terminal): each
# ends in the same graceful, accounted shutdown (SIGHUP's default action would kill it on the spot).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _EarlyStop:
    """Stop signals that arrive while the proxy is still starting (imports, opening the span store):
    remembered, so that startup completes and the proxy then shuts down cleanly, its run recorded."""

    requested = False

    @classmethod
    def note(cls, signum: int, _frame: object) -> None:
        cls.requested = True


def _run_one(
    exp: Experiment,
    host: str,
    port: int,
    db: str,
    capture: str | None,
    capture_responses: bool,
    run_id: str,
    no_scrape: bool,
    worker_index: int | None,
    db_memory: str,
    parent_pid: int | None = None,
) -> None:
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _EarlyStop.note)
    if parent_pid is not None:
        _stop_with_parent(parent_pid)
    from specproxy.proxy.server.app import ProxySettings

    settings = ProxySettings(
        experiment=exp,
        db=db,
        run_id=run_id,
        capture=capture,
        capture_responses=capture_responses,
        api_key=os.environ.get("SPECPROXY_API_KEY") or None,
        scrape_metrics=not no_scrape,
        worker_index=worker_index,
        db_memory_limit=db_memory,
    )
    run_async(_serve(settings, host, port, reuse_port=worker_index is not None))


async def _serve(settings: ProxySettings, host: str, port: int, *, reuse_port: bool) -> None:
    from aiohttp import web

    from specproxy.proxy.server.app import STATE, create_app
    from specproxy.proxy.server.connections import ClientLimits, ProxyRunner, default_max_connections
    from specproxy.proxy.spans.sink import SpanSinkError

    exp = settings.experiment
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    if _EarlyStop.requested:
        stop.set()
    app = create_app(settings)
    st = app[STATE]
    where = f" (worker {settings.worker_index})" if settings.worker_index is not None else ""
    limits = ClientLimits(
        max_connections=exp.max_client_connections or default_max_connections(len(exp.arms)),
        header_timeout_s=exp.client_header_timeout_s,
    )
    runner = ProxyRunner(app, limits, shutdown_timeout=exp.shutdown_grace_s)
    try:
        await runner.setup()
    except SpanSinkError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None, backlog=2048)
        try:
            await site.start()
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        # Everything made at startup (imports, OTel, DuckDB) lives for the whole run: move it out of
        # the collector's sight so that full collections under load do not walk it again and again.
        gc.collect()
        gc.freeze()
        click.echo(
            f"specproxy serve{where}: listening on http://{host}:{port}, mode {exp.mode}, "
            f"baseline {exp.baseline.name} at {exp.baseline.url}, run {st.run_id}, "
            f"spans -> {settings.db or exp.db}",
            err=True,
        )
        parent_watch = asyncio.create_task(_ParentWatch.wait_for_parent_death(stop))
        await stop.wait()
        parent_watch.cancel()
        click.echo(f"specproxy serve{where}: shutting down (grace {exp.shutdown_grace_s:.0f}s)", err=True)
    finally:
        await runner.cleanup()
    sink = st.sink
    if sink is not None:
        click.echo(f"specproxy serve{where}: {sink.written} spans written, {sink.dropped} dropped", err=True)


def _stop_with_parent(parent_pid: int) -> None:
    """A worker shuts down (SIGTERM: requests finish, spans are written) when the ``serve --workers``
    process that started it dies, even by SIGKILL; otherwise it would keep the port and its span store.

    Linux delivers the signal itself (PR_SET_PDEATHSIG); elsewhere :func:`_serve` polls the parent."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
                _ParentWatch.kernel = True
        except (OSError, AttributeError):
            pass
    _ParentWatch.pid = parent_pid
    if os.getppid() != parent_pid:  # it died before the signal was set up
        _EarlyStop.requested = True


_PR_SET_PDEATHSIG = 1


class _ParentWatch:
    pid: int | None = None
    kernel = False  # the kernel signals the parent's death; no polling needed

    @classmethod
    async def wait_for_parent_death(cls, stop: asyncio.Event) -> None:
        while cls.pid is not None and not cls.kernel:
            if os.getppid() != cls.pid:
                log.warning("the parent serve process %d is gone: shutting down", cls.pid)
                stop.set()
                return
            await asyncio.sleep(1.0)


def _run_workers(
    config_path: str,
    host: str,
    port: int,
    db: str,
    capture: str | None,
    capture_responses: bool,
    workers: int,
    run_id: str,
    no_scrape: bool,
    log_level: str,
    db_memory: str,
) -> None:
    procs: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    for sig in _STOP_SIGNALS:
        signal.signal(sig, forward)
    for i in range(workers):
        argv = [
            sys.executable,
            "-m",
            "specproxy",
            "serve",
            "--config",
            config_path,
            "--host",
            host,
            "--port",
            str(port),
            "--db",
            worker_path(db, i),
            "--run-id",
            run_id,
            "--worker-index",
            str(i),
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            log_level,
            "--db-memory",
            db_memory,
        ]
        if capture:
            argv += ["--capture", worker_path(capture, i)]
            if capture_responses:
                argv.append("--capture-responses")
        if no_scrape:  # (otherwise the first worker writes the scrapes, the others read the gauges)
            argv.append("--no-scrape")
        procs.append(subprocess.Popen(argv))
    stopping = False
    while any(p.poll() is None for p in procs):
        # A worker that dies on its own (port taken, span store locked) takes the others down with it.
        if not stopping and any(p.poll() not in (None, 0) for p in procs):
            stopping = True
            forward(signal.SIGTERM, None)
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    failed = [i for i, c in enumerate(codes) if c not in (0, -signal.SIGTERM, -signal.SIGINT)]
    if failed:
        raise click.ClickException(f"worker(s) {failed} exited with {[codes[i] for i in failed]}")
