"""The experiment file loads into frozen config; every mistake names the file, the arm and the field."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from specproxy.config import ConfigError, experiment_json, load_experiment
from tests import processes

GOOD = """
[experiment]
name = "llama8b-spec"
mode = "shadow"
db = "spans.duckdb"
model = "meta-llama/Llama-3.1-8B-Instruct"

[[arms]]
name = "baseline"
role = "baseline"
url = "http://127.0.0.1:8001/"
speculative = {}

[[arms]]
name = "eagle3"
url = "http://127.0.0.1:8002"
speculative = { method = "eagle3", model = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", num_speculative_tokens = 3 }

[[arms]]
name = "ngram"
url = "http://127.0.0.1:8003"
sample = 0.5
speculative = { method = "ngram", num_speculative_tokens = 4, prompt_lookup_min = 2, prompt_lookup_max = 5 }
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.toml"
    p.write_text(text)
    return p


def test_good_file_loads_typed_and_frozen(tmp_path: Path) -> None:
    exp = load_experiment(write(tmp_path, GOOD))
    assert exp.name == "llama8b-spec" and exp.mode == "shadow" and exp.db == "spans.duckdb"
    assert exp.baseline.name == "baseline" and exp.baseline.url == "http://127.0.0.1:8001"
    assert [a.name for a in exp.candidates] == ["eagle3", "ngram"]
    assert exp.arm("eagle3").spec_method == "eagle3" and exp.arm("eagle3").num_speculative_tokens == 3
    assert exp.baseline.spec_method == "none" and exp.baseline.num_speculative_tokens is None
    assert exp.arm("ngram").sample == 0.5
    assert exp.baseline.replicas_behind_url == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        exp.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        exp.arm("ngram").speculative["method"] = "eagle"  # type: ignore[index]


@pytest.mark.parametrize(
    ("replace", "by", "message"),
    [
        (
            "num_speculative_tokens = 4",
            "num_speculative_tokens = 0",
            "arms[2].speculative.num_speculative_tokens: must be ≥ 1",
        ),
        (
            "prompt_lookup_min = 2",
            "prompt_lookup_min = 7",
            "arms[2].speculative.prompt_lookup_min: must be ≤",
        ),
        (
            'method = "eagle3"',
            'method = "medusa"',
            "arms[1].speculative.method: 'medusa' was removed in vLLM 0.33",
        ),
        ('method = "eagle3"', 'method = "magic"', "arms[1].speculative.method: unknown method 'magic'"),
        ('mode = "shadow"', 'mode = "mirror"', "experiment.mode: must be 'shadow' or 'split'"),
        ('url = "http://127.0.0.1:8002"', 'url = "127.0.0.1:8002"', "arms[1].url: must start with http://"),
        ("sample = 0.5", "sample = 2", "arms[2].sample: must be between 0 and 1"),
        ("sample = 0.5", "sampel = 0.5", "arms[2].sampel: unknown field"),
        ('role = "baseline"', 'role = "candidate"', 'exactly one arm must have role = "baseline"'),
        ('name = "ngram"', 'name = "eagle3"', "arms[2].name: duplicate arm name 'eagle3'"),
        ("sample = 0.5", "sample = true", "arms[2].sample: must be a number"),
        ("sample = 0.5", "replicas_behind_url = 0", "arms[2].replicas_behind_url: must be ≥ 1"),
        ("sample = 0.5", "replicas_behind_url = 1.5", "arms[2].replicas_behind_url: must be an integer"),
        (
            'role = "baseline"',
            'role = "shadow"',
            "arms[0].role: must be 'baseline', 'candidate' or 'replica'",
        ),
        (
            'name = "eagle3"',
            'name = "eagle3"\nrole = "replica"',
            "arms[1].speculative: a replica is a plain copy of the baseline",
        ),
        (
            'mode = "shadow"',
            'mode = "shadow"\nat_concurrency = 0',
            "experiment.at_concurrency: must be a concurrency ≥ 1",
        ),
        (
            'mode = "shadow"',
            'mode = "shadow"\nat_concurrency = "8"',
            "experiment.at_concurrency: must be an integer",
        ),
        (
            'mode = "shadow"',
            'mode = "shadow"\nat_concurrency = 32\npeak_concurrency = 8',
            "experiment.peak_concurrency: must be ≥ at_concurrency",
        ),
    ],
)
def test_mistakes_name_file_arm_and_field(tmp_path: Path, replace: str, by: str, message: str) -> None:
    assert replace in GOOD
    path = write(tmp_path, GOOD.replace(replace, by, 1))
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_replica_arms_and_the_operating_point(tmp_path: Path) -> None:
    text = GOOD.replace('mode = "shadow"', 'mode = "shadow"\nat_concurrency = 8\npeak_concurrency = 64')
    text += '\n[[arms]]\nname = "baseline-2"\nrole = "replica"\nurl = "http://127.0.0.1:8004"\n'
    exp = load_experiment(write(tmp_path, text))
    assert (exp.at_concurrency, exp.peak_concurrency) == (8, 64)
    assert [a.name for a in exp.replicas] == ["baseline-2"]
    replica = exp.arm("baseline-2")
    assert replica.role == "replica" and replica.spec_method == "none"
    assert [a.name for a in exp.candidates] == ["eagle3", "ngram", "baseline-2"]
    # the operating point travels with the run (runs.config_json)
    assert '"at_concurrency": 8' in experiment_json(exp) and '"peak_concurrency": 64' in experiment_json(exp)
    plain = load_experiment(write(tmp_path, GOOD))
    assert plain.replicas == () and plain.at_concurrency is None and plain.peak_concurrency is None


def test_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the experiment file"):
        load_experiment(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_experiment(write(tmp_path, "[experiment\nname="))


# Run as a light install would, without the tokenizers package (a None in sys.modules makes both
# ``import tokenizers`` and ``importlib.util.find_spec("tokenizers")`` say it is not there).
_WITHOUT_TOKENIZERS = """
import sys
sys.modules["tokenizers"] = None
from specproxy.cli import main
from specproxy.proxy.upstream.tokens import load_tokenizer
try:
    load_tokenizer(sys.argv[2])
except ValueError as exc:
    print(exc)
main(["serve", "--config", sys.argv[1], "--port", "0"])
"""


def test_a_tokenizer_json_without_the_tokenizers_extra_is_one_sentence(tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    cfg = write(
        tmp_path, GOOD.replace("speculative = {}\n", 'speculative = {}\ntokenizer = "tokenizer.json"\n')
    )
    done = processes.run([sys.executable, "-c", _WITHOUT_TOKENIZERS, str(cfg), str(tok)])
    assert done.returncode == 1, done.stdout + done.stderr
    # the config names the arm, the field and the extra, before serve starts anything
    assert (
        f"{cfg}: arms[0].tokenizer: 'tokenizer.json' is a tokenizer.json: reading it needs the tokenizers "
        "package, which the light install leaves out (pip install 'specproxy[tokenizers]')"
    ) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    # and a tokenizer loaded past the config says the same extra
    assert f"reading {tok}'s tokenizer needs tokenizers (specproxy[tokenizers])" in done.stdout
