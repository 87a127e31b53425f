"""`specproxy replay` on hostile input files and options: `file:line: what is wrong`, exit 1, never a
traceback; with --on-error skip the bad records are counted and the good ones measured.

Each case runs the real CLI in a subprocess. Errors found while reading need no backend (the target is
a closed port); the skip case replays against a real test backend on 127.0.0.1.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import pytest

from specproxy.proxy.replay.loadgen import poisson_offsets, timed_offsets
from tests.support import backend_process, run_cli

ROOT = Path(__file__).resolve().parents[1]
NOWHERE = "http://127.0.0.1:9"


def replay(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_cli("replay", *args, timeout=timeout)


def rejected(result: subprocess.CompletedProcess[str], *phrases: str, status: int = 1) -> None:
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


def jsonl(*records: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def capture(body: dict[str, object], **extra: object) -> dict[str, object]:
    return {"request_id": "r", "path": "/v1/chat/completions", "body": body, **extra}


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
NESTED = '{"prompt": "x", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"


def _long_first_line() -> str:
    body = {"messages": [{"role": "user", "content": "y" * 100_000}], "max_tokens": 4}
    return jsonl(capture(body), capture(CHAT))


# (name, file content, where the error is, what it says)
BAD_FILES: list[tuple[str, Callable[[], str | bytes], str, str]] = [
    ("nested.jsonl", lambda: jsonl({"prompt": "ok"}, NESTED), ":2:", "nested deeper than"),
    (
        "field.csv",
        lambda: "TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1," + "9" * 140_000 + ",5\n",
        ":3:",
        "field",
    ),
    (
        "max-tokens.jsonl",
        lambda: jsonl(capture(CHAT), capture({**CHAT, "max_tokens": "abc"})),
        ":2:",
        "max_tokens: expected an integer",
    ),
    ("huge-output.jsonl", lambda: jsonl({"prompt": "p", "output_tokens": 1e30}), ":1:", "output_tokens"),
    (
        "huge-input.jsonl",
        lambda: jsonl({"timestamp": 0, "input_length": 1e12, "output_length": 4, "hash_ids": []}),
        ":1:",
        "input_length",
    ),
    (
        "late-utf8.jsonl",
        lambda: jsonl({"prompt": "ok"}, {"prompt": "fine"}).encode() + b'{"prompt": "\xff\xfe"}\n',
        ":3:",
        "not UTF-8",
    ),
    (
        "late-utf8.csv",
        lambda: b"TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1,10,5\n2,1\xff0,5\n",
        ":4:",
        "not UTF-8",
    ),
    (
        "late-utf8.json",
        lambda: (
            b'[\n{"conversations": [{"from": "human", "value": "ok"}]},\n'
            b'{"conversations": [{"from": "human", "value": "\xff"}]}\n]\n'
        ),
        ":3:",
        "not UTF-8",
    ),
    (
        "nan-time.jsonl",
        lambda: jsonl(
            capture(CHAT, arrival_unix_s=1.0),
            '{"path": "/v1/chat/completions", '
            '"arrival_unix_s": NaN, "body": {"messages": [{"role": "user", "content": "x"}]}}',
        ),
        ":2:",
        "NaN",
    ),
    (
        "nan-time.csv",
        lambda: "TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\nnan,10,5\n",
        ":3:",
        "timestamp: expected a finite number",
    ),
    (
        "inf-temperature.jsonl",
        lambda: jsonl(capture({**CHAT, "temperature": 1e400})),
        ":1:",
        "temperature",
    ),
]


@pytest.mark.parametrize("name, content, where, message", BAD_FILES)
def test_a_bad_record_is_file_line_what(
    tmp_path: Path, name: str, content: Callable[[], str | bytes], where: str, message: str
) -> None:
    log = tmp_path / name
    data = content()
    log.write_bytes(data if isinstance(data, bytes) else data.encode())
    result = replay(str(log), "--target", NOWHERE, "--warmup", "1", "--db", str(tmp_path / "x.duckdb"))
    rejected(result, f"{log}{where}", message)
    assert not (tmp_path / "x.duckdb").exists()


def test_a_first_line_over_64_kib_is_still_detected(tmp_path: Path) -> None:
    log = tmp_path / "capture.jsonl"
    log.write_text(_long_first_line(), encoding="utf-8")
    # detection succeeds: the run then fails only on the closed port, naming it
    result = replay(str(log), "--target", NOWHERE, "--db", str(tmp_path / "x.duckdb"))
    assert "replaying 2 capture items" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rate", "nan"], "--rate"),
        (["--rate", "inf"], "--rate"),
        (["--timed", "--speedup", "-1"], "--speedup"),
        (["--timed", "--speedup", "nan"], "--speedup"),
        (["--duration", "nan"], "--duration"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--concurrency", "1,99999999999"], "at most 1,000,000"),
    ],
)
def test_options_must_be_finite_numbers_in_range(tmp_path: Path, args: list[str], message: str) -> None:
    log = tmp_path / "l.jsonl"
    log.write_text(jsonl({"prompt": "p", "output_tokens": 4}), encoding="utf-8")
    rejected(replay(str(log), "--target", NOWHERE, *args), message, status=2)


@pytest.fixture
def backend_url() -> Iterator[str]:
    """A vLLM-shaped test backend in its own process (4 tokens, 2 ms apart)."""
    with backend_process("--itl-ms", "2", "--tokens", "4") as url:
        yield url


def test_skip_counts_every_bad_record_and_measures_the_rest(tmp_path: Path, backend_url: str) -> None:
    log = tmp_path / "capture.jsonl"
    good = capture(CHAT)
    # nesting as deep as real tool schemas is fine; only absurd depth is refused
    shallow = capture({**CHAT, "tools": [{"a": [[[[[[[[[[{}]]]]]]]]]]}]})
    lines = [
        json.dumps(good).encode(),
        json.dumps(capture({**CHAT, "max_tokens": "abc"})).encode(),
        ('{"path": "/v1/chat/completions", "body": ' + "[" * 5000 + "]" * 5000 + "}").encode(),
        b'{"path": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "\xff"}]}}',
        b'{"path": "/v1/chat/completions", "arrival_unix_s": NaN, "body": {"prompt": "x"}}',
        json.dumps(shallow).encode(),
        json.dumps(good).encode(),
    ]
    log.write_bytes(b"\n".join(lines) + b"\n")
    db = tmp_path / "out.duckdb"
    result = replay(
        str(log),
        "--target",
        backend_url,
        "--concurrency",
        "2",
        "--warmup",
        "1",
        "--on-error",
        "skip",
        "--rounds",
        "1",
        "--no-progress",
        "--db",
        str(db),
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"skipped 4 bad record(s); first: {log}:2: body.max_tokens" in result.stderr
    with duckdb.connect(str(db), read_only=True) as conn:
        rows = conn.execute("SELECT status, count(*) FROM requests GROUP BY 1").fetchall()
    assert rows == [("ok", 3)]


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_poisson_offsets_refuse_a_rate_that_is_not_a_positive_number(rate: float) -> None:
    with pytest.raises(ValueError, match="rate must be a finite number > 0"):
        poisson_offsets(3, rate)


def test_timed_offsets_refuse_bad_speedups_and_arrivals() -> None:
    for speedup in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="speedup must be a finite number > 0"):
            timed_offsets([0.0, 1.0], speedup)
    with pytest.raises(ValueError, match="arrival times must be finite"):
        timed_offsets([0.0, math.nan, 2.0])
    assert timed_offsets([10.0, 12.0, 11.0], 2.0) == [0.0, 1.0, 0.5]
