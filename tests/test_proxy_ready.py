"""``GET /ready`` turns 503 (with its reason) as soon as the baseline goes away, and back to 200 when it
returns; ``GET /health`` stays 200 throughout (liveness, not readiness)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from specproxy.proxy.server.readiness import SinkCounts, span_store_problem
from tests.backends import BackendConfig, running_backend
from tests.proxies import running_proxy
from tests.support import WAIT_S, free_port


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


async def test_ready_follows_the_baseline_and_health_does_not(tmp_path: Path) -> None:
    port = free_port()
    arms = [{"name": "base", "role": "baseline", "url": f"http://127.0.0.1:{port}"}]
    async with running_proxy(tmp_path, arms, scrape_metrics=False) as p, aiohttp.ClientSession() as s:
        async with running_backend(BackendConfig(), port=port):
            status, body = await _get(s, p.url + "/ready")
            assert (status, body["status"], body["reasons"]) == (200, "ready", [])
        # The backend has stopped: the very next probe sees it (each /ready probes the baseline).
        status, body = await _get(s, p.url + "/ready")
        assert status == 503 and body["status"] == "not ready"
        assert "baseline base is unreachable" in body["reasons"][0]
        assert (await _get(s, p.url + "/health"))[0] == 200
        async with running_backend(BackendConfig(), port=port), asyncio.timeout(WAIT_S):
            while (await _get(s, p.url + "/ready"))[0] != 200:  # a probe's poll, as a balancer's
                pass


async def test_a_baseline_whose_health_fails_is_not_ready(tmp_path: Path) -> None:
    cfg = BackendConfig(health_status=500)  # vLLM's /health once its engine has died
    async with running_backend(cfg) as base:
        arms = [{"name": "base", "role": "baseline", "url": base.url}]
        async with running_proxy(tmp_path, arms, scrape_metrics=False) as p, aiohttp.ClientSession() as s:
            status, body = await _get(s, p.url + "/ready")
            assert status == 503
            assert body["reasons"] == ["baseline base answered /health with HTTP 500"]
            cfg.health_status = 200
            assert (await _get(s, p.url + "/ready"))[0] == 200


def test_span_store_problems() -> None:
    fine = SinkCounts(written=10, failed=0, queue_depth=0, queue_size=100)
    assert span_store_problem(None, fine) is None
    assert span_store_problem(fine, fine) is None
    failing = SinkCounts(written=10, failed=4, queue_depth=3, queue_size=100)
    assert "failed to write 4 spans" in (span_store_problem(fine, failing) or "")
    recovered = SinkCounts(written=11, failed=4, queue_depth=0, queue_size=100)
    assert span_store_problem(failing, recovered) is None
    full = SinkCounts(written=11, failed=4, queue_depth=100, queue_size=100)
    assert "queue is full" in (span_store_problem(recovered, full) or "")
