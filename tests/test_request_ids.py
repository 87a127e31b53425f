"""Request ids sent upstream are UUIDs, as some servers (llama-cpp-python's) require, and still join
the spans: a backend that refuses any other X-Request-Id, replayed to through the real CLI and
proxied to by serve's app."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import duckdb
from aiohttp import web

from specproxy.proxy.upstream.calls import upstream_request_id
from tests import processes
from tests.backends import STATS, BackendConfig, BackendStats, make_backend_app, serving_app
from tests.proxies import running_proxy, spans
from tests.support import replay_target_argv, wait_for_count

UUID = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}", re.IGNORECASE)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def uuid_request_ids_only(request: web.Request, handler: Handler) -> web.StreamResponse:
    """What llama-cpp-python's server does: an X-Request-Id that is not a UUID is a 400."""
    rid = request.headers.get("X-Request-Id")
    if rid is not None and not UUID.fullmatch(rid):
        return web.json_response({"error": {"message": "Wrong X-Request-ID format"}}, status=400)
    return await handler(request)


@asynccontextmanager
async def strict_backend() -> AsyncIterator[tuple[str, BackendStats]]:
    app = make_backend_app(BackendConfig(tokens=4))
    app.middlewares.append(uuid_request_ids_only)
    async with serving_app(app, access_log=None) as port:
        yield f"http://127.0.0.1:{port}", app[STATS]


def test_upstream_ids_are_uuids_that_keep_the_id_they_stand_for() -> None:
    given = "3f2b9c1e-0d4a-4e8b-9c7d-1a2b3c4d5e6f"
    assert upstream_request_id(given) == given
    assert upstream_request_id(given.replace("-", "")) == given.replace("-", "")
    for rid in ("replay-1-c4-00001-q7", "日本", "a\udcffb", "", "0" * 31):
        sent = upstream_request_id(rid)
        assert UUID.fullmatch(sent) and sent.isascii(), rid
        assert upstream_request_id(rid) == sent
    assert upstream_request_id("a") != upstream_request_id("b")


async def test_replay_through_a_proxy_to_a_server_that_takes_only_uuids(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"prompt": f"q{i}", "output_tokens": 3}) + "\n" for i in range(6)))
    db = tmp_path / "replay.duckdb"
    async with (
        strict_backend() as (url, stats),
        running_proxy(tmp_path / "proxy", [{"name": "base", "role": "baseline", "url": url}]) as proxy,
    ):
        # in a thread: the proxy it goes through runs on this event loop
        argv = replay_target_argv(log, proxy.url, db, "--concurrency", "2", "--rounds", "1")
        replay = await asyncio.to_thread(processes.run, argv)
    assert replay.returncode == 0, replay.stderr
    with duckdb.connect(str(db), read_only=True) as conn:
        rows = conn.execute("SELECT request_id, status FROM requests").fetchall()
    assert len(rows) == 6 and {status for _, status in rows} == {"ok"}
    replayed = sorted(rid for rid, _ in rows)
    assert all(UUID.fullmatch(rid) for rid in replayed)
    # the proxy's spans and the backend's requests carry the very ids replay stored: they join
    assert sorted(r["request_id"] for r in spans(proxy.db)) == replayed
    assert sorted(h["X-Request-Id"] for h in stats.headers) == replayed


async def test_serve_forwards_one_uuid_per_client_request_to_every_arm(tmp_path: Path) -> None:
    async with strict_backend() as (base_url, base), strict_backend() as (cand_url, cand):
        arms = [
            {"name": "base", "role": "baseline", "url": base_url},
            {"name": "cand", "url": cand_url},
        ]
        async with running_proxy(tmp_path, arms) as proxy, aiohttp.ClientSession() as session:
            for rid in ("client-7", "7b0e8c52-3f1d-4c9a-8e2b-5d6f7a8b9c0d"):
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
                async with session.post(
                    proxy.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["X-Request-Id"] == rid
                    await resp.read()
            # the shadow is called beside the primary and may answer later
            await wait_for_count(lambda: len(cand.headers), 2, "shadow calls")
    assert [h["X-Request-Id"] for h in base.headers] == [
        upstream_request_id("client-7"),
        "7b0e8c52-3f1d-4c9a-8e2b-5d6f7a8b9c0d",
    ]
    assert [h["X-Request-Id"] for h in cand.headers] == [h["X-Request-Id"] for h in base.headers]
    stored = {(r["arm"], r["request_id"], r["status"]) for r in spans(proxy.db)}
    assert stored == {
        (arm, rid, "ok")
        for arm in ("base", "cand")
        for rid in ("client-7", "7b0e8c52-3f1d-4c9a-8e2b-5d6f7a8b9c0d")
    }
