"""A level judged on its healthy rounds: a round that failed the measurement's health checks is left
out of every figure of its level (for every arm) when enough others passed, and the output says which
rounds were used and why the others were not; too few healthy rounds, or a check of the whole level
that failed, leave the level UNRELIABLE. Synthetic spans (tests/spanfactory.py), real DuckDB files,
the CLI in a subprocess where the output a user reads is checked."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from specproxy.analysis import evaluate, open_store
from specproxy.analysis.figures.validity import HealthFailure, LevelHealth
from specproxy.analysis.verdicts.evaluation import RunEvaluation, Settings
from specproxy.slo import parse_slo
from tests.spanfactory import ArmSpec, SyntheticRun, health_row, make_run, write_db
from tests.support import run_cli

ARMS = [
    ArmSpec("baseline", "baseline", "none"),
    ArmSpec("replica", "replica", "none"),
    ArmSpec("eagle3", speedup=1.4),
]
LEVELS = (4, 16)
ROUNDS = 5
SETTINGS = Settings(bootstrap_iterations=300, slo=parse_slo("ttft_p95=400ms"))
# Figures that say how the level was judged, not what was measured.
HOW_JUDGED = {"rounds_measured", "rounds_used", "rounds_dropped", "health_checks", "health"}


def _health(failing: dict[tuple[int, int], float], level_wide: tuple[int, ...] = ()) -> list[tuple[Any, ...]]:
    """Every arm's clock lag in every level and round (0.4 %, or ``failing[(level, round)]`` for
    eagle3), and the client's start lag for the whole level (``level_wide`` levels: over the limit)."""
    rows = []
    for level in LEVELS:
        for round_ in range(1, ROUNDS + 1):
            for arm in ARMS:
                lag = failing.get((level, round_), 0.004) if arm.name == "eagle3" else 0.004
                rows.append(health_row("run-1", level, "engine_clock_lag", lag, arm=arm.name, round_=round_))
        start_lag = 0.2 if level in level_wide else 0.001
        rows.append(health_row("run-1", level, "loadgen_start_lag_p99_s", start_lag))
    return rows


def _run(health: list[tuple[Any, ...]]) -> SyntheticRun:
    return make_run(
        ARMS, levels=LEVELS, n_per_level=40, seed=7, rounds=ROUNDS, round_sigma=0.03, health=health
    )


def _without(run: SyntheticRun, level: int, round_: int) -> SyntheticRun:
    """The run as if ``round_`` of ``level`` had never been measured: no calls, no /metrics window,
    no health rows."""
    window = f"c={level} r{round_}/{ROUNDS}:"
    return replace(
        run,
        spans=[s for s in run.spans if not (s.concurrency_level == level and s.round == round_)],
        metrics=[m for m in run.metrics if not m[3].startswith(window)],
        health=[h for h in run.health if not (h[2] == level and h[3] == round_)],
    )


def _evaluate(path: Path) -> RunEvaluation:
    with open_store([path]) as store:
        (ev,) = evaluate(store, settings=SETTINGS)
    return ev


def _cli(*args: str) -> str:
    result = run_cli("analyze", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_level_is_judged_on_the_rounds_that_passed(tmp_path: Path) -> None:
    """One of c=16's five rounds had eagle3's simulator 9.4 % behind its clock: c=16 is judged on the
    other four, and every figure of it, for every arm, is what a store holding only those four gives."""
    run = _run(_health({(16, 3): 0.094}))
    path = write_db(tmp_path / "dropped.duckdb", [run])
    ev = _evaluate(path)
    clean = _evaluate(write_db(tmp_path / "four.duckdb", [_without(run, 16, 3)]))

    rows = {(r.arm, r.level): r for r in ev.rows}
    for arm in ("baseline", "replica", "eagle3"):
        row = rows[(arm, "16")]
        assert row.reliable and row.rounds == 4 and row.rounds_measured == 5
        assert row.rounds_used == (1, 2, 4, 5) and [d.round for d in row.rounds_dropped] == [3]
        assert rows[(arm, "4")].rounds_used == (1, 2, 3, 4, 5) and not rows[(arm, "4")].rounds_dropped
    assert rows[("eagle3", "16")].verdict == "WIN"

    def measured(e: RunEvaluation) -> list[dict[str, Any]]:
        return [{k: v for k, v in asdict(r).items() if k not in HOW_JUDGED} for r in e.rows]

    assert measured(ev) == measured(clean)
    assert rows[("eagle3", "16")].acceptance_rate is not None  # the /metrics window of round 3 left out too
    assert ev.categories == clean.categories
    assert [a.deploy for a in ev.arms] == [a.deploy for a in clean.arms]
    assert ev.slo is not None and ev.slo == clean.slo
    assert ev.unreliable_levels == []

    note = "c=16: judged on rounds 1, 2, 4, 5 of 5; round 3 dropped: engine_clock_lag 9.4% > 2.0% (eagle3)"
    assert note in ev.notes
    table = _cli(str(path))
    assert note in table
    # the replicas' noise floor is run-wide here: its margin is said once, not once per level
    margins = [line for line in table.splitlines() if line.startswith("  margin ")]
    assert len(margins) == 1 and margins[0].startswith("  margin every level: replica noise floor")
    line = next(line for line in table.splitlines() if line.startswith("c=16") and " eagle3 " in line)
    assert " 4 of 5 " in line and line.rstrip().endswith("WIN")
    doc = json.loads(_cli(str(path), "--format", "json"))
    eagle = next(r for r in doc["runs"][0]["rows"] if r["arm"] == "eagle3" and r["level"] == "16")
    assert eagle["rounds_used"] == [1, 2, 4, 5]
    assert eagle["rounds_dropped"] == [
        {
            "round": 3,
            "failures": [
                {
                    "check": "engine_clock_lag",
                    "arm": "eagle3",
                    "round": 3,
                    "value": 0.094,
                    "threshold": 0.02,
                    "at": None,  # a live row's window end; replay's rows have rounds
                }
            ],
        }
    ]
    rows_csv = list(csv.DictReader(io.StringIO(_cli(str(path), "--format", "csv"))))
    eagle_csv = next(r for r in rows_csv if r["arm"] == "eagle3" and r["level"] == "16" and not r["category"])
    assert eagle_csv["rounds"] == "4" and eagle_csv["rounds_measured"] == "5"
    assert eagle_csv["rounds_used"] == "1 2 4 5"
    assert eagle_csv["rounds_dropped"] == "round 3 dropped: engine_clock_lag 9.4% > 2.0% (eagle3)"
    out = tmp_path / "report.html"
    reported = run_cli("report", str(path), "-o", str(out))
    assert reported.returncode == 0, reported.stderr
    assert "judged on rounds 1, 2, 4, 5 of 5" in out.read_text()


def test_too_few_healthy_rounds_leave_the_level_unreliable(tmp_path: Path) -> None:
    """Three of five rounds failed: two healthy rounds cannot show the drift between rounds."""
    run = _run(_health({(16, 1): 0.05, (16, 3): 0.094, (16, 4): 0.03}))
    ev = _evaluate(write_db(tmp_path / "three.duckdb", [run]))
    row = next(r for r in ev.rows if r.arm == "eagle3" and r.level == "16")
    assert row.verdict == "UNRELIABLE" and not row.reliable and row.rounds == 5 and not row.rounds_dropped
    assert row.health.startswith("engine_clock_lag 9.4% > 2.0% (eagle3 round 3)")
    assert row.health.endswith("2 of 5 rounds passed every check (3 needed to judge the level on them)")
    assert ev.unreliable_levels == ["16"]
    assert any(n.startswith("c=16 UNRELIABLE: engine_clock_lag 9.4%") for n in ev.notes)
    assert not any("judged on rounds" in n for n in ev.notes)


def test_a_check_of_the_whole_level_that_failed_leaves_it_unreliable(tmp_path: Path) -> None:
    """A row without a round holds for every round: no round can be dropped to escape it."""
    run = _run(_health({(16, 3): 0.094}, level_wide=(16,)))
    ev = _evaluate(write_db(tmp_path / "wide.duckdb", [run]))
    row = next(r for r in ev.rows if r.arm == "eagle3" and r.level == "16")
    assert row.verdict == "UNRELIABLE" and not row.rounds_dropped and row.rounds == 5
    assert "loadgen_start_lag_p99_s 200.0 ms > 50.0 ms (client)" in row.health


def test_the_deploy_verdict_asks_the_same_question_whatever_the_health(tmp_path: Path) -> None:
    """The top tested level failed (3 of 5 rounds): with no peak given the deploy verdict is UNRELIABLE
    and says how to judge at the highest level measured soundly; given that, it answers; and a LOSS at
    the operating point is a LOSS whatever the peak."""
    path = write_db(tmp_path / "top.duckdb", [_run(_health({(16, 1): 0.05, (16, 3): 0.094, (16, 4): 0.03}))])

    def deploy(*args: str) -> dict[str, Any]:
        (run,) = json.loads(_cli(str(path), "--format", "json", *args))["runs"]
        return next(a for a in run["arms"] if a["arm"] == "eagle3")["deploy"]  # type: ignore[no-any-return]

    assumed = deploy()
    assert assumed["verdict"] == "UNRELIABLE" and assumed["peak_concurrency"] == 16
    assert "peak = highest tested level c=16" in assumed["assumed"]
    assert (
        "peak c=16 failed its health checks (engine_clock_lag 9.4% > 2.0% (eagle3 round 3);"
        in assumed["text"]
    )
    assert assumed["text"].endswith(
        "give --peak-concurrency 4 to judge at the highest level measured soundly, or rerun slower"
    )
    assert deploy("--peak-concurrency", "4")["verdict"] == "WIN"
    # a peak between c=4 and c=16 is judged at both: c=16 failed, so it cannot be judged
    between = deploy("--peak-concurrency", "8")
    assert (
        between["verdict"] == "UNRELIABLE"
        and "peak c=8: tested c=16 failed its health checks" in between["text"]
    )

    losing = [ArmSpec("baseline", "baseline", "none"), ArmSpec("eagle3", speedup=0.7)]
    health = _health({(16, 1): 0.05, (16, 3): 0.094, (16, 4): 0.03})
    run = make_run(losing, levels=LEVELS, n_per_level=40, seed=7, rounds=ROUNDS, health=health)
    path = write_db(tmp_path / "loss.duckdb", [run])
    loss = deploy()
    assert loss["verdict"] == "LOSS" and "loses at the operating point" in loss["text"]


def test_the_store_leaves_out_the_calls_and_counter_windows_of_the_rounds_named(tmp_path: Path) -> None:
    """Planned rounds' windows ('c=16 r3/5') and extra rounds' ('c=16 r6 extra') alike; the health
    table keeps every round (it is what the rounds were judged by)."""
    run = _run(_health({}))
    renamed = [
        (*m[:3], m[3].replace("c=16 r5/5", "c=16 r6 extra"), *m[4:]) if m[3].startswith("c=16 r5/5:") else m
        for m in run.metrics
    ]
    path = write_db(tmp_path / "windows.duckdb", [replace(run, metrics=renamed)])
    with open_store([path]) as store:
        before = store.query("SELECT count(*) AS n FROM requests")[0]["n"]
        store.leave_out_rounds([("run-1", "16", 3), ("run-1", "16", 6), ("run-1", "4", 9)])
        phases = {r["phase"] for r in store.query("SELECT DISTINCT phase FROM backend_metrics")}
        calls = store.query("SELECT count(*) AS n FROM requests WHERE concurrency_level = 16 AND round = 3")
        after = store.query("SELECT count(*) AS n FROM requests")[0]["n"]
        kept = store.query("SELECT count(*) AS n FROM health WHERE concurrency_level = 16 AND round = 3")
        store.leave_out_rounds([])
        again = store.query("SELECT count(*) AS n FROM requests")[0]["n"]
    gone = {"c=16 r3/5:before", "c=16 r3/5:after", "c=16 r6 extra:before", "c=16 r6 extra:after"}
    assert not phases & gone and {"c=16 r2/5:before", "c=4 r3/5:after"} <= phases
    assert calls[0]["n"] == 0 and after == before - 40 * len(ARMS) and again == before
    assert kept[0]["n"] == len(ARMS)


@pytest.mark.parametrize(
    ("failed", "used", "reliable"),
    [
        ({3: 0.094}, (1, 2, 4, 5, 6), True),  # a round added after the planned five
        ({3: 0.094, 5: 0.03}, (1, 2, 4, 6), True),
        ({1: 0.05, 3: 0.094, 5: 0.03, 6: 0.1}, (1, 2, 3, 4, 5, 6), False),
    ],
)
def test_the_rounds_a_level_had_come_from_its_rows(
    failed: dict[int, float], used: tuple[int, ...], reliable: bool
) -> None:
    failures = tuple(HealthFailure("engine_clock_lag", "eagle3", r, v, 0.02) for r, v in failed.items())
    health = LevelHealth(12, failures, (1, 2, 3, 4, 5, 6))
    assert health.reliable is reliable and health.used_rounds == used
    if reliable:
        assert health.judged_on("256").startswith(
            f"c=256: judged on rounds {', '.join(map(str, used))} of 6; "
        )
    else:
        assert health.judged_on("256") == "" and "2 of 6 rounds passed" in health.describe()
