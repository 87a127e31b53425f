"""What shadow traffic can and cannot tell: per-call speed and identity yes, capacity (throughput at the
peak) no. Shadow copies reach a candidate at the baseline's pace, so its wall-clock throughput is the
baseline's by construction: no WIN and no "enable" may rest on it. Synthetic spans with known answers
(tests/spanfactory.py) in real DuckDB files, and the CLI in a subprocess where the output a user reads
is checked."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from specproxy.analysis import evaluate, open_store
from specproxy.analysis.verdicts.rows import RunEvaluation
from tests.spanfactory import ArmSpec, SyntheticRun, make_run, write_db
from tests.support import replay_target_argv, run_cli, serving, simulators

BASELINE = ArmSpec("baseline", "baseline", "none")


def _ngram(speedup_at: dict[float, float]) -> ArmSpec:
    return ArmSpec("ngram", spec_method="ngram", speedup_by_level=speedup_at)


def _run(arms: list[ArmSpec], mode: str, levels: tuple[float | None, ...] = (2, 64)) -> SyntheticRun:
    """A paired replay of ``arms`` or, with ``mode = 'shadow'``, serve's shadow traffic: the candidates'
    calls are shadow copies (routed_as = 'shadow') that start with the baseline's calls and, as far as
    wall-clock throughput goes, end with them (each keeps its own decode speed): the baseline's pace,
    which is all a shadow's throughput can show."""
    run = make_run(arms, levels=levels, n_per_level=150, rounds=3, seed=7, run_id=f"{mode}-1")
    if mode != "shadow":
        return run
    base = {(s.request_id, s.round): s for s in run.spans if s.arm_role == "baseline"}
    spans = []
    for s in run.spans:
        b = base.get((s.request_id, s.round))
        if s.arm_role != "baseline" and b is not None:
            s = dataclasses.replace(s, t_start=b.t_start, t_start_ns=b.t_start_ns, e2e_s=b.e2e_s)
        spans.append(s)
    row = list(run.run_row)
    row[2] = mode
    return dataclasses.replace(run, spans=spans, run_row=tuple(row))


def _evaluated(tmp_path: Path, run: SyntheticRun) -> RunEvaluation:
    path = tmp_path / f"{run.run_id}-{len(list(tmp_path.iterdir()))}.duckdb"
    with open_store([write_db(path, [run])]) as store:
        (ev,) = evaluate(store)
    return ev


def _candidate(ev: RunEvaluation) -> tuple[dict[str, Any], Any]:
    rows = {r.level: r for r in ev.rows if r.arm == "ngram"}
    deploy = next(a.deploy for a in ev.arms if a.arm == "ngram")
    return rows, deploy


def test_an_ngram_that_loses_capacity_at_c64_is_never_enabled_on_shadow_traffic(tmp_path: Path) -> None:
    """An n-gram candidate 1.6x faster per call at c=2 that loses a fifth of its speed at c=64: the
    paired replay calls c=64 a LOSS and the deploy verdict no WIN. On shadow traffic its throughput is
    the baseline's by construction (1.00x), whether its per-call speed at c=64 shows the loss or not
    (copies at a lighter load than its capacity may decode as fast as the baseline's calls): no WIN
    rests on throughput, the deploy verdict is never WIN or "enable" and says the capacity question
    is open and how to answer it. Before, the by-construction 1.00x [0.97, 1.02] at c=64 counted as
    "peak throughput is not lower", and at c=2 the by-construction ratio's width decided the WIN."""
    arms = [BASELINE, _ngram({2: 1.6, 64: 0.8})]
    rows, deploy = _candidate(_evaluated(tmp_path, _run(arms, "replay-paired")))
    assert rows["64"].verdict == "LOSS" and rows["64"].throughput_speedup is not None
    assert rows["64"].throughput_speedup.point < 0.9 and deploy.verdict != "WIN"

    for at_64 in (0.8, 1.0):
        ev = _evaluated(tmp_path, _run([BASELINE, _ngram({2: 1.6, 64: at_64})], "shadow"))
        rows, deploy = _candidate(ev)
        for row in rows.values():
            assert row.throughput_speedup is None and row.throughput_basis == "shadow"
            assert row.verdict != "WIN" or "throughput CI" not in row.reason
        assert rows["2"].verdict == "WIN" and "per call" in rows["2"].reason
        assert rows["64"].verdict == ("LOSS" if at_64 < 1 else "NO CLEAR GAIN")
        assert deploy.verdict == "NO CLEAR GAIN" and "enable:" not in deploy.text
        assert "at peak (c=64) throughput not measured (shadow)" in deploy.text
        if at_64 == 1.0:
            assert "capacity at the peak is open" in deploy.text and "replay sweep" in deploy.text
        assert any("ngram: shadow traffic: throughput ratio —" in n for n in ev.notes)


def test_live_shadow_win_is_per_call_only(tmp_path: Path) -> None:
    """serve's live shadow traffic (no levels): a per-call WIN is reported, the deploy verdict is not."""
    arms = [BASELINE, _ngram({})]
    arms[1] = dataclasses.replace(arms[1], speedup=1.6)
    run = _run(arms, "shadow", levels=(None,))
    rows, deploy = _candidate(_evaluated(tmp_path, run))
    assert rows["live"].verdict == "WIN" and rows["live"].throughput_speedup is None
    assert deploy.verdict == "NO CLEAR GAIN" and "capacity at the peak is open" in deploy.text


def test_table_and_json_do_not_show_shadow_throughput_as_a_comparison(tmp_path: Path) -> None:
    """What a user reads: `analyze` marks the throughput cell `— (shadow)` with the note saying why, the
    JSON has no ratio (null, basis "shadow"), and the report says so and leaves the capacity open."""
    path = write_db(tmp_path / "shadow.duckdb", [_run([BASELINE, _ngram({2: 1.6, 64: 1.0})], "shadow")])
    table = run_cli("analyze", str(path))
    assert table.returncode == 0, table.stderr
    lines = [ln for ln in table.stdout.splitlines() if ln.startswith("c=64") and " ngram " in ln]
    assert lines and "— (shadow)" in lines[0]
    assert "shadow copies reach it at the baseline's pace" in table.stdout
    doc = json.loads(run_cli("analyze", str(path), "--format", "json").stdout)
    rows = [r for run in doc["runs"] for r in run["rows"] if r["arm"] == "ngram"]
    assert rows and all(r["throughput_speedup"] is None and r["throughput_basis"] == "shadow" for r in rows)
    report = tmp_path / "report.html"
    assert run_cli("report", str(path), "-o", str(report)).returncode == 0
    html = report.read_text()
    assert (
        "capacity at the peak is open" in html
        and "shadow copies reach it at the baseline&#x27;s pace" in html
    )


@pytest.mark.slow
def test_real_shadow_traffic_shows_no_throughput_comparison(tmp_path: Path) -> None:
    """The real pieces: a baseline and an n-gram `specproxy sim` behind `specproxy serve` in shadow
    mode, `specproxy replay --target` through it at c=2 and c=16 in three rounds. serve's store knows
    the n-gram arm only through copies sent at the baseline's pace: no throughput ratio at any level,
    and whatever its per-call speed, no deploy WIN and no "enable"."""
    db = tmp_path / "shadow.duckdb"
    with simulators(baseline=["--time-scale", "4"], ngram=["--time-scale", "4", "--method", "ngram"]) as urls:
        config = tmp_path / "shadow.toml"
        config.write_text(
            f'[experiment]\nname = "ngram-shadow"\nmode = "shadow"\ndb = "{db}"\n\n'
            f'[[arms]]\nname = "baseline"\nrole = "baseline"\nurl = "{urls["baseline"]}"\n\n'
            f'[[arms]]\nname = "ngram"\nurl = "{urls["ngram"]}"\n'
            'speculative = { method = "ngram", num_speculative_tokens = 4 }\n'
        )
        log = tmp_path / "items.jsonl"
        log.write_text(
            "".join(
                json.dumps({"question_id": i, "turns": [f"Repeat after me: {i} {i} {i}"]}) + "\n"
                for i in range(32)
            )
        )
        with serving(config) as proxy:
            argv = replay_target_argv(log, proxy.url, tmp_path / "client.duckdb", "--concurrency", "2,16")
            replay = subprocess.run(
                [*argv, "--rounds", "3", "--max-tokens", "48"],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert replay.returncode == 0, replay.stderr
        assert proxy.returncode == 0, proxy.output
    result = run_cli("analyze", str(db), "--format", "json")
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)["runs"]
    rows = [r for r in run["rows"] if r["arm"] == "ngram"]
    assert {r["level"] for r in rows} == {"2", "16"}
    assert all(r["throughput_speedup"] is None and r["throughput_basis"] == "shadow" for r in rows), rows
    (arm,) = [a for a in run["arms"] if a["arm"] == "ngram"]
    assert arm["deploy"]["verdict"] != "WIN" and "enable:" not in arm["deploy"]["text"], arm["deploy"]
