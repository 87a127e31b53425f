"""Launch-time validation: each problem is a sentence that says what to change."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from specproxy.cli import main
from specproxy.config import Experiment, load_experiment, parse_experiment
from specproxy.engines.launch.validate import Finding, check_experiment, engine_python, module_available
from tests.support import free_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# An experiment file's start: the model and a baseline arm ``b`` (a test adds to the arm, or more arms).
BASELINE_FILE = f"""
[experiment]
model = "{MODEL}"
[[arms]]
name = "b"
role = "baseline"
url = "http://127.0.0.1:8001"
"""


def _exp(*arms: dict[str, Any], model: str | None = MODEL) -> Experiment:
    experiment: dict[str, Any] = {"name": "v"}
    if model:
        experiment["model"] = model
    listed = [dict(a) for a in arms]
    listed[0].setdefault("role", "baseline")
    for i, a in enumerate(listed):
        a.setdefault("name", f"arm{i}")
        # Free ports: checks with local=True also look at whether the port is taken.
        a.setdefault("url", f"http://127.0.0.1:{free_port()}")
    return parse_experiment({"experiment": experiment, "arms": listed})


def _messages(findings: list[Finding], level: str | None = None) -> list[str]:
    return [str(f) for f in findings if level is None or f.level == level]


def _no_probe(_bin: str, _module: str) -> bool:
    return False


def test_a_clean_experiment_has_no_findings() -> None:
    exp = _exp(
        {"engine": {"gpus": [0]}},
        {
            "speculative": {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
            "engine": {"gpus": [1]},
        },
    )
    assert check_experiment(exp, local=False) == []


def test_unknown_and_removed_methods_are_rejected_when_the_file_loads(tmp_path: Path) -> None:
    # The loader rejects them already; `plan` turns that into a sentence, not a traceback.
    for method, expected in (
        ("medusa", "'medusa' was removed in vLLM 0.33; use eagle3, mtp"),
        ("mlp_speculator", "'mlp_speculator' was removed in vLLM 0.33"),
        ("lookahead", "unknown method 'lookahead' (one of:"),
    ):
        path = tmp_path / f"{method}.toml"
        path.write_text(f"""{BASELINE_FILE}
[[arms]]
name = "c"
url = "http://127.0.0.1:8002"
speculative = {{ method = "{method}", num_speculative_tokens = 3 }}
""")
        result = CliRunner().invoke(main, ["engines", "plan", str(path)])
        assert result.exit_code == 1
        assert expected in result.output
        assert f"{path}: arms[1].speculative.method" in result.output


def test_ngram_min_above_max_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(f"""{BASELINE_FILE}
speculative = {{ method = "ngram", prompt_lookup_min = 6, prompt_lookup_max = 3 }}
""")
    result = CliRunner().invoke(main, ["engines", "up", str(path), "--engine", "sim"])
    assert result.exit_code == 1
    assert "arms[0].speculative.prompt_lookup_min: must be ≤ prompt_lookup_max (6 > 3)" in result.output


def test_experiments_built_in_code_get_the_speculative_checks_too() -> None:
    exp = _exp({})
    bad = exp.arms[0].__class__(
        name="x", url="http://127.0.0.1:18009", speculative={"method": "medusa", "num_speculative_tokens": 2}
    )
    exp = exp.__class__(name="v", model=MODEL, arms=(exp.arms[0], bad))
    errors = _messages(check_experiment(exp, local=False), "error")
    assert any("'medusa' was removed in vLLM 0.33" in e for e in errors)


def test_missing_model() -> None:
    errors = _messages(check_experiment(_exp({}, model=None), local=False), "error")
    assert errors == [
        "error: experiment.model is not set: engines need the model to serve "
        '(e.g. model = "meta-llama/Llama-3.1-8B-Instruct" under [experiment])'
    ]


def test_suffix_without_arctic_inference() -> None:
    exp = _exp(
        {"engine": {"gpus": [0]}},
        {
            "name": "suffix",
            "speculative": {"method": "suffix", "num_speculative_tokens": 32},
            "engine": {"gpus": [1]},
        },
    )
    # Planning for elsewhere: a warning that names the package.
    (warning,) = check_experiment(exp, local=False)
    assert warning.level == "warning" and warning.arm == "suffix"
    assert "needs the arctic-inference package" in warning.message
    # Launching here, with a vllm whose Python lacks it: an error that says how to fix it.
    found = check_experiment(exp, local=True, vllm_bin=sys.executable, module_probe=_no_probe)
    errors = _messages(found, "error")
    assert any(
        "arm 'suffix': method 'suffix' needs the arctic-inference package, which the Python running" in e
        and "pip install arctic-inference" in e
        for e in errors
    ), errors
    assert (
        check_experiment(
            exp, local=True, vllm_bin=sys.executable, module_probe=lambda _b, m: m == "arctic_inference"
        )
        == []
    )


def test_module_probe_asks_the_engines_own_python(tmp_path: Path) -> None:
    fake_vllm = tmp_path / "vllm"
    fake_vllm.write_text(f"#!{sys.executable}\nprint('vllm')\n")
    fake_vllm.chmod(fake_vllm.stat().st_mode | stat.S_IEXEC)
    assert engine_python(str(fake_vllm)) == sys.executable
    assert module_available(str(fake_vllm), "json") is True
    assert module_available(str(fake_vllm), "arctic_inference_not_here") is False
    env_style = tmp_path / "vllm-env"
    env_style.write_text("#!/usr/bin/env python3\n")
    env_style.chmod(0o755)
    assert engine_python(str(env_style)) is not None
    assert engine_python(str(tmp_path / "missing")) is None


def test_mtp_on_a_model_without_mtp_heads_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    (warning,) = check_experiment(_exp({"speculative": spec}), local=False)
    assert warning.level == "warning"
    assert "method 'mtp' needs a model that carries multi-token-prediction heads" in warning.message
    assert "'meta-llama/Llama-3.1-8B-Instruct' may not" in warning.message
    # A family known to ship MTP heads passes.
    assert check_experiment(_exp({"speculative": spec}, model="deepseek-ai/DeepSeek-V3"), local=False) == []
    # A local checkpoint is judged by its config.json.
    with_heads, without = tmp_path / "with", tmp_path / "without"
    with_heads.mkdir()
    without.mkdir()
    (with_heads / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 1}))
    (without / "config.json").write_text(json.dumps({"num_hidden_layers": 32}))
    assert check_experiment(_exp({"speculative": spec}, model=str(with_heads)), local=False) == []
    (warning,) = check_experiment(_exp({"speculative": spec}, model=str(without)), local=False)
    assert "its config.json has no MTP layers" in warning.message
    # So is a checkpoint in the Hugging Face cache.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = tmp_path / "hub" / "models--acme--tiny-mtp" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"text_config": {"mtp_num_hidden_layers": 1}}))
    assert check_experiment(_exp({"speculative": spec}, model="acme/tiny-mtp"), local=False) == []


def test_two_arms_on_one_gpu_without_a_memory_split() -> None:
    exp = _exp(
        {"name": "baseline", "engine": {"gpus": [0]}},
        {"name": "ngram", "speculative": {"method": "ngram"}, "engine": {"gpus": [0]}},
    )
    (error,) = check_experiment(exp, local=False)
    assert error.level == "error"
    assert str(error) == (
        "error: arms 'baseline', 'ngram' share GPU 0 without a memory split: each takes vLLM's default 0.9 "
        "of it and the second fails to start; set engine.gpu_memory_utilization = 0.45 on each of them, "
        "or give them different engine.gpus"
    )
    # Arms without engine.gpus both land on GPU 0.
    implicit = _exp({}, {"speculative": {"method": "ngram"}})
    (error,) = check_experiment(implicit, local=False)
    assert "share GPU 0 (an arm without engine.gpus uses GPUs 0…tp-1) without a memory split" in error.message
    # A split that over-commits the GPU.
    over = _exp(
        {"engine": {"gpus": [0], "gpu_memory_utilization": 0.6}},
        {"speculative": {"method": "ngram"}, "engine": {"gpus": [0], "gpu_memory_utilization": 0.6}},
    )
    (error,) = check_experiment(over, local=False)
    assert "adds up to 1.2 > 1" in error.message
    # A real split is allowed, with a warning that the arms compete for compute.
    ok = _exp(
        {"engine": {"gpus": [0], "gpu_memory_utilization": 0.45}},
        {"speculative": {"method": "ngram"}, "engine": {"gpus": [0], "gpu_memory_utilization": 0.45}},
    )
    (warning,) = check_experiment(ok, local=False)
    assert warning.level == "warning" and "compete for its compute" in warning.message
    # Simulated arms use no GPU.
    assert check_experiment(exp, engine="sim", local=False) == []


def test_tensor_parallel_needs_enough_gpus() -> None:
    exp = _exp({"engine": {"gpus": [0], "tensor_parallel_size": 2}})
    (error,) = check_experiment(exp, local=False)
    assert "tensor_parallel_size = 2 needs 2 GPUs, but engine.gpus lists 1 ([0])" in error.message
    (warning,) = check_experiment(_exp({"engine": {"gpus": [0, 1]}}), local=False)
    assert "the extra GPUs stay idle" in warning.message


def test_extra_args_may_not_fight_the_plan() -> None:
    exp = _exp({"engine": {"gpus": [0], "extra_args": ["--port=9000", "--enable-prefix-caching"]}})
    (error,) = check_experiment(exp, local=False)
    assert "engine.extra_args[0] sets --port, which the plan sets from the experiment file" in error.message


def test_ports_shared_or_taken() -> None:
    exp = _exp(
        {"url": "http://127.0.0.1:18050", "engine": {"gpus": [0]}},
        {"url": "http://127.0.0.1:18050", "engine": {"gpus": [1]}},
    )
    (error,) = check_experiment(exp, engine="sim", local=False)
    assert "port 18050 is also used by arm 'arm0'" in error.message
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        taken = _exp({"url": f"http://127.0.0.1:{port}"})
        (error,) = check_experiment(taken, engine="sim", local=True)
        assert f"port {port} is already in use on this machine" in error.message


def test_vllm_missing_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    errors = _messages(check_experiment(_exp({}), local=True), "error")
    assert any("'vllm' is not on PATH" in e and "--engine sim" in e for e in errors)


def test_synthetic_acceptance_is_flagged_as_not_lossless() -> None:
    exp = _exp({"speculative": {"method": "ngram", "synthetic_acceptance_rate": 0.7}})
    (warning,) = check_experiment(exp, engine="sim", local=False)
    assert "NOT lossless" in warning.message


def test_up_prints_every_error_and_starts_nothing(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(f"""
[experiment]
name = "bad"
model = "{MODEL}"
[[arms]]
name = "b"
role = "baseline"
url = "http://127.0.0.1:18061"
engine = {{ gpus = [0] }}
[[arms]]
name = "c"
url = "http://127.0.0.1:18062"
speculative = {{ method = "suffix" }}
engine = {{ gpus = [0] }}
""")
    env = {"PATH": "/nonexistent"}
    result = CliRunner().invoke(main, ["engines", "up", str(path)], env={**os.environ, **env})
    assert result.exit_code == 1
    assert "the experiment cannot be launched as written" in result.output
    assert "share GPU 0 without a memory split" in result.output
    assert "'vllm' is not on PATH" in result.output
    assert not (tmp_path / ".specproxy-engines").exists()
    # The file itself loads: these are launch-time problems, not file errors.
    load_experiment(path)
