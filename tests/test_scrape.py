"""The metrics scraper against small aiohttp servers that serve vLLM-format /metrics text."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import duckdb
import pytest
from aiohttp import web

from specproxy.config import Arm
from specproxy.proxy.spans.sink import SpanSink
from specproxy.proxy.upstream.scrape import (
    SPEC_ACCEPTED,
    SPEC_ACCEPTED_PER_POS,
    SPEC_DRAFTS,
    EngineLoad,
    MetricsScraper,
    Snapshot,
    counter_delta,
    counter_deltas,
    engine_load,
    engine_load_from_text,
    parse_metrics,
    spec_decode_summary,
)
from tests.backends import BackendConfig, running_backend
from tests.proxies import running_proxy
from tests.support import free_port, wait_for_count, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def vllm_metrics_text(engines: Mapping[str, Mapping[str, float]]) -> str:
    """/metrics as vLLM 0.33 writes it (prometheus_client exposition): per engine, counters with their
    `_created` companions, gauges, a histogram and the per-position acceptance counter."""
    out: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for sample_name, labels, value in samples:
            text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            out.append(f"{sample_name}{{{text}}} {value!r}")

    def base(engine: str) -> dict[str, str]:
        return {"engine": engine, "model_name": MODEL}

    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        [("vllm:num_requests_running", base(e), v["running"]) for e, v in engines.items()],
    )
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        [("vllm:kv_cache_usage_perc", base(e), 0.25) for e in engines],
    )
    for short, key in [
        ("spec_decode_num_drafts", "drafts"),
        ("spec_decode_num_draft_tokens", "draft_tokens"),
        ("spec_decode_num_accepted_tokens", "accepted"),
        ("generation_tokens", "generated"),
    ]:
        name = f"vllm:{short}"
        family(
            f"{name}",
            "counter",
            f"Number of {short}.",
            [(f"{name}_total", base(e), v[key]) for e, v in engines.items()],
        )
        family(
            f"{name}_created",
            "gauge",
            f"Number of {short}.",
            [(f"{name}_created", base(e), 1.7724e9) for e in engines],
        )
    family(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "counter",
        "Accepted tokens per draft position.",
        [
            (SPEC_ACCEPTED_PER_POS, {**base(e), "position": str(p)}, v[f"pos{p}"])
            for e, v in engines.items()
            for p in range(3)
        ],
    )
    family(
        "vllm:time_to_first_token_seconds",
        "histogram",
        "Histogram of time to first token in seconds.",
        [
            s
            for e in engines
            for s in [
                ("vllm:time_to_first_token_seconds_bucket", {**base(e), "le": "0.05"}, 3.0),
                ("vllm:time_to_first_token_seconds_bucket", {**base(e), "le": "+Inf"}, 4.0),
                ("vllm:time_to_first_token_seconds_count", base(e), 4.0),
                ("vllm:time_to_first_token_seconds_sum", base(e), 0.31),
            ]
        ],
    )
    family(
        "python_gc_objects_collected",
        "counter",
        "Objects collected during gc",
        [("python_gc_objects_collected_total", {"generation": "0"}, 123.0)],
    )
    return "\n".join(out) + "\n"


def engine_state(
    drafts: float, draft_tokens: float, accepted: float, pos: tuple[float, float, float], running: float = 2.0
) -> dict[str, float]:
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted": accepted,
        "generated": accepted * 2,
        "running": running,
        "pos0": pos[0],
        "pos1": pos[1],
        "pos2": pos[2],
    }


class FakeVllm:
    """A backend whose /metrics text the test changes between scrapes."""

    def __init__(self) -> None:
        self.text = ""
        self.hits = 0

    async def metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.Response(text=self.text, content_type="text/plain", charset="utf-8")


async def start(aiohttp_server: Any, routes: dict[str, Any]) -> str:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    server = await aiohttp_server(app, host="127.0.0.1")
    return f"http://127.0.0.1:{server.port}"


def snap(series: dict[str, dict[tuple[tuple[str, str], ...], float]], arm: str = "a") -> Snapshot:
    return Snapshot(arm=arm, scraped_at=datetime.now(UTC), series=series)


def test_counter_delta_sums_engines_and_handles_a_reset() -> None:
    e0, e1, e2 = (("engine", "0"),), (("engine", "1"),), (("engine", "2"),)
    before = snap({SPEC_DRAFTS: {e0: 100.0, e1: 500.0}})
    # Engine 1 restarted (500 → 30: counted from zero, so +30); engine 2 is new (+7); engine 0 +50.
    after = snap({SPEC_DRAFTS: {e0: 150.0, e1: 30.0, e2: 7.0}})
    assert counter_delta(before, after, SPEC_DRAFTS) == 50 + 30 + 7
    assert counter_deltas(before, after, SPEC_DRAFTS) == {(): 87.0}
    assert counter_delta(before, after, "vllm:absent_total") is None
    failed = Snapshot(arm="a", scraped_at=datetime.now(UTC), error="refused")
    assert counter_delta(failed, after, SPEC_DRAFTS) is None


def test_spec_decode_summary_is_vllms_arithmetic() -> None:
    def pos(p: str, e: str) -> tuple[tuple[str, str], ...]:
        return (("engine", e), ("position", p))

    e0, e1 = (("engine", "0"),), (("engine", "1"),)
    before = snap(
        {
            SPEC_DRAFTS: {e0: 10, e1: 10},
            "vllm:spec_decode_num_draft_tokens_total": {e0: 30, e1: 30},
            SPEC_ACCEPTED: {e0: 20, e1: 20},
            SPEC_ACCEPTED_PER_POS: {
                pos("0", "0"): 9,
                pos("1", "0"): 7,
                pos("2", "0"): 4,
                pos("0", "1"): 9,
                pos("1", "1"): 7,
                pos("2", "1"): 4,
            },
        }
    )
    after = snap(
        {
            SPEC_DRAFTS: {e0: 60, e1: 110},
            "vllm:spec_decode_num_draft_tokens_total": {e0: 180, e1: 330},
            SPEC_ACCEPTED: {e0: 120, e1: 220},
            SPEC_ACCEPTED_PER_POS: {
                pos("0", "0"): 54,
                pos("1", "0"): 42,
                pos("2", "0"): 24,
                pos("0", "1"): 99,
                pos("1", "1"): 77,
                pos("2", "1"): 44,
            },
        }
    )
    summary = spec_decode_summary(before, after)
    # Δdrafts = 50 + 100 = 150, Δdraft_tokens = 450, Δaccepted = 300, Δper_pos = 135, 105, 60.
    assert summary == {
        "num_drafts": 150.0,
        "draft_tokens": 450.0,
        "accepted_tokens": 300.0,
        "acceptance_rate": 300 / 450,
        "mean_acceptance_length": 1 + 300 / 150,
        "per_position_rates": [135 / 150, 105 / 150, 60 / 150],
    }
    # An arm without speculative decoding: nothing to report, no division by zero.
    plain = snap({"vllm:num_requests_running": {e0: 1.0}})
    assert spec_decode_summary(plain, plain) == {
        "num_drafts": None,
        "draft_tokens": None,
        "accepted_tokens": None,
        "acceptance_rate": None,
        "mean_acceptance_length": None,
        "per_position_rates": [],
    }


def test_parse_keeps_vllm_series_and_drops_created() -> None:
    text = vllm_metrics_text(
        {"0": engine_state(10, 30, 20, (9, 7, 4)), "1": engine_state(1, 3, 2, (1, 1, 0))}
    )
    s = parse_metrics("eagle3", text)
    assert s.ok and s.arm == "eagle3"
    assert not any(n.endswith("_created") or not n.startswith("vllm:") for n in s.series)
    assert s.value(SPEC_DRAFTS) == 11.0
    assert s.value(SPEC_DRAFTS, engine="1") == 1.0
    assert s.value(SPEC_ACCEPTED_PER_POS, position="1") == 8.0
    assert s.value("vllm:time_to_first_token_seconds_bucket", le="+Inf") == 8.0
    with pytest.raises(ValueError):
        parse_metrics("x", "<html>definitely { not prometheus\n")


async def test_scrapes_land_in_backend_metrics_and_give_deltas(aiohttp_server: Any, tmp_path: Path) -> None:
    vllm = FakeVllm()
    url = await start(aiohttp_server, {"/metrics": vllm.metrics})
    arms = [Arm(name="eagle3", url=url + "/")]
    db = tmp_path / "spans.duckdb"
    sink = SpanSink(db, flush_interval_s=0.05)
    sink.start()
    try:
        async with aiohttp.ClientSession() as session:
            scraper = MetricsScraper(arms, sink, session, run_id="run-1", interval_s=5.0)
            vllm.text = vllm_metrics_text(
                {
                    "0": engine_state(100, 300, 200, (90, 70, 40)),
                    "1": engine_state(1000, 3000, 2000, (900, 700, 400)),
                }
            )
            before = await scraper.scrape_once("c=16:before")
            # Engine 0 moves on; engine 1 restarted and has counted a little since.
            vllm.text = vllm_metrics_text(
                {
                    "0": engine_state(150, 450, 300, (135, 105, 60)),
                    "1": engine_state(50, 150, 100, (45, 35, 20)),
                }
            )
            after = await scraper.scrape_once("c=16:after")
    finally:
        sink.close()
    b, a = before["eagle3"], after["eagle3"]
    assert b.ok and a.ok and scraper.latest["eagle3"] is a
    # the running gauge summed over both engines; this backend exports no waiting gauge
    load = scraper.engine_load["eagle3"]
    assert load[:2] == (4.0, None), load
    # stamped with the moment of its reading, which a call's span turns into the gauges' age
    assert load.read_at == scraper.load_read_at["eagle3"] and load.read_at <= time.monotonic()
    summary = spec_decode_summary(b, a)
    # Δdrafts = 50 (engine 0) + 50 (engine 1 from zero); Δdraft_tokens 300; Δaccepted 200.
    assert (summary["num_drafts"], summary["draft_tokens"], summary["accepted_tokens"]) == (100, 300, 200)
    assert summary["acceptance_rate"] == pytest.approx(200 / 300)
    assert summary["mean_acceptance_length"] == pytest.approx(3.0)
    assert summary["per_position_rates"] == pytest.approx([90 / 100, 70 / 100, 40 / 100])

    with duckdb.connect(str(db), read_only=True) as conn:
        rows = conn.execute(
            "SELECT run_id, arm, phase, name, labels_json, value, scraped_at FROM backend_metrics"
        ).fetchall()
    per_scrape = sum(len(v) for v in a.series.values())
    assert len(rows) == 2 * per_scrape
    assert {r[2] for r in rows} == {"c=16:before", "c=16:after"}
    assert all(r[0] == "run-1" and r[1] == "eagle3" and r[3].startswith("vllm:") for r in rows)
    assert not any(r[3].endswith("_created") for r in rows)
    drafts = {(r[2], json.loads(r[4])["engine"]): r[5] for r in rows if r[3] == SPEC_DRAFTS}
    assert drafts == {
        ("c=16:before", "0"): 100.0,
        ("c=16:before", "1"): 1000.0,
        ("c=16:after", "0"): 150.0,
        ("c=16:after", "1"): 50.0,
    }
    labels = next(json.loads(r[4]) for r in rows if r[3] == SPEC_ACCEPTED_PER_POS)
    assert set(labels) == {"engine", "model_name", "position"}
    assert {r[6] for r in rows if r[2] == "c=16:after"} == {a.scraped_at}


async def test_backends_without_metrics_are_tolerated_and_logged_once(
    aiohttp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    vllm = FakeVllm()
    vllm.text = vllm_metrics_text({"0": engine_state(1, 3, 2, (1, 1, 0))})

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(text='<html><body>{"not": prometheus}</body></html>', content_type="text/html")

    good = await start(aiohttp_server, {"/metrics": vllm.metrics})
    no_metrics = await start(aiohttp_server, {"/health": vllm.metrics})  # /metrics → 404
    bad_text = await start(aiohttp_server, {"/metrics": garbage})
    arms = [
        Arm(name="baseline", url=good, role="baseline"),
        Arm(name="llamacpp", url=no_metrics),
        Arm(name="garbage", url=bad_text),
        Arm(name="down", url=f"http://127.0.0.1:{free_port()}"),
    ]
    async with aiohttp.ClientSession() as session:
        scraper = MetricsScraper(arms, None, session, run_id="run-1", interval_s=1.0)
        with caplog.at_level(logging.WARNING, logger="specproxy.proxy.upstream.scrape"):
            first = await scraper.scrape_once()
            second = await scraper.scrape_once()
    assert first["baseline"].ok and second["baseline"].ok
    assert "HTTP 404" in (first["llamacpp"].error or "")
    assert "not Prometheus text" in (first["garbage"].error or "")
    assert "failed" in (first["down"].error or "")
    for arm in ("llamacpp", "garbage", "down"):
        assert not second[arm].ok
        assert sum(f"arm {arm}:" in r.getMessage() for r in caplog.records) == 1, arm
    assert counter_delta(first["llamacpp"], second["llamacpp"], SPEC_DRAFTS) is None


async def test_run_scrapes_periodically_until_cancelled(aiohttp_server: Any) -> None:
    vllm = FakeVllm()
    vllm.text = vllm_metrics_text({"0": engine_state(1, 3, 2, (1, 1, 0))})
    url = await start(aiohttp_server, {"/metrics": vllm.metrics})
    async with aiohttp.ClientSession() as session:
        scraper = MetricsScraper([Arm(name="a", url=url)], None, session, run_id="r", interval_s=0.05)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = asyncio.create_task(scraper.run())
        await wait_for_count(lambda: scraper.scrapes, 3, "scrapes")
        waited_s = loop.time() - t0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert scraper.scrapes >= 3 and scraper.scrapes <= vllm.hits <= scraper.scrapes + 1  # +1: cut mid-scrape
    assert waited_s >= 2 * 0.05 * 0.9  # three scrapes, an interval apart: not a busy loop


def test_the_engine_load_line_scan_agrees_with_the_full_parse() -> None:
    text = vllm_metrics_text(
        {
            "0": engine_state(1, 3, 2, (1, 1, 0), running=5.0),
            "1": engine_state(1, 3, 2, (1, 1, 0), running=2.0),
        }
    )
    assert (
        engine_load_from_text(text)
        == EngineLoad(*engine_load(parse_metrics("a", text)))
        == EngineLoad(7.0, None)
    )
    text += 'vllm:num_requests_waiting{engine="0",model_name="m x"} 4.0 1700000000000\n'
    text += "vllm:num_requests_waiting 1\n"
    assert (
        engine_load_from_text(text)
        == EngineLoad(*engine_load(parse_metrics("a", text)))
        == EngineLoad(7.0, 5.0)
    )
    assert engine_load_from_text("# nothing here\n") == EngineLoad(None, None)
    # another engine's names (llama.cpp's server)
    llamacpp = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n"
    assert (
        engine_load_from_text(llamacpp)
        == EngineLoad(*engine_load(parse_metrics("a", llamacpp)))
        == EngineLoad(2.0, 1.0)
    )


async def test_a_client_asks_the_proxy_to_scrape_under_a_phase(tmp_path: Path) -> None:
    """POST /specproxy/scrape: every arm's /metrics now, in backend_metrics under the phase the client
    names (replay --target brackets each level so); a bad phase, a missing key or --no-scrape is a
    sentence."""
    async with (
        running_backend(BackendConfig(tokens=3)) as base,
        running_proxy(
            tmp_path,
            [{"name": "base", "role": "baseline", "url": base.url}],
            api_key="k",
            scrape_interval_s=60,
        ) as p,
        aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as s,
    ):
        url = f"{p.url}/specproxy/scrape"
        async with s.post(url, json={"phase": "c=4 r1/2:before"}) as r:
            assert r.status == 200 and await r.json() == {
                "run_id": p.state.run_id,
                "phase": "c=4 r1/2:before",
                "arms": {"base": {"ok": True, "error": None}},
                "copies_running": 0,
            }
        for bad in ({"phase": "periodic"}, {"phase": 4}, ["c=4:before"]):
            async with s.post(url, json=bad) as r:
                message = (await r.json())["error"]["message"]
                assert r.status == 400 and message.startswith(
                    "phase must be a level's label and :before or :after"
                )
        async with s.post(url, data=b"{") as r:
            assert r.status == 400 and "expected a JSON body" in (await r.json())["error"]["message"]
        async with (
            aiohttp.ClientSession() as anonymous,
            anonymous.post(url, json={"phase": "c=4:after"}) as r,
        ):
            assert r.status == 401
    with duckdb.connect(str(p.db), read_only=True) as con:
        phases = con.execute("SELECT DISTINCT phase FROM backend_metrics ORDER BY phase").fetchall()
    assert phases == [("c=4 r1/2:before",), ("periodic",)]  # and the periodic scrapes at start and end
    # (no backend behind it: a proxy that does not scrape answers without asking one)
    arms = [{"name": "base", "role": "baseline", "url": f"http://127.0.0.1:{free_port()}"}]
    async with (
        running_proxy(tmp_path / "off", arms, scrape_metrics=False) as p,
        aiohttp.ClientSession() as s,
        s.post(f"{p.url}/specproxy/scrape", json={"phase": "c=4:before"}) as r,
    ):
        assert r.status == 409
        assert (await r.json())["error"]["message"] == (
            "this proxy does not scrape its arms' /metrics (it was started with --no-scrape)"
        )


async def test_a_level_end_scrape_waits_for_the_shadow_copies(tmp_path: Path) -> None:
    """The client's calls of a level have ended but a shadow copy still runs: the scrape at the level's
    end waits for it, so its tokens count in this level's window, not the next one's."""
    release = asyncio.Event()
    async with (
        running_backend(BackendConfig(tokens=3)) as base,
        running_backend(BackendConfig(tokens=3, gate=release)) as cand,
        running_proxy(
            tmp_path,
            [{"name": "base", "role": "baseline", "url": base.url}, {"name": "cand", "url": cand.url}],
            scrape_interval_s=60,
        ) as p,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(f"{p.url}/v1/completions", json={"model": "m", "prompt": "p"}) as r:
            assert r.status == 200  # the baseline answered; the copy to cand waits on the gate
        await wait_until(lambda: cand.stats.active == 1, "the shadow copy in flight")
        dispatcher = p.state.dispatcher
        assert dispatcher is not None
        settling = asyncio.Event()
        settle = dispatcher.settle

        async def observed(timeout_s: float) -> int:
            settling.set()
            return await settle(timeout_s)

        dispatcher.settle = observed  # type: ignore[method-assign]

        async def scrape_at_the_end() -> int:
            async with s.post(f"{p.url}/specproxy/scrape", json={"phase": "c=1:after"}) as r:
                assert r.status == 200
                running: int = (await r.json())["copies_running"]
                return running

        scrape = asyncio.ensure_future(scrape_at_the_end())
        await wait_until(settling.is_set, "the scrape to wait for the copies")
        assert not scrape.done() and cand.stats.active == 1
        release.set()
        assert await scrape == 0
    with duckdb.connect(str(p.db), read_only=True) as con:
        running = con.execute(
            "SELECT value FROM backend_metrics WHERE phase = 'c=1:after' AND arm = 'cand' "
            "AND name = 'vllm:num_requests_running'"
        ).fetchall()
    assert running == [(0.0,)]  # the copy had ended when the engine was scraped
