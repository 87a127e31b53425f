"""Verdicts that hold up against themselves: null (A/A) runs, lagging levels, matched load, the
operating point, replay rounds. Synthetic spans with known answers (tests/spanfactory.py), real DuckDB
files, the CLI in a subprocess where the output a user reads is checked."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pytest

from specproxy import schema
from specproxy.analysis import evaluate, open_store
from specproxy.analysis.figures.run_figures import LevelSummary
from specproxy.analysis.verdicts.evaluation import Settings
from specproxy.analysis.verdicts.rows import SUMMARY_FIELDS, LevelRow
from tests.spanfactory import (
    ArmSpec,
    SyntheticRun,
    health_row,
    live_health_rows,
    make_live_load_run,
    make_run,
    since_t0,
    write_db,
)
from tests.support import run_cli as _cli

NULL_ARMS = [
    ArmSpec("baseline", "baseline", "none"),
    ArmSpec("replica", "replica", "none"),
    ArmSpec("null_eagle3", spec_method="eagle3"),  # a plain arm labelled with a speculative method
]


def _json(*args: str) -> dict[str, Any]:
    result = _cli("analyze", *args, "--format", "json")
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def test_null_runs_give_no_win_or_loss(tmp_path: Path) -> None:
    """Eight A/A runs, three rounds each, with drift between rounds that every request of a round
    shares (an arm's slow moment): no null arm comes out WIN or LOSS deployed, the replica at no level
    (its own noise floor holds it), and the null arm labelled eagle3 at no more than 5 % of its levels,
    which is what the intervals' joint 95 % allows: the margin is the replicas' typical deviation, not
    a replica's farthest interval bound (here 13-22 %, which hid real differences of that size)."""
    per_level: Counter[str] = Counter()
    replica: Counter[str] = Counter()
    deploy: Counter[str] = Counter()
    for seed in range(8):
        run = make_run(
            NULL_ARMS,
            levels=(1, 8, 32),
            n_per_level=60,
            seed=seed,
            rounds=3,
            round_sigma=0.05,
            run_id=f"aa{seed}",
        )
        path = write_db(tmp_path / f"aa{seed}.duckdb", [run])
        with open_store([path]) as store:
            (ev,) = evaluate(store, settings=Settings(bootstrap_iterations=400))
        per_level.update(r.verdict or "—" for r in ev.rows if r.arm == "null_eagle3")
        replica.update(r.verdict or "—" for r in ev.rows if r.arm == "replica")
        deploy.update(a.deploy.verdict for a in ev.arms if a.deploy is not None)
        assert {r.rounds for r in ev.rows} == {3} and not any(r.drift_note for r in ev.rows)
    print(f"null per-level verdicts {dict(per_level)}, deploy verdicts {dict(deploy)}")
    assert replica == Counter({"NO CLEAR GAIN": 8 * 3})
    assert per_level["WIN"] + per_level["LOSS"] <= 0.05 * 8 * 3
    assert deploy == Counter({"NO CLEAR GAIN": 8 * 2})


def test_a_true_effect_is_still_found_with_rounds(tmp_path: Path) -> None:
    arms = [*NULL_ARMS, ArmSpec("eagle3", speedup=1.5)]
    wins = 0
    for seed in range(4):
        run = make_run(arms, levels=(1, 8), n_per_level=60, seed=seed, rounds=3, round_sigma=0.02)
        path = write_db(tmp_path / f"p{seed}.duckdb", [run])
        with open_store([path]) as store:
            (ev,) = evaluate(store, settings=Settings(bootstrap_iterations=400))
        wins += sum(1 for r in ev.rows if r.arm == "eagle3" and r.level == "1" and r.verdict == "WIN")
    assert wins == 4


def test_a_lag_under_the_limit_moves_the_bounds_out_by_itself(tmp_path: Path) -> None:
    """Simulators 1.5 % and 0.5 % behind their clocks pass the 2 % gate, but a ratio measured there can
    be off whatever the sampling error: the candidate's lag may have hidden up to 1.5 % of its speed (the
    upper bound moves out by that), the baseline's may have flattered it by up to 0.5 % (the lower)."""
    arms = [ArmSpec("baseline", "baseline", "none"), ArmSpec("eagle3", speedup=1.5)]
    lag = [
        health_row("run-1", 4, "engine_clock_lag", 0.015, arm="eagle3", round_=1),
        health_row("run-1", 4, "engine_clock_lag", 0.005, arm="baseline", round_=1),
    ]
    rows = {}
    for name, health in (("calm", []), ("lag", lag)):
        run = make_run(arms, levels=(4,), n_per_level=80, rounds=3, seed=4, health=health)
        with open_store([write_db(tmp_path / f"{name}.duckdb", [run])]) as store:
            (ev,) = evaluate(store, settings=Settings(bootstrap_iterations=300))
        rows[name] = next(r for r in ev.rows if r.arm == "eagle3")
    calm, lagged = rows["calm"], rows["lag"]
    assert lagged.reliable and lagged.verdict == calm.verdict == "WIN"
    for figure in ("decode_speedup", "throughput_speedup"):
        a, b = getattr(calm, figure), getattr(lagged, figure)
        assert b.point == a.point
        assert b.low == pytest.approx(a.low / 1.005) and b.high == pytest.approx(a.high * 1.015)


def test_rounds_pair_calls_within_their_round(tmp_path: Path) -> None:
    """Three rounds reuse the same request ids: each candidate call is paired with the baseline call of
    its own round, and no baseline call of a later round is taken for a repeat."""
    run = make_run(
        [*NULL_ARMS[:2], ArmSpec("eagle3", speedup=1.3)], levels=(4,), n_per_level=50, seed=2, rounds=3
    )
    doc = _json(str(write_db(tmp_path / "rounds.duckdb", [run])))
    (ev,) = doc["runs"]
    replica = next(r for r in ev["rows"] if r["arm"] == "replica")
    expected = sum(1 for s in run.spans if s.arm == "replica" and s.identical is not None)
    assert replica["compared"] == expected and replica["rounds"] == 3 and replica["blocks"] == "3 rounds"
    # /metrics: one before/after window per round ('c=4 r2/3'); the level's acceptance sums them
    increase: Counter[str] = Counter()
    for _, arm, _, phase, name, _labels, value in run.metrics:
        if arm == "eagle3":
            increase[name] += value if phase.endswith(":after") else -value
    eagle = next(r for r in ev["rows"] if r["arm"] == "eagle3")
    assert eagle["acceptance_rate"] == pytest.approx(
        increase["vllm:spec_decode_num_accepted_tokens_total"]
        / increase["vllm:spec_decode_num_draft_tokens_total"]
    )
    assert len({m[3] for m in run.metrics}) == 6
    base = next(r for r in ev["rows"] if r["arm"] == "baseline")
    assert base["compared"] == 0  # no 'repeat' pairs across rounds
    table = _cli("analyze", str(tmp_path / "rounds.duckdb"))
    assert "1 round" not in table.stdout


def test_a_lagging_level_is_unreliable(tmp_path: Path) -> None:
    """A simulator 30 % behind its clock at c=16: that level gets no verdict, the crossover leaves it
    out, the deploy verdict (whose assumed peak is the highest tested level, c=16) is UNRELIABLE and
    says which option judges at a level measured soundly, and the table, JSON, CSV and report say so
    and why."""
    arms = [ArmSpec("baseline", "baseline", "none"), ArmSpec("eagle3", speedup=1.5)]
    health = [health_row("run-1", lv, "engine_clock_lag", 0.004, arm="eagle3", round_=1) for lv in (1, 4)] + [
        health_row("run-1", 16, "engine_clock_lag", 0.31, arm="eagle3", round_=1),
        health_row("run-1", 16, "loadgen_start_lag_p99_s", 0.002),
        # a threshold in the row wins over the default (0.05 s)
        health_row("run-1", 4, "proxy_queue_p99_s", 0.08, threshold=0.1),
    ]
    run = make_run(arms, levels=(1, 4, 16), n_per_level=150, rounds=3, seed=4, health=health)
    path = write_db(tmp_path / "lag.duckdb", [run])
    doc = _json(str(path))
    (ev,) = doc["runs"]
    rows = {(r["arm"], r["level"]): r for r in ev["rows"]}
    lagging = rows[("eagle3", "16")]
    assert lagging["verdict"] == "UNRELIABLE" and lagging["reliable"] is False
    assert "engine_clock_lag 31.0% > 2.0% (eagle3 round 1)" in lagging["health"]
    assert rows[("baseline", "16")]["reliable"] is False
    assert rows[("eagle3", "4")]["reliable"] is True and rows[("eagle3", "4")]["verdict"] == "WIN"
    assert ev["unreliable_levels"] == ["16"]
    # two reliable levels: each interval at 1 - 0.05 / 2
    assert rows[("eagle3", "1")]["confidence"] == pytest.approx(0.975)
    (arm,) = [a for a in ev["arms"] if a["arm"] == "eagle3"]
    assert arm["crossover"]["first_not_paying"] is None  # c=16 left out: it wins at every reliable level
    deploy = arm["deploy"]
    assert deploy["verdict"] == "UNRELIABLE" and "peak = highest tested level c=16" in deploy["text"]
    assert "UNRELIABLE at c=16" in deploy["text"]
    assert deploy["text"].endswith(
        "peak c=16 failed its health checks (engine_clock_lag 31.0% > 2.0% (eagle3 round 1)); give "
        "--peak-concurrency 4 to judge at the highest level measured soundly, or rerun slower"
    )
    # as it says: judged at the highest level measured soundly
    (given,) = _json(str(path), "--peak-concurrency", "4")["runs"]
    assert next(a for a in given["arms"] if a["arm"] == "eagle3")["deploy"]["verdict"] == "WIN"
    table = _cli("analyze", str(path)).stdout
    assert "c=16 UNRELIABLE: engine_clock_lag 31.0% > 2.0%" in table
    assert any(
        line.startswith("c=16") and line.rstrip().endswith("UNRELIABLE") for line in table.splitlines()
    )
    rows_csv = list(csv.DictReader(io.StringIO(_cli("analyze", str(path), "--format", "csv").stdout)))
    lag_csv = next(r for r in rows_csv if r["arm"] == "eagle3" and r["level"] == "16" and not r["category"])
    assert lag_csv["verdict"] == "UNRELIABLE" and lag_csv["reliable"] == "False" and lag_csv["health"]
    out = tmp_path / "report.html"
    assert _cli("report", str(path), "-o", str(out)).returncode == 0
    html = out.read_text()
    assert 'class="l UNREL"' in html or 'class="UNREL"' in html
    assert "engine_clock_lag 31.0% &gt; 2.0%" in html


def test_identical_engines_at_unequal_load_are_compared_at_matched_load(tmp_path: Path) -> None:
    """Two identical engines, the candidate shadowed at sample = 0.2 under load: it runs at a fifth of
    the baseline's load and decodes faster for that alone. At matched load: no clear gain, ratio ~1."""
    path = write_db(tmp_path / "shadow.duckdb", [make_live_load_run(2000, sample=0.2)])
    (ev,) = _json(str(path))["runs"]
    cand = next(r for r in ev["rows"] if r["arm"] == "candidate")
    assert cand["verdict"] == "NO CLEAR GAIN"
    assert 0.95 <= cand["decode_speedup"]["point"] <= 1.06
    # shadow copies reach it at the baseline's pace: no throughput ratio (tests/test_analysis_shadow.py)
    assert cand["throughput_speedup"] is None and cand["throughput_basis"] == "shadow"
    # what a per-call comparison at unequal load says, kept beside it
    assert cand["unmatched_decode_speedup"]["point"] > 1.2
    load = cand["load"]
    assert load["basis"] == "proxy in-flight" and load["p50"] < 0.4 * load["baseline_p50"]
    assert load["method"] == "interpolated" and load["matched_share"] > 0.8
    assert "arms ran at different loads" in cand["reason"]
    table = _cli("analyze", str(path)).stdout
    line = next(line for line in table.splitlines() if line.startswith("live") and " candidate " in line)
    assert "(matched load)" in line and "unequal" in line and line.rstrip().endswith("NO CLEAR GAIN")


def test_a_real_gain_survives_the_load_matching(tmp_path: Path) -> None:
    run = make_live_load_run(2000, sample=0.2, speedup=1.5, load_column="engine_running", seed=8)
    (ev,) = _json(str(write_db(tmp_path / "gain.duckdb", [run])))["runs"]
    cand = next(r for r in ev["rows"] if r["arm"] == "candidate")
    # the gauges agree with the proxy's count (no other client): matched on the count, both reported
    load = cand["load"]
    assert load["basis"] == "proxy in-flight" and load["engine_p50"] is not None
    assert cand["verdict"] == "WIN" and 1.4 <= cand["decode_speedup"]["point"] <= 1.6


def test_arms_that_never_ran_at_comparable_loads_are_not_compared(tmp_path: Path) -> None:
    """The baseline held at 28-32 calls in flight, the identical candidate at a fifth of that: the
    plain ratio (about 1.5x) is the load's effect alone, and no line fitted over 28-32 reaches 6. No
    figure, no WIN or LOSS, and the loads each arm saw are said where the figure would be."""
    path = write_db(tmp_path / "steady.duckdb", [make_live_load_run(2000, sample=0.2, steady=True)])
    (ev,) = _json(str(path))["runs"]
    cand = next(r for r in ev["rows"] if r["arm"] == "candidate")
    assert cand["verdict"] == "NO CLEAR GAIN" and cand["decode_speedup"] is None
    assert cand["throughput_speedup"] is None and cand["unmatched_decode_speedup"]["point"] > 1.3
    load = cand["load"]
    assert load["method"] == "not compared" and load["baseline_range"][0] > 15 > 10 > load["compared_at"]
    assert cand["reason"].startswith("not compared at matched load (load P50")
    table = _cli("analyze", str(path)).stdout
    line = next(line for line in table.splitlines() if line.startswith("live") and " candidate " in line)
    assert "(matched load)" not in line and "unequal" in line and line.rstrip().endswith("NO CLEAR GAIN")
    assert "candidate live: not compared at matched load (load P50" in table


def test_the_operating_point_comes_from_the_options_or_the_experiment(tmp_path: Path) -> None:
    """eagle3 wins at c=1 and c=4 and is slower at c=16 (decode 0.9x, throughput lower)."""
    arms = [
        ArmSpec("baseline", "baseline", "none"),
        ArmSpec("eagle3", speedup=1.5, speedup_by_level={16: 0.85}),
    ]
    run = make_run(arms, levels=(1, 4, 16), n_per_level=150, rounds=3, seed=9)
    path = write_db(tmp_path / "op.duckdb", [run])

    def deploy(*args: str) -> dict[str, Any]:
        (ev,) = _json(str(path), *args)["runs"]
        return next(a for a in ev["arms"] if a["arm"] == "eagle3")["deploy"]  # type: ignore[no-any-return]

    assumed = deploy()
    assert (
        assumed["verdict"] == "LOSS"
        and "assumed: operating point = lowest tested level c=1, peak = highest tested level c=16"
        in assumed["text"]
    )
    low_peak = deploy("--at-concurrency", "1", "--peak-concurrency", "4")
    assert low_peak["verdict"] == "WIN" and low_peak["assumed"] == ""
    between = deploy("--at-concurrency", "2", "--peak-concurrency", "3")
    assert between["verdict"] == "WIN" and "between tested c=1 and c=4" in between["text"]
    # the experiment file's operating point (runs.config_json), when the options do not say
    with duckdb.connect(str(path)) as conn:
        conn.execute(
            "UPDATE runs SET config_json = ?",
            [json.dumps({"name": "x", "at_concurrency": 1, "peak_concurrency": 4})],
        )
    from_file = deploy()
    assert from_file["verdict"] == "WIN" and from_file["at_concurrency"] == 1
    (ev,) = _json(str(path))["runs"]
    assert "operating point c=1 (experiment file)" in ev["operating_point"]
    assert deploy("--peak-concurrency", "16")["verdict"] == "LOSS"
    # a peak below the operating point is refused, as in the experiment file and the lab
    for command in ("analyze", "report"):
        bad = _cli(command, str(path), "--at-concurrency", "16", "--peak-concurrency", "4")
        assert bad.returncode == 2 and "must be ≥ --at-concurrency (4 < 16)" in bad.stderr, bad.stderr


def test_a_store_from_before_rounds_still_analyses(tmp_path: Path) -> None:
    """A schema-6 file: no round, engine load or health; the analysis reads it as one round."""
    path = tmp_path / "old.duckdb"
    run = make_run(
        [ArmSpec("baseline", "baseline", "none"), ArmSpec("eagle3", speedup=1.4)], levels=(1,), seed=3
    )
    with duckdb.connect(str(path)) as conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER, applied_at TIMESTAMPTZ)")
        for version, stmts in enumerate(schema.MIGRATIONS[:6], start=1):
            for stmt in stmts:
                conn.execute(stmt)
            conn.execute("INSERT INTO schema_version VALUES (?, now())", [version])
        columns = [
            c for c in schema.REQUESTS_DDL.split("(", 1)[1].split("\n") if c.strip() and c.strip() != ")"
        ]
        names = [c.split()[0] for c in columns]
        conn.executemany(
            f"INSERT INTO requests ({', '.join(names)}) VALUES ({', '.join('?' for _ in names)})",
            [tuple(getattr(s, n) for n in names) for s in run.spans],
        )
    (ev,) = _json(str(path))["runs"]
    row = next(r for r in ev["rows"] if r["arm"] == "eagle3")
    assert row["rounds"] == 1 and row["reliable"] is True
    # one round cannot see the drift between runs: the 1.4x gain is shown, but gives no WIN
    assert (
        row["verdict"] == "NO CLEAR GAIN"
        and "1 round: cannot see between-run drift, so no WIN" in row["reason"]
    )
    assert row["decode_speedup"]["low"] > 1.3


def test_a_sampled_shadow_at_a_replay_level_is_not_judged_by_wall_clock(tmp_path: Path) -> None:
    """Replay driven through `serve` carries its level, but the shadow sampled 1 in 4 served a quarter
    of the work: its wall-clock tok/s would read 0.25x. The per-call token rate is compared instead."""
    arms = [ArmSpec("baseline", "baseline", "none"), ArmSpec("candidate", spec_method="eagle3")]
    run = make_run(arms, levels=(32,), n_per_level=400, shadow_sample=0.25, seed=6)
    (ev,) = _json(str(write_db(tmp_path / "sampled.duckdb", [run])))["runs"]
    cand = next(r for r in ev["rows"] if r["arm"] == "candidate")
    assert cand["calls"] == 100 and cand["agg_tok_s"] < 0.5 * ev["rows"][0]["agg_tok_s"]
    assert cand["throughput_basis"] == "per call" and 0.8 < cand["throughput_speedup"]["point"] < 1.25
    assert cand["verdict"] == "NO CLEAR GAIN"


def _as_service_of_two(run: SyntheticRun, config_json: str) -> SyntheticRun:
    """The run as if the baseline's URL spread its calls over two engines: a scrape through it reads
    one engine's gauges, half the proxy's count."""
    spans = [
        dataclasses.replace(s, engine_running=(s.engine_running or 0.0) / 2) if s.arm == "baseline" else s
        for s in run.spans
    ]
    row = (*run.run_row[:6], config_json, *run.run_row[7:])
    return dataclasses.replace(run, spans=spans, run_row=row)


def test_an_arm_url_of_several_engines_is_counted_per_engine(tmp_path: Path) -> None:
    run = make_live_load_run(2000, sample=0.2, load_column="engine_running", seed=8)
    unsaid = write_db(tmp_path / "unsaid.duckdb", [_as_service_of_two(run, "{}")])
    (ev,) = _json(str(unsaid))["runs"]
    cand = next(r for r in ev["rows"] if r["arm"] == "candidate")
    # the gauges read half the proxy's count: the figures warn, and the loads are the service's
    assert "baseline's engine gauges read" in cand["reason"], cand["reason"]
    assert "set replicas_behind_url (now 1)" in cand["reason"]
    whole = cand["load"]["baseline_p50"]

    config = json.dumps({"arms": [{"name": "baseline", "replicas_behind_url": 2}, {"name": "candidate"}]})
    said = write_db(tmp_path / "said.duckdb", [_as_service_of_two(run, config)])
    (ev,) = _json(str(said))["runs"]
    cand = next(r for r in ev["rows"] if r["arm"] == "candidate")
    load = cand["load"]
    assert load["basis"] == "proxy in-flight per engine (baseline's ÷ 2: replicas_behind_url)", load
    assert load["baseline_p50"] == pytest.approx(whole / 2) and "gauges read" not in cand["reason"]


def _in_flight_during(run: SyntheticRun, arm: str, start_s: float, end_s: float) -> int:
    """How many of ``arm``'s calls overlap (start_s, end_s), seconds after T0: computed from the spans."""
    return sum(1 for s in run.spans if s.arm == arm and since_t0(s)[0] < end_s and since_t0(s)[1] > start_s)


def test_live_traffic_is_judged_without_its_failed_health_windows(tmp_path: Path) -> None:
    """One 10 s window in which the proxy's loop lagged does not make hours of live traffic
    UNRELIABLE: the calls in flight during it are left out, every arm's, and the notes say so."""
    run = make_live_load_run(2000, sample=0.2, seed=8)
    rows = live_health_rows(run, failing={3})
    path = write_db(tmp_path / "live.duckdb", [dataclasses.replace(run, health=rows)])
    (ev,) = _json(str(path))["runs"]
    cand = next(r for r in ev["rows"] if r["arm"] == "candidate")
    base = next(r for r in ev["rows"] if r["arm"] == "baseline")
    assert cand["verdict"] == "NO CLEAR GAIN", cand["reason"]
    for arm, row in (("candidate", cand), ("baseline", base)):
        total = sum(1 for s in run.spans if s.arm == arm)
        assert row["ok"] == total - _in_flight_during(run, arm, 30.0, 40.0), (arm, row["ok"], total)
    note = next(n for n in ev["notes"] if n.startswith("live: judged without"))
    assert note.startswith(f"live: judged without 1 of {len(rows)} health windows") and "09:00:40 UTC" in note

    many = set(range(0, len(rows), 2)) | {1}  # more than half the windows failed
    path = write_db(tmp_path / "bad.duckdb", [dataclasses.replace(run, health=live_health_rows(run, many))])
    (ev,) = _json(str(path))["runs"]
    cand = next(r for r in ev["rows"] if r["arm"] == "candidate")
    assert cand["verdict"] == "UNRELIABLE" and "health windows passed every check" in cand["reason"]


def test_the_fields_a_row_copies_from_its_summary_exist_on_both() -> None:
    row_fields = {f.name for f in dataclasses.fields(LevelRow)}
    summary_fields = {f.name for f in dataclasses.fields(LevelSummary)}
    assert set(SUMMARY_FIELDS) <= row_fields & summary_fields
