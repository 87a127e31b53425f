"""`specproxy serve` as a real subprocess: SIGTERM under load loses no span; --workers; user mistakes."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import duckdb
import pytest
from click.testing import CliRunner

from specproxy.cli import main
from tests.backends import BackendConfig, running_backend
from tests.support import free_port, http_ok, start_cli, stop, wait_http, wait_until, wait_until_sync


def _stop(proc: subprocess.Popen[bytes]) -> str:
    out = stop(proc)
    if proc.stdout is not None:
        proc.stdout.close()
    return out


def _write_config(path: Path, base_url: str, cand_url: str | None, db: Path) -> Path:
    text = f'[experiment]\nname = "serve-test"\nmode = "shadow"\ndb = "{db}"\nshutdown_grace_s = 10\n\n'
    text += f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{base_url}"\n'
    if cand_url:
        text += f'\n[[arms]]\nname = "cand"\nurl = "{cand_url}"\n'
        text += 'speculative = { method = "ngram", num_speculative_tokens = 3 }\n'
    path.write_text(text)
    return path


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
async def test_a_stop_signal_under_load_finishes_requests_and_writes_every_span(
    tmp_path: Path, stop_signal: signal.Signals
) -> None:
    db = tmp_path / "spans.duckdb"
    n = 24
    release = asyncio.Event()  # the backends generate once the proxy has been told to stop
    async with (
        running_backend(BackendConfig(itl_s=0.02, tokens=30, gate=release)) as base,
        running_backend(BackendConfig(itl_s=0.02, tokens=30, tokens_per_chunk=3, gate=release)) as cand,
    ):
        cfg = _write_config(tmp_path / "exp.toml", base.url, cand.url, db)
        port = free_port()
        proc = start_cli(["serve", "--config", str(cfg), "--port", str(port)])
        try:
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health", 30.0, proc)
            async with aiohttp.ClientSession() as s:

                async def one(i: int) -> bytes:
                    body = {"model": "m", "prompt": f"p{i}", "stream": True, "temperature": 0}
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                        assert r.status == 200
                        return await r.read()

                tasks = [asyncio.create_task(one(i)) for i in range(n)]
                await wait_until(
                    lambda: base.stats.active == n and cand.stats.active == n,
                    f"all {n} requests and their shadow copies in flight",
                )
                proc.send_signal(stop_signal)
                health = f"http://127.0.0.1:{port}/health"
                stopping = "the proxy to stop taking connections"
                await asyncio.to_thread(wait_until_sync, lambda: not http_ok(health), stopping)
                release.set()
                bodies = await asyncio.gather(*tasks)
            assert all(b.endswith(b"data: [DONE]\n\n") for b in bodies)  # graceful: all finished
            code = await asyncio.to_thread(proc.wait, 30)
        finally:
            out = _stop(proc)
    assert code == 0, out
    assert f"{2 * n} spans written, 0 dropped" in out
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute(
            "SELECT arm, status, count(*), count(DISTINCT request_id) FROM requests GROUP BY ALL ORDER BY arm"
        ).fetchall()
        run = con.execute("SELECT name, mode, ended_at IS NOT NULL FROM runs").fetchall()
        scraped = con.execute("SELECT DISTINCT arm, name FROM backend_metrics ORDER BY arm").fetchall()
    assert rows == [("base", "ok", n, n), ("cand", "ok", n, n)]
    # The arms' /metrics were scraped (at least once, at shutdown).
    assert scraped == [("base", "vllm:num_requests_running"), ("cand", "vllm:num_requests_running")]
    assert run == [("serve-test", "shadow", True)]


async def test_workers_share_the_port_and_write_one_store_each(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    async with running_backend(BackendConfig(tokens=3)) as base:
        cfg = _write_config(tmp_path / "exp.toml", base.url, None, db)
        often = cfg.read_text().replace("shutdown_grace_s", "scrape_interval_s = 0.5\nshutdown_grace_s")
        cfg.write_text(often)
        port = free_port()
        proc = start_cli(
            ["serve", "--config", str(cfg), "--port", str(port), "--workers", "2", "--run-id", "shared-run"]
        )
        try:
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health", 40.0, proc)
            files = [tmp_path / f"spans.w{i}.duckdb" for i in (0, 1)]
            # Both workers are past their signal set-up once their stores exist.
            await wait_until(lambda: all(f.exists() for f in files), "both workers' span stores")
            # Each worker reads the arm's gauges every 0.5 s (only the first writes the scrapes).
            await wait_until(lambda: base.stats.metrics_reads >= 6, "a few reads of the arm's /metrics")
            # Each request on its own connection, so the kernel spreads them over the workers.
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                for i in range(30):
                    body = {"model": "m", "prompt": f"p{i}"}
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                        assert r.status == 200
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
        finally:
            out = _stop(proc)
    assert code == 0, out
    total = 0
    for i in (0, 1):
        with duckdb.connect(str(tmp_path / f"spans.w{i}.duckdb"), read_only=True) as con:
            total += con.execute("SELECT count(*) FROM requests WHERE run_id = 'shared-run'").fetchone()[0]  # type: ignore[index]
            assert con.execute("SELECT run_id FROM runs").fetchall() == [("shared-run",)]
            # Every worker's calls carry the engine's gauges, not only the scraping worker's.
            with_gauges = "SELECT count(*) FROM requests WHERE engine_running IS NOT NULL"
            assert con.execute(with_gauges).fetchone()[0] > 0, f"worker {i}: no span with engine gauges"  # type: ignore[index]
            scraped = con.execute("SELECT count(*) FROM backend_metrics").fetchone()[0]  # type: ignore[index]
            assert (scraped > 0) == (i == 0), f"worker {i}: {scraped} backend_metrics rows"
    assert total == 30
    assert not db.exists()


def test_sigterm_while_starting_still_records_the_run(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    cfg = _write_config(tmp_path / "exp.toml", f"http://127.0.0.1:{free_port()}", None, db)
    proc = start_cli(["serve", "--config", str(cfg), "--port", str(free_port())])
    try:
        # The span store appears while the proxy is starting.
        wait_until_sync(lambda: db.exists() or proc.poll() is not None, "the span store to be created")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    finally:
        out = _stop(proc)
    assert code == 0, out
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs WHERE ended_at IS NOT NULL").fetchone() == (1,)


def test_a_span_store_held_by_another_process_is_a_sentence(tmp_path: Path) -> None:
    db = tmp_path / "held.duckdb"
    # Holds the file until killed.
    hold = "import duckdb, sys; c = duckdb.connect(sys.argv[1]); print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        cfg = _write_config(tmp_path / "exp.toml", f"http://127.0.0.1:{free_port()}", None, db)
        result = CliRunner().invoke(main, ["serve", "--config", str(cfg), "--port", str(free_port())])
    finally:
        holder.kill()
        holder.wait()
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()
    assert result.exit_code == 1, result.output
    assert str(db) in result.output and "Traceback" not in result.output


def test_config_mistakes_are_sentences_not_tracebacks(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(main, ["serve", "--config", str(tmp_path / "nope.toml")])
    assert missing.exit_code == 1 and "cannot read the experiment file" in missing.output
    bad = tmp_path / "bad.toml"
    bad.write_text('[[arms]]\nname = "a"\nurl = "ftp://x"\nrole = "baseline"\n')
    result = runner.invoke(main, ["serve", "--config", str(bad)])
    assert result.exit_code == 1 and "arms[0].url: must start with http://" in result.output
    assert "Traceback" not in result.output
    helped = runner.invoke(main, ["serve", "--help"])
    assert helped.exit_code == 0 and "--workers" in helped.output and "--capture" in helped.output


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_workers_shut_down_when_the_parent_is_killed(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    async with running_backend(BackendConfig(tokens=3)) as base:
        cfg = _write_config(tmp_path / "exp.toml", base.url, None, db)
        port = free_port()
        proc = start_cli(["serve", "--config", str(cfg), "--port", str(port), "--workers", "2"])
        try:
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health", 40.0, proc)
            files = [tmp_path / f"spans.w{i}.duckdb" for i in (0, 1)]
            deadline = time.monotonic() + 60
            while not (all(f.exists() for f in files) and len(_children(proc.pid)) == 2):
                assert time.monotonic() < deadline, _children(proc.pid)
                await asyncio.sleep(0.05)
            workers = _children(proc.pid)
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 10)
            deadline = time.monotonic() + 90  # they finish shutting down (spans written) and exit
            while any(_alive(w) for w in workers) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not any(_alive(w) for w in workers), [w for w in workers if _alive(w)]
        finally:
            out = _stop(proc)
    for f in files:  # each worker closed its store cleanly, with its run ended
        with duckdb.connect(str(f), read_only=True) as con:
            assert con.execute("SELECT count(*) FROM runs WHERE ended_at IS NOT NULL").fetchone() == (1,), out
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (closed connections may linger)
        s.bind(("127.0.0.1", port))  # nothing listens on the port any more
