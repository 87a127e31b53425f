"""`specproxy serve` as a real subprocess loses no span silently: every call counted in /metrics is a row
in the store or a counted drop, with poisoned values too; after SIGKILL the store still opens."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import duckdb

from tests.backends import BackendConfig, running_backend
from tests.support import free_port, metric_totals, start_cli, stop, wait_http

BODY: dict[str, Any] = {"model": "m", "prompt": "p", "stream": True, "temperature": 0}


def _config(path: Path, base_url: str, cand_url: str, db: Path) -> Path:
    path.write_text(
        f'[experiment]\nname = "span-loss"\nmode = "shadow"\ndb = "{db}"\nshutdown_grace_s = 10\n\n'
        f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{base_url}"\n\n'
        f'[[arms]]\nname = "cand"\nurl = "{cand_url}"\n'
    )
    return path


@asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[tuple[subprocess.Popen[bytes], str, Path]]:
    db = tmp_path / "spans.duckdb"
    async with (
        running_backend(BackendConfig(tokens=4)) as base,
        running_backend(BackendConfig(tokens=4)) as cand,
    ):
        cfg = _config(tmp_path / "exp.toml", base.url, cand.url, db)
        port = free_port()
        proc = start_cli(["serve", "--config", str(cfg), "--port", str(port)])
        try:
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health", 30.0, proc)
            yield proc, f"http://127.0.0.1:{port}", db
        finally:
            stop(proc)
            if proc.stdout is not None:
                proc.stdout.close()


async def wait_for_metrics(url: str, done: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        for _ in range(2000):
            async with s.get(url + "/metrics") as r:
                totals = metric_totals(await r.text())
            if done(totals):
                return totals
            await asyncio.sleep(0.01)
    raise AssertionError(f"/metrics never got there: {totals}")


def raw_request(url: str, request_id: bytes) -> bytes:
    """A request whose X-Request-Id is not valid UTF-8 (no HTTP client library sends that)."""
    host, port = url.removeprefix("http://").split(":")
    body = b'{"model": "m", "prompt": "p", "temperature": 0}'
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: " + request_id + b"\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


async def test_calls_counted_equal_rows_plus_drops_with_poisoned_values(tmp_path: Path) -> None:
    async with serving(tmp_path) as (proc, url, db):
        async with aiohttp.ClientSession() as s:
            requests: list[tuple[dict[str, Any], dict[str, str]]] = [
                ({"seed": 18446744073709551615}, {"X-Request-Id": "seed"}),
                ({"max_tokens": 2147483648}, {"X-Request-Id": "max-tokens"}),
                ({"seed": -(2**63), "max_completion_tokens": -(2**40)}, {"X-Request-Id": "negative"}),
            ]
            requests += [({}, {"X-Request-Id": f"good-{i}"}) for i in range(6)]
            for extra, headers in requests:
                async with s.post(url + "/v1/completions", json=BODY | extra, headers=headers) as r:
                    await r.read()
            # A concurrency level out of range is the client's mistake: refused, no upstream call.
            headers = {"X-Request-Id": "level", "X-Specproxy-Concurrency-Level": "2147483648"}
            async with s.post(url + "/v1/completions", json=BODY, headers=headers) as r:
                assert r.status == 400
        await asyncio.to_thread(raw_request, url, b"bad-\xff\xfe-utf8")
        n_calls = 2 * (len(requests) + 1)  # each request: the baseline call and its shadow
        totals = await wait_for_metrics(url, lambda t: t.get("specproxy_requests_total", 0) >= n_calls)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
        out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    assert code == 0, out
    calls = int(totals["specproxy_requests_total"])
    exit_line = re.search(r"(\d+) spans written, (\d+) dropped", out)
    assert exit_line is not None, out
    written, dropped = int(exit_line[1]), int(exit_line[2])
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT count(*) FROM requests").fetchone()
        notes = dict(con.execute("SELECT request_id, any_value(notes) FROM requests GROUP BY 1").fetchall())
        stored = con.execute(
            "SELECT seed, max_tokens FROM requests WHERE request_id IN ('seed', 'negative') ORDER BY 1"
        ).fetchall()
    assert rows is not None
    assert calls == n_calls and calls == rows[0] + dropped and written == rows[0], (calls, rows, out)
    assert dropped == 0, out  # every poisoned value fits somewhere: NULL and a note
    assert "seed 18446744073709551615 is out of range for BIGINT" in notes["seed"]
    assert "max_tokens 2147483648 is out of range for INTEGER" in notes["max-tokens"]
    assert "level" not in notes
    assert notes["negative"] == "max_tokens -1099511627776 is out of range for INTEGER: stored as NULL"
    # The proxy makes a request id that is not UTF-8 a valid header value (percent-encoded) at the door.
    assert "bad-%FF%FE-utf8" in notes
    assert stored == [(-(2**63), None), (-(2**63), None), (None, None), (None, None)]  # BIGINT's bound fits
    assert all(notes[f"good-{i}"] is None for i in range(6))


async def test_after_sigkill_the_store_opens_and_keeps_every_span_reported_written(tmp_path: Path) -> None:
    async with serving(tmp_path) as (proc, url, db):
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> None:
                async with s.post(url + "/v1/completions", json=BODY, headers={"X-Request-Id": f"q{i}"}) as r:
                    await r.read()

            await asyncio.gather(*(one(i) for i in range(20)))
            # serve writes a batch at least every 2 s: wait for it, then send more that the kill catches
            first = await wait_for_metrics(url, lambda t: t.get("specproxy_spans_written_total", 0) >= 40)
            await asyncio.gather(*(one(i) for i in range(20, 30)))
            last = await wait_for_metrics(url, lambda t: t.get("specproxy_requests_total", 0) >= 60)
        proc.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(proc.wait, 30) == -signal.SIGKILL
    with duckdb.connect(str(db), read_only=True) as con:  # replays the write-ahead log
        rows = con.execute("SELECT count(*), count(DISTINCT request_id) FROM requests").fetchone()
        version = con.execute("SELECT max(version) FROM schema_version").fetchone()
    assert rows is not None and version is not None and version[0] >= 7
    # Every span reported written survives the kill; what it may lose is what was counted but not yet
    # written: the queue (at most one flush interval of calls) and the calls in flight.
    assert first["specproxy_spans_written_total"] >= 40
    assert int(last["specproxy_spans_written_total"]) <= rows[0] <= 60
