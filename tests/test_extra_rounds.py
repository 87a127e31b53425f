"""When a level gets an extra round, and what is said about it: the pure decisions, as tables."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from click.testing import CliRunner

from specproxy.cli import main
from specproxy.lab.plan import EXTRA_ROUNDS
from specproxy.proxy.replay.extra_rounds import (
    LevelRounds,
    extra_round_due,
    failed_rounds,
    judged,
    why_extra,
)
from specproxy.proxy.spans.sink import HealthRow
from specproxy.schema import MIN_HEALTHY_ROUNDS

NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("planned", "ran", "healthy", "budget", "due"),
    [
        (5, 5, 5, 2, False),  # every round passed
        (5, 5, 3, 2, False),  # enough passed: a level is judged on MIN_HEALTHY_ROUNDS of them
        (5, 5, 2, 2, True),  # too few passed, budget left
        (5, 6, 2, 2, True),  # the first extra failed too, one more allowed
        (5, 7, 2, 2, False),  # budget of two spent
        (5, 6, 3, 2, False),  # the extra round brought it to enough
        (5, 5, 2, 0, False),  # no budget at all
        (5, 3, 0, 2, False),  # planned rounds still running: nothing extra yet
        (5, 5, 1, 2, True),  # two missing, two left: both must pass
        (5, 6, 1, 2, False),  # the first of them failed: the second cannot make three
        (5, 5, 0, 2, False),  # three missing, two left: hopeless at this pace, none run
        (5, 5, 0, 3, True),
        (3, 3, 2, 2, True),  # a 3-round level with a failed round needs three healthy
        (2, 2, 2, 2, False),  # a 2-round level whose rounds all passed is judged on them
        (2, 2, 1, 2, True),  # once one failed it needs three healthy too: two more
        (2, 2, 1, 1, False),
        (1, 1, 1, 3, False),
        (1, 1, 0, 3, True),  # a single round that failed: three more, all passing
        (1, 1, 0, 2, False),
    ],
)
def test_an_extra_round_is_due_while_too_few_rounds_passed_and_the_budget_allows(
    planned: int, ran: int, healthy: int, budget: int, due: bool
) -> None:
    assert extra_round_due(planned, ran, healthy, budget) is due


def test_a_level_is_judged_when_every_round_passed_or_enough_did() -> None:
    assert judged(1, 1) and judged(2, 2) and judged(6, MIN_HEALTHY_ROUNDS)
    assert not judged(2, 1) and not judged(5, MIN_HEALTHY_ROUNDS - 1)


def row(
    round_: int | None, check: str, value: float, threshold: float | None, arm: str | None = None
) -> HealthRow:
    return HealthRow("run", arm, 256, round_, check, value, threshold, NOW)


def test_failed_rounds_name_each_failed_check_once_per_round() -> None:
    rows = [
        row(1, "engine_clock_lag", 0.01, 0.02, "eagle3"),
        row(2, "engine_clock_lag", 0.07, 0.02, "eagle3"),
        row(2, "engine_clock_lag", 0.05, 0.02, "ngram"),
        row(2, "event_loop_lag_share", 0.03, 0.02),
        row(3, "event_loop_lag_p99_s", 9.0, None),  # shown, never gates
        row(3, "sim_time_scale", 0.5, None),
        row(4, "loadgen_start_lag_p99_s", 0.06, 0.05),
    ]
    assert failed_rounds(rows) == {
        2: ["engine_clock_lag", "event_loop_lag_share"],
        4: ["loadgen_start_lag_p99_s"],
    }
    assert failed_rounds(rows[:1]) == {}


def test_why_an_extra_round_runs_names_the_failed_rounds_and_checks() -> None:
    two = {2: ["engine_clock_lag"], 4: ["engine_clock_lag"]}
    assert (
        why_extra("c=256", two, 6) == "c=256: rounds 2 and 4 failed engine_clock_lag; running extra round 6"
    )
    three = {1: ["engine_clock_lag"], 2: ["event_loop_lag_share"], 3: ["engine_clock_lag"]}
    assert why_extra("r=4", three, 4) == (
        "r=4: rounds 1, 2 and 3 failed engine_clock_lag and event_loop_lag_share; running extra round 4"
    )
    assert why_extra("c=1", {1: ["engine_clock_lag"]}, 2).startswith("c=1: round 1 failed")


@pytest.mark.parametrize(
    ("rounds", "said"),
    [
        (LevelRounds("c=64", 3, 3, 3, 2), None),
        (LevelRounds("c=64", 3, 2, 2, 2), None),  # stopped before its rounds were done
        (
            LevelRounds("c=256", 5, 6, 3, 2),
            "c=256: 1 of 2 extra rounds run, 3 of 6 rounds passed every health check (3 needed)",
        ),
        (
            LevelRounds("c=256", 5, 7, 2, 2),
            "c=256: 2 of 2 extra rounds run, only 2 of 7 rounds passed every health check, fewer than the 3 "
            "needed",
        ),
        (
            LevelRounds("c=256", 5, 6, 1, 3, extra_out_of_time=True),
            "c=256: 1 of 3 extra rounds run, no more within the time budget, only 1 of 6 rounds passed every "
            "health check, fewer than the 3 needed",
        ),
        (
            LevelRounds("c=256", 5, 5, 1, 0),
            "c=256: 1 of 5 rounds passed every health check, fewer than 3; no extra rounds were allowed",
        ),
        (
            LevelRounds("c=256", 5, 5, 0, 2),
            "c=256: 0 of 5 rounds passed every health check, fewer than 3; no extra round ran, as the 2 "
            "allowed could not make up the difference even if all passed",
        ),
    ],
)
def test_what_the_extra_rounds_did_is_said_only_where_a_level_needed_them(
    rounds: LevelRounds, said: str | None
) -> None:
    assert rounds.sentence() == said
    assert rounds.enough is judged(rounds.ran, rounds.healthy)


def test_lab_help_gives_the_extra_rounds_and_their_default() -> None:
    res = CliRunner().invoke(main, ["lab", "--help"], terminal_width=100)
    assert res.exit_code == 0
    said = " ".join(res.output.split())
    assert "--extra-rounds N Add up to N rounds to a level whose rounds left too few" in said
    assert f"same pace (default {EXTRA_ROUNDS})" in said
