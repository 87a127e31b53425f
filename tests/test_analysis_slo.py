"""Goodput, capacity and the fleet at a latency SLO: hand-built spans whose answers are computed here
independently (numpy's percentile, the interpolation written out), real DuckDB files, the CLI in a
subprocess where the output a user reads is checked."""

from __future__ import annotations

import csv as csv_module
import io
import json
import math
import statistics
from datetime import timedelta
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specproxy.analysis import evaluate, open_store
from specproxy.analysis.render.slo_table import fleet_cells
from specproxy.analysis.slo.answer import _headline, _ratio_text
from specproxy.analysis.slo.capacity import (
    BETWEEN,
    EVERY,
    NONE,
    Capacity,
    CapacityRatio,
    Crossing,
    capacity_ratio,
    crossing,
    slo_crossing,
)
from specproxy.analysis.slo.fleet import (
    CountRange,
    Peak,
    arm_fleet,
    candidate_fleet,
    interpolate,
    replicas_needed,
)
from specproxy.analysis.verdicts.evaluation import Settings
from specproxy.config import ConfigError, experiment_json, parse_experiment
from specproxy.record import SpanRecord
from specproxy.slo import SloError, parse_slo
from tests.spanfactory import T0, ArmSpec, SyntheticRun, epoch_ns, health_row, make_run, write_db
from tests.support import run_cli as _cli

LEVELS = (1, 2, 4, 8)
CALLS = 40
TOKENS = 100
GAP_S = 0.1  # between call starts
E2E_S = 1.0
# each arm's TTFT at level L spreads evenly over [0.5, 1.5] × L × its scale
TTFT_SCALE = {"baseline": 0.100, "eagle3": 0.080}


def _ttfts(arm: str, level: int, scales: dict[str, float] = TTFT_SCALE) -> list[float]:
    return [scales[arm] * level * (0.5 + i / (CALLS - 1)) for i in range(CALLS)]


def _span(arm: str, level: int, i: int, ttft: float) -> SpanRecord:
    start = T0 + timedelta(seconds=1000 * level + GAP_S * i)
    return SpanRecord(
        run_id="slo",
        request_id=f"q{level}-{i}",
        arm=arm,
        arm_role="baseline" if arm == "baseline" else "candidate",
        backend_url="http://127.0.0.1:9000",
        span_id=f"{arm}-{level}-{i}",
        spec_method="none" if arm == "baseline" else "eagle3",
        source="replay",
        routed_as="primary",
        category="chat",
        concurrency_level=level,
        stream=True,
        temperature=0.0,
        t_start=start,
        t_start_ns=epoch_ns(start),
        ttft_s=ttft,
        e2e_s=E2E_S,
        decode_tok_s=(TOKENS - 1) / (E2E_S - ttft) if ttft < E2E_S else 50.0,
        completion_tokens=TOKENS,
        tpot_s=0.01,
        output_sha256=f"out-{level}-{i}",
        identical=None if arm == "baseline" else True,
        status="ok",
        round=1,
    )


def _store(
    tmp_path: Path,
    *,
    experiment: dict[str, Any] | None = None,
    health: list[Any] | None = None,
    scales: dict[str, float] = TTFT_SCALE,
) -> Path:
    spans = [
        _span(arm, lv, i, t) for arm in scales for lv in LEVELS for i, t in enumerate(_ttfts(arm, lv, scales))
    ]
    config = json.dumps(experiment or {"name": "slo"})
    run_row = ("slo", "slo", "replay-paired", "replay", T0, T0, config, "{}", "testhost", "0.1.0")
    return write_db(tmp_path / "slo.duckdb", [SyntheticRun("slo", "slo", spans, [], run_row, health or [])])


def _analyze(db: Path, *args: str) -> dict[str, Any]:
    result = _cli("analyze", str(db), "--format", "json", "--bootstrap-iterations", "200", *args)
    assert result.returncode == 0, result.stderr
    slo: dict[str, Any] = json.loads(result.stdout)["runs"][0]["slo"]
    return slo


def _p95(arm: str, level: int, scales: dict[str, float] = TTFT_SCALE) -> float:
    return float(np.quantile(_ttfts(arm, level, scales), 0.95))


def _expected_capacity(arm: str, threshold: float, scales: dict[str, float] = TTFT_SCALE) -> float:
    """The interpolation written out: the last holding level and the first failing one."""
    points = [(lv, _p95(arm, lv, scales)) for lv in LEVELS]
    below = max(p for p in points if p[1] <= threshold)
    above = min(p for p in points if p[1] > threshold)
    return below[0] + (threshold - below[1]) / (above[1] - below[1]) * (above[0] - below[0])


def _arm(doc: dict[str, Any], name: str) -> dict[str, Any]:
    arm: dict[str, Any] = next(a for a in doc["arms"] if a["arm"] == name)
    return arm


def test_goodput_and_capacity_have_the_known_answers(tmp_path: Path) -> None:
    doc = _analyze(_store(tmp_path), "--slo", "ttft_p95=500ms")
    for row in doc["levels"]:
        ttfts = _ttfts(row["arm"], int(row["level"]))
        met = sum(t <= 0.5 for t in ttfts)
        wall = GAP_S * (CALLS - 1) + E2E_S
        assert row["met"] == met and row["calls"] == CALLS
        assert row["share"]["point"] == pytest.approx(met / CALLS)
        assert row["requests_per_s"]["point"] == pytest.approx(met / wall)
        assert row["tokens_per_s"]["point"] == pytest.approx(met * TOKENS / wall)
        (target,) = row["targets"]
        assert target["value"]["point"] == pytest.approx(_p95(row["arm"], int(row["level"])))
        assert target["value"]["low"] <= target["value"]["point"] <= target["value"]["high"]
        assert row["holds"] == (target["value"]["point"] <= 0.5)
    base, cand = _arm(doc, "baseline"), _arm(doc, "eagle3")
    for arm, got in (("baseline", base), ("eagle3", cand)):
        c = got["capacity"]
        assert c["crossing"]["state"] == BETWEEN
        assert c["crossing"]["load"] == pytest.approx(_expected_capacity(arm, 0.5))
        # the straight line between the tested levels is a guess: the interval spans both of them
        holds, fails = c["crossing"]["holds_at"], c["crossing"]["fails_at"]
        assert c["low"] <= holds < c["crossing"]["load"] < fails <= c["high"]
    # eagle3 fails at the top level, c=8: its capacity is bounded there, not open above
    assert cand["capacity"]["crossing"]["fails_at"] == 8 and not cand["capacity"]["high_open"]
    assert "≥" not in cand["text"]
    ratio = cand["ratio"]
    expected = _expected_capacity("eagle3", 0.5) / _expected_capacity("baseline", 0.5)
    assert ratio["point"] == pytest.approx(expected) and ratio["low"] <= expected <= ratio["high"]
    bracket = cand["capacity"]["crossing"], base["capacity"]["crossing"]
    assert ratio["low"] <= bracket[0]["holds_at"] / bracket[1]["fails_at"]
    assert ratio["high"] >= bracket[0]["fails_at"] / bracket[1]["holds_at"]
    assert cand["headline"].startswith(f"eagle3 serves {expected:.2f}x [")
    assert "at your SLO (ttft_p95 ≤ 500 ms)" in cand["headline"]


def _report(db: Path, *args: str) -> str:
    out = db.parent / "report.html"
    result = _cli("report", str(db), "-o", str(out), "--bootstrap-iterations", "200", *args)
    assert result.returncode == 0, result.stderr
    return out.read_text()


def test_an_slo_no_arm_meets(tmp_path: Path) -> None:
    db = _store(tmp_path)
    doc = _analyze(db, "--slo", "ttft_p95=10ms", "--peak-concurrency", "16")
    for name in ("baseline", "eagle3"):
        c = _arm(doc, name)["capacity"]
        assert c["crossing"]["state"] == NONE and c["crossing"]["load"] is None
        assert _arm(doc, name)["text"] == "none measured: fails at every tested level (lowest c=1)"
    ratio = _arm(doc, "eagle3")["ratio"]
    assert (ratio["point"], ratio["low"], ratio["high"]) == (None, None, None)
    assert ratio["note"] == "both fail the SLO at every tested load"
    assert all(r["met"] == 0 and r["holds"] is False for r in doc["levels"])
    assert all(f["replicas"] is None for f in doc["fleet"])
    args = ("--slo", "ttft_p95=10ms", "--bootstrap-iterations", "200")
    text = _cli("analyze", str(db), *args).stdout
    fails = "fails your SLO (ttft_p95 ≤ 10 ms) at every tested level (lowest c=1): no capacity measured"
    assert f"baseline {fails}\n" in text
    assert f"eagle3 {fails}; nor for baseline, which fails it at every tested level too" in text
    assert "0.00x" not in text and "serves" not in text
    csv = _cli("analyze", str(db), *args, "--format", "csv").stdout
    level_rows = [r for r in csv_module.DictReader(io.StringIO(csv)) if not r["category"]]
    assert len(level_rows) == 2 * len(LEVELS)
    for row in level_rows:
        assert row["capacity_state"] == NONE and row["capacity_at_slo"] == row["capacity_ratio"] == ""
    assert f"eagle3 {fails}" in _report(db, *args[:2])


def test_an_slo_only_the_candidate_meets(tmp_path: Path) -> None:
    # a baseline whose p95 at c=1 is 0.435 s, far above 200 ms; the candidate's 0.145 s
    scales = {"baseline": 0.300, "eagle3": 0.100}
    db = _store(tmp_path, scales=scales)
    doc = _analyze(db, "--slo", "ttft_p95=200ms", "--peak-concurrency", "16")
    base, cand = _arm(doc, "baseline"), _arm(doc, "eagle3")
    assert base["capacity"]["crossing"]["state"] == NONE and base["capacity"]["high"] is None
    assert cand["capacity"]["crossing"]["load"] == pytest.approx(_expected_capacity("eagle3", 0.2, scales))
    # the candidate's capacity is at least its interval's low end (c=1, where it holds); the
    # baseline's below c=1: the ratio is above 1 / 1, and nothing bounds it above
    ratio = cand["ratio"]
    assert (ratio["point"], ratio["bound"], ratio["high"]) == (None, ">", None)
    assert cand["capacity"]["low"] == 1 and ratio["low"] == pytest.approx(1.0)
    assert cand["headline"].startswith(
        "eagle3 serves > 1.00x more concurrent users than baseline at your SLO"
    )
    assert cand["headline"].endswith("; baseline fails it at every tested level")
    assert base["headline"].startswith("baseline fails your SLO (ttft_p95 ≤ 200 ms) at every tested level")
    fleet = {f["arm"]: f for f in doc["fleet"]}
    assert fleet["baseline"]["replicas"] is None and fleet["eagle3"]["saving"] is None
    text = _cli("analyze", str(db), "--slo", "ttft_p95=200ms", "--bootstrap-iterations", "200").stdout
    assert cand["headline"] in text and "0.00x" not in text
    assert escape(cand["headline"]) in _report(db, "--slo", "ttft_p95=200ms")


def test_an_slo_only_the_baseline_meets(tmp_path: Path) -> None:
    # a candidate with a slower first token: its p95 at c=1 is 0.435 s, the baseline's 0.145 s
    scales = {"baseline": 0.100, "eagle3": 0.300}
    db = _store(tmp_path, scales=scales)
    doc = _analyze(db, "--slo", "ttft_p95=200ms")
    base, cand = _arm(doc, "baseline"), _arm(doc, "eagle3")
    assert base["capacity"]["crossing"]["state"] == BETWEEN
    assert base["capacity"]["crossing"]["load"] == pytest.approx(_expected_capacity("baseline", 0.2, scales))
    assert cand["capacity"]["crossing"]["state"] == NONE
    # below c=1 against at least c=1: under 1x, and nothing measured bounds it below
    ratio = cand["ratio"]
    assert (ratio["point"], ratio["bound"], ratio["low"]) == (None, "<", None)
    assert base["capacity"]["low"] == 1 and ratio["high"] == pytest.approx(1.0)
    fails = (
        "eagle3 fails your SLO (ttft_p95 ≤ 200 ms) at every tested level (lowest c=1): no capacity measured"
    )
    assert cand["headline"] == f"{fails}; it serves < 1.00x the concurrent users of baseline (fewer)"
    text = _cli("analyze", str(db), "--slo", "ttft_p95=200ms", "--bootstrap-iterations", "200").stdout
    assert cand["headline"] in text and "0.00x" not in text
    assert escape(cand["headline"]) in _report(db, "--slo", "ttft_p95=200ms")


def test_a_ratio_bound_needs_the_other_arms_interval_measured() -> None:
    """An arm that failed everywhere against one whose interval reaches below its lowest level: no
    bound on the ratio, and the sentence says only what is known."""
    loads = (1.0, 2.0, 4.0)
    failing = Capacity(Crossing(NONE, None, None, 1.0), None, None, False, loads)
    vague = Capacity(Crossing(BETWEEN, 1.5, 1.0, 2.0), None, 2.0, False, loads)
    low = capacity_ratio(failing, vague, None, None, 0.95)
    assert (low.point, low.low, low.high, low.bound) == (None, None, None, "<")
    high = capacity_ratio(vague, failing, None, None, 0.95)
    assert (high.point, high.low, high.high, high.bound) == (None, None, None, ">")
    ctx = ("ttft_p95 ≤ 1 s", "concurrency", "baseline")
    assert _headline("eagle3", "candidate", failing, low, ctx) == (
        "eagle3 fails your SLO (ttft_p95 ≤ 1 s) at every tested level (lowest c=1): no capacity measured"
    )
    assert _headline("eagle3", "candidate", vague, high, ctx).endswith(
        "baseline fails it at every tested level, so no ratio"
    )
    # some replicates held at the lowest level: the interval's top is a bound
    reaching = Capacity(Crossing(NONE, None, None, 1.0), None, 1.5, False, loads)
    measured = Capacity(Crossing(BETWEEN, 3.0, 2.0, 4.0), 2.0, 4.0, False, loads)
    assert capacity_ratio(reaching, measured, None, None, 0.95).high == pytest.approx(1.5 / 2.0)
    assert _headline(
        "eagle3", "candidate", reaching, capacity_ratio(reaching, measured, None, None, 0.95), ctx
    ) == (
        "eagle3 fails your SLO (ttft_p95 ≤ 1 s) at every tested level (lowest c=1): no capacity measured "
        "(95% interval up to c≈1.5); it serves < 0.75x the concurrent users of baseline (fewer)"
    )


def test_an_slo_every_arm_meets(tmp_path: Path) -> None:
    doc = _analyze(_store(tmp_path), "--slo", "ttft_p95=60s,e2e_p99=2s")
    for name in ("baseline", "eagle3"):
        c = _arm(doc, name)["capacity"]
        assert c["crossing"]["state"] == EVERY and c["crossing"]["load"] == 8 and c["high_open"]
    ratio = _arm(doc, "eagle3")["ratio"]
    assert ratio["point"] is None and "both hold the SLO at every tested load" in ratio["note"]
    assert "≥ c=8" in _arm(doc, "eagle3")["text"]


def test_unreliable_levels_are_left_out_of_capacity(tmp_path: Path) -> None:
    db = _store(tmp_path, health=[health_row("slo", 8, "engine_clock_lag", 0.2)])
    doc = _analyze(db, "--slo", "ttft_p95=700ms")
    base = _arm(doc, "baseline")
    # without c=8 (1.16 s) the baseline holds at every level left (c=4 at 0.58 s)
    assert base["capacity"]["crossing"]["state"] == EVERY and base["capacity"]["crossing"]["load"] == 4
    assert base["left_out"] == ["c=8: UNRELIABLE"]
    assert all(not r["reliable"] for r in doc["levels"] if r["level"] == "8")


def test_an_itl_slo_on_spans_without_itl_is_not_checked(tmp_path: Path) -> None:
    db = _store(tmp_path)
    doc = _analyze(db, "--slo", "ttft_p95=500ms,itl_p99=80ms")
    assert all(r["met"] == 0 and r["holds"] is None for r in doc["levels"])
    assert all(r["targets"][1]["missing"] == CALLS for r in doc["levels"])
    assert _arm(doc, "eagle3")["capacity"] is None
    text = _cli("analyze", str(db), "--slo", "ttft_p95=500ms,itl_p99=80ms", "--bootstrap-iterations", "200")
    assert "itl not recorded for 40 of 40 ok calls; could not be checked, not counted as met" in text.stdout
    assert "not checked" in text.stdout
    # each note names its level as the tables do
    assert "eagle3 c=8: itl not recorded" in text.stdout


def test_fleet_at_the_peak_from_the_experiment_file(tmp_path: Path) -> None:
    """The SLO, peak, price and each arm's GPUs come from the run's recorded experiment."""
    exp = parse_experiment(
        {
            "experiment": {"name": "slo", "peak_concurrency": 12, "gpu_hour_usd": 2.0},
            "slo": {"ttft_p95": "500ms"},
            "arms": [
                {"name": "baseline", "role": "baseline", "url": "http://127.0.0.1:1"},
                {
                    "name": "eagle3",
                    "url": "http://127.0.0.1:2",
                    "speculative": {"method": "eagle3", "model": "m"},
                    "engine": {"tensor_parallel_size": 2},
                },
            ],
        }
    )
    doc = _analyze(_store(tmp_path, experiment=json.loads(experiment_json(exp))))
    assert doc["source"] == "run's experiment" and doc["peak"]["load"] == 12
    fleet = {f["arm"]: f for f in doc["fleet"]}
    base_cap, cand_cap = _expected_capacity("baseline", 0.5), _expected_capacity("eagle3", 0.5)
    # capacities c≈3.45 and c≈4.31: 4 replicas of one GPU against 3 of two
    assert fleet["baseline"]["replicas"] == math.ceil(12 / base_cap) == 4
    assert fleet["eagle3"]["replicas"] == math.ceil(12 / cand_cap) == 3
    assert fleet["eagle3"]["gpus"] == 6 and fleet["eagle3"]["gpus_source"] == "engine: tensor_parallel_size 2"
    assert fleet["baseline"]["gpus_source"] == "engine: tensor_parallel_size 1"
    assert fleet["baseline"]["cost_per_hour"] == pytest.approx(4 * 2.0)
    assert fleet["eagle3"]["cost_per_hour"] == pytest.approx(6 * 2.0)
    assert fleet["eagle3"]["saving"]["point"] == pytest.approx(1 - 6 / 4)
    # the replicas at the ends of the capacity's reported interval, and the saving from those
    for name, gpus in (("baseline", 1), ("eagle3", 2)):
        c = _arm(doc, name)["capacity"]
        span = {"low": math.ceil(12 / c["high"]), "high": math.ceil(12 / c["low"]), "low_open": False}
        assert fleet[name]["replicas_range"] == span | {"high_open": False}
        assert fleet[name]["gpus_range"]["high"] == span["high"] * gpus
    b, e = fleet["baseline"]["gpus_range"], fleet["eagle3"]["gpus_range"]
    saving = fleet["eagle3"]["saving"]
    assert saving["low"] == pytest.approx(1 - e["high"] / b["low"])
    assert saving["high"] == pytest.approx(1 - e["low"] / b["high"])
    text = _cli("analyze", str(tmp_path / "slo.duckdb"), "--bootstrap-iterations", "200").stdout
    row = next(line.split() for line in text.splitlines() if line.startswith("eagle3 ") and "$" in line)
    assert " ".join(row[2:8]) == f"3 [{e['low'] // 2}, {e['high'] // 2}] 6 [{e['low']}, {e['high']}]"
    # each of the baseline's 4 replicas runs at c=3, between c=2 and c=4: its goodput tok/s there
    per_level = {int(r["level"]): r["tokens_per_s"]["point"] for r in doc["levels"] if r["arm"] == "baseline"}
    expected_tokens = 4 * (per_level[2] + (per_level[4] - per_level[2]) / 2)
    assert fleet["baseline"]["tokens_per_s"] == pytest.approx(expected_tokens)
    assert fleet["baseline"]["cost_per_million_tokens"] == pytest.approx(8.0 / (expected_tokens * 3600 / 1e6))


def _between(load: float, low: float | None, high: float | None, *, high_open: bool = False) -> Capacity:
    """A capacity crossed between c=4 and c=8 of the tested 1, 2, 4, 8, with the given interval."""
    return Capacity(Crossing(BETWEEN, load, 4.0, 8.0), low, high, high_open, (1.0, 2.0, 4.0, 8.0))


def test_fleet_arithmetic() -> None:
    assert [replicas_needed(12, c) for c in (5.0, 6.25, 12.0, 24.0)] == [3, 2, 1, 1]
    assert replicas_needed(12, 4.0) == 3  # exactly three, not four from 12 / 4 = 3.0000000001
    assert interpolate([(4.0, 400.0), (8.0, 600.0)], 6.0) == 500.0
    assert interpolate([(4.0, 400.0), (8.0, 600.0)], 2.0) == 200.0  # through zero below the lowest
    peak = Peak(12.0, "concurrency", "command line")
    goodput = [(4.0, 400.0), (8.0, 600.0)]
    base = arm_fleet("baseline", peak, _between(5.0, 4.0, 8.0), goodput, (1, "default"), 3.0)
    # 3 replicas at c=4 each: 3 × 400 tok/s; $9 per hour over 4.32 M tokens per hour
    assert (base.replicas, base.gpus, base.cost_per_hour, base.tokens_per_s) == (3, 3, 9.0, 1200.0)
    assert base.cost_per_million_tokens == pytest.approx(9.0 / (1200.0 * 3600 / 1e6))
    # capacity [4, 8]: 12 / 8 → 2 replicas at its high end, 12 / 4 → 3 at its low end
    assert base.replicas_range == CountRange(2, 3, False, False)
    every = Capacity(Crossing(EVERY, 8.0, 8.0, None), 6.0, 8.0, True, (1.0, 2.0, 4.0, 8.0))
    cand = arm_fleet("eagle3", peak, every, goodput, (2, "engine"), 3.0)
    # held at every level: ≤ 2 replicas of 2 GPUs, at most 12 / 6 → 2 at the interval's low end
    assert (cand.replicas, cand.gpus, cand.at_most) == (2, 4, True)
    assert cand.gpus_range == CountRange(4, 4, True, False)
    saved = candidate_fleet(cand, base)
    assert saved.saving is not None and saved.saving.point == pytest.approx(1 - 4 / 3)
    # its most GPUs (4) over the baseline's fewest (2); its fewest (4, or fewer) over the most (3)
    assert saved.saving.low == pytest.approx(1 - 4 / 2) and saved.saving.high == pytest.approx(1 - 4 / 3)
    assert saved.saving_open == (False, True)
    assert fleet_cells(saved)[2:4] == ["≤2 [≤2, 2]", "≤4 [≤4, 4]"]
    assert fleet_cells(saved)[-1] == "-33% [-100%, ≥-33%]"
    none = arm_fleet(
        "x",
        peak,
        Capacity(Crossing(NONE, None, None, 1.0), None, None, False, (1.0,)),
        goodput,
        (1, "default"),
        3.0,
    )
    assert none.replicas is None and none.note == "holds the SLO at no tested load"
    assert candidate_fleet(none, base).saving is None


def test_the_fleet_interval_is_the_capacity_interval() -> None:
    """Replicas at each end of the capacity's interval; one that reaches below the lowest tested load
    leaves the fleet open above, and the saving open below."""
    peak = Peak(100.0, "concurrency", "command line")
    goodput = [(1.0, 50.0), (8.0, 300.0)]
    base = arm_fleet("baseline", peak, _between(6.0, 4.0, 8.0), goodput, (1, "default"), None)
    # 100 / 6 → 17; 100 / 8 → 13; 100 / 4 → 25
    assert (base.replicas, base.replicas_range) == (17, CountRange(13, 25, False, False))
    wide = arm_fleet("eagle3", peak, _between(7.0, None, 8.0), goodput, (2, "engine"), None)
    # below the lowest (c=1): at least 100 replicas at that end, maybe more
    assert (wide.replicas, wide.replicas_range) == (15, CountRange(13, 100, False, True))
    assert wide.gpus_range == CountRange(26, 200, False, True)
    saved = candidate_fleet(wide, base)
    assert saved.saving is not None and saved.saving.point == pytest.approx(1 - 30 / 17)
    assert saved.saving.low == pytest.approx(1 - 200 / 13) and saved.saving.high == pytest.approx(1 - 26 / 25)
    assert saved.saving_open == (True, False)
    assert fleet_cells(saved)[2:4] == ["15 [13, ≥100]", "30 [26, ≥200]"]
    # no interval for the capacity (no replicates): the counts alone
    bare = arm_fleet("x", peak, _between(6.0, None, None), goodput, (1, "default"), None)
    assert bare.replicas == 17 and bare.replicas_range is None and fleet_cells(bare)[2] == "17"


def test_crossing_is_agnostic_of_the_load_axis() -> None:
    # offered rates in requests/s: any increasing loads, interpolated linearly
    rates = [(0.5, 0.2), (1.5, 0.4), (3.0, 0.9)]
    c = crossing(rates, 0.5)
    assert c.state == BETWEEN and c.load == pytest.approx(1.5 + 0.1 / 0.5 * 1.5)
    assert (c.holds_at, c.fails_at) == (1.5, 3.0)
    assert crossing(rates, 1.0).state == EVERY and crossing(rates, 0.1).state == NONE
    # a level that holds again above the first failure does not count
    assert crossing([(1, 0.2), (2, 0.9), (4, 0.3)], 0.5).fails_at == 2
    # two targets: the first to fail binds
    both = slo_crossing([1, 2, 4], [[0.1, 0.2, 0.3], [0.1, 0.6, 0.9]], [0.5, 0.5])
    assert both.target == 1 and both.load == pytest.approx(1 + 0.4 / 0.5)


def test_the_report_shows_the_capacity_chart_and_fleet(tmp_path: Path) -> None:
    db = _store(tmp_path)
    out = tmp_path / "report.html"
    result = _cli(
        "report", str(db), "-o", str(out), "--slo", "ttft_p95=500ms", "--peak-concurrency", "12",
        "--gpu-hour-usd", "2", "--bootstrap-iterations", "200",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    assert "Deploy verdict at your SLO: ttft_p95 ≤ 500 ms" in html
    for arm in ("baseline", "eagle3"):
        assert f'aria-label="{arm}: capacity at the SLO"' in html
    assert f"capacity ≈ {_expected_capacity('baseline', 0.5):.3g}" in html
    assert "ttft_p95 (ms)" in html and "Fleet and cost at the peak" in html and "GPUs saved [95% CI]" in html
    # the fleet's cells as the JSON has them: replicas at the capacity interval's ends
    doc = _analyze(db, "--slo", "ttft_p95=500ms", "--peak-concurrency", "12", "--gpu-hour-usd", "2")
    for fleet in doc["fleet"]:
        span = fleet["replicas_range"]
        assert f'<td class="">{fleet["replicas"]} [{span["low"]}, {span["high"]}]</td>' in html


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ttft_p95=500", "expected a duration with a unit"),
        ("latency_p95=1s", "unknown metric 'latency'"),
        ("ttft_p10=1s", "percentile p10 is outside p50..p99.9"),
        ("ttft=1s", "expected METRIC_pPERCENTILE"),
        ("ttft_p95", "expected NAME=VALUE"),
        ("ttft_p95=1s,ttft_p99=2s", "ttft has two targets"),
        ("e2e_p95=0s", "must be above zero"),
        ("", "no targets"),
    ],
)
def test_slo_parse_errors_name_the_bad_part(text: str, message: str) -> None:
    with pytest.raises(SloError, match=message):
        parse_slo(text)


def test_slo_parses() -> None:
    slo = parse_slo("ttft_p95=500ms, itl_p99=80ms,e2e_p99.9=20s,tpot_p50=0.05s")
    assert slo.describe() == "ttft_p95 ≤ 500 ms, itl_p99 ≤ 80 ms, e2e_p99.9 ≤ 20 s, tpot_p50 ≤ 50 ms"
    assert [t.column for t in slo.targets] == ["ttft_s", "itl_p99_s", "e2e_s", "tpot_s"]
    assert [t.column for t in parse_slo("itl_p90=1s").targets] == ["itl_p95_s"]


def test_bad_slo_on_the_command_line_is_a_usage_error(tmp_path: Path) -> None:
    result = _cli("analyze", str(tmp_path / "none.duckdb"), "--slo", "ttft_p95=fast")
    assert result.returncode == 2
    assert "Invalid value for '--slo': ttft_p95='fast': expected a duration with a unit" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_slo_in_the_experiment_file_names_the_table() -> None:
    arms = [{"name": "b", "role": "baseline", "url": "http://127.0.0.1:1"}]
    with pytest.raises(ConfigError, match=r"exp.toml: slo: e2e_p95: must be a duration with a unit"):
        parse_experiment({"slo": {"e2e_p95": 20}, "arms": arms}, "exp.toml")
    with pytest.raises(ConfigError, match=r"exp.toml: slo: 'ttft_p1': percentile p1 is outside"):
        parse_experiment({"slo": {"ttft_p1": "1s"}, "arms": arms}, "exp.toml")


def test_a_peak_rate_on_a_concurrency_sweep_is_said_not_used(tmp_path: Path) -> None:
    doc = _analyze(_store(tmp_path), "--slo", "ttft_p95=500ms", "--peak-rate", "5")
    assert doc["peak"] is None and doc["fleet"] == []
    assert doc["notes"] == [
        "fleet: the levels are on the concurrency axis; a peak given as --peak-rate cannot be placed on it"
    ]


def test_the_capacity_interval_covers_the_true_crossing(tmp_path: Path) -> None:
    """Twelve synthetic runs (three rounds, 60 calls a level and round, lognormal TTFT, 1 % timeouts):
    the capacity interval contains the crossing of the population's P95 (timeouts count as
    violations) for nearly every arm and run."""
    levels, threshold = (1, 8, 32, 64), 0.4
    z = statistics.NormalDist().inv_cdf(0.95 / 0.99)  # 1 % of calls time out: slower than any SLO
    p95 = {lv: 0.05 * (1 + lv / 8) * math.exp(0.5 * z) for lv in levels}
    truth = 8 + (threshold - p95[8]) / (p95[32] - p95[8]) * 24
    arms = [ArmSpec("baseline", "baseline", "none"), ArmSpec("replica", "replica", "none")]
    covered = []
    for seed in range(12):
        run = make_run(arms, levels=levels, n_per_level=60, rounds=3, seed=seed, run_id=f"cov{seed}")
        path = write_db(tmp_path / f"cov{seed}.duckdb", [run])
        with open_store([path]) as store:
            settings = Settings(slo=parse_slo("ttft_p95=400ms"), bootstrap_iterations=400)
            (ev,) = evaluate(store, settings=settings)
        assert ev.slo is not None
        for arm in ev.slo.arms:
            assert arm.capacity is not None
            low, high = arm.capacity.low or 0.0, arm.capacity.high or math.inf
            covered.append(low <= truth <= high)
    print(f"capacity intervals containing the true crossing c≈{truth:.1f}: {sum(covered)}/{len(covered)}")
    assert sum(covered) >= 0.85 * len(covered)


@pytest.mark.parametrize(
    ("ratio", "words"),
    [
        (CapacityRatio(1.3, 1.2, 1.4, ""), "1.30x [1.20, 1.40] more concurrent users than baseline"),
        (CapacityRatio(0.6, 0.5, 0.8, ""), "0.60x [0.50, 0.80] the concurrent users of baseline (fewer)"),
        # an interval across 1 says neither more nor fewer, whichever side the point is on
        (
            CapacityRatio(0.72, 0.39, 1.82, "≤"),
            "≤0.72x [0.39, 1.82] the concurrent users of baseline (no clear difference)",
        ),
        (
            CapacityRatio(1.56, 0.82, 3.15, "≥"),
            "≥1.56x [0.82, 3.15] the concurrent users of baseline (no clear difference)",
        ),
        (CapacityRatio(1.1, None, None, ""), "1.10x more concurrent users than baseline"),
        (CapacityRatio(0.9, None, None, ""), "0.90x the concurrent users of baseline (fewer)"),
    ],
)
def test_a_capacity_ratio_says_more_or_fewer_only_when_its_interval_does(
    ratio: CapacityRatio, words: str
) -> None:
    assert _ratio_text(ratio, "concurrent users", "baseline") == f"serves {words}"
