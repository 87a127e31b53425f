"""Replay in rounds: every call stamped with its round, the arms' order rotated and the items shuffled
from one round to the next, the engine's load on each span, and the measurement's health per round."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from specproxy.config import Arm
from specproxy.engines.sim.config import SimConfig
from specproxy.engines.sim.server import running_sim
from specproxy.proxy.health import (
    THRESHOLDS,
    LoopLagSampler,
    SimClock,
    histogram_quantile,
    over_threshold,
    write_delay_p99,
)
from specproxy.proxy.replay.formats import ReplayItem
from specproxy.proxy.replay.runner import LoadPlan, ReplaySettings, run_replay
from tests.backends import BackendConfig, running_backend
from tests.support import chat_items as items
from tests.support import query_rows as rows


async def test_rounds_stamp_each_call_rotate_the_arms_and_shuffle_the_items(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    async with (
        running_backend(BackendConfig(itl_s=0.002)) as base,
        running_backend(BackendConfig(itl_s=0.002)) as twin,
        running_backend(BackendConfig(itl_s=0.002, tokens_per_chunk=2)) as spec,
    ):
        arms = (
            Arm(name="base", url=base.url, role="baseline"),
            Arm(name="twin", url=twin.url, role="replica"),
            Arm(name="spec", url=spec.url, speculative={"method": "ngram", "num_speculative_tokens": 1}),
        )
        settings = ReplaySettings(
            arms=arms,
            db_path=db,
            show_progress=False,
            seed=3,
            load=LoadPlan(levels=(1, 2), warmup=1, rounds=3),
        )
        result = await run_replay(settings, items(6))
    assert result.phases == [f"c={c} r{k}/3" for c in (1, 2) for k in (1, 2, 3)]
    # every call is stamped with its round; each round sends every item once to every arm
    counts = rows(
        db,
        "SELECT arm, arm_role, concurrency_level, round, count(*), count(DISTINCT prompt_sha256) "
        "FROM requests GROUP BY ALL ORDER BY ALL",
    )
    assert counts == [
        (arm, role, c, k, 6, 6)
        for arm, role in (("base", "baseline"), ("spec", "candidate"), ("twin", "replica"))
        for c in (1, 2)
        for k in (1, 2, 3)
    ]
    # a request id names one item of one round: the arms share it, rounds do not
    assert rows(db, "SELECT count(DISTINCT request_id) FROM requests") == [(36,)]
    assert rows(db, "SELECT count(*) FROM requests WHERE identical") == [(72,)]  # twin and spec, 36 each
    # at c=1 the arm that goes first in a round sends its first call first: base, then twin, then spec
    first = rows(
        db,
        "SELECT round, arg_min(arm, t_start_ns) FROM requests WHERE concurrency_level = 1 "
        "GROUP BY round ORDER BY round",
    )
    assert first == [(1, "base"), (2, "twin"), (3, "spec")]
    # the items come in the given order in round 1 and shuffled (by the seed) in the others
    orders = rows(
        db,
        "SELECT round, list(prompt_sha256 ORDER BY t_start_ns) FROM requests "
        "WHERE arm = 'base' AND concurrency_level = 1 GROUP BY round ORDER BY round",
    )
    given = orders[0][1]
    assert orders[1][1] != given and orders[2][1] != given and sorted(orders[1][1]) == sorted(given)
    # the client-side health of every round; no simulator, so no engine clock
    health = rows(
        db,
        "SELECT concurrency_level, round, list(check_name ORDER BY check_name), bool_and(arm IS NULL), "
        "bool_and(value >= 0) FROM health GROUP BY ALL ORDER BY ALL",
    )
    checks = ["event_loop_lag_p99_s", "event_loop_lag_share", "loadgen_start_lag_p99_s", "proxy_queue_p99_s"]
    assert health == [(c, k, checks, True, True) for c in (1, 2) for k in (1, 2, 3)]
    assert len(result.health) == 24


async def test_a_simulator_that_cannot_keep_its_clock_gets_a_lagging_health_row(tmp_path: Path) -> None:
    """A simulator asked to run 2000x faster than its profile cannot: each of its steps takes longer to
    compute than the step's scaled duration, so its clock falls behind, and replay records it."""
    db = tmp_path / "spans.duckdb"
    async with running_sim(SimConfig(time_scale=5)) as base, running_sim(SimConfig(time_scale=2000)) as fast:
        arms = (
            Arm(name="base", url=base.url, role="baseline"),
            Arm(name="fast", url=fast.url, role="replica"),
        )
        settings = ReplaySettings(
            arms=arms, db_path=db, show_progress=False, load=LoadPlan(levels=(4,), warmup=0, rounds=2)
        )
        result = await run_replay(settings, items(8, max_tokens=64))
    lag = {
        (arm, k): (value, threshold)
        for arm, k, value, threshold in rows(
            db, "SELECT arm, round, value, threshold FROM health WHERE check_name = 'engine_clock_lag'"
        )
    }
    assert set(lag) == {(arm, k) for arm in ("base", "fast") for k in (1, 2)}
    for k in (1, 2):
        value, threshold = lag[("fast", k)]
        assert threshold == THRESHOLDS["engine_clock_lag"] == 0.02
        assert value > threshold and value > lag[("base", k)][0]
    assert {
        (r.arm, r.round) for r in over_threshold(result.health) if r.check_name == "engine_clock_lag"
    } >= {
        ("fast", 1),
        ("fast", 2),
    }


async def test_a_simulators_write_delays_are_counted_per_chunk_and_recorded_per_round(tmp_path: Path) -> None:
    """The simulator counts one write delay per streamed chunk with new tokens (its histogram in
    /sim/stats); replay records the P99 of each round's delays per arm, a row that never gates."""
    db = tmp_path / "spans.duckdb"
    async with running_sim(SimConfig(time_scale=5)) as sim, aiohttp.ClientSession() as session:
        arms = (Arm(name="base", url=sim.url, role="baseline"),)
        settings = ReplaySettings(
            arms=arms, db_path=db, show_progress=False, load=LoadPlan(levels=(2,), warmup=0, rounds=2)
        )
        result = await run_replay(settings, items(4, max_tokens=16))
        async with session.get(sim.url + "/sim/stats") as resp:
            stats = await resp.json()
        async with session.get(sim.url + "/sim/requests?timeline=1&limit=100") as resp:
            truths = (await resp.json())["requests"]
    bounds, counts = stats["write_delay_bounds_s"], stats["write_delay_counts"]
    assert len(counts) == len(bounds) + 1 and bounds == sorted(bounds)
    assert sum(counts) == sum(len(t["sent_s"]) for t in truths) > 0
    delays = rows(
        db,
        "SELECT arm, round, value, threshold FROM health "
        "WHERE check_name = 'engine_write_delay_p99_s' ORDER BY round",
    )
    assert [(arm, k, threshold) for arm, k, _, threshold in delays] == [("base", 1, None), ("base", 2, None)]
    assert all(bounds[0] <= value <= bounds[-1] for *_, value, _ in delays)
    assert not [r for r in over_threshold(result.health) if r.check_name == "engine_write_delay_p99_s"]


async def test_a_loop_too_busy_to_wake_the_lag_sampler_still_reads_late() -> None:
    # The measured work ends while the sampler's wake-up is overdue and has never run (a client
    # process starved of the CPU for a whole short round): the lag it would have read is kept.
    async with LoopLagSampler() as sampler:
        await asyncio.sleep(0)  # the sampler's task starts and arms its first wake-up
        time.sleep(3 * LoopLagSampler.interval_s)  # the loop blocked past that wake-up
    assert len(sampler.lags_s) == 1 and sampler.lags_s[0] >= 2 * LoopLagSampler.interval_s
    async with LoopLagSampler(keep=lambda: False) as idle:
        await asyncio.sleep(0)
        time.sleep(3 * LoopLagSampler.interval_s)
    assert idle.lags_s == []  # only while ``keep()`` says the lag counts


def test_a_histograms_p99_is_the_upper_bound_of_the_bucket_that_holds_it() -> None:
    before = {"a": SimClock(0.0, 1.0, (0.001, 0.002, 0.004), (5, 0, 0, 0))}
    after = {"a": SimClock(0.0, 2.0, (0.001, 0.002, 0.004), (95, 9, 1, 0))}
    assert write_delay_p99(before, after) == {"a": 0.002}  # 90, 9 and 1 delays in between
    assert write_delay_p99(after, before) == {}  # counts went down: a restarted simulator
    assert write_delay_p99(before, before) == {}  # no chunk written in between
    assert histogram_quantile((0.001,), (0, 3), 0.99) == 0.001  # above every bound: the last one


async def test_each_call_carries_the_engine_load_of_a_scrape_made_during_its_round(tmp_path: Path) -> None:
    db = tmp_path / "spans.duckdb"
    long_items = [
        ReplayItem(
            f"q{i}",
            "chat",
            {"messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 200, "ignore_eos": True},
        )
        for i in range(8)
    ]
    async with running_sim(SimConfig()) as base:
        settings = ReplaySettings(
            arms=(Arm(name="base", url=base.url, role="baseline"),),
            db_path=db,
            show_progress=False,
            load=LoadPlan(levels=(4,), warmup=0),
        )
        await run_replay(settings, long_items)
    got = rows(
        db,
        "SELECT engine_running, engine_waiting, engine_load_age_s FROM requests WHERE status = 'ok' "
        "ORDER BY t_start_ns",
    )
    assert len(got) == 8
    # the first wave starts before any scrape of the round: the load it met is unknown, not "idle"
    assert got[:4] == [(None, None, None)] * 4
    # the second wave starts while a scrape has seen (about) four requests running, none waiting, and
    # says how long before the call it read them
    assert all(
        running is not None and running >= 3 and waiting == 0 and age is not None and age >= 0
        for running, waiting, age in got[4:]
    ), got
