"""The proxy in-process on a real socket for tests, its span rows, and waiting for its calls to finish.

Example::

    async with running_proxy(tmp_path, [{"name": "base", "role": "baseline", "url": url}]) as p:
        ...  # send requests to p.url
        await wait_for_calls(p, 4)  # shadow copies finish after the client has its answer
    rows = spans(p.db)  # the span store is complete once the proxy has stopped
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
from aiohttp import web

from specproxy.config import Arm, parse_experiment
from specproxy.proxy.replay.runner import LoadPlan, ReplaySettings
from specproxy.proxy.server.app import STATE, ProxySettings, ProxyState, create_app
from specproxy.proxy.server.connections import ClientLimits, ProxyRunner
from tests.backends import BackendConfig, RunningBackend, running_backend
from tests.spanfactory import new_store
from tests.support import free_port, wait_for_count


@dataclass
class RunningProxy:
    url: str
    state: ProxyState
    db: Path

    def replay_settings(self, db_path: Path, load: LoadPlan) -> ReplaySettings:
        """An in-process replay through this proxy: its one arm, ``target``, the baseline."""
        arms = (Arm(name="target", url=self.url, role="baseline"),)
        return ReplaySettings(arms=arms, db_path=db_path, show_progress=False, load=load)


@asynccontextmanager
async def running_proxy(
    tmp_path: Path, arms: list[dict[str, Any]], **experiment: Any
) -> AsyncIterator[RunningProxy]:
    """The proxy on a free port; keyword arguments are [experiment] fields or ProxySettings fields."""
    settings_kw = {
        k: experiment.pop(k)
        for k in ("capture", "capture_responses", "api_key", "scrape_metrics")
        if k in experiment
    }
    exp = parse_experiment({"experiment": {"name": "t", **experiment}, "arms": arms})
    tmp_path.mkdir(parents=True, exist_ok=True)
    db = tmp_path / "spans.duckdb"
    if not db.exists():
        new_store(db)  # the sink's migration of a new file is most of a small test's CPU
    app = create_app(ProxySettings(experiment=exp, db=str(db), **settings_kw))
    limits = ClientLimits(exp.max_client_connections or 1000, header_timeout_s=exp.client_header_timeout_s)
    runner = ProxyRunner(app, limits, shutdown_timeout=5)  # what `specproxy serve` runs
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield RunningProxy(f"http://127.0.0.1:{port}", app[STATE], db)
    finally:
        await runner.cleanup()


@asynccontextmanager
async def one_arm_proxy(
    tmp_path: Path, cfg: BackendConfig | None = None, **experiment: Any
) -> AsyncIterator[tuple[RunningProxy, RunningBackend]]:
    """The proxy in front of one scripted backend, the baseline ``b``: yields the proxy and the backend.
    Keyword arguments are [experiment] fields, as for :func:`running_proxy`."""
    async with (
        running_backend(cfg or BackendConfig()) as base,
        running_proxy(tmp_path, [{"name": "b", "role": "baseline", "url": base.url}], **experiment) as p,
    ):
        yield p, base


@asynccontextmanager
async def two_arm_proxy(
    tmp_path: Path, cfg: BackendConfig
) -> AsyncIterator[tuple[RunningProxy, RunningBackend, RunningBackend]]:
    """The proxy in front of two scripted backends alike, baseline ``base`` and shadow candidate ``cand``:
    yields the proxy and the two backends."""
    async with (
        running_backend(cfg) as base,
        running_backend(cfg) as cand,
        running_proxy(
            tmp_path,
            [{"name": "base", "role": "baseline", "url": base.url}, {"name": "cand", "url": cand.url}],
        ) as p,
    ):
        yield p, base, cand


def spans(db: Path, where: str = "true") -> list[dict[str, Any]]:
    with duckdb.connect(str(db), read_only=True) as con:
        rel = con.execute(f"SELECT * FROM requests WHERE {where} ORDER BY t_start_ns")
        cols = [d[0] for d in rel.description]
        return [dict(zip(cols, row, strict=True)) for row in rel.fetchall()]


def calls_finished(p: RunningProxy, **labels: str) -> int:
    """Upstream calls the proxy has finished (primary, shadow, verify and dropped copies alike), or
    those whose labels (``arm``, ``route``, ``status``) match ``labels``."""
    return sum(
        int(sample.value)
        for metric in p.state.metrics.registry.collect()
        if metric.name == "specproxy_requests"
        for sample in metric.samples
        if sample.name == "specproxy_requests_total" and labels.items() <= sample.labels.items()
    )


async def wait_for_calls(p: RunningProxy, n: int, **labels: str) -> None:
    """Until the proxy has finished ``n`` upstream calls (matching ``labels``, if given); a shadow copy
    may end after its client's call, and its span is counted when it ends."""
    what = " ".join(["finished upstream calls", *(f"{k}={v}" for k, v in labels.items())])
    await wait_for_count(lambda: calls_finished(p, **labels), n, what)
