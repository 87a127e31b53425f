"""Replay against real aiohttp backends on 127.0.0.1, spans read back from the DuckDB file."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from specproxy.commandline import parse_levels
from specproxy.config import Arm
from specproxy.proxy.replay.formats import ReplayItem, read_items
from specproxy.proxy.replay.loadgen import closed_loop, open_loop, poisson_offsets, timed_offsets
from specproxy.proxy.replay.runner import LoadPlan, ReplayError, ReplaySettings, run_replay
from specproxy.proxy.replay.workload import CATEGORIES, mixed_workload
from tests.backends import BackendConfig, running_backend
from tests.support import free_port, wait_for_count
from tests.support import query_rows as rows


def items(n: int) -> list[ReplayItem]:
    cats = ("chat", "summarization")
    return [
        ReplayItem(
            f"q{i}",
            "chat",
            {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 6},
            cats[i % 2],
            arrival_s=i * 0.01,
        )
        for i in range(n)
    ]


def arms(base_url: str, cand_url: str) -> tuple[Arm, ...]:
    return (
        Arm(name="base", url=base_url, role="baseline"),
        Arm(
            name="spec",
            url=cand_url,
            speculative={"method": "ngram", "num_speculative_tokens": 2},
            description="three tokens per chunk",
        ),
    )


async def test_paired_sweep_writes_one_span_per_arm_and_checks_identity(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    async with (
        running_backend(BackendConfig(itl_s=0.001)) as base,
        running_backend(BackendConfig(itl_s=0.001, tokens_per_chunk=3, spec_metrics=True)) as cand,
    ):
        settings = ReplaySettings(
            arms=arms(base.url, cand.url),
            db_path=db,
            run_name="t",
            show_progress=False,
            load=LoadPlan(levels=(1, 4), warmup=2),
        )
        result = await run_replay(settings, items(8))
        # temperature 0 is sent explicitly, streaming is on, the category header reaches the backend
        body = cand.stats.bodies[-1]
        assert body["temperature"] == 0 and body["stream"] is True and body["model"] == "test-model"
        cats = {h.get("X-Specproxy-Category") for h in cand.stats.headers}
        assert cats == {"chat", "summarization"}
        # warm-up: 2 calls per level per arm, not recorded
        assert base.stats.requests == cand.stats.requests == 2 * (8 + 2)
    assert result.phases == ["c=1", "c=4"]
    assert result.per_arm["spec"].compared == 16 and result.per_arm["spec"].mismatches == 0
    got = rows(
        db,
        "SELECT arm, concurrency_level, count(*), count(DISTINCT request_id) FROM requests "
        "WHERE run_id = ? GROUP BY ALL ORDER BY ALL",
        [result.run_id],
    )
    assert got == [("base", 1, 8, 8), ("base", 4, 8, 8), ("spec", 1, 8, 8), ("spec", 4, 8, 8)]
    # both arms share request ids, the candidate's outputs match the baseline's
    spans = rows(
        db,
        "SELECT source, routed_as, category, status, identical, arm_role, completion_tokens, "
        "ttft_s > 0, decode_tok_s > 0, chunks FROM requests WHERE arm = 'spec'",
    )
    assert {s[:6] for s in spans} == {
        ("replay", "replay", c, "ok", True, "candidate") for c in ("chat", "summarization")
    }
    assert all(s[6] == 6 and s[7] and s[8] and s[9] == 3 for s in spans)  # 6 tokens in chunks of 1 + 3 + 2
    base_identical = rows(db, "SELECT DISTINCT identical FROM requests WHERE arm = 'base'")
    assert base_identical == [(None,)]
    assert rows(
        db,
        "SELECT count(*) FROM requests r JOIN requests b USING (request_id) "
        "WHERE r.arm = 'spec' AND b.arm = 'base'",
    ) == [(16,)]
    # the run records each arm's stack
    (name, mode, source, stacks) = rows(db, "SELECT name, mode, source, stacks_json FROM runs")[0]
    assert (name, mode, source) == ("t", "replay-paired", "replay")
    stack = json.loads(stacks)
    assert stack["base"]["version"] == "0.33.0"
    assert stack["spec"]["models"]["data"][0]["id"] == "test-model"
    assert stack["spec"]["description"] == "three tokens per chunk"
    # /metrics scraped before and after each level
    phases = {p for (p,) in rows(db, "SELECT DISTINCT phase FROM backend_metrics")}
    assert {"c=1:before", "c=1:after", "c=4:before", "c=4:after"} <= phases


async def test_paired_identity_catches_a_diverging_candidate(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    async with running_backend(BackendConfig()) as base, running_backend(BackendConfig(diverge_at=3)) as cand:
        # with token ids on both sides the divergence is a token index
        with_ids = tuple(dataclasses.replace(a, return_token_ids=True) for a in arms(base.url, cand.url))
        settings = ReplaySettings(
            arms=with_ids, db_path=db, show_progress=False, load=LoadPlan(levels=(2,), warmup=0)
        )
        result = await run_replay(settings, items(4))
    assert result.per_arm["spec"].mismatches == 4
    got = rows(db, "SELECT DISTINCT identical, first_divergence FROM requests WHERE arm = 'spec'")
    assert got == [(False, 3)]


async def test_split_mode_sends_each_item_to_one_arm_by_weight(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    async with running_backend() as base, running_backend() as cand:
        a, b = arms(base.url, cand.url)
        split_arms = (a, Arm(name=b.name, url=b.url, weight=3.0))
        settings = ReplaySettings(
            arms=split_arms,
            db_path=db,
            mode="split",
            show_progress=False,
            load=LoadPlan(levels=(4,), warmup=0),
        )
        await run_replay(settings, items(200))
        assert base.stats.requests + cand.stats.requests == 200
    counts = dict(rows(db, "SELECT arm, count(*) FROM requests GROUP BY arm"))
    assert counts["base"] + counts["spec"] == 200 and 25 < counts["base"] < 75
    assert rows(db, "SELECT DISTINCT routed_as, identical FROM requests") == [("split", None)]


async def test_poisson_rate_and_timed_runs(tmp_path: Path) -> None:
    async with running_backend() as base:
        one = (Arm(name="base", url=base.url, role="baseline"),)
        for load in (LoadPlan(kind="rate", rates=(200.0,)), LoadPlan(kind="timed", speedup=2.0)):
            db = tmp_path / f"{load.kind}.duckdb"
            settings = ReplaySettings(arms=one, db_path=db, show_progress=False, load=load)
            result = await run_replay(settings, items(20))
            assert result.lag_p99_s is not None  # how well the schedule was kept is a benchmark's figure
            assert rows(db, "SELECT count(*), count(concurrency_level) FROM requests") == [(20, 0)]
            phase = "r=200" if load.kind == "rate" else "timed x2"
            assert rows(
                db, "SELECT count(*) > 0 FROM backend_metrics WHERE phase = ?", [f"{phase}:after"]
            ) == [(True,)]


async def test_duration_bounds_each_level_and_items_per_level_cycles(tmp_path: Path) -> None:
    db = tmp_path / "d.duckdb"
    async with running_backend(BackendConfig(itl_s=0.02)) as base:
        settings = ReplaySettings(
            arms=(Arm(name="b", url=base.url, role="baseline"),),
            db_path=db,
            show_progress=False,
            load=LoadPlan(levels=(1, 2), warmup=0, duration_s=0.4, items_per_level=lambda c: 1000),
        )
        await run_replay(settings, items(3))
    per_level = dict(rows(db, "SELECT concurrency_level, count(*) FROM requests GROUP BY 1"))
    # 6 tokens 20 ms apart: a call takes at least 0.1 s, so a 0.4 s level sends a handful, never 1000.
    # A level starts `level` calls at once, however slowly the machine then runs them.
    assert 1 <= per_level[1] <= 8 and 2 <= per_level[2] <= 14
    assert rows(db, "SELECT count(DISTINCT prompt_sha256) FROM requests") == [(3,)]


async def test_timed_needs_timestamps(tmp_path: Path) -> None:
    async with running_backend() as base:
        settings = ReplaySettings(
            arms=(Arm(name="b", url=base.url, role="baseline"),),
            db_path=tmp_path / "x",
            show_progress=False,
            load=LoadPlan(kind="timed"),
        )
        untimed = [ReplayItem("a", "chat", {"messages": [{"role": "user", "content": "x"}]}, where="f:1")]
        with pytest.raises(ReplayError, match="f:1: --timed needs arrival times"):
            await run_replay(settings, untimed)


async def test_unreachable_arm_fails_before_the_run_naming_its_url(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with running_backend() as base:
        settings = ReplaySettings(
            arms=arms(base.url, url), db_path=tmp_path / "x.duckdb", show_progress=False
        )
        with pytest.raises(ReplayError, match=f"arm 'spec' at {url} is not reachable"):
            await run_replay(settings, items(2))
        assert base.stats.requests == 0
    assert not (tmp_path / "x.duckdb").exists()


async def test_stop_keeps_what_was_measured(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    stop = asyncio.Event()
    async with running_backend(BackendConfig(itl_s=0.02)) as base:
        settings = ReplaySettings(
            arms=(Arm(name="b", url=base.url, role="baseline"),),
            db_path=db,
            show_progress=False,
            load=LoadPlan(levels=(2,), warmup=0),
        )

        async def stop_after_some_calls() -> None:
            await wait_for_count(lambda: base.stats.completed, 4, "calls answered by the backend")
            stop.set()

        # Stopped by what has happened, not at a time: the run may take a while to start on a busy machine.
        stopper = asyncio.create_task(stop_after_some_calls())
        result = await run_replay(settings, items(1000), stop)
        await stopper
    assert result.interrupted
    (ok, cancelled, total) = rows(
        db,
        "SELECT count(*) FILTER (status = 'ok'), count(*) FILTER "
        "(status = 'client_cancelled'), count(*) FROM requests",
    )[0]
    assert 2 <= ok < 1000 and cancelled <= 2 and total == ok + cancelled
    assert rows(db, "SELECT ended_at IS NOT NULL FROM runs") == [(True,)]


def test_replay_of_every_synthesized_format_reaches_the_backend(tmp_path: Path) -> None:
    p = tmp_path / "mooncake.jsonl"
    p.write_text(
        "".join(
            json.dumps({"timestamp": 10 * i, "input_length": 50, "output_length": 3, "hash_ids": [1]}) + "\n"
            for i in range(5)
        )
    )
    got = read_items(p)

    async def go() -> list[dict[str, Any]]:
        async with running_backend() as base:
            settings = ReplaySettings(
                arms=(Arm(name="b", url=base.url, role="baseline"),),
                db_path=tmp_path / "m.duckdb",
                show_progress=False,
                load=LoadPlan(kind="timed", speedup=10),
            )
            await run_replay(settings, got.items)
            return base.stats.bodies

    bodies = asyncio.run(go())
    assert len(bodies) == 5 and all(b["max_tokens"] == 3 and len(b["prompt"].split()) == 50 for b in bodies)
    assert rows(tmp_path / "m.duckdb", "SELECT DISTINCT endpoint, completion_tokens FROM requests") == [
        ("completions", 3)
    ]


async def test_closed_loop_holds_its_level() -> None:
    inflight = 0
    seen: list[int] = []

    async def send(_: int) -> None:
        nonlocal inflight
        inflight += 1
        seen.append(inflight)
        await asyncio.sleep(0)  # the call yields; others run before it returns
        inflight -= 1

    stats = await closed_loop(list(range(100)), 8, send)
    # Eight start at once, then each call that ends is replaced at once: 8 in flight at every start.
    assert seen == [*range(1, 9), *[8] * 92] and stats.gauge.peak == 8 and stats.sent == 100
    shares = stats.gauge.distribution()
    assert set(shares) <= set(range(9)) and sum(shares.values()) == pytest.approx(1.0)


async def test_open_loop_keeps_schedule() -> None:
    starts: list[float] = []
    loop = asyncio.get_running_loop()
    all_sent = asyncio.Event()

    async def send(_: int) -> None:
        starts.append(loop.time())
        if len(starts) == 50:
            all_sent.set()
        await all_sent.wait()  # no call is answered before the last is sent: an open loop does not wait

    offsets = poisson_offsets(50, 500.0, seed=3)
    stats = await asyncio.wait_for(open_loop(list(range(50)), offsets, send), 30)
    assert stats.sent == 50 and stats.gauge.peak == 50 and len(stats.lag_s) == 50
    # Never early: each call starts at or after its offset from the start of the loop.
    assert all(s - stats.started_at >= o - 1e-3 for s, o in zip(starts, offsets, strict=True))
    assert timed_offsets([5.0, 7.0, 6.0], 2.0) == [0.0, 1.0, 0.5]


def test_parse_levels() -> None:
    assert parse_levels("1, 4,16") == (1, 4, 16)
    for bad in ("", "0", "a,b", "-1"):
        with pytest.raises(ValueError):
            parse_levels(bad)


def test_workload_is_deterministic_and_balanced() -> None:
    a, b = mixed_workload(25), mixed_workload(25)
    assert a == b
    assert [i.category for i in a[:5]] == list(CATEGORIES)
    assert mixed_workload(5, seed=1) != mixed_workload(5, seed=0)
    summ = a[1].body["messages"][0]["content"]
    assert a[1].category == "summarization" and len(summ.split()) > 300
    assert mixed_workload(5, max_tokens_scale=0.5)[0].body["max_tokens"] == 80
