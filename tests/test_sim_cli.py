"""`specproxy sim` as others launch it: a subprocess that prints where it listens, and clear flag errors."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from specproxy.engines.sim.cli import speculative_from_flags
from specproxy.engines.sim.config import SpeculativeConfig
from specproxy.lab.arms import LAB_ARMS
from tests.support import free_port, run_cli, start_cli, stop, wait_http


def test_sim_subprocess_serves_and_stops() -> None:
    port = free_port()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    proc = start_cli(
        [
            "sim",
            "--port",
            str(port),
            "--speculative-config",
            json.dumps(spec),
            "--time-scale",
            "50",
            "--served-model-name",
            "llama",
        ]
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        body = json.dumps(
            {"model": "llama", "prompt": "The plan", "max_tokens": 5, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 5
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/stats", timeout=5) as resp:
            stats = json.loads(resp.read())
        assert stats["method"] == "ngram" and stats["num_speculative_tokens"] == 4
        assert stats["time_scale"] == 50
        assert _post_time_scale(port, 12.5) == (200, 12.5)
        assert _post_time_scale(port, 0)[0] == 400
    finally:
        out = stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()
    assert f"listening on http://127.0.0.1:{port}" in out
    assert "Traceback" not in out


def _post_time_scale(port: int, value: float) -> tuple[int, float | None]:
    """POST /sim/time_scale: the status and the engine's time scale it reports."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/sim/time_scale",
        data=json.dumps({"time_scale": value}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())["time_scale"]
    except urllib.error.HTTPError as exc:
        return exc.code, None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--speculative-config", "{bad"], "not valid JSON"),
        (
            ["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
            "unknown speculative method",
        ),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6, '
                '"prompt_lookup_max": 3}',
            ],
            "prompt_lookup_min=6 must be <= prompt_lookup_max=3",
        ),
        (["--profile", "no-such-gpu"], "no cost profile 'no-such-gpu'"),
        (["--method", "eagle3", "--lossy-rate", "2"], "--lossy-rate must lie in [0, 1]"),
        (["--num-speculative-tokens", "3"], "needs --method"),
    ],
)
def test_bad_flags_exit_with_a_sentence(args: list[str], message: str) -> None:
    result = run_cli("sim", "--port", "0", *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_every_option() -> None:
    result = run_cli("sim", "--help")
    for flag in (
        "--method",
        "--num-speculative-tokens",
        "--speculative-config",
        "--host",
        "--port",
        "--model",
        "--served-model-name",
        "--profile",
        "--time-scale",
        "--seed",
        "--per-request-spec-decode-metrics",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--lossy-rate",
        "--error-rate",
        "--stall-ms",
        "--drop-rate",
        "--max-concurrency",
    ):
        assert flag in result.stdout


@pytest.mark.parametrize("arm", [name for name, spec in LAB_ARMS if spec])
def test_method_shorthand_is_the_labs_arm(arm: str) -> None:
    """`specproxy sim --method M` runs the speculative config the lab's arm M runs."""
    lab_spec = next(spec for name, spec in LAB_ARMS if name == arm) or {}
    spec = speculative_from_flags(method=arm, num_speculative_tokens=None, speculative_config=None)
    assert spec == SpeculativeConfig.from_dict(lab_spec)
