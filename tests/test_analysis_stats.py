"""Bootstrap intervals cover the truth at about their nominal rate; verdict rules and the crossover."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from specproxy.analysis.stats import (
    Interval,
    paired_median_ratio,
    percentile,
    rng_for,
    throughput_ratio,
    unpaired_median_ratio,
)
from specproxy.analysis.verdict import (
    LOSS,
    NO_CLEAR_GAIN,
    WIN,
    Thresholds,
    crossover,
    deploy_verdict,
    level_verdict,
    verdict_runs,
)


def _coverage_paired(reps: int, n: int, m: int | None, true_ratio: float, seed: int) -> float:
    """Share of paired intervals that contain the true ratio of medians.

    Baseline decode ~ lognormal(log 80, 0.35); candidate = baseline × ratio × lognormal(0, 0.15), so
    the candidate's population median is exactly 80 × ratio.
    """
    gen = np.random.default_rng(seed)
    hits = 0
    for i in range(reps):
        base = 80 * np.exp(gen.normal(0, 0.35, n))
        cand = base * true_ratio * np.exp(gen.normal(0, 0.15, n))
        point = float(np.median(cand) / np.median(base))
        sub = np.arange(n) if m is None else gen.choice(n, m, replace=False)
        iv = paired_median_ratio(
            cand[sub], base[sub], point=point, n_total=n, iterations=300, rng=rng_for(seed, str(i))
        )
        assert iv.low is not None and iv.high is not None
        hits += iv.low <= true_ratio <= iv.high
    return hits / reps


def _coverage_unpaired(reps: int, n: int, true_ratio: float, seed: int) -> float:
    gen = np.random.default_rng(seed)
    hits = 0
    for i in range(reps):
        base = 80 * np.exp(gen.normal(0, 0.35, n))
        cand = 80 * true_ratio * np.exp(gen.normal(0, 0.35, n))
        point = float(np.median(cand) / np.median(base))
        iv = unpaired_median_ratio(
            cand, base, point=point, n_cand=n, n_base=n, iterations=400, rng=rng_for(seed, str(i))
        )
        assert iv.low is not None and iv.high is not None
        hits += iv.low <= true_ratio <= iv.high
    return hits / reps


def test_paired_intervals_cover_the_true_ratio_at_about_95_percent() -> None:
    # 300 repetitions: a true 95 % rate lands in [0.91, 0.98] with probability > 99 %
    assert 0.91 <= _coverage_paired(300, 120, None, 1.4, seed=11) <= 0.985


def test_unpaired_intervals_cover_the_true_ratio_at_about_95_percent() -> None:
    assert 0.91 <= _coverage_unpaired(300, 120, 0.9, seed=12) <= 0.985


def test_subsampled_intervals_of_large_levels_cover_too() -> None:
    # n = 20000 pairs resampled from m = 1000 of them (m-out-of-n, scaled by sqrt(m/n))
    assert 0.86 <= _coverage_paired(100, 20000, 1000, 1.2, seed=13) <= 1.0


@pytest.mark.slow
def test_coverage_with_many_repetitions() -> None:
    # measured: paired 97.7 %, unpaired 94.0 % (±0.5 %) for a nominal 95 %
    assert 0.925 <= _coverage_paired(2000, 200, None, 1.3, seed=21) <= 0.98
    assert 0.925 <= _coverage_unpaired(2000, 200, 1.3, seed=22) <= 0.98


def test_interval_narrows_with_more_data_and_is_reproducible() -> None:
    gen = np.random.default_rng(3)
    widths = []
    for n in (100, 1600):
        base = 80 * np.exp(gen.normal(0, 0.35, n))
        cand = base * 1.3 * np.exp(gen.normal(0, 0.15, n))
        point = float(np.median(cand) / np.median(base))
        a = paired_median_ratio(cand, base, point=point, n_total=n, iterations=500, rng=rng_for(1, "x"))
        b = paired_median_ratio(cand, base, point=point, n_total=n, iterations=500, rng=rng_for(1, "x"))
        assert a == b
        assert a.low is not None and a.high is not None
        widths.append(a.high - a.low)
    assert widths[1] < widths[0] / 2.5  # about 1/sqrt(16) = 1/4


def test_throughput_interval_is_centred_on_the_wall_clock_ratio() -> None:
    gen = np.random.default_rng(5)
    tokens = gen.integers(16, 256, 400).astype(float)
    e2e_b = tokens / 80 * np.exp(gen.normal(0, 0.2, 400))
    e2e_c = e2e_b / 1.25
    iv = throughput_ratio(
        tokens,
        e2e_c,
        tokens,
        e2e_b,
        point=1.1,
        n_cand=400,
        n_base=400,
        paired=True,
        iterations=500,
        rng=rng_for(0, "t"),
    )
    assert iv.low is not None and iv.high is not None
    assert iv.low < 1.1 < iv.high
    assert math.isclose(math.log(iv.low) + math.log(iv.high), 2 * math.log(1.1), abs_tol=0.02)


def test_too_few_calls_give_no_interval() -> None:
    one = np.array([80.0])
    iv = paired_median_ratio(one, one, point=1.0, n_total=1, iterations=100, rng=rng_for(0))
    assert iv == Interval(1.0, None, None)


def test_percentile_is_linear_interpolation() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([0.0, 10.0], 0.95) == pytest.approx(9.5)


T = Thresholds()


@pytest.mark.parametrize(
    ("decode", "throughput", "identical", "compared", "verdict"),
    [
        (Interval(1.5, 1.3, 1.7), Interval(1.0, 0.95, 1.05), 100, 100, WIN),
        (Interval(1.5, 1.3, 1.7), Interval(1.0, 0.95, 1.05), 0, 0, WIN),  # identity unchecked
        (Interval(1.06, 1.04, 1.08), Interval(1.0, 0.95, 1.05), 100, 100, NO_CLEAR_GAIN),
        (Interval(1.5, 1.3, 1.7), Interval(0.9, 0.85, 0.97), 100, 100, LOSS),  # this level's throughput lower
        (Interval(0.9, 0.85, 0.98), Interval(1.0, 0.95, 1.05), 100, 100, LOSS),  # decode slower
        (Interval(1.5, 1.3, 1.7), Interval(1.0, 0.95, 1.05), 98, 100, LOSS),  # identity below 99 %
        (Interval(1.5, 1.3, 1.7), Interval(1.0, 0.95, 1.05), 99, 100, WIN),  # exactly 99 % passes
        (Interval(1.5, None, None), Interval(1.0, 0.95, 1.05), 100, 100, NO_CLEAR_GAIN),
        (Interval(1.5, 1.3, 1.7), None, 100, 100, NO_CLEAR_GAIN),
        (Interval(1.0, 0.95, 1.05), Interval(1.0, 0.99, 1.0), 100, 100, NO_CLEAR_GAIN),  # upper = 1.0
    ],
)
def test_verdict_rules(
    decode: Interval, throughput: Interval | None, identical: int, compared: int, verdict: str
) -> None:
    assert level_verdict(decode, throughput, identical, compared, T)[0] == verdict


def test_configurable_thresholds() -> None:
    decode, peak = Interval(1.2, 1.1, 1.3), Interval(1.0, 0.95, 1.05)
    assert level_verdict(decode, peak, 100, 100, Thresholds(win_threshold=1.15))[0] == NO_CLEAR_GAIN
    assert level_verdict(decode, peak, 95, 100, Thresholds(identity_min=0.9))[0] == WIN


def test_crossover_follows_the_per_level_verdicts() -> None:
    c = crossover([(1, WIN), (4, WIN), (16, NO_CLEAR_GAIN), (64, LOSS)])
    assert (c.pays_up_to, c.first_not_paying, c.verdict_there) == (4, 16, NO_CLEAR_GAIN)
    assert c.describe([1, 4, 16, 64]) == "WIN up to c=4; not from c=16 (NO CLEAR GAIN)"
    assert crossover([(8, WIN), (1, WIN)]).first_not_paying is None
    never = crossover([(1, LOSS), (8, WIN)])
    assert never.pays_up_to is None and never.first_not_paying == 1
    assert "WIN at every tested level" in crossover([(1, WIN)]).describe([1])


def test_verdict_runs_merge_equal_neighbours() -> None:
    assert verdict_runs([(16, WIN), (1, WIN), (4, WIN), (64, LOSS), (256, LOSS)]) == (
        "WIN up to c=16, LOSS from c=64"
    )
    assert verdict_runs([(1, WIN), (4, NO_CLEAR_GAIN), (16, NO_CLEAR_GAIN), (64, LOSS)]) == (
        "WIN at c=1, NO CLEAR GAIN at c=4–16, LOSS at c=64"
    )
    assert verdict_runs([(1, LOSS), (4, LOSS)]) == "LOSS at every tested level"


@pytest.mark.parametrize(
    ("verdicts", "peak", "identical", "expected", "phrase"),
    [
        # wins at low load, but the peak level's throughput is lower: not for peak load (n-gram)
        (
            [(1, WIN), (16, WIN), (64, LOSS)],
            Interval(0.86, 0.8, 0.92),
            100,
            LOSS,
            "do not enable for peak load",
        ),
        ([(1, WIN), (16, WIN), (64, NO_CLEAR_GAIN)], Interval(1.0, 0.98, 1.02), 100, WIN, "clear up to c=16"),
        ([(1, WIN), (64, WIN)], Interval(1.1, 1.05, 1.15), 100, WIN, "pays at every tested level"),
        ([(1, WIN), (64, WIN)], Interval(1.1, 1.05, 1.15), 90, LOSS, "identical 90.00% < 99%"),
        ([(1, NO_CLEAR_GAIN), (64, LOSS)], Interval(1.0, 0.98, 1.02), 100, LOSS, "do not enable"),
        # wins at c=1, decode slower at c=16, peak fine: no blanket WIN
        ([(1, WIN), (16, LOSS), (64, WIN)], Interval(1.0, 0.98, 1.02), 100, NO_CLEAR_GAIN, "loses at c=16"),
        (
            [(1, NO_CLEAR_GAIN), (64, NO_CLEAR_GAIN)],
            Interval(1.0, 0.98, 1.02),
            100,
            NO_CLEAR_GAIN,
            "no clear",
        ),
        ([(1, WIN), (64, WIN)], None, 100, NO_CLEAR_GAIN, "not estimable"),
    ],
)
def test_deploy_verdict_applies_the_peak_rule(
    verdicts: list[tuple[int, str]], peak: Interval | None, identical: int, expected: str, phrase: str
) -> None:
    d = deploy_verdict(verdicts, "64", peak, identical, 100, T)
    assert d.verdict == expected and phrase in d.text, d
    assert "at peak (c=64)" in d.text


def test_chart_axes_cover_the_data() -> None:
    from specproxy.analysis.svg import nice_ticks

    assert nice_ticks(0, 125) == [0, 25, 50, 75, 100, 125]
    ticks = nice_ticks(1.0, 1.0)  # every ratio 1.0: a band around it, not 1..2
    assert ticks[0] < 1.0 < ticks[-1] and ticks[-1] - ticks[0] < 0.5
    assert nice_ticks(0.83, 1.71)[0] <= 0.83 and nice_ticks(0.83, 1.71)[-1] >= 1.71


@pytest.mark.slow
def test_end_to_end_intervals_cover_the_true_speedup(tmp_path: Path) -> None:
    """The whole pipeline (spans in DuckDB → pairs → bootstrap), repeated on fresh synthetic runs whose
    true speedup is known (1.3 at c=1, 0.9 at c=8): the intervals cover it at about 95 %."""
    from specproxy.analysis import evaluate, open_store
    from tests.spanfactory import ArmSpec, make_run, write_db

    truth = {"1": 1.3, "8": 0.9}
    hits = total = 0
    for rep in range(60):
        arms = [ArmSpec("baseline", "baseline", "none"), ArmSpec("eagle3", speedup_by_level={1: 1.3, 8: 0.9})]
        run = make_run(arms, levels=(1, 8), n_per_level=150, seed=rep)
        path = write_db(tmp_path / f"r{rep}.duckdb", [run])
        with open_store([path]) as store:
            (ev,) = evaluate(store)
        for row in ev.rows:
            if row.arm == "eagle3" and row.decode_speedup and row.decode_speedup.low is not None:
                total += 1
                hits += row.decode_speedup.low <= truth[row.level] <= (row.decode_speedup.high or 0)
    assert total == 120
    print(f"end-to-end coverage {hits}/{total}")
    assert 0.88 <= hits / total <= 1.0
