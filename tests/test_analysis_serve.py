"""Live traffic: `specproxy serve` in shadow mode in front of two simulators, then `specproxy analyze`.

Serve's spans have no concurrency level (one level, "live"), each request gives a primary and a shadow
span with the same request_id, and /metrics is scraped periodically: the analysis must pair them,
compare their outputs and take acceptance from the periodic window, equal to the simulator's truth.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from specproxy.cli import main
from tests import processes
from tests.support import (
    kept_and_lagging_simulators,
    metric_sum,
    replay_target_argv,
    serving,
    simulators,
    wait_until_sync,
)


@pytest.fixture
def sims() -> Iterator[dict[str, str]]:
    # Time scale 2: a call decodes for about 0.2 s, long enough for the proxy's own loop lag on a busy
    # machine to stay a small share of it (its health check); much faster, and the live level's figures
    # are rightly UNRELIABLE.
    with simulators(baseline=["--time-scale", "2"], ngram=["--time-scale", "2", "--method", "ngram"]) as urls:
        yield urls


def _shadow_config(path: Path, db: Path, sims: dict[str, str]) -> Path:
    path.write_text(f"""
[experiment]
name = "ngram-shadow"
mode = "shadow"
db = "{db}"
scrape_interval_s = 0.5

[[arms]]
name = "baseline"
role = "baseline"
url = "{sims["baseline"]}"

[[arms]]
name = "ngram"
url = "{sims["ngram"]}"
speculative = {{ method = "ngram", num_speculative_tokens = 5, prompt_lookup_min = 1, prompt_lookup_max = 4 }}
""")
    return path


def test_shadow_traffic_is_analysed_as_one_live_level(sims: dict[str, str], tmp_path: Path) -> None:
    db = tmp_path / "shadow.duckdb"
    config = _shadow_config(tmp_path / "shadow.toml", db, sims)
    with serving(config) as proxy:
        # Streams are read to the end of the HTTP body (urllib), not just to [DONE]: the openai client
        # closes the connection at [DONE], and the proxy then sometimes records the primary as
        # client_cancelled (reported to the serve owner); that race is not what this test is about.
        for i in range(8):
            body = {
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "temperature": 0,
                "max_tokens": 48,
                "stream": True,
                "messages": [
                    {
                        "role": "user",
                        "content": "Summarize: the cat sat on the mat, the mat was red "
                        f"and the cat was happy on the red mat ({i})",
                    }
                ],
            }
            request = urllib.request.Request(
                f"{proxy.url}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as resp:
                assert b"data: [DONE]" in resp.read()
        # The shadow copies end after their clients' calls; the proxy scrapes the arms once more when
        # it stops, after them.
        calls = f"{proxy.url}/metrics"
        wait_until_sync(lambda: metric_sum(calls, "specproxy_requests_total") >= 16, "16 finished calls")
    assert proxy.returncode == 0, proxy.output

    result = CliRunner().invoke(main, ["analyze", str(db), "--format", "json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)["runs"]
    assert run["name"] == "ngram-shadow" and run["peak_level"] == "live"
    rows = {r["arm"]: r for r in run["rows"]}
    assert set(rows) == {"baseline", "ngram"}
    assert {r["level"] for r in run["rows"]} == {"live"}
    ngram = rows["ngram"]
    assert rows["baseline"]["ok"] == ngram["ok"] == 8, _statuses(db)
    assert (ngram["identical"], ngram["compared"]) == (8, 8)
    assert ngram["paired"] is True and ngram["decode_speedup"]["point"] > 0
    if ngram["verdict"] == "UNRELIABLE":
        # A busy machine: serve's own health rows (its loop lag, its queueing) held the level back.
        assert ngram["reliable"] is False and "health checks" in ngram["reason"], ngram["reason"]
    else:
        assert ngram["verdict"] in ("WIN", "LOSS", "NO CLEAR GAIN")
    # acceptance from the periodic /metrics window == the simulator's own per-request truth
    with urllib.request.urlopen(f"{sims['ngram']}/sim/requests?limit=1000", timeout=10) as resp:
        truths = json.load(resp)["requests"]
    assert len(truths) == 8
    accepted = sum(t["accepted_tokens"] for t in truths)
    assert ngram["acceptance_rate"] == pytest.approx(
        accepted / sum(t["draft_tokens"] for t in truths), rel=1e-12
    )
    assert ngram["acceptance_length"] == pytest.approx(
        1 + accepted / sum(t["num_drafts"] for t in truths), rel=1e-12
    )
    table = CliRunner().invoke(main, ["analyze", str(db)])
    assert "live   ngram" in table.stdout


def _statuses(db: Path) -> list[tuple[object, ...]]:
    result = CliRunner().invoke(
        main,
        [
            "sql",
            str(db),
            "SELECT arm, routed_as, status, http_status, error FROM requests",
            "--format",
            "csv",
        ],
    )
    return [tuple(line.split(",")) for line in result.stdout.splitlines()]


def _replay_through(
    proxy_url: str, log: Path, tmp_path: Path, *sweep: str
) -> subprocess.CompletedProcess[str]:
    """`specproxy replay LOG --target PROXY` with ``sweep``, its own spans in tmp_path; it must succeed."""
    replay = processes.run(replay_target_argv(log, proxy_url, tmp_path / "client.duckdb", *sweep))
    assert replay.returncode == 0, replay.stderr
    return replay


def test_replay_through_serve_has_acceptance_per_level(sims: dict[str, str], tmp_path: Path) -> None:
    """replay --target a served proxy: the proxy scrapes the engines at each level's start and end (on
    replay's request), so the engines' counters come out per level, each level's equal to the
    simulator's truth for the calls of that level."""
    db = tmp_path / "proxy.duckdb"
    config = _shadow_config(tmp_path / "shadow.toml", db, sims)
    log = tmp_path / "question.jsonl"
    log.write_text(
        "".join(json.dumps({"question_id": i, "turns": [f"Summarize item {i}"]}) + "\n" for i in range(4))
    )
    with serving(config) as proxy:
        sweep = ["--concurrency", "1,2", "--rounds", "2", "--max-tokens", "32"]
        replay = _replay_through(proxy.url, log, tmp_path, *sweep)
        assert "did not scrape" not in replay.stderr, replay.stderr
    assert proxy.returncode == 0, proxy.output
    with urllib.request.urlopen(f"{sims['ngram']}/sim/requests?limit=1000", timeout=10) as resp:
        truths = {t["request_id"]: t for t in json.load(resp)["requests"]}
    with duckdb.connect(str(db), read_only=True) as conn:
        levels = dict(
            conn.execute(
                "SELECT concurrency_level, list(request_id) FROM requests WHERE arm = 'ngram' GROUP BY ALL"
            ).fetchall()
        )
        acceptance = {
            level: (drafts, draft_tokens, accepted)
            for level, drafts, draft_tokens, accepted in conn.execute(
                "SELECT level, drafts, draft_tokens, accepted_tokens FROM acceptance WHERE arm = 'ngram'"
            ).fetchall()
        }
    assert sorted(levels) == [1, 2] and all(len(ids) == 8 for ids in levels.values())  # 4 items × 2 rounds
    for level, ids in levels.items():
        mine = [truths[_truth_id(truths, rid)] for rid in ids]
        expected = tuple(
            float(sum(t[k] for t in mine)) for k in ("num_drafts", "draft_tokens", "accepted_tokens")
        )
        assert expected[2] > 0
        assert acceptance[str(level)] == expected, (level, acceptance)
    # and the analysis reads them per level, as for a replay that scraped the arms itself
    result = CliRunner().invoke(
        main, ["analyze", str(db), "--format", "json", "--bootstrap-iterations", "200"]
    )
    assert result.exit_code == 0, result.output
    rows = {r["level"]: r for r in json.loads(result.stdout)["runs"][0]["rows"] if r["arm"] == "ngram"}
    assert set(rows) == {"1", "2"}
    for level, (_, draft_tokens, accepted) in acceptance.items():
        if level in rows:
            assert rows[level]["acceptance_rate"] == pytest.approx(accepted / draft_tokens, rel=1e-12)


def _truth_id(truths: dict[str, object], request_id: str) -> str:
    """The simulator's id for a call: the request id the proxy sent, perhaps with an API prefix."""
    (found,) = [t for t in truths if t.endswith(request_id)]
    return found


def test_replay_through_serve_records_each_level_rounds_health_in_the_proxys_store(tmp_path: Path) -> None:
    """replay --target names each level-round to the proxy, which reads its simulator arms' clocks at
    both ends: a simulator far too fast for the machine fails every round, in the proxy's own store,
    so the level is UNRELIABLE there; the replay hears of it and says so."""
    db = tmp_path / "proxy.duckdb"
    with kept_and_lagging_simulators() as urls:
        config = tmp_path / "exp.toml"
        config.write_text(
            f'[experiment]\nmode = "shadow"\ndb = "{db}"\n\n'
            f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{urls["base"]}"\n\n'
            f'[[arms]]\nname = "fast"\nrole = "replica"\nurl = "{urls["fast"]}"\n'
        )
        log = tmp_path / "question.jsonl"
        log.write_text(
            "".join(json.dumps({"question_id": i, "turns": [f"Say {i}"]}) + "\n" for i in range(4))
        )
        with serving(config) as proxy:
            sweep = ["--concurrency", "2", "--rounds", "3", "--extra-rounds", "0", "--max-tokens", "16"]
            replay = _replay_through(proxy.url, log, tmp_path, *sweep)
        assert proxy.returncode == 0, proxy.output
    with duckdb.connect(str(db), read_only=True) as conn:
        lags = conn.execute(
            "SELECT arm, concurrency_level, round, value > threshold FROM health "
            "WHERE check_name = 'engine_clock_lag' ORDER BY ALL"
        ).fetchall()
    assert [(a, c, r) for a, c, r, _ in lags] == [(a, 2, r) for a in ("base", "fast") for r in (1, 2, 3)]
    assert all(over for a, _, _, over in lags if a == "fast"), lags
    assert "engine_clock_lag (fast)" in replay.stderr
    result = CliRunner().invoke(main, ["analyze", str(db), "--format", "json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)["runs"]
    (row,) = [r for r in run["rows"] if r["arm"] == "fast"]
    assert row["verdict"] == "UNRELIABLE" and "engine_clock_lag" in row["reason"], row
