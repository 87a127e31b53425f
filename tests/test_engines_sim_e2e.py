"""The README's engines flow on simulated arms, end to end: `engines up --engine sim` → /health →
requests → `serve` in shadow mode → requests through the proxy with the openai client → spans and
stacks in DuckDB → `engines down`."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import openai

from specproxy.config import load_experiment
from specproxy.engine_state import read_state
from tests.support import free_ports, serving, wait_http
from tests.support import run_cli as _cli

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
EAGLE3_HEAD = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


def test_up_sim_serve_requests_down(tmp_path: Path) -> None:
    ports = free_ports(3)
    path = tmp_path / "exp.toml"
    path.write_text(f"""
[experiment]
name = "sim-e2e"
mode = "shadow"
db = "spans.duckdb"
model = "{MODEL}"

[[arms]]
name = "baseline"
role = "baseline"
url = "http://127.0.0.1:{ports[0]}"

[[arms]]
name = "ngram"
url = "http://127.0.0.1:{ports[1]}"
speculative = {{ method = "ngram", num_speculative_tokens = 4, prompt_lookup_min = 2, prompt_lookup_max = 5 }}

[[arms]]
name = "eagle3"
url = "http://127.0.0.1:{ports[2]}"
speculative = {{ method = "eagle3", model = "{EAGLE3_HEAD}", num_speculative_tokens = 3 }}
""")
    try:
        up = _cli(
            "engines", "up", str(path), "--engine", "sim", "--sim-time-scale", "20", "--health-timeout", "60"
        )
        assert up.returncode == 0, up.stderr
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/health")  # engines up waited for it already

        # Each arm answers as vLLM would, with per-request speculation stats on the candidates.
        with openai.OpenAI(base_url=f"http://127.0.0.1:{ports[2]}/v1", api_key="none") as direct:
            reply = direct.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Name three rivers."}],
                max_tokens=16,
                temperature=0,
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 16
            spec = (reply.model_extra or {})["metrics"]["speculative_decoding"]
            assert spec["num_draft_tokens"] > 0 and spec["mean_acceptance_length"] >= 1

        status = _cli("engines", "status", str(path), "--json")
        assert status.returncode == 0
        assert [a["arm"] for a in json.loads(status.stdout)["arms"]] == ["baseline", "ngram", "eagle3"]

        with serving(path, "--db", str(tmp_path / "spans.duckdb")) as proxy:
            with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none") as client:
                for i in range(4):
                    stream = client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"Summarise request number {i}."}],
                        max_tokens=24,
                        temperature=0,
                        stream=True,
                    )
                    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                    assert text
        assert "spans written" in proxy.output, proxy.output

        db = duckdb.connect(str(tmp_path / "spans.duckdb"), read_only=True)
        try:
            rows = db.execute(
                "SELECT arm, count(*), count(*) FILTER (WHERE status = 'ok') FROM requests "
                "GROUP BY arm ORDER BY arm"
            ).fetchall()
            assert rows == [("baseline", 4, 4), ("eagle3", 4, 4), ("ngram", 4, 4)]
            stacks = json.loads(db.execute("SELECT stacks_json FROM runs").fetchall()[0][0])
        finally:
            db.close()
        # The stacks `engines up` captured reach the run record through the state file.
        engine_stack = stacks["eagle3"]["engine"]
        assert engine_stack["engine"] == "sim" and engine_stack["server_version"] == "0.33.0"
        assert "--speculative-config" in engine_stack["argv"]
    finally:
        down = _cli("engines", "down", str(path))
    assert down.returncode == 0 and down.stdout.count("stopped") == 3, down.stdout
    assert read_state(load_experiment(path)) is None
