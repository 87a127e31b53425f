"""Levels measured on a machine that could not keep up: UNRELIABLE, and the lab's pacing that slows the
simulators down until a wave at the level keeps up."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import duckdb
import pytest

from specproxy.config import Arm
from specproxy.engines.sim.config import SimConfig
from specproxy.engines.sim.server import running_sim
from specproxy.lab.pacing import TIME_SCALE_CHECK, LevelPace, SimPacer, kept_up
from specproxy.lab.peak import judged_peak
from specproxy.proxy.replay.console import Console
from specproxy.proxy.replay.extra_rounds import LevelRounds
from specproxy.proxy.replay.formats import ReplayItem
from specproxy.proxy.replay.runner import LevelTrial, LoadPlan, ReplaySettings, run_replay
from specproxy.proxy.spans.sink import HealthRow
from tests.support import TOO_FAST, kept_and_lagging_simulators, replica_replay_files
from tests.support import run_cli as cli


@pytest.fixture
def sims() -> Iterator[dict[str, str]]:
    with kept_and_lagging_simulators() as urls:
        yield urls


def test_a_level_a_simulator_cannot_keep_up_with_is_unreliable_and_says_why(
    sims: dict[str, str], tmp_path: Path
) -> None:
    cfg, log = replica_replay_files(tmp_path, sims)
    db = tmp_path / "spans.duckdb"
    res = cli(
        "replay", str(log), "--config", str(cfg), "--concurrency", "4", "--rounds", "2", "--max-tokens", "64",
        "--db", str(db), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    # replay says so as it ends ...
    assert "engine_clock_lag (fast)" in res.stderr and "did not keep up" in res.stderr
    res = cli("analyze", str(db), "--format", "json")
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(res.stdout)["runs"]
    rows = {r["arm"]: r for r in run["rows"]}
    # ... and the analysis gives the level no verdict, naming the check, the arm and how far over it was
    assert rows["fast"]["verdict"] == "UNRELIABLE" and rows["fast"]["reliable"] is False
    assert "engine_clock_lag" in rows["fast"]["health"] and "(fast round" in rows["fast"]["health"]
    assert run["unreliable_levels"] == ["4"]


async def test_the_pacer_slows_the_simulators_until_a_wave_at_the_level_keeps_up(tmp_path: Path) -> None:
    said = io.StringIO()
    items = [
        ReplayItem(
            f"q{i}", "chat", {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 64}
        )
        for i in range(8)
    ]
    async with (
        running_sim(SimConfig(time_scale=TOO_FAST)) as a,
        running_sim(SimConfig(time_scale=TOO_FAST)) as b,
    ):
        arms = (Arm(name="base", url=a.url, role="baseline"), Arm(name="twin", url=b.url, role="replica"))
        pacer = SimPacer(arms, TOO_FAST, TOO_FAST / 256, Console(said))
        settings = ReplaySettings(
            arms=arms,
            db_path=tmp_path / "spans.duckdb",
            show_progress=False,
            load=LoadPlan(levels=(4,), rounds=2),
            pacer=pacer,
        )
        result = await run_replay(settings, items)
        async with aiohttp.ClientSession() as session, session.get(f"{a.url}/sim/stats") as resp:
            engine_scale = (await resp.json())["time_scale"]
    (pace,) = pacer.paces
    first_scale, first = pace.trials[0]
    assert first_scale == TOO_FAST and not kept_up(first)
    # halved after each wave that did not keep up; the level is measured at the last wave's scale
    assert [scale for scale, _ in pace.trials] == [TOO_FAST / 2**i for i in range(len(pace.trials))]
    assert all(not kept_up(t) for _, t in pace.trials[:-1])
    assert pace.time_scale == pace.trials[-1][0] == engine_scale < TOO_FAST
    assert f"c=4: a wave at time scale {TOO_FAST:g} saw clock lag" in said.getvalue()
    assert pace.sentence().startswith(f"c=4 at time scale {pace.time_scale:g}")
    # the scale each round ran at is recorded with its health (a row that never gates)
    with duckdb.connect(str(settings.db_path), read_only=True) as conn:
        recorded = conn.execute(
            "SELECT round, value, threshold FROM health WHERE check_name = ? ORDER BY round",
            [TIME_SCALE_CHECK],
        ).fetchall()
    assert recorded == [(1, pace.time_scale, None), (2, pace.time_scale, None)]
    assert result.per_arm["base"].ok == result.per_arm["twin"].ok == 16  # the waves are not recorded


async def test_a_paced_level_longer_than_its_trial_wave_has_every_prompt_warm_before_round_one(
    tmp_path: Path,
) -> None:
    # Twelve distinct long prompts at c=4: the pacer's trial wave sends the first four; the other eight
    # would reach the engine's prefix cache cold in round 1 only (a slow first round), so they are warmed
    # before it.
    items = [
        ReplayItem(f"q{i}", "chat", {"messages": [{"role": "user", "content": f"doc {i}: " + "words " * 200}],
                                     "max_tokens": 8})
        for i in range(12)
    ]  # fmt: skip
    async with running_sim(SimConfig()) as sim:
        arms = (Arm(name="base", url=sim.url, role="baseline"),)
        settings = ReplaySettings(
            arms=arms,
            db_path=tmp_path / "spans.duckdb",
            show_progress=False,
            load=LoadPlan(levels=(4,), rounds=1, items_per_level=lambda _: 12, warm_fresh_prompts=True),
            pacer=SimPacer(arms, 1.0, 1 / 4, Console(io.StringIO())),
        )
        result = await run_replay(settings, items)
        async with aiohttp.ClientSession() as session, session.get(f"{sim.url}/sim/requests") as resp:
            truths = (await resp.json())["requests"]
    assert result.per_arm["base"].ok == 12
    measured = truths[-12:]  # the round's calls came last, after the trial wave and the warm-ups
    assert len(truths) >= 12 + 12
    assert all(t["cached_prompt_tokens"] > 0 for t in measured), [t["cached_prompt_tokens"] for t in measured]


def test_a_level_whose_rounds_failed_a_check_slows_the_next_level() -> None:
    said = io.StringIO()
    pacer = SimPacer((), 1.0, 0.25, Console(said))
    now = datetime.now(UTC)
    passed = HealthRow("r", "ngram", 16, 1, "engine_clock_lag", 0.01, 0.02, now)
    failed = HealthRow("r", "ngram", 64, 2, "engine_clock_lag", 0.05, 0.02, now)
    pacer.measured(16, [passed])
    assert pacer.scale == 1.0
    pacer.measured(64, [passed._replace(concurrency_level=64), failed])
    assert pacer.scale == 0.5
    assert "c=64 failed engine_clock_lag in a measured round: the next level starts at time scale 0.5" in (
        said.getvalue()
    )
    for _ in range(3):  # never below the slowest scale
        pacer.measured(256, [failed])
    assert pacer.scale == 0.25


@pytest.mark.parametrize(
    ("trial", "scales"),
    [
        # the simulators keep up, only the client's loop lags: one halving below the slowest scale
        (LevelTrial({"base": 0.001}, 0.05), [1.0, 0.5, 0.25, 0.125]),
        # a simulator behind its clock: never below the slowest scale
        (LevelTrial({"base": 0.05}, 0.05), [1.0, 0.5, 0.25]),
        # no lag anywhere, but the client's loop busy most of the wave: slowed, never below the slowest
        (LevelTrial({"base": 0.001}, 0.001, 0.6), [1.0, 0.5, 0.25]),
        # a third busy: the waves after which every round's loop lagged (a quiet 2-core VM, c=256)
        (LevelTrial({"base": 0.001}, 0.001, 0.34), [1.0, 0.5, 0.25]),
        # busy with room to spare: measured at the first scale
        (LevelTrial({"base": 0.001}, 0.001, 0.2), [1.0]),
    ],
)
async def test_a_lagging_or_busy_client_is_slowed_down_to_its_floor(
    trial: LevelTrial, scales: list[float]
) -> None:
    pacer = SimPacer((), 1.0, 0.25, Console(io.StringIO()), slowest_for_client=0.125)

    async def wave() -> LevelTrial:
        return trial

    await pacer.settle(256, wave)
    assert [scale for scale, _ in pacer.paces[0].trials] == scales


async def test_a_level_whose_wave_fails_at_the_slowest_scale_is_skipped_and_so_is_every_level_above() -> None:
    """Over a round's own limit at the slowest scale: the level's rounds would fail as its wave did, so
    it gets none, nor does any level above it; short of room to spare but within the limit: measured
    in the fewest rounds it can be judged on; the sweep's first level always in full."""
    said = io.StringIO()
    pacer = SimPacer((), 0.25, 0.25, Console(said), skip_unmeasurable=True)
    waves = {
        1: LevelTrial({"base": 0.05}, 0.001),  # over the limit, but the first level
        16: LevelTrial({"base": 0.001}, 0.001),  # kept up
        64: LevelTrial({"base": 0.015}, 0.001),  # within the 2 % limit, over the 1 % trial margin
        256: LevelTrial({"ngram": 0.03}, 0.001),  # over the limit
        512: LevelTrial({"base": 0.0}, 0.0),  # never sent: a lower level could not be measured
    }
    sent: list[int] = []
    for level, trial in waves.items():

        async def wave(trial: LevelTrial = trial, level: int = level) -> LevelTrial:
            sent.append(level)
            return trial

        await pacer.settle(level, wave)
    assert sent == [1, 16, 64, 256]
    assert [pacer.rounds(c, 5) for c in waves] == [5, 5, 3, 0, 0]
    assert "c=256: a wave at time scale 0.25 saw clock lag 3.0% (ngram)" in said.getvalue()
    assert [p.level for p in pacer.skipped] == [256, 512] and pacer.shortened == {64}
    # a level the user named (the operating point) is measured whatever its wave saw
    named = SimPacer((), 0.25, 0.25, Console(io.StringIO()), skip_unmeasurable=True, never_skip=(256,))
    for level in (1, 256):

        async def failing() -> LevelTrial:
            return LevelTrial({"ngram": 0.03}, 0.001)

        await named.settle(level, failing)
    assert named.skipped == [] and named.rounds(256, 5) == 3


async def test_a_level_resumed_after_the_sweep_runs_at_its_own_scale_again() -> None:
    """A deciding round at a level the sweep left behind: the simulators go back to the scale that
    level's rounds ran at (a later level slowed them), and the round records it."""
    async with running_sim(SimConfig()) as a, running_sim(SimConfig()) as b:
        arms = (Arm(name="base", url=a.url, role="baseline"), Arm(name="twin", url=b.url, role="replica"))
        pacer = SimPacer(arms, 1.0, 0.25, Console(io.StringIO()))
        waves = iter([LevelTrial({"base": 0.0}, 0.0), LevelTrial({"base": 0.05}, 0.0), LevelTrial({}, 0.0)])

        async def wave() -> LevelTrial:
            return next(waves)

        await pacer.settle(1, wave)
        await pacer.settle(64, wave)  # lagged at 1.0, kept up at 0.5
        assert pacer.scales() == {1: 1.0, 64: 0.5}

        async def scales() -> list[float]:
            async with aiohttp.ClientSession() as session:
                found = []
                for arm in arms:
                    async with session.get(f"{arm.url}/sim/stats") as resp:
                        found.append((await resp.json())["time_scale"])
                return found

        assert await scales() == [0.5, 0.5]
        assert await pacer.resume(1) == {TIME_SCALE_CHECK: 1.0}
        assert await scales() == [1.0, 1.0]
        assert await pacer.resume(64) == {TIME_SCALE_CHECK: 0.5}
        assert await scales() == [0.5, 0.5]


def test_the_peak_moves_to_the_highest_level_measured_soundly_with_a_label() -> None:
    pacer = SimPacer((), 0.25, 0.25, Console(io.StringIO()), skip_unmeasurable=True)
    pacer.skipped.append(LevelPace(256, 0.25, ((0.25, LevelTrial({"ngram": 0.03}, 0.001)),)))
    rounds = [
        LevelRounds("c=1", 3, 3, 3),
        LevelRounds("c=16", 3, 3, 3),
        LevelRounds("c=64", 3, 6, 2),  # too few passed, extra rounds spent
    ]
    moved = judged_peak((1, 16, 64, 256), rounds, pacer)
    assert moved is not None and moved.level == 16
    assert moved.label == "judged at c=16: c=64, c=256 could not be measured on this machine"
    assert moved.why == (
        "c=64: 2 of 6 rounds passed the health checks; c=256: a wave at time scale 0.25 saw clock lag 3.0% "
        "(ngram), loop lag 0.1% of decode: skipped"
    )
    # the top level measured soundly (a round dropped, the rest judged): the question stays the same
    assert judged_peak((1, 16), [LevelRounds("c=1", 3, 3, 3), LevelRounds("c=16", 5, 5, 4)], pacer) is None
    # no level measured soundly: nothing to move to
    assert judged_peak((1, 16), [LevelRounds("c=1", 3, 3, 1), LevelRounds("c=16", 3, 3, 0)], None) is None


def test_a_level_s_rounds_are_cut_to_end_within_the_budget_but_never_below_three() -> None:
    """Rounds of about 10 s (a 5 s wave, 2 waves a round) with 35 s left: 3 of 5, not fewer; with room,
    all 5; a level not yet settled keeps its plan (asked before the sweep starts)."""
    said = io.StringIO()
    pacer = SimPacer((), 0.25, 0.25, Console(said), skip_unmeasurable=True)
    assert pacer.rounds(64, 5, waves=2, until=time.monotonic() + 1) == 5
    pacer.paces.append(LevelPace(64, 0.25, ((0.25, LevelTrial({"base": 0.001}, 0.001)),)))
    pacer.paces.append(LevelPace(256, 0.25, ((0.25, LevelTrial({"base": 0.001}, 0.001)),)))
    pacer.wave_s = 5.0
    assert pacer.rounds(64, 5, waves=2, until=time.monotonic() + 200) == 5
    assert pacer.rounds(256, 5, waves=2, until=time.monotonic() + 35) == 3
    assert pacer.rounds(256, 5, waves=2, until=time.monotonic() + 500) == 3  # decided once
    assert (
        "c=256: 3 of 5 rounds (about 10 s each): more would end past the lab's time budget" in said.getvalue()
    )
