"""A real replay against the simulator, analysed; the figures checked against the simulator's truth.

Two `specproxy sim` processes (a baseline and an EAGLE-3 arm that reports per-request speculation),
`specproxy replay` at concurrency 1 and 4 with no warm-up (so every call the simulators served is a
span), then `specproxy analyze --format json`. The simulator's counters are exact (its /metrics are the
sums of its per-request ground truth, GET /sim/requests), so the acceptance figures must match to
floating-point precision; the latency figures are checked against an independent numpy computation
over the spans.
"""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

from tests.support import run_cli, simulators

PROMPTS = [
    "Summarize: the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat",
    "Tell me a story about a dragon who learned to cook",
    "Extract the names as JSON: Alice met Bob and Carol at the market on Monday morning",
    "What is the capital of France, and why did it become the capital?",
]


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, str]]:
    eagle3 = ["--method", "eagle3", "--per-request-spec-decode-metrics", "summary"]
    with simulators(baseline=["--time-scale", "20"], eagle3=["--time-scale", "20", *eagle3]) as urls:
        yield urls


@pytest.fixture(scope="module")
def replayed(sims: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("simreplay")
    db = work / "spans.duckdb"
    (work / "exp.toml").write_text(f"""
[experiment]
name = "simtest"
db = "{db}"
model = "meta-llama/Llama-3.1-8B-Instruct"

[[arms]]
name = "baseline"
role = "baseline"
url = "{sims["baseline"]}"

[[arms]]
name = "eagle3"
url = "{sims["eagle3"]}"

[arms.speculative]
method = "eagle3"
model = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
num_speculative_tokens = 3
""")
    with (work / "log.jsonl").open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"{PROMPTS[i % 4]} (#{i})", "output_tokens": 48}) + "\n")
    result = run_cli(
        "replay",
        str(work / "log.jsonl"),
        "--config",
        str(work / "exp.toml"),
        "--concurrency",
        "1,4",
        "--warmup",
        "0",
        "--rounds",
        "1",
        "--no-progress",
        "--run-name",
        "simrun",
        "--capture-output",
    )
    assert result.returncode == 0, result.stderr
    return db


def _truths(url: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/sim/requests?limit=100000", timeout=10) as resp:
        return {t["request_id"]: t for t in json.load(resp)["requests"]}


def test_analyze_matches_the_simulators_ground_truth(sims: dict[str, str], replayed: Path) -> None:
    result = run_cli("analyze", str(replayed), "--format", "json")
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)["runs"]
    assert run["name"] == "simrun"
    rows = {(r["arm"], r["level"]): r for r in run["rows"]}
    assert set(rows) == {("baseline", "1"), ("baseline", "4"), ("eagle3", "1"), ("eagle3", "4")}

    with duckdb.connect(str(replayed), read_only=True) as conn:
        spans = conn.execute(
            "SELECT arm, concurrency_level, request_id, status, completion_tokens, decode_tok_s, ttft_s, "
            "e2e_s, t_start_ns FROM requests"
        ).fetchall()
    by_group: dict[tuple[str, str], list[tuple[Any, ...]]] = defaultdict(list)
    for s in spans:
        by_group[(s[0], str(s[1]))].append(s)

    for arm, url in sims.items():
        truths = _truths(url)
        for level in ("1", "4"):
            group = by_group[(arm, level)]
            row = rows[(arm, level)]
            assert row["calls"] == row["ok"] == 16
            truth = [truths[s[2]] for s in group]  # every span's call, as the simulator saw it
            assert row["completion_tokens"] == sum(t["completion_tokens"] for t in truth)
            # independent computation over the spans (numpy's linear percentiles)
            decode = [s[5] for s in group if s[5] is not None]
            ttft = [s[6] for s in group if s[6] is not None]
            wall = max(s[8] / 1e9 + s[7] for s in group) - min(s[8] / 1e9 for s in group)
            assert row["agg_tok_s"] == pytest.approx(sum(s[4] for s in group) / wall, rel=1e-9)
            assert row["p50_decode_tok_s"] == pytest.approx(float(np.quantile(decode, 0.5)), rel=1e-12)
            assert row["p95_ttft_s"] == pytest.approx(float(np.quantile(ttft, 0.95)), rel=1e-12)
            if arm == "baseline":
                assert row["acceptance_rate"] is None and row["req_acceptance_length"] is None
                continue
            # /metrics deltas of the level == the sums of the simulator's per-request truth
            drafts = sum(t["num_drafts"] for t in truth)
            draft_tokens = sum(t["draft_tokens"] for t in truth)
            accepted = sum(t["accepted_tokens"] for t in truth)
            assert row["acceptance_rate"] == pytest.approx(accepted / draft_tokens, rel=1e-12)
            assert row["acceptance_length"] == pytest.approx(1 + accepted / drafts, rel=1e-12)
            # the per-request figures the responses carried agree with the counters
            assert row["req_acceptance_rate"] == pytest.approx(accepted / draft_tokens, rel=1e-12)
            assert row["req_acceptance_length"] == pytest.approx(1 + accepted / drafts, rel=1e-12)
            # the simulator is lossless at temperature 0: every greedy output identical
            assert (row["identical"], row["compared"]) == (16, 16)
            assert row["paired"] is True and row["decode_speedup"]["low"] is not None
    # EAGLE-3 at concurrency 1 is faster per request (the simulator's profile: ~1.7x)
    assert rows[("eagle3", "1")]["decode_speedup"]["point"] > 1.2


def test_report_from_a_real_replay(replayed: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    result = run_cli("report", str(replayed), "-o", str(out))
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    assert "run simrun" in html and "<svg" in html
    # a level the busy machine could not measure soundly is left out of every chart, said so
    assert "TTFT CDF at c=4" in html or "c=4 UNRELIABLE: " in html
    # each arm's stack as captured by replay (the simulator answers /version like vLLM)
    assert "0.33.0" in html
