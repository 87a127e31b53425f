"""Matched load with real pieces: two identical `specproxy sim`, `specproxy serve` in shadow mode with
the candidate sampled at 0.2, `specproxy replay --target` at c=32 through it, `specproxy analyze`.

The candidate's engine runs at about a fifth of the baseline's load and decodes faster for that alone
(about 8 % on the simulator's H100 profile); compared at matched load it must come out a tie. This is
the run the analysis README's matched-load section quotes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.support import replay_target_argv, run_cli, serving, simulators

ITEMS = 300


def _config(path: Path, db: Path, urls: dict[str, str]) -> Path:
    path.write_text(f"""
[experiment]
name = "identical-shadow"
mode = "shadow"
db = "{db}"
scrape_interval_s = 1

[[arms]]
name = "baseline"
role = "baseline"
url = "{urls["baseline"]}"

[[arms]]
name = "twin"
url = "{urls["twin"]}"
sample = 0.2
""")
    return path


def _analyze(db: Path) -> dict[str, Any]:
    result = run_cli("analyze", str(db), "--format", "json")
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)["runs"]
    return run  # type: ignore[no-any-return]


def test_an_identical_arm_shadowed_at_a_fifth_is_a_tie_at_matched_load(tmp_path: Path) -> None:
    db = tmp_path / "shadow.duckdb"
    log = tmp_path / "items.jsonl"
    log.write_text(
        "".join(
            json.dumps({"question_id": i, "turns": [f"Tell a story about item {i}"]}) + "\n"
            for i in range(ITEMS)
        )
    )
    # Time scale 1: the simulators keep their clocks on two slow cores with the proxy and replay on them.
    with simulators(baseline=["--time-scale", "1"], twin=["--time-scale", "1"]) as urls:
        with serving(_config(tmp_path / "exp.toml", db, urls)) as proxy:
            argv = replay_target_argv(log, proxy.url, tmp_path / "client.duckdb", "--concurrency", "32")
            replay = subprocess.run(
                [*argv, "--max-tokens", "64"], capture_output=True, text=True, timeout=300, check=False
            )
            assert replay.returncode == 0, replay.stderr
        assert proxy.returncode == 0, proxy.output
    run = _analyze(db)
    twin = next(r for r in run["rows"] if r["arm"] == "twin" and r["level"] == "32")
    load = twin["load"]
    # each arm's load is reported: the proxy's count over each call's decode, and the engines' gauges
    assert load["p50"] is not None and load["baseline_p50"] is not None, load
    assert load["p50"] < 0.5 * load["baseline_p50"], load
    assert load["engine_p50"] is not None and load["engine_baseline_p50"] is not None, load
    assert load["method"] in ("interpolated", "extrapolated"), twin["reason"]
    assert twin["verdict"] == "NO CLEAR GAIN", twin["reason"]
    decode = twin["decode_speedup"]
    assert 0.95 <= decode["point"] <= 1.05, (decode, twin["reason"])
    assert decode["low"] <= 1.0 <= decode["high"], decode
    # the plain per-call comparison at unequal load, kept beside it, is what the matching removes
    assert twin["unmatched_decode_speedup"]["point"] > decode["point"]
    assert "compared at matched load" in twin["reason"] and "load P50" in twin["reason"]
    table = run_cli("analyze", str(db)).stdout
    line = next(x for x in table.splitlines() if x.startswith("c=32") and " twin " in x)
    assert "(matched load)" in line and "unequal" in line and line.rstrip().endswith("NO CLEAR GAIN")
    plain, throughput = twin["unmatched_decode_speedup"], twin["throughput_speedup"]
    print(f"twin decode {decode}, plain {plain}, throughput {throughput}, load {load}")
