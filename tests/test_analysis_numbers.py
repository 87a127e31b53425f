"""Every number of the verdict table against an independent computation from the synthetic spans.

The synthetic run is built in Python (tests/spanfactory.py); the expected figures are computed here
from those records with plain Python and numpy (percentiles: numpy's linear interpolation, the
definition analysis uses), then compared with `analyze --format json` (full precision) and with the
printed table (to the last printed digit).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specproxy.analysis import Settings, analyze_text
from specproxy.analysis.stats import wilson_interval
from specproxy.record import SpanRecord
from tests.spanfactory import ArmSpec, SyntheticRun, make_run, write_db
from tests.support import run_cli as _cli

ARMS = [
    ArmSpec("baseline", "baseline", "none"),
    ArmSpec("eagle3", speedup=1.5, speedup_by_level={16: 0.9}, identical_p=0.995, acceptance_rate=0.7),
    ArmSpec("ngram", spec_method="ngram", speedup=1.1, identical_p=0.95, acceptance_rate=0.4, k=4),
    ArmSpec("replica", "replica", "none", identical_p=0.99),
]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SyntheticRun]:
    run = make_run(ARMS, levels=(1, 4, 16), n_per_level=150, seed=7, restart_engine="1")
    path = write_db(tmp_path_factory.mktemp("numbers") / "spans.duckdb", [run])
    return path, run


def analyze_json(path: Path, *options: str) -> dict[str, Any]:
    """`specproxy analyze PATH --format json OPTIONS...`, succeeded, as the document it printed."""
    result = _cli("analyze", str(path), "--format", "json", *options)
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def rows_by_arm(path: Path) -> dict[str, dict[str, Any]]:
    """The rows of the one run in ``path`` that `analyze` judges, by arm (a run of one level)."""
    return {r["arm"]: r for r in analyze_json(path)["runs"][0]["rows"]}


@pytest.fixture(scope="module")
def analyzed_json(synthetic: tuple[Path, SyntheticRun]) -> dict[str, Any]:
    return analyze_json(synthetic[0])


def expected_figures(run: SyntheticRun) -> dict[tuple[str, str], dict[str, Any]]:
    """The table's figures per (arm, level), computed from the records alone."""
    groups: dict[tuple[str, str], list[SpanRecord]] = defaultdict(list)
    for s in run.spans:
        groups[(s.arm, str(s.concurrency_level))].append(s)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key, spans in groups.items():
        ok = [s for s in spans if s.status == "ok"]
        starts = [s.t_start_ns / 1e9 for s in spans if s.status != "dropped"]  # type: ignore[operator]
        ends = [s.t_start_ns / 1e9 + (s.e2e_s or 0.0) for s in spans if s.status != "dropped"]  # type: ignore[operator]
        tokens = sum(s.completion_tokens or 0 for s in ok)
        decode = [s.decode_tok_s for s in ok if s.decode_tok_s is not None]
        ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
        drafts = [s.num_drafts for s in ok if s.num_drafts is not None]
        accepted = [s.accepted_tokens for s in ok if s.accepted_tokens is not None]
        draft_tokens = [s.draft_tokens for s in ok if s.draft_tokens is not None]
        out[key] = {
            "calls": len(spans),
            "ok": len(ok),
            "completion_tokens": tokens,
            "agg_tok_s": tokens / (max(ends) - min(starts)),
            "p50_decode_tok_s": float(np.quantile(decode, 0.5)),
            "p50_ttft_s": float(np.quantile(ttft, 0.5)),
            "p95_ttft_s": float(np.quantile(ttft, 0.95)),
            "req_acceptance_rate": sum(accepted) / sum(draft_tokens) if draft_tokens else None,
            "req_acceptance_length": 1 + sum(accepted) / sum(drafts) if drafts else None,
        }
    # /metrics: per arm and level, each series' after - before, or after alone when it went down
    series: dict[tuple[str, str, str, str], list[tuple[Any, float]]] = defaultdict(list)
    for run_id, arm, at, phase, name, labels, value in run.metrics:
        assert run_id == run.run_id
        series[(arm, phase.split(":")[0], name, labels)].append((at, value))
    totals: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (arm, window, name, _), points in series.items():
        (_, before), (_, after) = sorted(points, key=lambda p: p[0])
        totals[(arm, window.removeprefix("c="))][name] += after - before if after >= before else after
    for key, fig in out.items():
        t = totals.get(key)
        fig["acceptance_rate"] = (
            t["vllm:spec_decode_num_accepted_tokens_total"] / t["vllm:spec_decode_num_draft_tokens_total"]
            if t
            else None
        )
        fig["acceptance_length"] = (
            1 + t["vllm:spec_decode_num_accepted_tokens_total"] / t["vllm:spec_decode_num_drafts_total"]
            if t
            else None
        )
    # identity and paired decode speedup: each candidate call beside the baseline call of its request
    base = {s.request_id: s for s in run.spans if s.arm == "baseline"}
    for key, fig in out.items():
        arm, level = key
        if arm == "baseline":
            fig.update(compared=0, identical=0, decode_speedup=None)
            continue
        calls = [s for s in run.spans if s.arm == arm and str(s.concurrency_level) == level]
        compared = [s for s in calls if s.identical is not None]
        fig["compared"] = len(compared)
        fig["identical"] = sum(1 for s in compared if s.identical)
        pairs = [
            (s.decode_tok_s, base[s.request_id].decode_tok_s)
            for s in calls
            if s.status == "ok"
            and base[s.request_id].status == "ok"
            and s.decode_tok_s
            and base[s.request_id].decode_tok_s
        ]
        c, b = zip(*pairs, strict=True)
        fig["decode_speedup"] = float(np.quantile(c, 0.5)) / float(np.quantile(b, 0.5))
        fig["throughput_ratio"] = fig["agg_tok_s"] / out[("baseline", level)]["agg_tok_s"]
    return out


def test_json_figures_match_an_independent_computation(
    synthetic: tuple[Path, SyntheticRun], analyzed_json: dict[str, Any]
) -> None:
    _, run = synthetic
    (got_run,) = analyzed_json["runs"]
    expected = expected_figures(run)
    assert {(r["arm"], r["level"]) for r in got_run["rows"]} == set(expected)
    for row in got_run["rows"]:
        exp = expected[(row["arm"], row["level"])]
        for name in ("calls", "ok", "completion_tokens", "compared", "identical"):
            assert row[name] == exp[name], (row["arm"], row["level"], name)
        for name in (
            "agg_tok_s",
            "p50_decode_tok_s",
            "p50_ttft_s",
            "p95_ttft_s",
            "acceptance_rate",
            "acceptance_length",
            "req_acceptance_rate",
            "req_acceptance_length",
        ):
            if exp[name] is None:
                assert row[name] is None, name
            else:
                assert row[name] == pytest.approx(exp[name], rel=1e-9), (row["arm"], row["level"], name)
        if exp["decode_speedup"] is not None:
            assert row["paired"] is True
            assert row["decode_speedup"]["point"] == pytest.approx(exp["decode_speedup"], rel=1e-9)
            assert row["throughput_speedup"]["point"] == pytest.approx(exp["throughput_ratio"], rel=1e-9)
            iv = row["decode_speedup"]
            assert iv["low"] < iv["point"] < iv["high"]


def _fmt(value: float | None, digits: int, scale: float = 1.0, suffix: str = "") -> str:
    return "—" if value is None else f"{value * scale:.{digits}f}{suffix}"


def test_printed_table_matches_to_the_last_digit(synthetic: tuple[Path, SyntheticRun]) -> None:
    path, run = synthetic
    figures = "calls,agg_tok_s,p50_decode,p50_ttft,p95_ttft,accept_rate,accept_len,req_accept_len"
    result = _cli("analyze", str(path), "--columns", figures + ",identical,decode_speedup,throughput_ratio")
    assert result.returncode == 0, result.stderr
    expected = expected_figures(run)
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("level"))
    checked = 0
    for line in lines[header + 2 :]:
        if not line.startswith("c="):
            break
        cells = re.split(r"\s{2,}", line.strip())
        level, arm = cells[0].removeprefix("c="), cells[1]
        exp = expected[(arm, level)]
        assert cells[2] == f"{exp['ok']}/{exp['calls']}"
        assert cells[3] == _fmt(exp["agg_tok_s"], 1)
        assert cells[4] == _fmt(exp["p50_decode_tok_s"], 1)
        assert cells[5] == _fmt(exp["p50_ttft_s"], 1, 1000)
        assert cells[6] == _fmt(exp["p95_ttft_s"], 1, 1000)
        assert cells[7] == _fmt(exp["acceptance_rate"], 1, 100, "%")
        assert cells[8] == _fmt(exp["acceptance_length"], 2)
        assert cells[9] == _fmt(exp["req_acceptance_length"], 2)
        assert cells[10] == (f"{exp['identical']}/{exp['compared']}" if exp["compared"] else "—")
        if exp["decode_speedup"] is not None:
            assert cells[11].startswith(f"{exp['decode_speedup']:.2f}x [")
            assert cells[12].startswith(f"{exp['throughput_ratio']:.2f}x [")
        checked += 1
    assert checked == len(expected) == 12


def test_the_default_table_fits_120_columns_and_wide_shows_every_figure(
    synthetic: tuple[Path, SyntheticRun],
) -> None:
    """The default table: level, arm, calls, identity, the two ratios, the verdict (and the rounds,
    since this run's levels were measured once); --wide every column that holds a figure."""
    path = str(synthetic[0])
    default = _cli("analyze", path).stdout.splitlines()
    header = next(i for i, line in enumerate(default) if line.startswith("level"))
    rows = [line for line in default[header:] if line.startswith(("level", "c="))]
    assert len(rows) == 13 and max(len(line) for line in rows) <= 120
    assert re.split(r"\s{2,}", rows[0]) == [
        "level",
        "arm",
        "ok/calls",
        "identical",
        "decode speedup [95% CI]",
        "throughput ratio [95% CI]",
        "rounds",
        "verdict",
    ]
    wide = _cli("analyze", path, "--wide").stdout.splitlines()
    cells = re.split(r"\s{2,}", next(line for line in wide if line.startswith("level")))
    assert "agg tok/s" in cells and "P95 TTFT ms" in cells and "margin" in cells
    assert "load P50 arm/base" not in cells  # a replay has no live loads: the column would be all —
    bad = _cli("analyze", path, "--columns", "agg_toks")
    assert bad.returncode == 2 and "unknown column 'agg_toks'; known: level, arm, calls" in bad.stderr


def test_a_peak_the_lab_moved_is_labelled_in_the_titles(synthetic: tuple[Path, SyntheticRun]) -> None:
    """The lab's label for a peak judged below its top level stands in the run's title and the deploy
    verdicts' title, and every deploy verdict reads the peak there."""
    label = "judged at c=4: c=16 could not be measured on this machine"
    settings = Settings(peak_concurrency=4, peak_source=label, bootstrap_iterations=200)
    text = analyze_text([synthetic[0]], settings=settings)
    assert f"peak c=4 ({label})" in next(line for line in text.splitlines() if line.startswith("run "))
    title = next(line for line in text.splitlines() if line.startswith("deploy verdict"))
    assert title.endswith(f"; {label})") and "peak = highest tested level" not in title
    deploy = [line for line in text.splitlines() if "at peak (" in line]
    assert deploy and all("at peak (c=4)" in line for line in deploy)
    # a peak given on the command line says so, with no label
    plain = analyze_text([synthetic[0]], settings=Settings(peak_concurrency=4, bootstrap_iterations=200))
    assert "peak c=4 (command line)" in plain and "could not be measured" not in plain


def _rule(d: dict[str, Any], t: dict[str, Any], identity: dict[str, Any] | None, md: float, mt: float) -> str:
    """The verdict rule, restated: this level's decode and throughput intervals against the margins (a WIN
    needs throughput surely not lower beyond it), identity failing when the mismatch rate's lower bound
    is above 1 %."""
    if d["high"] < 1 - md or t["high"] < 1 - mt or (identity is not None and identity["low"] > 0.01):
        return "LOSS"
    return "WIN" if d["low"] > 1 + md and t["low"] >= 1 - mt else "NO CLEAR GAIN"


def _one_round(rule: str, row: dict[str, Any]) -> str:
    """What a level measured in one round (this module's run) shows for ``rule``'s verdict: a WIN or a
    LOSS on speed becomes NO CLEAR GAIN, and the reason keeps the verdict the intervals gave."""
    if rule in ("WIN", "LOSS") and "so no " + rule in row["reason"]:
        return "NO CLEAR GAIN"
    return rule


@pytest.mark.parametrize(
    ("options", "read"),
    [
        ((), 2),  # c=1 and c=16
        (("--at-concurrency", "4"), 2),  # c=4 and c=16
        (("--at-concurrency", "2", "--peak-concurrency", "16"), 3),  # c=1 and c=4 around 2, and c=16
        (("--at-concurrency", "16", "--peak-concurrency", "16"), 1),
    ],
)
def test_intervals_hold_jointly_over_the_levels_the_deploy_verdict_reads(
    synthetic: tuple[Path, SyntheticRun], options: tuple[str, ...], read: int
) -> None:
    rows = analyze_json(synthetic[0], *options)["runs"][0]["rows"]
    confidences = [r["confidence"] for r in rows if r["role"] != "baseline"]
    assert len(confidences) == 9 and confidences == pytest.approx([1 - 0.05 / read] * 9)  # 3 arms, 3 levels


def test_verdicts_follow_the_rules(analyzed_json: dict[str, Any]) -> None:
    doc = analyzed_json
    rows = doc["runs"][0]["rows"]
    for r in rows:
        if r["role"] == "baseline":
            assert r["verdict"] is None
            continue
        # each level on its own: its own throughput ratio and margin, not the peak level's
        rule = _rule(
            r["decode_speedup"],
            r["throughput_speedup"],
            r["identity_mismatch"],
            r["decode_margin"],
            r["throughput_margin"],
        )
        speed_only = r["identity_mismatch"] is None or r["identity_mismatch"]["low"] <= 0.01
        assert r["verdict"] == ("NO CLEAR GAIN" if rule in ("WIN", "LOSS") and speed_only else rule), r
        assert r["verdict"] == _one_round(rule, r), r
        # three levels, of which the deploy verdict reads two (the lowest as the operating point, the
        # highest as the peak): each interval at 1 - 0.05 / 2, so that those two hold together at 95 %
        assert r["confidence"] == pytest.approx(1 - 0.05 / 2)
        assert r["rounds"] == 1 and r["drift_note"] == "1 round: cannot see between-run drift"
    eagle = {r["level"]: r for r in rows if r["arm"] == "eagle3"}
    # the true speedup is 1.5 at c=1 and c=4 and 0.9 at c=16: the interval must say so
    assert eagle["1"]["decode_speedup"]["low"] > 1.3 and eagle["16"]["decode_speedup"]["high"] < 1.0
    # one round: the intervals' WIN and LOSS are named in the reason, the verdict withholds them
    assert eagle["1"]["verdict"] == eagle["16"]["verdict"] == "NO CLEAR GAIN"
    assert "so no WIN on speed" in eagle["1"]["reason"] and "so no LOSS on speed" in eagle["16"]["reason"]
    # the replica (no speculation) sets the margin: the median of its deviations from 1x over the reliable
    # levels, or how far its interval at the level lies from 1x, at least 3 %
    replicas = {r["level"]: r for r in rows if r["arm"] == "replica" and r["reliable"]}
    assert sorted(replicas) == ["1", "16", "4"]
    for name in ("decode", "throughput"):
        ivs = {level: r[f"{name}_speedup"] for level, r in replicas.items()}
        median = float(np.median([abs(iv["point"] - 1) for iv in ivs.values()]))
        for level, iv in ivs.items():
            gap = max(iv["low"] - 1, 1 - iv["high"])
            assert eagle[level][f"{name}_margin"] == pytest.approx(max(0.03, median, gap))
    for r in replicas.values():
        assert r["verdict"] == "NO CLEAR GAIN"  # inside its own noise floor, by construction
    arms = {a["arm"]: a for a in doc["runs"][0]["arms"]}
    # the crossover follows the verdicts: the last WIN of the run of WINs from c=1, the first level after
    for name, arm in arms.items():
        if arm["kind"] == "baseline":
            assert arm["crossover"] is None and arm["deploy"] is None
            continue
        verdicts = [(int(r["level"]), r["verdict"]) for r in rows if r["arm"] == name]
        verdicts.sort()
        wins = 0
        while wins < len(verdicts) and verdicts[wins][1] == "WIN":
            wins += 1
        assert arm["crossover"]["pays_up_to"] == (verdicts[wins - 1][0] if wins else None), name
        assert arm["crossover"]["first_not_paying"] == (verdicts[wins][0] if wins < len(verdicts) else None)
        # no operating point given: assumed c=1, peak c=16, and the sentence says so
        assert (
            "assumed: operating point = lowest tested level c=1, peak = highest tested level c=16"
            in (arm["deploy"]["text"])
        )
    # eagle3's intervals win at c=1 (the assumed operating point) and its peak throughput is lower, but
    # the run had one round: neither is evidence, and the sentence says why
    assert arms["eagle3"]["deploy"]["verdict"] == "NO CLEAR GAIN"
    assert (
        "at peak (c=16) throughput 0.8" in arms["eagle3"]["deploy"]["text"]
        and "(1 round)" in arms["eagle3"]["deploy"]["text"]
    )
    assert "the operating point was measured in one round" in arms["eagle3"]["deploy"]["text"]
    assert arms["ngram"]["deploy"]["verdict"] == "LOSS"  # 22 of 444 mismatched: surely above 1 %
    assert arms["replica"]["deploy"]["verdict"] == "NO CLEAR GAIN"
    # 2 of 149 mismatched at c=4 is no evidence of a rate above 1 %: the intervals alone decide there
    assert "so no WIN on speed" in eagle["4"]["reason"]
    assert arms["eagle3"]["crossover"]["pays_up_to"] is None
    # the replica (no speculation) is the noise floor; it is counted from the spans' own verdicts
    replica = [r for r in rows if r["arm"] == "replica"]
    assert doc["runs"][0]["noise_compared"] == sum(r["compared"] for r in replica)
    assert doc["runs"][0]["noise_mismatched"] == sum(r["compared"] - r["identical"] for r in replica)


def expected_categories(run: SyntheticRun) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Per candidate arm, category and level, from the records alone: the paired P50 decode speedup,
    the per-call throughput ratio (Σ tokens / Σ e2e), identity counts."""
    base = {s.request_id: s for s in run.spans if s.arm == "baseline"}
    groups: dict[tuple[str, str, str], list[SpanRecord]] = defaultdict(list)
    for s in run.spans:
        if s.arm != "baseline":
            groups[(s.arm, str(s.category), str(s.concurrency_level))].append(s)
    out = {}
    for key, calls in groups.items():
        both = [
            (c, base[c.request_id]) for c in calls if c.status == "ok" and base[c.request_id].status == "ok"
        ]
        dec = [(c.decode_tok_s, b.decode_tok_s) for c, b in both if c.decode_tok_s and b.decode_tok_s]
        cd, bd = zip(*dec, strict=True)
        rate_c = sum(c.completion_tokens or 0 for c, _ in both) / sum(c.e2e_s or 0.0 for c, _ in both)
        rate_b = sum(b.completion_tokens or 0 for _, b in both) / sum(b.e2e_s or 0.0 for _, b in both)
        compared = [c for c in calls if c.identical is not None]
        out[key] = {
            "calls": len(dec),
            "p50_decode_tok_s": float(np.quantile(cd, 0.5)),
            "baseline_p50_decode_tok_s": float(np.quantile(bd, 0.5)),
            "decode_speedup": float(np.quantile(cd, 0.5)) / float(np.quantile(bd, 0.5)),
            "throughput_ratio": rate_c / rate_b,
            "compared": len(compared),
            "identical": sum(1 for c in compared if c.identical),
        }
    return out


def test_category_figures_match_an_independent_computation(
    synthetic: tuple[Path, SyntheticRun], analyzed_json: dict[str, Any]
) -> None:
    path, run = synthetic
    expected = expected_categories(run)
    (got_run,) = analyzed_json["runs"]
    got = {(c["arm"], c["category"], c["level"]): c for c in got_run["categories"]}
    assert set(got) == set(expected)
    levels = {r["level"]: r for r in got_run["rows"] if r["arm"] == "eagle3"}
    for key, c in got.items():
        exp = expected[key]
        assert c["paired"] is True
        for name in ("calls", "compared", "identical"):
            assert c[name] == exp[name], (key, name)
        for name in ("p50_decode_tok_s", "baseline_p50_decode_tok_s"):
            assert c[name] == pytest.approx(exp[name], rel=1e-9), (key, name)
        assert c["decode_speedup"]["point"] == pytest.approx(exp["decode_speedup"], rel=1e-9), key
        assert c["throughput_speedup"]["point"] == pytest.approx(exp["throughput_ratio"], rel=1e-9), key
        assert c["decode_speedup"]["low"] < c["decode_speedup"]["point"] < c["decode_speedup"]["high"]
        # the category's verdict: its own decode CI and identity, the level's aggregate throughput CI
        level_thr = next(r for r in got_run["rows"] if r["arm"] == key[0] and r["level"] == key[2])
        mismatch = wilson_interval(c["compared"] - c["identical"], c["compared"], level_thr["confidence"])
        rule = _rule(
            c["decode_speedup"],
            level_thr["throughput_speedup"],
            None if mismatch is None else {"low": mismatch.low},
            level_thr["decode_margin"],
            level_thr["throughput_margin"],
        )
        assert c["verdict"] == _one_round(rule, c), key
        # marked where the level's throughput set it: the category's own figures read otherwise
        never_binds = {"low": 1.0, "high": 1.0}
        own = _rule(
            c["decode_speedup"],
            never_binds,
            None if mismatch is None else {"low": mismatch.low},
            level_thr["decode_margin"],
            level_thr["throughput_margin"],
        )
        assert c["set_by_level"] == (own != rule), key
    assert levels["1"]["verdict"] == "NO CLEAR GAIN" and "so no WIN" in levels["1"]["reason"]
    # the printed matrix, to the last digit: "1.49x WIN" per arm, category and level
    result = _cli("analyze", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("arm ") and "category" in line)
    level_names = [c.removeprefix("c=") for c in re.split(r"\s{2,}", lines[header].strip())[2:]]
    short = {"WIN": "WIN", "LOSS": "LOSS", "NO CLEAR GAIN": "NCG"}
    checked = 0
    for line in lines[header + 2 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        arm, category = cells[0], cells[1]
        for level, cell in zip(level_names, cells[2:], strict=True):
            exp = expected[(arm, category, level)]
            mine = got[(arm, category, level)]
            mark = "†" if mine["set_by_level"] else ""
            assert cell == f"{exp['decode_speedup']:.2f}x {short[mine['verdict']]}{mark}"
            checked += 1
    assert checked == len(expected) == 3 * 2 * 3


def test_split_traffic_compares_per_call_token_rates(tmp_path: Path) -> None:
    """In split mode the baseline got 3 requests in 4: its wall-clock tok/s is 3x the candidate's
    for that reason alone, so the throughput ratio is Σ tokens / Σ e2e per arm, not agg tok/s."""
    arms = [ArmSpec("baseline", "baseline", "none"), ArmSpec("eagle3", speedup=1.5)]
    run = make_run(arms, levels=(None,), n_per_level=400, paired=False, split_cycle=[0, 0, 0, 1], seed=2)
    path = write_db(tmp_path / "split.duckdb", [run])
    rows = rows_by_arm(path)
    cand, base = rows["eagle3"], rows["baseline"]
    assert cand["paired"] is False and cand["calls"] == 100 and base["calls"] == 300

    def rate(arm: str) -> float:
        ok = [s for s in run.spans if s.arm == arm and s.status == "ok" and s.e2e_s]
        return sum(s.completion_tokens or 0 for s in ok) / sum(s.e2e_s or 0.0 for s in ok)

    assert cand["throughput_speedup"]["point"] == pytest.approx(rate("eagle3") / rate("baseline"), rel=1e-9)
    assert cand["throughput_speedup"]["point"] > 1.0  # faster per call, though its wall-clock tok/s is lower
    assert cand["agg_tok_s"] < base["agg_tok_s"]
    # unpaired decode speedup: ratio of the arms' own P50s
    assert cand["decode_speedup"]["point"] == pytest.approx(
        cand["p50_decode_tok_s"] / base["p50_decode_tok_s"]
    )
    assert cand["verdict"] == "WIN"


def test_sampled_shadow_traffic_compares_per_call_token_rates(tmp_path: Path) -> None:
    """Live shadow traffic where the candidate got a copy of one request in 4: its wall-clock tok/s is a
    quarter of the baseline's for that reason alone; the throughput ratio compares Σ tokens / Σ e2e
    over the pairs instead."""
    arms = [ArmSpec("baseline", "baseline", "none"), ArmSpec("eagle3", speedup=1.5)]
    run = make_run(arms, levels=(None,), n_per_level=400, shadow_sample=0.25, seed=3)
    path = write_db(tmp_path / "shadow.duckdb", [run])
    rows = rows_by_arm(path)
    cand, base = rows["eagle3"], rows["baseline"]
    assert cand["paired"] is True and cand["calls"] == 100 and base["calls"] == 400
    assert cand["throughput_basis"] == "per call"
    base_of = {s.request_id: s for s in run.spans if s.arm == "baseline"}
    pairs = [(s, base_of[s.request_id]) for s in run.spans if s.arm == "eagle3"]
    pairs = [(c, b) for c, b in pairs if c.status == b.status == "ok"]
    rate_c = sum(c.completion_tokens or 0 for c, _ in pairs) / sum(c.e2e_s or 0.0 for c, _ in pairs)
    rate_b = sum(b.completion_tokens or 0 for _, b in pairs) / sum(b.e2e_s or 0.0 for _, b in pairs)
    assert cand["throughput_speedup"]["point"] == pytest.approx(rate_c / rate_b, rel=1e-9)
    assert cand["agg_tok_s"] < 0.5 * base["agg_tok_s"] and cand["throughput_speedup"]["point"] > 1.0
