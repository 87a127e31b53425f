"""`specproxy replay` as a subprocess: real backends on 127.0.0.1, errors as sentences, Ctrl-C."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner, Result

from specproxy.cli import main
from tests.support import (
    backend_process,
    free_port,
    interrupted_cli,
    replay_target_args,
    run_cli,
    serving,
)

ROOT = Path(__file__).resolve().parents[1]


def run_in_process(*args: str) -> Result:
    """The command in-process (click's runner): for errors found before any network or subprocess."""
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def backend_url() -> Iterator[str]:
    """A vLLM-shaped test backend in its own process (8 tokens, 5 ms apart)."""
    with backend_process("--ttft-ms", "2", "--itl-ms", "5", "--tokens", "8") as url:
        yield url


def write_custom(path: Path, n: int, bad_line: int | None = None) -> Path:
    lines = [json.dumps({"prompt": f"question number {i}", "output_tokens": 4}) for i in range(n)]
    if bad_line is not None:
        lines[bad_line - 1] = '{"prompt": 42}'
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_replay_through_target_writes_spans(tmp_path: Path, backend_url: str) -> None:
    log = write_custom(tmp_path / "log.jsonl", 12, bad_line=5)
    db = tmp_path / "out.duckdb"
    res = run_cli(
        "replay",
        str(log),
        "--target",
        backend_url,
        "--concurrency",
        "1,3",
        "--db",
        str(db),
        "--on-error",
        "skip",
        "--rounds",
        "1",
        "--no-progress",
        "--run-name",
        "cli",
    )
    assert res.returncode == 0, res.stderr
    assert f"skipped 1 bad record(s); first: {log}:5: prompt: expected a non-empty string" in res.stderr
    assert "target" in res.stderr and "22 spans" in res.stderr
    with duckdb.connect(str(db), read_only=True) as conn:
        got = conn.execute(
            "SELECT concurrency_level, count(*), min(status), max(status), min(temperature) "
            "FROM requests GROUP BY 1 ORDER BY 1"
        ).fetchall()
        assert got == [(1, 11, "ok", "ok", 0.0), (3, 11, "ok", "ok", 0.0)]
        assert conn.execute("SELECT name, mode FROM runs").fetchall() == [("cli", "replay-paired")]


def test_bad_line_stops_with_file_and_line(tmp_path: Path) -> None:
    log = write_custom(tmp_path / "log.jsonl", 6, bad_line=3)
    res = run_in_process("replay", str(log), "--target", "http://127.0.0.1:9")
    assert res.exit_code == 1
    assert f"Error: {log}:3: prompt: expected a non-empty string" in res.stderr
    assert "Traceback" not in res.stderr


def test_empty_file_names_the_formats(tmp_path: Path) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    res = run_in_process("replay", str(log), "--target", "http://127.0.0.1:9")
    assert res.exit_code == 1 and "the file is empty" in res.stderr
    assert "mooncake" in res.stderr and "sharegpt" in res.stderr and "Traceback" not in res.stderr


def test_unreachable_arm_names_its_url(tmp_path: Path, backend_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = tmp_path / "exp.toml"
    cfg.write_text(
        f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{backend_url}"\n\n'
        f'[[arms]]\nname = "eagle3"\nurl = "{dead}"\n'
    )
    res = run_cli(
        "replay",
        str(write_custom(tmp_path / "l.jsonl", 2)),
        "--config",
        str(cfg),
        "--db",
        str(tmp_path / "x.duckdb"),
    )
    assert res.returncode == 1
    assert f"arm 'eagle3' at {dead} is not reachable" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "give exactly one of --config"),
        (["--target", "http://x", "--rate", "2", "--timed"], "choose one"),
        (["--target", "http://x", "--concurrency", "0"], "integers ≥ 1"),
        (["--target", "ftp://x"], "must start with http://"),
        (["--target", "http://x", "--mode", "split"], "--mode split needs the arms"),
    ],
)
def test_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    res = run_in_process("replay", str(write_custom(tmp_path / "l.jsonl", 1)), *args)
    assert res.exit_code == 2 and message in res.stderr


def test_ctrl_c_stops_cleanly_and_keeps_spans(tmp_path: Path, backend_url: str) -> None:
    log = write_custom(tmp_path / "log.jsonl", 5000)
    db = tmp_path / "out.duckdb"
    argv = replay_target_args(log, backend_url, db, "--concurrency", "4")
    # Under way: the 4 warm-up calls and 8 measured ones answered (at most 4 more are in flight).
    code, out = interrupted_cli(argv, backend_url + "/metrics", 12, 30)
    assert code == 130, out
    assert "interrupted: the spans measured so far are kept" in out and "Traceback" not in out
    with duckdb.connect(str(db), read_only=True) as conn:
        ok, other = conn.execute(
            "SELECT count(*) FILTER (status = 'ok'), count(*) FILTER (status <> 'ok') FROM requests"
        ).fetchone()  # type: ignore[misc]
        assert 4 <= ok < 5000 and other <= 4
        assert conn.execute("SELECT ended_at IS NOT NULL FROM runs").fetchall() == [(True,)]


def test_help_lists_every_option() -> None:
    res = run_in_process("replay", "--help")
    assert res.exit_code == 0
    for opt in (
        "--config",
        "--target",
        "--format",
        "--concurrency",
        "--rate",
        "--timed",
        "--speedup",
        "--mode",
        "--temperature",
        "--max-tokens",
        "--limit",
        "--duration",
        "--rounds",
        "--extra-rounds",
        "--db",
        "--run-name",
        "--seed",
        "--on-error",
    ):
        assert opt in res.stdout
    # what an extra round is, in a sentence a user can act on
    said = " ".join(res.stdout.split())
    assert (
        "--extra-rounds N Add up to N rounds to a level whose rounds left too few that passed every" in said
    )
    assert "[default: 0; x>=0]" in said.split("--extra-rounds", 1)[1].split("--warmup", 1)[0]


def _shadow_config(tmp_path: Path, url: str) -> Path:
    """A shadow-mode experiment file whose baseline ``base`` and candidate ``cand`` are both ``url``."""
    cfg = tmp_path / "exp.toml"
    cfg.write_text(
        f'[experiment]\nmode = "shadow"\n\n[[arms]]\nname = "base"\nrole = "baseline"\n'
        f'url = "{url}"\n\n[[arms]]\nname = "cand"\nurl = "{url}"\n'
    )
    return cfg


def test_through_serve_then_replay_its_capture(tmp_path: Path, backend_url: str) -> None:
    """replay --target a real `specproxy serve` (shadow mode), then replay the capture it wrote."""
    cfg = _shadow_config(tmp_path, backend_url)
    proxy_db, client_db = tmp_path / "proxy.duckdb", tmp_path / "client.duckdb"
    capture = tmp_path / "cap.jsonl"
    with serving(cfg, "--db", str(proxy_db), "--capture", str(capture)) as served:
        log = tmp_path / "question.jsonl"
        log.write_text(
            "".join(
                json.dumps({"question_id": i, "category": "qa", "turns": [f"q {i}"]}) + "\n" for i in range(6)
            )
        )
        options = ("--concurrency", "2", "--max-tokens", "5", "--rounds", "1")
        res = run_cli(*replay_target_args(log, served.url, client_db, *options))
        assert res.returncode == 0, res.stderr
    assert served.returncode == 0, served.output
    with duckdb.connect(str(client_db), read_only=True) as conn:
        client_ids = {r for (r,) in conn.execute("SELECT request_id FROM requests").fetchall()}
    with duckdb.connect(str(proxy_db), read_only=True) as conn:
        proxy = conn.execute("SELECT arm, request_id, category FROM requests").fetchall()
    assert len(client_ids) == 6
    # the proxy's upstream spans carry replay's request ids and categories, one per arm (and no warm-up
    # calls: through a proxy they are off unless asked for)
    assert {(a, r, c) for a, r, c in proxy} == {(a, r, "qa") for a in ("base", "cand") for r in client_ids}
    # the capture the proxy wrote is a replay log: detected, timed, sent to both arms
    res = run_cli(
        "replay",
        str(capture),
        "--config",
        str(cfg),
        "--timed",
        "--speedup",
        "10",
        "--db",
        str(tmp_path / "again.duckdb"),
        "--rounds",
        "1",
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    assert "replaying 6 capture items" in res.stderr and "12 spans" in res.stderr


def test_replay_through_serve_labels_rounds_and_serve_records_its_health(
    tmp_path: Path, backend_url: str
) -> None:
    """replay --target with rounds: the proxy's spans carry each call's level and round; and serve writes
    its own health (loop lag, queueing per arm) for the live traffic it carried, and again for each
    level-round replay named."""
    cfg = _shadow_config(tmp_path, backend_url)
    proxy_db = tmp_path / "proxy.duckdb"
    with serving(cfg, "--db", str(proxy_db)) as served:
        log = tmp_path / "question.jsonl"
        log.write_text("".join(json.dumps({"question_id": i, "turns": [f"q {i}"]}) + "\n" for i in range(4)))
        # 5 tokens a call: the labels and health are the question, not 256 tokens 5 ms apart
        options = ("--concurrency", "1,2", "--rounds", "2", "--max-tokens", "5")
        res = run_cli(*replay_target_args(log, served.url, tmp_path / "client.duckdb", *options))
        assert res.returncode == 0, res.stderr
    assert served.returncode == 0, served.output
    with duckdb.connect(str(proxy_db), read_only=True) as conn:
        phases = conn.execute(
            "SELECT arm, concurrency_level, round, count(*) FROM requests GROUP BY ALL ORDER BY ALL"
        ).fetchall()
        live = conn.execute(
            "SELECT check_name, arm, bool_and(round IS NULL), bool_and(value >= 0), any_value(threshold) "
            "FROM health WHERE concurrency_level IS NULL GROUP BY ALL ORDER BY ALL"
        ).fetchall()
        per_round = conn.execute(
            "SELECT DISTINCT concurrency_level, round, check_name, arm FROM health "
            "WHERE concurrency_level IS NOT NULL ORDER BY ALL"
        ).fetchall()
    assert phases == [(arm, c, k, 4) for arm in ("base", "cand") for c in (1, 2) for k in (1, 2)]
    assert live == [
        ("event_loop_lag_p99_s", None, True, True, None),
        ("event_loop_lag_share", None, True, True, 0.02),
        ("proxy_queue_p99_s", "base", True, True, 0.05),
        ("proxy_queue_p99_s", "cand", True, True, 0.05),
    ]
    # each level-round replay named: the proxy's own checks there (the backend has no simulator clock)
    assert {(c, k) for c, k, check, _ in per_round if check == "proxy_queue_p99_s"} == {
        (c, k) for c in (1, 2) for k in (1, 2)
    }
    assert {check for _, _, check, _ in per_round} <= {
        "proxy_queue_p99_s",
        "event_loop_lag_share",
        "event_loop_lag_p99_s",
    }, per_round
    assert all(arm is None for *_, arm in per_round), per_round


def test_replay_through_a_proxy_that_does_not_scrape_says_so(tmp_path: Path, backend_url: str) -> None:
    """The levels' boundary scrapes are the proxy's to do: one started with --no-scrape refuses, and
    replay says what that costs (once), the spans written all the same."""
    cfg = tmp_path / "exp.toml"
    arm = f'[[arms]]\nname = "base"\nrole = "baseline"\nurl = "{backend_url}"\n'
    cfg.write_text(f'[experiment]\nmode = "shadow"\n\n{arm}')
    log = write_custom(tmp_path / "log.jsonl", 2)
    with serving(cfg, "--db", str(tmp_path / "proxy.duckdb"), "--no-scrape") as served:
        res = run_cli(
            "replay", str(log), "--target", served.url, "--concurrency", "1,2",
            "--db", str(tmp_path / "c.duckdb"), "--rounds", "1", "--no-progress",
        )  # fmt: skip
    assert res.returncode == 0, res.stderr
    note = f"the proxy at {served.url} did not scrape its arms at the levels' boundaries (HTTP 409: "
    assert res.stderr.count(note) == 1, res.stderr
    assert "engines' counters are not split by level" in res.stderr and "4 spans" in res.stderr
