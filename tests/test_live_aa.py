"""Live verdicts you can bet on: the analysis of split and shadow traffic, on synthetic closed loops
with known truth (tests/closedloop.py), designs drawn at random from a seed.

- A/A: an identical arm at any split ratio (50/50 to 90/10, three-way), shadow sample (0.2-1.0),
  level (2-64) and output length is not called different, and most such levels are judged;
- power: a real 1.6x arm is found at c=2;
- a matched interval holds its own point where only a few drains move the baseline's load;
- broken engine gauges are left out with a note, never read as more engines behind a URL;
- stale gauges of calls shorter than the scrape interval are not read as more engines either;
- the validity gate holds live levels to replay's rule;
- a shadow under one call lighter than its baseline spans the load's effect.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np

from specproxy.analysis import Settings, evaluate, open_store
from specproxy.analysis.figures import arm_calls, matched
from specproxy.analysis.figures.arm_calls import ArmCalls
from specproxy.analysis.stats import Interval
from specproxy.analysis.verdicts.rows import RunEvaluation
from tests.closedloop import Design, make_closed_loop_run, make_design
from tests.spanfactory import SyntheticRun, live_health_rows, make_live_load_run, make_wave_run, write_db

DESIGNS = 20


def _evaluate(run: SyntheticRun, path: Path) -> RunEvaluation:
    with open_store([str(write_db(path, [run]))]) as store:
        (ev,) = evaluate(store, settings=Settings())
    return ev


def test_identical_arms_are_not_called_different_at_any_split_sample_or_level(tmp_path: Path) -> None:
    rng = random.Random(26)
    judged, different, covered, rows = 0, [], 0, 0
    for k in range(DESIGNS):
        design = make_design(rng)
        ev = _evaluate(make_closed_loop_run(design, seed=k), tmp_path / f"aa{k}.duckdb")
        for row in ev.rows:
            if row.arm == "baseline":
                continue
            rows += 1
            iv = row.decode_speedup
            if row.verdict in ("WIN", "LOSS"):
                different.append(f"{design.describe()}: {row.arm} {row.verdict} {iv} ({row.reason})")
            if iv is not None and iv.low is not None and iv.high is not None:
                judged += 1
                covered += iv.low <= 1.0 <= iv.high
        for arm in ev.arms:
            assert arm.deploy is None or arm.deploy.verdict not in ("WIN", "LOSS"), (design, arm.deploy)
    assert rows >= DESIGNS
    assert len(different) <= 0.05 * rows, different
    assert judged >= 0.6 * rows, (judged, rows)
    assert covered >= 0.9 * judged, (covered, judged)


def test_a_real_gain_is_found_at_c2_in_split_and_shadow(tmp_path: Path) -> None:
    rng = random.Random(7)
    found = []
    for k in range(8):
        design = make_design(rng, speedup=1.6, level=2)
        if design.mode == "shadow" and design.samples["candidate"] >= 0.9:
            # a shadow that got (nearly) every call is judged on the wall-clock throughput too, which in
            # shadow mode follows the baseline's pace by construction: not this test's question
            continue
        ev = _evaluate(make_closed_loop_run(design, seed=100 + k), tmp_path / f"p{k}.duckdb")
        row = next(r for r in ev.rows if r.arm == "candidate")
        found.append((design.describe(), row.verdict, row.decode_speedup))
    assert len(found) >= 5 and all(verdict == "WIN" for _, verdict, _ in found), found


def test_split_unequal_loads_bracket_the_load_model(tmp_path: Path) -> None:
    """60/40 of a closed loop at c=64: the arms run at about 25 and 38 calls. The interval spans both
    the plain comparison (no load effect) and the matched one (the fitted line's), so it holds 1.0."""
    design = Design("split", 64, requests=400, baseline_weight=0.6, weights={"candidate": 0.4})
    ev = _evaluate(make_closed_loop_run(design, seed=3), tmp_path / "split.duckdb")
    row = next(r for r in ev.rows if r.arm == "candidate")
    assert row.load is not None and row.load.unequal, row.load
    iv, plain = row.decode_speedup, row.unmatched_decode_speedup
    assert iv is not None and plain is not None and iv.low is not None and iv.high is not None
    assert plain.low is not None and plain.high is not None
    assert iv.low <= min(plain.low, iv.point) and iv.high >= max(plain.high, iv.point)
    assert iv.low <= 1.0 <= iv.high and row.verdict == "NO CLEAR GAIN", (iv, row.reason)


def test_a_shadow_at_near_equal_load_spans_the_loads_effect(tmp_path: Path) -> None:
    """A shadow twin at sample 0.75 of c=4 on quiet engines runs at about 2.2 calls beside the
    baseline's 3: under one call apart, compared call by call, yet about 0.8 % faster for that alone,
    which the paired interval resolves. The interval spans the load's effect and holds 1.0."""
    lifted = 0
    for seed in range(3):
        design = Design(
            "shadow", 4, requests=300, tokens=(64, 256), samples={"candidate": 0.75}, noise=0.03,
            clock_lag={"baseline": 0.0, "candidate": 0.0},
        )  # fmt: skip
        ev = _evaluate(make_closed_loop_run(design, seed=seed), tmp_path / f"near{seed}.duckdb")
        row = next(r for r in ev.rows if r.arm == "candidate")
        iv, load = row.decode_speedup, row.load
        assert load is not None and not load.unequal and load.method == matched.NEAR_EQUAL, load
        assert load.effect is not None and 0.98 < load.effect < 0.999, load
        assert iv is not None and iv.low is not None and iv.high is not None
        assert iv.low <= 1.0 <= iv.high and row.verdict == "NO CLEAR GAIN", (iv, row.reason)
        assert "the candidate's calls up to" in row.reason, row.reason
        lifted += iv.low / load.effect > 1.0  # the plain interval alone would have missed 1.0
    assert lifted >= 2, lifted


def test_where_no_line_places_the_load_the_plain_comparison_is_stretched_by_the_loads_largest_effect() -> (
    None
):
    """A steady closed loop keeps the baseline at one load, so no line reads another: the plain
    comparison, stretched by (L + 1) / (l + 1) on the side the load difference favours."""
    plain = Interval(1.02, 1.00, 1.04)
    lighter = matched.LoadFigures("proxy in-flight", 13.0, 15.0, method=matched.NOT_COMPARED)
    got = matched.bounded(
        matched.MatchedLoad(lighter, None, None, "not compared at matched load"), plain, plain
    )
    assert got.figures.method == matched.BOUNDED and got.decode is not None and got.throughput is not None
    assert got.decode == Interval(1.02, 1.00 * 14 / 16, 1.04), got.decode  # a lighter arm: truth below
    assert got.throughput == got.decode
    assert "at most 1.14x slower" in got.note and "baseline's calls" in got.note, got.note
    heavier = dataclasses.replace(lighter, p50=15.0, baseline_p50=13.0)
    got = matched.bounded(matched.MatchedLoad(heavier, None, None, ""), plain, None)
    assert got.decode == Interval(1.02, 1.00, 1.04 * 16 / 14) and got.throughput is None, got.decode
    # loads so far apart that even the bound places nothing (over 2x wide): still not compared
    far = dataclasses.replace(lighter, p50=5.0, baseline_p50=31.0)
    load = matched.MatchedLoad(far, None, None, "not compared at matched load")
    assert matched.bounded(load, plain, plain) is load
    # a comparison the line placed is left as it is
    placed = matched.MatchedLoad(dataclasses.replace(lighter, method=matched.INTERPOLATED), plain, None, "")
    assert matched.bounded(placed, plain, plain) is placed


def _drained_closed_loop(seed: int) -> matched.LoadBands:
    """A shadow at a fifth of c=32, as a real one runs: the baseline held at ~30.6 calls but for one
    drain a round (the last tenth of its time, at 10.5-13 calls), an identical twin at 4-8 calls. Only
    the three drains tell the baseline's slope, so a resample that draws none of them extrapolates a
    slope fitted to one load."""
    rng = np.random.default_rng(seed)

    def calls(loads: np.ndarray, start: np.ndarray, round_: np.ndarray) -> ArmCalls:
        per_token = (0.007 + 0.000025 * loads) * rng.lognormal(0.0, 0.03, len(loads))
        tokens = np.full(len(loads), 64.0)
        engine = np.full(len(loads), np.nan)
        return ArmCalls(loads, 1 / per_token, tokens, tokens * per_token, start, round_, engine)

    rounds = np.repeat([1.0, 2.0, 3.0], 300)
    drain = np.tile(np.arange(300) >= 270, 3)
    start = 30 * (rounds - 1) + np.where(drain, rng.uniform(27, 30, 900), rng.uniform(0, 27, 900))
    loads = np.where(drain, rng.uniform(10.5, 13, 900), rng.uniform(30.4, 30.7, 900))
    baseline = calls(loads, start, rounds)
    twin_rounds = np.repeat([1.0, 2.0, 3.0], 60)
    twin = calls(rng.uniform(4, 8, 180), 30 * (twin_rounds - 1) + rng.uniform(0, 30, 180), twin_rounds)
    figures = matched.LoadFigures("proxy in-flight", float(np.median(twin.load)), float(np.median(loads)))
    return matched.LoadBands(figures, twin, baseline)


def test_a_matched_interval_holds_its_point_where_few_cells_move_the_baselines_load() -> None:
    """The resamples that missed every drain extrapolate wildly; the interval must still hold its own
    point, and an identical twin's must not leave 1.0 by more than the default margin (3 %)."""
    placed = 0
    for seed in range(12):
        got = matched.compare(
            _drained_closed_loop(seed), iterations=1000, confidence=0.95, rng=np.random.default_rng(seed)
        )
        iv = got.decode
        if iv is None:
            continue
        placed += 1
        assert got.figures.method == matched.EXTRAPOLATED, got.note
        assert iv.low is not None and iv.high is not None
        assert iv.low <= iv.point <= iv.high, (seed, iv)
        assert iv.low <= 1.03 and iv.high >= 1 / 1.03, (seed, iv)
    assert placed >= 3, placed


def test_a_broken_gauge_is_left_out_and_not_blamed_on_replicas(tmp_path: Path) -> None:
    """The baseline's /metrics scrapes failed under load (0 whenever 8 or more calls were in flight),
    then never refreshed (0 always): left out either way, never blamed on replicas_behind_url."""
    run = make_live_load_run(2000, sample=0.2, load_column="engine_running", seed=8)
    run = dataclasses.replace(run, health=live_health_rows(run, set()))
    broken = 0
    for span in run.spans:
        if span.arm == "baseline" and (span.inflight_at_start or 0) >= 8:
            span.engine_running, span.engine_waiting = 0.0, 0.0
            broken += 1
    cand = next(r for r in _evaluate(run, tmp_path / "gauges.duckdb").rows if r.arm == "candidate")
    assert cand.load is not None
    assert f"baseline's engine gauges read 0 running+waiting on {broken} of" in cand.load.gauge_note
    assert "replicas_behind_url" not in cand.reason and "replicas_behind_url" not in cand.load.gauge_note
    assert cand.load.engine_baseline_p50 is None, cand.load
    assert cand.verdict == "NO CLEAR GAIN", cand.reason
    for span in run.spans:
        if span.arm == "baseline":
            span.engine_running, span.engine_waiting = 0.0, 0.0
    cand = next(r for r in _evaluate(run, tmp_path / "dead.duckdb").rows if r.arm == "candidate")
    assert cand.load is not None and cand.load.engine_baseline_p50 is None, cand.load
    dead = "baseline's engine gauges read 0 running+waiting at the median of its calls"
    assert dead in cand.load.gauge_note and "replicas_behind_url" not in cand.reason, cand.reason


def test_stale_gauges_of_short_calls_are_not_read_as_more_engines(tmp_path: Path) -> None:
    """Calls shorter than the scrape interval, in waves: each wave's gauges were read in the last
    one's tail, so they read a few calls where the proxy's calls each overlapped a dozen. Compared with
    the proxy's count when they were read, they agree; an engine of two behind the URL still shows."""
    one = _evaluate(make_wave_run(engines=1), tmp_path / "one.duckdb")
    cand = next(r for r in one.rows if r.arm == "candidate")
    assert cand.load is not None and cand.load.engine_baseline_p50 is not None, cand.load
    assert cand.load.baseline_p50 is not None
    # the trap: the gauges' median is well under 60 % of the calls' own load over their decode
    assert cand.load.engine_baseline_p50 < 0.6 * cand.load.baseline_p50, cand.load
    assert "replicas_behind_url" not in cand.load.gauge_note, cand.load.gauge_note
    two = _evaluate(make_wave_run(engines=2), tmp_path / "two.duckdb")
    cand = next(r for r in two.rows if r.arm == "candidate")
    assert cand.load is not None
    assert "baseline's engine gauges read" in cand.load.gauge_note, cand.load
    assert "set replicas_behind_url (now 1)" in cand.load.gauge_note


def _stamped(readings: list[tuple[float, float, int]]) -> ArmCalls:
    """An arm's calls carrying ``readings``: (engine gauge, the proxy's count then, calls stamped)."""
    gauge, count, read_s = (
        np.repeat(column, [n for _, _, n in readings]).astype(np.float64)
        for column in ([g for g, _, _ in readings], [c for _, c, _ in readings], np.arange(len(readings)))
    )
    n = len(gauge)
    ones = np.ones(n)
    return ArmCalls(count, 100 * ones, 32 * ones, ones, read_s, ones, gauge, 0, count, read_s)


def test_one_reading_carried_by_most_calls_is_one_reading() -> None:
    """A reading taken as a burst of calls starts finds the engine behind the proxy (1 against 4), and
    every call of the burst carries it: the hint counts readings, not calls."""
    burst = [(10.0, 10.0, 5)] * 5 + [(1.0, 4.0, 40)]
    assert arm_calls.few_engines_note("twin", _stamped(burst), {}) == ""
    halved = [(5.0, 10.0, 5)] * 5 + [(2.0, 4.0, 40)]
    note = arm_calls.few_engines_note("twin", _stamped(halved), {})
    assert "twin's engine gauges read 5.0 running+waiting where the proxy had 10.0" in note, note
    assert "(6 readings)" in note and "set replicas_behind_url (now 1)" in note, note
    # fewer readings than that say too little either way
    assert arm_calls.few_engines_note("twin", _stamped(halved[:3] + halved[-1:]), {}) == ""


def test_a_zero_read_between_waves_is_true_of_its_moment(tmp_path: Path) -> None:
    """Gauges read in the pause between waves say 0, and every call of the next wave carries one,
    sent while a dozen others were in flight. The proxy had none in flight as they were read: they
    are neither failed scrapes nor a sign of other engines, and they are read (P50 0)."""
    ev = _evaluate(make_wave_run(read_at=(0.6, 0.7)), tmp_path / "pause.duckdb")
    cand = next(r for r in ev.rows if r.arm == "candidate")
    assert cand.load is not None and cand.load.engine_baseline_p50 == 0.0, cand.load
    assert "read 0" not in cand.load.gauge_note and "replicas_behind_url" not in cand.load.gauge_note, (
        cand.load
    )


def test_live_levels_are_held_to_replays_validity_rule(tmp_path: Path) -> None:
    gain = Design("split", 2, weights={"candidate": 0.5}, speedups={"candidate": 1.6})
    clean = _evaluate(make_closed_loop_run(gain, seed=5), tmp_path / "clean.duckdb")
    assert next(r for r in clean.rows if r.arm == "candidate").verdict == "WIN"
    # the candidate's simulator 4 % behind its clock in every round: stretched figures, no verdict
    lagging = dataclasses.replace(gain, clock_lag={"candidate": 0.04})
    ev = _evaluate(make_closed_loop_run(lagging, seed=5), tmp_path / "lag.duckdb")
    row = next(r for r in ev.rows if r.arm == "candidate")
    assert row.verdict == "UNRELIABLE" and "engine_clock_lag 4.0% > 2.0% (candidate" in row.reason
    deploy = next(a for a in ev.arms if a.arm == "candidate").deploy
    assert deploy is not None and deploy.verdict not in ("WIN", "LOSS"), deploy
    # no health rows at all: nothing vouches for the level
    unchecked = dataclasses.replace(make_closed_loop_run(gain, seed=5), health=[])
    ev = _evaluate(unchecked, tmp_path / "unchecked.duckdb")
    row = next(r for r in ev.rows if r.arm == "candidate")
    assert row.verdict == "UNRELIABLE" and "no health checks recorded" in row.reason, row.reason
