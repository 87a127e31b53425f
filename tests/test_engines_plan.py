"""`specproxy engines plan`: the launch command of every arm, for every speculative method, and the
compose / Kubernetes renders of the same plan."""

from __future__ import annotations

import dataclasses
import json
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from specproxy.cli import main
from specproxy.config import SPEC_METHODS, EngineSettings, load_experiment, parse_experiment
from specproxy.engines.launch.plan import PlanError, SimOptions, plan_experiment
from specproxy.engines.launch.render import experiment_toml, in_cluster_experiment, service_name

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# One realistic --speculative-config per vLLM 0.33 method.
METHOD_CONFIGS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "ngram_gpu": {"method": "ngram_gpu", "num_speculative_tokens": 4},
    "draft_model": {
        "method": "draft_model",
        "model": "meta-llama/Llama-3.2-1B-Instruct",
        "num_speculative_tokens": 5,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 24},
    "eagle": {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 5},
    "eagle3": {
        "method": "eagle3",
        "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "num_speculative_tokens": 3,
    },
    "mtp": {"method": "mtp", "num_speculative_tokens": 1},
    "dflash": {"method": "dflash", "model": "z-lab/dflash-draft", "num_speculative_tokens": 8},
    "dspark": {"method": "dspark", "num_speculative_tokens": 4},
    "custom_class": {"method": "custom_class", "num_speculative_tokens": 2},
    "extract_hidden_states": {"method": "extract_hidden_states", "num_speculative_tokens": 1},
}


def test_every_vllm_method_has_a_plan_case() -> None:
    assert set(METHOD_CONFIGS) == set(SPEC_METHODS)


def _write(tmp_path: Path, body: str, name: str = "exp.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def _toml_inline(d: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + " }"


def _exp_with(tmp_path: Path, spec: dict[str, Any], engine: str = "") -> Path:
    return _write(
        tmp_path,
        f"""
[experiment]
name = "m"
model = "{MODEL}"

[[arms]]
name = "baseline"
role = "baseline"
url = "http://127.0.0.1:8001"
engine = {{ gpus = [0] }}

[[arms]]
name = "cand"
url = "http://127.0.0.1:8002"
speculative = {_toml_inline(spec)}
engine = {{ gpus = [1] {engine} }}
""",
    )


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _commands(shell: str) -> dict[str, list[str]]:
    """arm -> argv parsed back out of the rendered script (env prefix included as VAR=x words)."""
    out: dict[str, list[str]] = {}
    arm = None
    for block in shell.replace("\\\n", " ").splitlines():
        if block.startswith("# ") and " -> " in block:
            arm = block[2:].split(" -> ")[0]
        elif arm and block.rstrip().endswith("&"):
            out[arm] = shlex.split(block.rstrip()[:-1])
            arm = None
    return out


@pytest.mark.parametrize("method", sorted(METHOD_CONFIGS))
def test_plan_passes_the_speculative_config_verbatim(tmp_path: Path, method: str) -> None:
    spec = METHOD_CONFIGS[method]
    path = _exp_with(tmp_path, spec)
    result = _run("engines", "plan", str(path))
    assert result.exit_code == 0, result.output
    cmds = _commands(result.stdout)
    base, cand = cmds["baseline"], cmds["cand"]
    assert base[:4] == ["CUDA_VISIBLE_DEVICES=0", "vllm", "serve", MODEL]
    assert "--speculative-config" not in base and "--per-request-spec-decode-metrics" not in base
    assert cand[:4] == ["CUDA_VISIBLE_DEVICES=1", "vllm", "serve", MODEL]
    assert json.loads(cand[cand.index("--speculative-config") + 1]) == spec
    assert cand[cand.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert cand[cand.index("--port") + 1] == "8002"
    assert cand[cand.index("--served-model-name") + 1] == MODEL
    # Every shell line is runnable: the script parses as bash-compatible words.
    assert result.stdout.startswith("#!/usr/bin/env bash") and result.stdout.rstrip().endswith("wait")


def test_plan_carries_engine_settings(tmp_path: Path) -> None:
    path = _exp_with(
        tmp_path,
        METHOD_CONFIGS["eagle3"],
        engine=", tensor_parallel_size = 1, max_num_seqs = 64, gpu_memory_utilization = 0.85, "
        'max_model_len = 8192, extra_args = ["--enable-prefix-caching"], port = 9002, '
        'env = { VLLM_LOGGING_LEVEL = "DEBUG" }',
    )
    exp = load_experiment(path)
    launch = plan_experiment(exp)[1]
    assert launch.port == 9002 and launch.health_url == "http://127.0.0.1:9002/health"
    assert dict(launch.env) == {"CUDA_VISIBLE_DEVICES": "1", "VLLM_LOGGING_LEVEL": "DEBUG"}
    argv = list(launch.argv)
    assert argv[argv.index("--port") + 1] == "9002"
    assert argv[argv.index("--max-num-seqs") + 1] == "64"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.85"
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    assert argv[-1] == "--enable-prefix-caching"
    assert "--tensor-parallel-size" not in argv  # tp = 1 is vLLM's default
    assert launch.shell_line().startswith("CUDA_VISIBLE_DEVICES=1 VLLM_LOGGING_LEVEL=DEBUG vllm serve ")


def test_tensor_parallel_arm(tmp_path: Path) -> None:
    exp = parse_experiment(
        {
            "experiment": {"model": MODEL},
            "arms": [
                {
                    "name": "b",
                    "role": "baseline",
                    "url": "http://127.0.0.1:8001",
                    "engine": {"gpus": [2, 3], "tensor_parallel_size": 2},
                }
            ],
        }
    )
    launch = plan_experiment(exp)[0]
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert launch.argv[launch.argv.index("--tensor-parallel-size") + 1] == "2"


def test_sim_plan_uses_the_same_model_port_and_config(tmp_path: Path) -> None:
    exp = load_experiment(_exp_with(tmp_path, METHOD_CONFIGS["ngram"]))
    sim = plan_experiment(exp, engine="sim", sim=SimOptions(profile="h100", time_scale=0.5, seed=7))[1]
    argv = list(sim.argv)
    assert argv[1:4] == ["-m", "specproxy", "sim"]
    assert argv[argv.index("--port") + 1] == "8002"
    assert argv[argv.index("--model") + 1] == MODEL
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == METHOD_CONFIGS["ngram"]
    assert argv[argv.index("--profile") + 1] == "h100"
    assert argv[argv.index("--time-scale") + 1] == "0.5"
    assert argv[argv.index("--seed") + 1] == "7"
    assert "CUDA_VISIBLE_DEVICES" not in sim.env


def test_a_replica_is_planned_as_a_plain_copy_of_the_baseline(tmp_path: Path) -> None:
    path = _exp_with(tmp_path, METHOD_CONFIGS["eagle3"])
    path.write_text(
        path.read_text()
        + '\n[[arms]]\nname = "baseline-2"\nrole = "replica"\nurl = "http://127.0.0.1:8003"\n'
        "engine = { gpus = [2] }\n"
    )
    result = _run("engines", "plan", str(path))
    assert result.exit_code == 0, result.output
    cmds = _commands(result.stdout)
    base, replica = cmds["baseline"], cmds["baseline-2"]
    assert replica[:4] == ["CUDA_VISIBLE_DEVICES=2", "vllm", "serve", MODEL]
    assert replica[replica.index("--port") + 1] == "8003"
    # the same command as the baseline's but for the GPU and the port
    assert [w for w in replica if w not in ("CUDA_VISIBLE_DEVICES=2", "8003")] == [
        w for w in base if w not in ("CUDA_VISIBLE_DEVICES=0", "8001")
    ]
    sim = plan_experiment(load_experiment(path), engine="sim", sim=SimOptions(profile="h100"))[2]
    assert "--speculative-config" not in sim.argv and sim.port == 8003


def test_plan_without_model_or_port_is_a_sentence(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
[[arms]]
name = "baseline"
role = "baseline"
url = "http://127.0.0.1:8001"
""",
    )
    result = _run("engines", "plan", str(path))
    assert result.exit_code == 1
    assert "experiment.model is not set" in result.output
    assert "Traceback" not in result.output

    exp = parse_experiment(
        {"experiment": {"model": MODEL}, "arms": [{"name": "b", "role": "baseline", "url": "http://gpu-box"}]}
    )
    with pytest.raises(PlanError, match="names no port"):
        plan_experiment(exp)


def test_plan_of_a_missing_file_is_a_sentence(tmp_path: Path) -> None:
    result = _run("engines", "plan", str(tmp_path / "nope.toml"))
    assert result.exit_code == 1
    assert "cannot read the experiment file" in result.output


def test_plan_only_some_arms(tmp_path: Path) -> None:
    path = _exp_with(tmp_path, METHOD_CONFIGS["mtp"])
    result = _run("engines", "plan", str(path), "--arm", "baseline")
    assert result.exit_code == 0
    assert list(_commands(result.stdout)) == ["baseline"]
    result = _run("engines", "plan", str(path), "--arm", "nope")
    assert result.exit_code == 1 and "no arm named 'nope'" in result.output


def test_compose_render_is_the_plan_in_containers(tmp_path: Path) -> None:
    path = _exp_with(tmp_path, METHOD_CONFIGS["eagle3"])
    result = _run("engines", "plan", str(path), "--format", "compose")
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load(result.stdout)
    cand = doc["services"]["arm-cand"]
    assert cand["image"].startswith("vllm/vllm-openai:")
    assert cand["entrypoint"] == ["vllm", "serve"]
    assert cand["command"][0] == MODEL
    assert cand["command"][cand["command"].index("--host") + 1] == "0.0.0.0"
    spec_json = cand["command"][cand["command"].index("--speculative-config") + 1]
    assert json.loads(spec_json) == METHOD_CONFIGS["eagle3"]
    device = cand["deploy"]["resources"]["reservations"]["devices"][0]
    assert device == {"driver": "nvidia", "capabilities": ["gpu"], "device_ids": ["1"]}
    proxy = doc["services"]["specproxy"]
    assert set(proxy["depends_on"]) == {"arm-baseline", "arm-cand"}
    # The inlined experiment points each arm at its service and reads back to the same arms.
    inner = parse_experiment(tomllib.loads(doc["configs"]["experiment"]["content"]))
    assert [a.url for a in inner.arms] == ["http://arm-baseline:8001", "http://arm-cand:8002"]
    assert dict(inner.arm("cand").speculative) == METHOD_CONFIGS["eagle3"]
    assert inner.mode == "shadow" and inner.baseline.name == "baseline"


def test_k8s_render(tmp_path: Path) -> None:
    path = _exp_with(tmp_path, METHOD_CONFIGS["ngram"])
    result = _run("engines", "plan", str(path), "--format", "k8s", "--namespace", "spec")
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert ("Deployment", "arm-cand") in kinds and ("Service", "arm-cand") in kinds
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"} <= {k for k, _ in kinds}
    assert all(d["metadata"]["namespace"] == "spec" for d in docs)
    arm = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "arm-cand")
    container = arm["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["command"] == ["vllm", "serve"]


def test_k8s_render_refuses_sim(tmp_path: Path) -> None:
    result = _run("engines", "plan", str(_exp_with(tmp_path, {})), "--format", "k8s", "--engine", "sim")
    assert result.exit_code == 1 and "simulated arms need no cluster" in result.output


def test_plan_writes_to_a_file(tmp_path: Path) -> None:
    out = tmp_path / "arms.sh"
    result = _run("engines", "plan", str(_exp_with(tmp_path, METHOD_CONFIGS["ngram"])), "-o", str(out))
    assert result.exit_code == 0
    assert "vllm serve" in out.read_text()


def test_experiment_toml_round_trips(tmp_path: Path) -> None:
    exp = load_experiment(_exp_with(tmp_path, METHOD_CONFIGS["draft_model"]))
    again = parse_experiment(tomllib.loads(experiment_toml(exp)))
    # The engine tables are for `up`, not the proxy, and are left out.
    assert again.arms == tuple(dataclasses.replace(a, engine=EngineSettings()) for a in exp.arms)
    assert (again.name, again.mode, again.model) == (exp.name, exp.mode, exp.model)
    inner = in_cluster_experiment(exp)
    assert inner.db == "/data/specproxy.duckdb" and inner.source_path is None


@pytest.mark.parametrize(("arm", "service"), [("baseline", "arm-baseline"), ("Eagle_3.v2", "arm-eagle-3-v2")])
def test_service_names_are_dns_labels(arm: str, service: str) -> None:
    assert service_name(arm) == service


def test_readme_shows_the_real_plan_of_the_deploy_experiment() -> None:
    root = Path(__file__).resolve().parent.parent
    readme = root / "engines" / "README.md"
    section = readme.read_text().split("<!-- section: engines -->")[1].split("<!-- /section: engines -->")[0]
    result = _run("engines", "plan", str(root / "deploy" / "experiment.toml"))
    assert result.exit_code == 0 and result.stderr == ""
    assert f"```bash\n{result.stdout}```" in section
    for command in ("up", "status", "down"):
        assert f"specproxy engines {command} deploy/experiment.toml" in section
