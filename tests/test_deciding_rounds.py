"""Deciding rounds: after the sweep, the levels where the deploy verdict reads (the operating point,
the peak) are measured again while a verdict read there has an interval reaching across a margin
line, so that a ratio near the margin gets the same verdict run after run
(:mod:`specproxy.proxy.replay.rounds`, :mod:`specproxy.analysis.verdicts.settled`)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from specproxy.analysis import Settings, evaluate, open_store
from specproxy.analysis.render.table import deploy_lines, render_json
from specproxy.analysis.stats import Interval
from specproxy.analysis.verdicts.rows import RunEvaluation
from specproxy.analysis.verdicts.rules import NO_CLEAR_GAIN, UNRELIABLE, DeployVerdict, Thresholds
from specproxy.analysis.verdicts.settled import open_questions, open_questions_in_store
from specproxy.config import Arm
from specproxy.engines.sim.config import SimConfig
from specproxy.engines.sim.server import running_sim
from specproxy.proxy.replay.extra_rounds import LevelRounds, failed_rounds
from specproxy.proxy.replay.planning import PeakJudge
from specproxy.proxy.replay.runner import Decider, LoadPlan, ReplayResult, ReplaySettings, run_replay
from tests.support import chat_items, query_rows

N_ITEMS = 4
OPEN = "eagle3's throughput 0.96x [0.94, 0.98] reaches across 0.970"
EAGLE3 = {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}


async def _replay(
    db: Path,
    decider: Decider | None,
    deciding: int,
    levels: tuple[int, ...] = (1, 2),
    until: float | None = None,
    judged_peak: PeakJudge | None = None,
) -> ReplayResult:
    """A baseline and a plain copy of it labelled eagle3 (a null arm), ``levels`` in 3 rounds each."""
    async with running_sim(SimConfig()) as base, running_sim(SimConfig()) as null:
        arms = (
            Arm(name="base", url=base.url, role="baseline"),
            Arm(name="eagle3", url=null.url, speculative=EAGLE3),
        )
        load = LoadPlan(levels=levels, warmup=0, rounds=3, deciding_rounds=deciding, added_until=until)
        settings = ReplaySettings(
            arms=arms, db_path=db, show_progress=False, load=load, decider=decider, judged_peak=judged_peak
        )
        return await run_replay(settings, chat_items(N_ITEMS, max_tokens=16))


def _always(*levels: str) -> Decider:
    """A decider that finds the same question open at ``levels`` at every look."""

    def decider(snapshot: Path, run_id: str, peak: int | None) -> Mapping[str, Sequence[str]]:
        return {level: [OPEN] for level in levels}

    return decider


async def test_a_level_adds_rounds_after_the_sweep_while_a_verdict_there_is_open(tmp_path: Path) -> None:
    """The decider looks at a copy of the store after the sweep and after each deciding round; it
    finds a question open at c=2 twice, so two rounds are added there, and no more."""
    looks: list[int] = []

    def decider(snapshot: Path, run_id: str, peak: int | None) -> Mapping[str, Sequence[str]]:
        (spans,) = query_rows(snapshot, "SELECT count(*) FROM requests WHERE run_id = ?", [run_id])[0]
        looks.append(spans)
        return {"c=2": [OPEN]} if len(looks) <= 2 else {}

    result = await _replay(tmp_path / "spans.duckdb", decider, deciding=4)
    per_round = 2 * N_ITEMS  # every item to both arms
    # c=1's three rounds and c=2's three, then one round more before each later look: the copy holds
    # every span written so far
    assert looks == [6 * per_round, 7 * per_round, 8 * per_round]
    assert result.phases[-3:] == ["c=2 r3/3", "c=2 r4 extra", "c=2 r5 extra"]
    healthy = 5 - len(failed_rounds(r for r in result.health if r.concurrency_level == 2))
    assert result.levels[-1] == LevelRounds("c=2", 3, 5, healthy, 0, deciding=2, deciding_budget=4)
    assert result.levels[0] == LevelRounds("c=1", 3, 3, result.levels[0].healthy, 0, 0, 4)
    assert (
        result.levels[-1].deciding_sentence()
        == "c=2: 2 of 4 deciding rounds run; every verdict read here is settled"
    )
    rounds = query_rows(
        tmp_path / "spans.duckdb", "SELECT DISTINCT round FROM requests WHERE concurrency_level = 2"
    )
    assert sorted(rounds) == [(k,) for k in range(1, 6)]


async def test_a_lower_level_is_measured_again_after_the_sweep(tmp_path: Path) -> None:
    """The operating point (c=1) is open, the top level is not: c=1 gets its deciding round after
    c=2's rounds, numbered after its own, at its own concurrency."""
    looks = 0

    def decider(snapshot: Path, run_id: str, peak: int | None) -> Mapping[str, Sequence[str]]:
        nonlocal looks
        looks += 1
        return {"c=1": [OPEN]} if looks == 1 else {}

    db = tmp_path / "spans.duckdb"
    result = await _replay(db, decider, deciding=4)
    assert result.phases[-2:] == ["c=2 r3/3", "c=1 r4 extra"]
    assert (result.levels[0].ran, result.levels[0].deciding, result.levels[1].deciding) == (4, 1, 0)
    # the round went out as one of c=1, each item to both arms
    rows = query_rows(
        db,
        "SELECT arm, count(*), max(concurrency_level), min(concurrency_level) FROM requests "
        "WHERE round = 4 GROUP BY arm ORDER BY arm",
    )
    assert rows == [("base", N_ITEMS, 1, 1), ("eagle3", N_ITEMS, 1, 1)]


async def test_open_levels_share_the_budget_fewest_rounds_first(tmp_path: Path) -> None:
    """Both levels open at every look: the rounds alternate, the higher level first on a tie, until
    the budget is spent; each level says what is still open there."""
    result = await _replay(tmp_path / "spans.duckdb", _always("c=1", "c=2"), deciding=3)
    assert result.phases[-4:] == ["c=2 r3/3", "c=2 r4 extra", "c=1 r4 extra", "c=2 r5 extra"]
    low, top = result.levels
    assert (low.deciding, low.unsettled, top.deciding, top.unsettled) == (1, (OPEN,), 2, (OPEN,))
    assert low.deciding_sentence() == f"c=1: 1 of 3 deciding rounds run; still open: {OPEN}"


async def test_the_decider_reads_the_peak_where_the_run_judges_it(tmp_path: Path) -> None:
    """A run whose peak is judged below its top level (the lab's moved peak) hands that level to the
    decider; the judge sees every level's rounds as they went."""
    asked: list[int | None] = []
    seen: list[list[str]] = []

    def judge(levels: Sequence[LevelRounds]) -> int | None:
        seen.append([lv.level for lv in levels])
        return 1

    def decider(snapshot: Path, run_id: str, peak: int | None) -> Mapping[str, Sequence[str]]:
        asked.append(peak)
        return {}

    await _replay(tmp_path / "spans.duckdb", decider, deciding=2, judged_peak=judge)
    assert (seen, asked) == ([["c=1", "c=2"]], [1])


async def test_deciding_rounds_stop_at_the_budget_and_say_what_is_still_open(tmp_path: Path) -> None:
    result = await _replay(tmp_path / "spans.duckdb", _always("c=2"), deciding=2, levels=(2,))
    assert result.phases == ["c=2 r1/3", "c=2 r2/3", "c=2 r3/3", "c=2 r4 extra", "c=2 r5 extra"]
    top = result.levels[-1]
    assert (top.deciding, top.deciding_budget, top.unsettled, top.extra) == (2, 2, (OPEN,), 0)
    assert top.deciding_sentence() == f"c=2: 2 of 2 deciding rounds run; still open: {OPEN}"


async def test_no_deciding_round_starts_that_would_end_after_the_time_budget(tmp_path: Path) -> None:
    """A budget already spent: the question is asked, no round runs, and the lab says why."""
    result = await _replay(
        tmp_path / "spans.duckdb", _always("c=2"), deciding=4, levels=(2,), until=time.monotonic()
    )
    assert result.phases == ["c=2 r1/3", "c=2 r2/3", "c=2 r3/3"]
    top = result.levels[-1]
    assert (top.deciding, top.unsettled, top.out_of_time) == (0, (OPEN,), True)
    assert top.deciding_sentence() == (
        f"c=2: 0 of 4 deciding rounds run, no more within the time budget; still open: {OPEN}"
    )


async def test_a_decider_that_fails_costs_no_round_and_is_noted(tmp_path: Path) -> None:
    def broken(snapshot: Path, run_id: str, peak: int | None) -> Mapping[str, Sequence[str]]:
        raise RuntimeError("no analysis today")

    result = await _replay(tmp_path / "spans.duckdb", broken, deciding=3, levels=(2,))
    assert result.phases == ["c=2 r1/3", "c=2 r2/3", "c=2 r3/3"]
    assert result.levels[-1].deciding == 0
    assert any("no deciding rounds" in n and "no analysis today" in n for n in result.notes), result.notes


@pytest.fixture(scope="module")
def null_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunEvaluation]:
    """A real replay's store (c=1 and c=2, 3 rounds, no deciding rounds) and its evaluation."""
    import asyncio

    db = tmp_path_factory.mktemp("settled") / "spans.duckdb"
    asyncio.run(_replay(db, None, deciding=0))
    with open_store([db]) as store:
        (evaluation,) = evaluate(store)
    return db, evaluation


def _with(evaluation: RunEvaluation, level: str, **row: object) -> RunEvaluation:
    """The evaluation with the eagle3 arm's row at ``level`` changed (by default a NO CLEAR GAIN), and
    its deploy verdict reading c=1 as the operating point and c=2 as the peak, whatever this machine's
    health made of them."""
    row = {"verdict": NO_CLEAR_GAIN, **row}
    deploy = DeployVerdict(NO_CLEAR_GAIN, "", at_concurrency=1, peak_concurrency=2)
    arms = [dataclasses.replace(a, deploy=deploy) if a.arm == "eagle3" else a for a in evaluation.arms]
    rows = [
        dataclasses.replace(r, **row) if (r.arm, r.level) == ("eagle3", level) else r  # type: ignore[arg-type]
        for r in evaluation.rows
    ]
    return dataclasses.replace(evaluation, rows=rows, arms=arms)


IV = Interval
THR = IV(1.0, 0.98, 1.02)  # a throughput ratio that settles every line
CASES = [
    # (level, row changes, the open questions' (figure, line)); c=1 is the operating point, c=2 the peak
    ("2", {"throughput_speedup": IV(0.96, 0.95, 0.975)}, [("throughput", 0.97)]),
    ("2", {"throughput_speedup": IV(0.96, 0.95, 0.965)}, []),  # surely lower: LOSS, settled
    ("2", {"throughput_speedup": IV(1.0, 0.98, 1.02)}, []),  # surely not lower: settled
    ("2", {"throughput_speedup": IV(1.0, 0.98, 1.02), "throughput_margin": 0.01}, [("throughput", 0.99)]),
    # the peak reads throughput only; a decode interval across its line there does not matter
    ("2", {"decode_speedup": IV(1.03, 1.01, 1.05), "throughput_speedup": IV(1.0, 0.98, 1.02)}, []),
    # the operating point reads decode too: across 1 + margin (WIN) or 1 − margin (LOSS)
    ("1", {"decode_speedup": IV(1.04, 1.02, 1.06), "throughput_speedup": THR}, [("decode speedup", 1.03)]),
    ("1", {"decode_speedup": IV(0.97, 0.95, 0.99), "throughput_speedup": THR}, [("decode speedup", 0.97)]),
    ("1", {"decode_speedup": IV(1.10, 1.05, 1.15), "throughput_speedup": IV(1.0, 0.98, 1.02)}, []),
    ("1", {"decode_speedup": IV(1.0, 0.96, 1.04), "throughput_speedup": IV(1.0, 0.98, 1.02)},
     [("decode speedup", 1.03), ("decode speedup", 0.97)]),
    # rows whose verdict more rounds cannot move are not asked
    ("2", {"throughput_speedup": IV(0.96, 0.95, 0.975), "tokens_estimated": True}, []),
    ("2", {"throughput_speedup": IV(0.96, 0.95, 0.975), "verdict": UNRELIABLE}, []),
    ("2", {"throughput_speedup": IV(0.96, 0.95, 0.975), "throughput_margin": None}, [("throughput", 0.97)]),
    ("2", {"throughput_speedup": IV(0.96, None, None)}, []),  # no interval: nothing to narrow
]  # fmt: skip


@pytest.mark.parametrize(("level", "changes", "expected"), CASES)
def test_which_figures_are_open_questions(
    null_run: tuple[Path, RunEvaluation],
    level: str,
    changes: dict[str, object],
    expected: list[tuple[str, float]],
) -> None:
    _, evaluation = null_run
    changes = {"decode_margin": 0.03, "throughput_margin": 0.03, **changes}
    found = open_questions(_with(evaluation, level, **changes), level)
    assert [(q.arm, q.figure, round(q.line, 6)) for q in found] == [
        ("eagle3", f, line) for f, line in expected
    ]


def test_replicas_are_never_asked(null_run: tuple[Path, RunEvaluation]) -> None:
    """A replica's margin keeps it at NO CLEAR GAIN whatever its interval: nothing to settle."""
    _, evaluation = null_run
    asked = _with(evaluation, "2", throughput_speedup=IV(0.96, 0.95, 0.975), throughput_margin=0.03)
    assert len(open_questions(asked, "2")) == 1
    arms = [dataclasses.replace(a, kind="replica") if a.arm == "eagle3" else a for a in asked.arms]
    assert open_questions(dataclasses.replace(asked, arms=arms), "2") == []


def test_a_real_store_is_asked_with_the_margin_the_analysis_uses(
    null_run: tuple[Path, RunEvaluation],
) -> None:
    """On the real store: a margin that puts the decode line inside the operating point's interval
    opens a question there, one wider than the interval's reach does not (and the peak reads no
    decode line)."""
    db, evaluation = null_run
    row = next(r for r in evaluation.rows if (r.arm, r.level) == ("eagle3", "1"))
    iv = row.decode_speedup
    assert iv is not None and iv.low is not None and iv.high is not None, row
    inside = abs((iv.low + iv.high) / 2 - 1.0)
    beyond = max(abs(iv.low - 1.0), abs(iv.high - 1.0)) + 0.05
    run_id = evaluation.run_id

    def asked(level: str, margin: float) -> list[str]:
        found = open_questions_in_store(db, run_id, Settings(thresholds=Thresholds(min_margin=margin)))
        return found.get(level, [])

    found = asked("c=1", inside)
    if not row.reliable:
        # a loaded machine left c=1 without enough sound rounds: the rule asks nothing of it
        assert found == [], (row.verdict, found)
        return
    assert any(q.startswith("eagle3's decode speedup") for q in found), (iv, found)
    assert [q for q in asked("c=1", beyond) if "decode" in q] == []
    assert [q for q in asked("c=2", inside) if "decode" in q] == []


def test_a_deploy_verdict_at_the_margin_says_so_in_the_table_and_json(
    null_run: tuple[Path, RunEvaluation],
) -> None:
    """The same label, and beside it the figure whose interval reaches across a line it reads: in the
    deploy lines, the report's sentence and JSON; a margin beyond the interval's reach says nothing."""
    db, evaluation = null_run
    row = next(r for r in evaluation.rows if (r.arm, r.level) == ("eagle3", "1"))
    iv = row.decode_speedup
    assert iv is not None and iv.low is not None and iv.high is not None, row
    if not row.reliable:
        pytest.skip(f"this machine left c=1 without enough sound rounds: {row.health}")

    def judged(margin: float) -> RunEvaluation:
        settings = Settings(thresholds=Thresholds(min_margin=margin))
        with open_store([db]) as store:
            (ev,) = evaluate(store, settings=settings)
        return ev

    inside = judged(abs((iv.low + iv.high) / 2 - 1.0))
    deploy = next(a.deploy for a in inside.arms if a.arm == "eagle3")
    assert deploy is not None and any(q.startswith("eagle3's decode speedup") for q in deploy.at_margin)
    lines = "\n".join(deploy_lines(inside))
    assert f"at the margin: {deploy.at_margin[0]}" in lines and "(more rounds there would settle it)" in lines
    doc = json.loads(render_json([inside], Settings()))
    (arm,) = [a for a in doc["runs"][0]["arms"] if a["arm"] == "eagle3"]
    assert arm["deploy"]["at_margin"] == list(deploy.at_margin)
    beyond = judged(max(abs(iv.low - 1.0), abs(iv.high - 1.0)) + 0.05)
    assert all(a.deploy is None or a.deploy.at_margin == () for a in beyond.arms)
    assert "at the margin" not in "\n".join(deploy_lines(beyond))
