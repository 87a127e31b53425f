"""Figures say where their numbers came from: speeds on estimated token counts are marked and give no
WIN or LOSS, acceptance figures that were not measured are not printed as measured, and an arm whose
every call failed makes `analyze` fail with its first error. Synthetic spans (tests/spanfactory.py) in
real DuckDB files; the CLI in a subprocess where the output a user reads is checked."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from specproxy.analysis import evaluate, open_store, write_report
from specproxy.analysis.verdicts.evaluation import LevelRow, RunEvaluation, Settings
from specproxy.record import SpecSource, TokensSource
from tests.spanfactory import ArmSpec, make_run, write_db
from tests.support import run_cli as _cli

FAST = Settings(bootstrap_iterations=300)


def _evaluate(
    tmp_path: Path, arms: list[ArmSpec], name: str = "run", **kw: Any
) -> tuple[Path, RunEvaluation]:
    # three rounds: a level measured once gives no WIN or LOSS on speed
    levels, n, rounds = kw.pop("levels", (1,)), kw.pop("n_per_level", 20), kw.pop("rounds", 3)
    run = make_run(arms, levels=levels, n_per_level=n, rounds=rounds, **kw)
    path = write_db(tmp_path / f"{name}.duckdb", [run])
    with open_store([path]) as store:
        (ev,) = evaluate(store, settings=FAST)
    return path, ev


def _row(ev: RunEvaluation, arm: str, level: str = "1") -> LevelRow:
    return next(r for r in ev.rows if r.arm == arm and r.level == level)


def _deploy(ev: RunEvaluation, arm: str) -> str:
    outcome = next(a for a in ev.arms if a.arm == arm)
    assert outcome.deploy is not None
    return outcome.deploy.verdict


BASELINE = ArmSpec("baseline", "baseline", "none")


@pytest.mark.parametrize("source", ["usage", "tokenizer", "chunks", None])
def test_measured_token_counts_keep_their_verdict(tmp_path: Path, source: TokensSource | None) -> None:
    """A true 1.8x gain on counts from usage, the tokenizer, one-token chunks (or a store from before the
    column) is a WIN, unmarked: the control for the estimated case below."""
    _, ev = _evaluate(tmp_path, [BASELINE, ArmSpec("eagle3", speedup=1.8, tokens_source=source)])
    row = _row(ev, "eagle3")
    assert row.verdict == "WIN", row.reason
    assert not row.tokens_estimated and not row.own_tokens_estimated and row.estimate_note == ""
    assert row.tokens_source == (source or "not recorded")
    assert _deploy(ev, "eagle3") == "WIN"


def test_estimated_candidate_counts_give_no_win(tmp_path: Path) -> None:
    """The same 1.8x gain on counts estimated from the text: NO CLEAR GAIN, said so in the table, the
    JSON, the CSV and the deploy verdict."""
    path, ev = _evaluate(tmp_path, [BASELINE, ArmSpec("eagle3", speedup=1.8, tokens_source="text_estimate")])
    row = _row(ev, "eagle3")
    assert row.verdict == "NO CLEAR GAIN"
    assert row.tokens_estimated and row.own_tokens_estimated
    assert row.tokens_source == "text_estimate"
    assert "estimated from the text for the arm's calls" in row.reason and "±25%" in row.reason
    assert row.decode_speedup is not None and row.decode_speedup.point > 1.5  # the figure is still shown
    outcome = next(a for a in ev.arms if a.arm == "eagle3")
    assert outcome.deploy is not None and outcome.deploy.verdict == "NO CLEAR GAIN"
    assert "estimated" in outcome.deploy.text
    assert not _row(ev, "baseline").own_tokens_estimated

    table = _cli("analyze", "--wide", str(path))
    assert table.returncode == 0, table.stderr
    line = next(x for x in table.stdout.splitlines() if x.startswith("c=1") and " eagle3 " in x)
    assert "NO CLEAR GAIN (estimated tokens)" in line
    assert line.count("~") == 4  # agg tok/s, P50 decode tok/s, decode speedup, throughput ratio
    assert (
        "~ = built on token counts estimated from the text (text_estimate, stated error ±25%" in table.stdout
    )
    base_line = next(x for x in table.stdout.splitlines() if x.startswith("c=1") and " baseline " in x)
    assert "~" not in base_line

    doc = json.loads(_cli("analyze", str(path), "--format", "json").stdout)
    jrow = next(r for r in doc["runs"][0]["rows"] if r["arm"] == "eagle3")
    assert jrow["tokens_estimated"] is True and jrow["tokens_source"] == "text_estimate"
    assert jrow["verdict"] == "NO CLEAR GAIN" and "±25%" in jrow["estimate_note"]
    rows = list(csv.DictReader(io.StringIO(_cli("analyze", str(path), "--format", "csv").stdout)))
    crow = next(r for r in rows if r["arm"] == "eagle3" and not r["category"])
    assert crow["tokens_estimated"] == "True" and crow["tokens_source"] == "text_estimate"


def test_estimated_baseline_counts_mark_every_comparison(tmp_path: Path) -> None:
    """The baseline's counts are estimated: its own tok/s are marked, and every arm's speedup against it
    is an estimate: no LOSS for a true 0.6x either."""
    _, ev = _evaluate(
        tmp_path,
        [
            ArmSpec("baseline", "baseline", "none", tokens_source="text_estimate"),
            ArmSpec("slow", speedup=0.6),
        ],
    )
    base, slow = _row(ev, "baseline"), _row(ev, "slow")
    assert base.own_tokens_estimated and base.verdict is None
    assert slow.tokens_estimated and not slow.own_tokens_estimated
    assert slow.verdict == "NO CLEAR GAIN" and "the baseline's calls" in slow.reason
    assert _deploy(ev, "slow") == "NO CLEAR GAIN"


def test_a_mix_of_sources_is_estimated_and_says_the_mix(tmp_path: Path) -> None:
    """Some calls estimated, the rest from usage (a backend that sent usage only sometimes)."""
    run = make_run([BASELINE, ArmSpec("eagle3", speedup=1.8)], levels=(1,), n_per_level=60)
    for i, span in enumerate(s for s in run.spans if s.arm == "eagle3" and s.status == "ok"):
        if i % 3 == 0:
            span.tokens_source = "text_estimate"
    path = write_db(tmp_path / "mix.duckdb", [run])
    with open_store([path]) as store:
        (ev,) = evaluate(store, settings=FAST)
    row = _row(ev, "eagle3")
    ok = sum(1 for s in run.spans if s.arm == "eagle3" and s.status == "ok")
    estimated = (ok + 2) // 3
    assert row.tokens_source == f"usage {ok - estimated}/{ok}, text_estimate {estimated}/{ok}"
    assert row.tokens_estimated and row.verdict == "NO CLEAR GAIN"


def test_estimated_counts_do_not_hide_an_identity_failure(tmp_path: Path) -> None:
    """Identity does not depend on token counts: a candidate whose outputs differ is still a LOSS."""
    _, ev = _evaluate(
        tmp_path, [BASELINE, ArmSpec("eagle3", speedup=1.8, identical_p=0.7, tokens_source="text_estimate")]
    )
    row = _row(ev, "eagle3")
    assert row.verdict == "LOSS" and row.reason.startswith("mismatched")
    assert _deploy(ev, "eagle3") == "LOSS"


@pytest.mark.parametrize(
    ("source", "shown", "measured"),
    [
        ("vllm_request_metrics", "reported (vllm_request_metrics)", True),
        ("llamacpp_timings", "reported (llamacpp_timings)", True),
        ("stream_shape", "estimated (stream shape)", True),
        ("stream_shape_unreliable", "", False),
        ("unknown", "", False),
    ],
)
def test_acceptance_says_where_it_came_from(
    tmp_path: Path, source: SpecSource, shown: str, measured: bool
) -> None:
    """Reported and reliable stream-shape figures are shown with their source; an unreliable estimate
    (its figures are in the spans) and an unknown acceptance are "— not measured", with the reason."""
    path, ev = _evaluate(tmp_path, [BASELINE, ArmSpec("eagle3", speedup=1.8, spec_source=source)])
    row = _row(ev, "eagle3")
    assert row.req_acceptance_source == shown
    table = _cli("analyze", "--wide", str(path)).stdout
    line = next(x for x in table.splitlines() if x.startswith("c=1") and " eagle3 " in x)
    if measured:
        assert row.req_acceptance_length is not None and 2.0 < row.req_acceptance_length < 3.5
        assert row.req_acceptance_not_measured == ""
        assert f"{row.req_acceptance_length:.2f}" in line
        assert ("est" in line.split()) == (source == "stream_shape")
    else:
        assert row.req_acceptance_length is None and row.req_acceptance_rate is None
        assert "— not measured" in line
        reason = "stream-shape estimate unreliable" if source == "stream_shape_unreliable" else "unknown"
        assert reason in row.req_acceptance_not_measured
        assert f"req accept len eagle3 c=1: not measured for {row.req_acceptance_not_measured}" in table
    # the /metrics columns are the engine's own counters whatever the per-request source
    assert row.acceptance_length is not None


def test_a_level_of_mixed_acceptance_sources_uses_the_measured_calls(tmp_path: Path) -> None:
    run = make_run([BASELINE, ArmSpec("eagle3", speedup=1.8)], levels=(1,), n_per_level=40)
    spans = [s for s in run.spans if s.arm == "eagle3" and s.status == "ok"]
    for span in spans[::2]:
        span.spec_source = "stream_shape_unreliable"
        span.accepted_tokens = (span.num_drafts or 0) * 3  # what a merged stream looks like: all accepted
    path = write_db(tmp_path / "mixed.duckdb", [run])
    with open_store([path]) as store:
        (ev,) = evaluate(store, settings=FAST)
    row = _row(ev, "eagle3")
    kept = spans[1::2]
    expected = 1 + sum(s.accepted_tokens or 0 for s in kept) / sum(s.num_drafts or 0 for s in kept)
    assert row.req_acceptance_length == pytest.approx(expected)
    assert row.req_acceptance_not_measured.startswith(f"{len(spans[::2])} calls: stream-shape estimate")
    out = tmp_path / "report.html"
    write_report([path], out, settings=FAST)
    assert "are left out: not measured" in out.read_text(encoding="utf-8")


def test_an_arm_whose_every_call_failed_fails_analyze(tmp_path: Path) -> None:
    """An upstream that answers 400 with an empty body to every call: `analyze` prints the table, says
    the arm failed with its first error, and exits 1."""
    arms = [BASELINE, ArmSpec("eagle3", speedup=1.8), ArmSpec("rejected", http_error=400)]
    path = write_db(tmp_path / "failed.duckdb", [make_run(arms, levels=(1, 8), n_per_level=30, rounds=3)])
    result = _cli("analyze", str(path))
    assert result.returncode == 1
    assert "Error: run synthetic: arm 'rejected' failed: every call failed (180 of 180); first error: " in (
        result.stderr
    )
    assert "http_error HTTP 400: no error text (empty body)" in result.stderr
    rows = [x for x in result.stdout.splitlines() if x.startswith("c=") and " rejected " in x]
    assert len(rows) == 2 and all(x.rstrip().endswith("FAILED") for x in rows)
    assert "rejected: FAILED — arm 'rejected' failed" in result.stdout
    # the other candidate is still judged
    (eagle,) = [x.strip() for x in result.stdout.splitlines() if x.strip().startswith("eagle3: ")]
    assert eagle.split(" — ")[0] in ("eagle3: WIN", "eagle3: NO CLEAR GAIN"), eagle
    as_json = _cli("analyze", str(path), "--format", "json")
    assert as_json.returncode == 1
    doc = json.loads(as_json.stdout)
    assert doc["runs"][0]["failed_arms"] == [
        "arm 'rejected' failed: every call failed (180 of 180); first error: http_error HTTP 400: "
        "no error text (empty body)"
    ]


def test_the_first_error_is_the_earliest_and_an_arm_with_one_ok_call_has_not_failed(tmp_path: Path) -> None:
    run = make_run([BASELINE, ArmSpec("flaky", http_error=502)], levels=(1,), n_per_level=20)
    spans = sorted((s for s in run.spans if s.arm == "flaky"), key=lambda s: s.t_start_ns or 0)
    spans[0].error = "upstream said: no such model\nmore detail"
    spans[1].error = "a later error"
    path = write_db(tmp_path / "first.duckdb", [run])
    with open_store([path]) as store:
        (ev,) = evaluate(store, settings=FAST)
    assert ev.failed_arms == [
        "arm 'flaky' failed: every call failed (20 of 20); first error: http_error HTTP 502: "
        "upstream said: no such model"
    ]
    spans[-1].status, spans[-1].completion_tokens = "ok", 10
    path = write_db(tmp_path / "one_ok.duckdb", [run])
    with open_store([path]) as store:
        (ev,) = evaluate(store, settings=FAST)
    assert ev.failed_arms == []
