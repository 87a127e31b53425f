"""`specproxy serve` cut by its own shutdown: calls still running when `shutdown_grace_s` runs out end
with an error that says the proxy is shutting down, and their spans say the proxy cut them."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import duckdb
import orjson
import pytest

from tests.backends import BackendConfig, running_backend
from tests.support import started_serve, stop, wait_until

N = 64  # calls in flight at the signal: half streams, half plain


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
async def test_calls_running_at_the_end_of_the_grace_are_cut_with_an_error_the_client_sees(
    tmp_path: Path, stop_signal: signal.Signals
) -> None:
    db = tmp_path / "spans.duckdb"
    never = asyncio.Event()  # the backends never generate: every call outlasts the grace period
    async with (
        running_backend(BackendConfig(gate=never)) as base,
        running_backend(BackendConfig(gate=never)) as cand,
    ):
        cfg = tmp_path / "exp.toml"
        cfg.write_text(
            f'[experiment]\nname = "cut"\nmode = "shadow"\ndb = "{db}"\nshutdown_grace_s = 1\n\n'
            f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{base.url}"\n\n'
            f'[[arms]]\nname = "cand"\nurl = "{cand.url}"\n'
        )
        port, proc = await started_serve(cfg)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:

                async def one(i: int) -> tuple[int, bytes, str | None]:
                    body = {"model": "m", "prompt": f"p{i}", "stream": i % 2 == 0}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        return r.status, await r.read(), r.headers.get("Retry-After")

                tasks = [asyncio.create_task(one(i)) for i in range(N)]
                await wait_until(
                    lambda: base.stats.active == N and cand.stats.active == N, f"{N} calls in flight"
                )
                proc.send_signal(stop_signal)
                t0 = asyncio.get_running_loop().time()
                answers = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(proc.wait, 60)
            print(f"exit {asyncio.get_running_loop().time() - t0:.2f} s after {stop_signal.name} (grace 1 s)")
        finally:
            out = stop(proc)
    assert code == 0, out
    for i, (status, body, retry_after) in enumerate(answers):
        if i % 2 == 0:  # a stream under way: 200, then an error event
            assert status == 200, body[:300]
            event = body.rstrip().rsplit(b"\n\n", 1)[-1]
            assert event.startswith(b"data: "), body[-300:]
            error = orjson.loads(event[6:])["error"]
        else:
            assert (status, retry_after) == (503, "1"), body
            error = orjson.loads(body)["error"]
        assert error["code"] == 503 and "the proxy is shutting down" in error["message"], error
    assert f"{2 * N} spans written, 0 dropped" in out, out
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT arm, status, error FROM requests ORDER BY arm").fetchall()
    assert {(arm, status) for arm, status, _ in rows} == {
        ("base", "proxy_shutdown"),
        ("cand", "proxy_shutdown"),
    }
    assert all("cut by the proxy's shutdown" in error for _, _, error in rows)
