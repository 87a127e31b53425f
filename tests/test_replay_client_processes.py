"""Replay with --client-processes: a closed-loop round's slots spread over spawned client processes,
against two identical `specproxy sim` arms, spans read back from the one DuckDB file."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from specproxy.config import Arm
from specproxy.proxy.replay.cli import replay
from specproxy.proxy.replay.clients import (
    ClientReport,
    SharedLoad,
    client_pool,
    owner_of_calls,
    round_stats,
    slot_shares,
)
from specproxy.proxy.replay.loadgen import LoadStats
from specproxy.proxy.replay.planning import Phase
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.replay.recording import RunRecorder
from specproxy.proxy.replay.runner import LoadPlan, ReplayError, ReplaySettings, run_replay
from specproxy.proxy.upstream.calls import UpstreamState
from tests.support import (
    backend_process,
    chat_items,
    interrupted_cli,
    metric_sum,
    replay_target_args,
    simulators,
)
from tests.support import query_rows as rows

LEVELS = (1, 4)
ROUNDS = 2
N_ITEMS = 12


@pytest.fixture(scope="module")
def twin_sims() -> Iterator[dict[str, str]]:
    with simulators(base=["--time-scale", "20"], spec=["--time-scale", "20"]) as urls:
        yield urls


def twin_arms(urls: dict[str, str]) -> tuple[Arm, ...]:
    return (
        Arm(name="base", url=urls["base"], role="baseline"),
        Arm(name="spec", url=urls["spec"], weight=1.0),
    )


def settings(urls: dict[str, str], db: Path, processes: int, mode: str = "paired") -> ReplaySettings:
    return ReplaySettings(
        arms=twin_arms(urls),
        db_path=db,
        run_name=f"n{processes}",
        mode="split" if mode == "split" else "paired",
        show_progress=False,
        load=LoadPlan(levels=LEVELS, rounds=ROUNDS, warmup=1),
        client_processes=processes,
        seed=3,
    )


def per_round(db: Path, run_id: str) -> list[tuple[object, ...]]:
    """(arm, level, round, calls, distinct request ids, ok calls, identical) of a run's spans."""
    return rows(
        db,
        "SELECT arm, concurrency_level, round, count(*), count(DISTINCT request_id), "
        "count(*) FILTER (status = 'ok'), count(*) FILTER (identical) FROM requests "
        "WHERE run_id = ? GROUP BY ALL ORDER BY ALL",
        [run_id],
    )


def health_checks(db: Path, run_id: str) -> set[tuple[object, ...]]:
    return set(rows(db, "SELECT concurrency_level, round, check_name FROM health WHERE run_id = ?", [run_id]))


def test_slots_and_calls_are_shared_by_the_slot_owners() -> None:
    assert slot_shares(5, 2) == [3, 2] and slot_shares(1, 3) == [1, 0, 0] and sum(slot_shares(256, 7)) == 256
    owners = owner_of_calls(10, 5, 2)
    # slots 0, 2, 4 are process 0's; slots 1, 3 process 1's: calls follow the slot they would take
    assert owners == [0, 1, 0, 1, 0, 0, 1, 0, 1, 0]
    assert [owners.count(k) for k in (0, 1)] == [6, 4]


async def test_two_processes_record_every_call_as_one_does(tmp_path: Path, twin_sims: dict[str, str]) -> None:
    db = tmp_path / "spans.duckdb"
    one = await run_replay(settings(twin_sims, db, 1), chat_items(N_ITEMS))
    two = await run_replay(settings(twin_sims, db, 2), chat_items(N_ITEMS))
    assert one.phases == two.phases
    for result in (one, two):
        assert result.spans_dropped == 0 and not result.interrupted
        assert result.per_arm["spec"].compared == len(LEVELS) * ROUNDS * N_ITEMS
        assert result.per_arm["spec"].mismatches == 0
    expected = [
        (arm, level, round_, N_ITEMS, N_ITEMS, N_ITEMS, N_ITEMS if arm == "spec" else 0)
        for arm in ("base", "spec")
        for level in LEVELS
        for round_ in range(1, ROUNDS + 1)
    ]
    assert per_round(db, one.run_id) == per_round(db, two.run_id) == expected
    # every candidate span pairs with a baseline span of the same request id and level
    unpaired = rows(
        db,
        "SELECT count(*) FROM requests c WHERE c.run_id = ? AND c.arm = 'spec' AND NOT EXISTS ("
        "SELECT 1 FROM requests b WHERE b.run_id = c.run_id AND b.arm = 'base' "
        "AND b.request_id = c.request_id AND b.concurrency_level = c.concurrency_level)",
        [two.run_id],
    )
    assert unpaired == [(0,)]
    checks_one, checks_two = health_checks(db, one.run_id), health_checks(db, two.run_id)
    assert not any(str(c).startswith("client ") for _, _, c in checks_one)
    per_process = {(lv, r, c) for lv, r, c in checks_two if str(c).startswith("client ")}
    # c=1 has one slot, so only process 1 sends; c=4 has two slots in each process
    for round_ in range(1, ROUNDS + 1):
        assert (1, round_, "client 1 event_loop_lag_share") in per_process
        assert (1, round_, "client 2 event_loop_lag_share") not in per_process
        for k in (1, 2):
            for check in ("event_loop_lag_share", "event_loop_lag_p99_s", "loadgen_start_lag_p99_s"):
                assert (4, round_, f"client {k} {check}") in per_process
        assert (4, round_, "client parent event_loop_lag_p99_s") in per_process
    # the round's own rows are there as with one process
    assert {(lv, r, c) for lv, r, c in checks_one} <= {(lv, r, c) for lv, r, c in checks_two}


async def test_split_mode_draws_the_same_arms_in_processes(tmp_path: Path, twin_sims: dict[str, str]) -> None:
    db = tmp_path / "spans.duckdb"
    one = await run_replay(settings(twin_sims, db, 1, "split"), chat_items(N_ITEMS))
    two = await run_replay(settings(twin_sims, db, 3, "split"), chat_items(N_ITEMS))

    def drawn(run_id: str) -> list[tuple[object, ...]]:
        # each round's calls per arm: the seeded draw is made call by call in the parent either way
        return rows(
            db,
            "SELECT concurrency_level, round, arm, count(*), count(DISTINCT request_id), "
            "count(*) FILTER (status = 'ok') FROM requests WHERE run_id = ? GROUP BY ALL ORDER BY ALL",
            [run_id],
        )

    assert sum(int(str(r[3])) for r in drawn(one.run_id)) == len(LEVELS) * ROUNDS * N_ITEMS
    assert {r[2] for r in drawn(one.run_id)} == {"base", "spec"}
    assert drawn(one.run_id) == drawn(two.run_id)


def test_an_open_loops_parts_make_one_schedule() -> None:
    # two processes' parts of one arm's schedule, at 10/s each, interleaved: together 20/s
    parts = [
        LoadStats(sent=11, lag_s=[0.001] * 11, first_due=0.0, last_due=1.0, first_sent=0.0, last_sent=1.0),
        LoadStats(sent=11, lag_s=[0.002] * 11, first_due=0.05, last_due=1.05, first_sent=0.05, last_sent=1.1),
    ]
    reports = [ClientReport(k, [part], [], []) for k, part in enumerate(parts)]
    (merged,) = round_stats(reports)
    assert merged.sent == 22 and sorted(merged.lag_s) == [0.001] * 11 + [0.002] * 11
    assert merged.scheduled_rate() == pytest.approx(21 / 1.05)
    assert merged.achieved_rate() == pytest.approx(21 / 1.1)


async def test_a_rate_sweep_in_two_processes_sends_every_arrival(
    tmp_path: Path, twin_sims: dict[str, str]
) -> None:
    db = tmp_path / "spans.duckdb"
    results = []
    for n in (1, 2):
        s = dataclasses.replace(
            settings(twin_sims, db, n), load=LoadPlan(kind="rate", rates=(40.0,), rounds=ROUNDS, warmup=1)
        )
        results.append(await run_replay(s, chat_items(N_ITEMS)))
    one, two = results
    assert one.phases == two.phases
    expected = [
        (arm, None, round_, N_ITEMS, N_ITEMS, N_ITEMS, N_ITEMS if arm == "spec" else 0)
        for arm in ("base", "spec")
        for round_ in range(1, ROUNDS + 1)
    ]
    assert per_round(db, one.run_id) == per_round(db, two.run_id) == expected
    assert rows(db, "SELECT DISTINCT offered_rate FROM requests WHERE run_id = ?", [two.run_id]) == [(40.0,)]
    checks = {c for _, _, c in health_checks(db, two.run_id)}
    assert {"open_loop_achieved_rate", "open_loop_rate_shortfall", "client 2 event_loop_lag_share"} <= checks


def test_ctrl_c_with_client_processes_keeps_every_process_calls(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(json.dumps({"prompt": f"question {i}", "output_tokens": 8}) + "\n" for i in range(5000))
    )
    db = tmp_path / "out.duckdb"
    with backend_process("--ttft-ms", "2", "--itl-ms", "5", "--tokens", "8") as url:
        argv = replay_target_args(log, url, db, "--concurrency", "4")
        metrics = url + "/metrics"
        # Under way in both processes (with --target there is no warm-up): 16 calls answered.
        code, out = interrupted_cli([*argv, "--client-processes", "2"], metrics, 16, 60)
        answered = metric_sum(metrics, "test_backend_completed_total")
    assert code == 130, out
    assert "interrupted: the spans measured so far are kept" in out and "Traceback" not in out
    ((ok, other),) = rows(
        db, "SELECT count(*) FILTER (status = 'ok'), count(*) FILTER (status <> 'ok') FROM requests"
    )
    # every call answered has its span, whichever process sent it; at most the 4 in flight were cut off
    assert answered - 4 <= ok <= answered and other <= 4
    assert rows(db, "SELECT ended_at IS NOT NULL FROM runs") == [(True,)]


async def test_a_client_process_that_dies_fails_the_round_with_a_sentence(
    tmp_path: Path, twin_sims: dict[str, str]
) -> None:
    s = settings(twin_sims, tmp_path / "x.duckdb", 2)
    recorder = RunRecorder("replay-test", s.db_path, ["base", "spec"], ReplayProgress([], enabled=False))
    async with client_pool(s, "replay-test", {"base": None, "spec": None}, {}) as pool:
        assert pool is not None
        victim = pool.pids[1]
        os.kill(victim, signal.SIGKILL)
        await asyncio.to_thread(_wait_dead, victim)
        phase = Phase("c=4", 4, 1)
        with pytest.raises(ReplayError, match=r"client process 2 exited"):
            await pool.send_round(
                phase, [], SharedLoad(level=4), recorder, lambda: s.arms[0], UpstreamState()
            )


def _wait_dead(pid: int) -> None:
    """Until the child ``pid`` has exited, leaving it for its pool to reap (the pool reads its exit code
    as soon as its pipe closes, which can be before this wait starts)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        pass  # reaped by the pool already: gone either way


def test_cli_rejects_zero_processes(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    out = CliRunner().invoke(replay, [str(log), "--target", "http://127.0.0.1:9", "--client-processes", "0"])
    assert out.exit_code == 2 and "--client-processes" in out.output


def test_settings_reject_zero_processes(tmp_path: Path) -> None:
    s = settings({"base": "http://127.0.0.1:9", "spec": "http://127.0.0.1:9"}, tmp_path / "x.duckdb", 0)
    with pytest.raises(ReplayError, match="client processes must be ≥ 1"):
        asyncio.run(run_replay(s, chat_items(1)))
