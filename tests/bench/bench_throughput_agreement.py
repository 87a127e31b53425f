"""Benchmark: `agg tok/s` against the output token throughput AIPerf and GuideLLM measure on the same calls.

    python tests/bench/bench_throughput_agreement.py --tools /tmp/benchtools [--concurrency 8,32]
        [--requests 256] [--output-tokens 128] [--pause 15] [--work DIR]

One `specproxy sim` behind `specproxy serve` (split mode, the baseline alone), a fresh span store per
client run. Each client drives it at each concurrency with fixed-length outputs (``ignore_eos``;
output counts from the responses' usage): AIPerf (``aiperf profile``), GuideLLM (``guidellm run``) and
`specproxy replay --target` through the same serve. Then `specproxy analyze` on serve's store gives the
level's `agg tok/s`, set beside the client's own figure (AIPerf's and GuideLLM's output token
throughput; replay's: `agg tok/s` of the spans it wrote itself, timed on the client's side of the
socket) and an independent one: the store's tokens over first start to last end, by plain SQL (a
single uninterrupted run, where the two must agree). Last, two AIPerf runs ``--pause`` seconds apart
in one store: `agg tok/s` against AIPerf's Σ tokens / Σ benchmark durations, and what first start to
last end (the definition before) made of it. Exits 1 if a figure is off by more than 5 %.

AIPerf and GuideLLM are not the project's dependencies: install them in a venv of their own
(``python -m venv /tmp/benchtools && /tmp/benchtools/bin/pip install aiperf guidellm``) and pass its
folder as ``--tools``. Neither may reach the network here, so the tokenizer they need for synthetic
prompts is a byte-level BPE trained on the spot from that venv's own Python sources (``tokenizers``,
which both install) and saved as a Hugging Face tokenizer folder; output counts come from the server's
usage, so its vocabulary does not touch the figures compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import free_port, wait_http

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT_TOKENS = 64
TOLERANCE = 0.05
WIDTHS = (9, 4, 7, 8, 14, 11, 8, 12)

MAKE_TOKENIZER = """
import sys
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
texts = [p.read_text(errors="ignore") for p in sorted(Path(sys.prefix, "lib").rglob("*.py"))[:400]]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
alphabet = pre_tokenizers.ByteLevel.alphabet()
trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
tok.train_from_iterator(texts, trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
fast.save_pretrained(sys.argv[1])
"""


@dataclass(frozen=True)
class Measured:
    client: str
    concurrency: int
    requests: int
    tokens: int
    client_tok_s: float
    agg_tok_s: float
    span_tok_s: float  # the store's tokens over first start to last end (plain SQL)

    @property
    def off(self) -> float:
        return self.agg_tok_s / self.client_tok_s - 1.0


def _specproxy(*args: str) -> list[str]:
    return [sys.executable, "-m", "specproxy", *args]


@contextmanager
def process(argv: list[str], log: Path, health: str) -> Iterator[subprocess.Popen[bytes]]:
    """A child process writing to ``log``, ready when ``health`` answers; stopped with SIGTERM after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_http(health, proc=proc)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def serve(sim_url: str, work: Path, name: str) -> Iterator[tuple[str, Path]]:
    """`specproxy serve` in split mode in front of the simulator, its spans in a store of their own."""
    db = work / f"{name}.duckdb"
    config = work / f"{name}.toml"
    config.write_text(
        f'[experiment]\nname = "{name}"\nmode = "split"\ndb = "{db}"\n\n'
        f'[[arms]]\nname = "baseline"\nrole = "baseline"\nurl = "{sim_url}"\n'
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = _specproxy("serve", "--config", str(config), "--port", str(port))
    with process(argv, work / f"{name}.serve.log", f"{url}/health"):
        yield url, db


def run_aiperf(
    tools: Path, url: str, tokenizer: Path, c: int, n: int, osl: int, out: Path
) -> tuple[float, int]:
    """(AIPerf's output token throughput, its output tokens)."""
    argv = [str(tools / "bin" / "aiperf"), "profile", "--model", MODEL, "--tokenizer", str(tokenizer)]
    argv += ["--url", url, "--endpoint-type", "chat", "--streaming", "--concurrency", str(c)]
    argv += ["--request-count", str(n), "--prompt-input-tokens-mean", str(PROMPT_TOKENS)]
    argv += ["--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(osl)]
    argv += ["--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true"]
    argv += ["--use-server-token-count", "--ui-type", "none"]
    argv += ["--random-seed", "1", "--output-artifact-dir", str(out)]
    _run(argv, out.with_suffix(".log"))
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    return float(doc["output_token_throughput"]["avg"]), int(doc["output_token_count"]["sum"])


def run_guidellm(
    tools: Path, url: str, tokenizer: Path, c: int, n: int, osl: int, out: Path
) -> tuple[float, int]:
    """(GuideLLM's output tokens per second, its output tokens)."""
    spec = {
        "backend": {
            "kind": "openai_http",
            "target": url,
            "model": MODEL,
            "request_format": "/v1/chat/completions",
        },
        "profile": {"kind": "concurrent", "streams": [c]},
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": osl}],
        "constraints": [{"kind": "max_requests", "count": n}],
    }
    scenario = out.with_suffix(".scenario.json")
    scenario.write_text(json.dumps({"spec": spec}))
    report = out.with_suffix(".json")
    argv = [str(tools / "bin" / "guidellm"), "run", "--scenario", str(scenario)]
    argv += ["--output", f"kind=json,path={report}", "--disable-console-interactive"]
    _run(argv, out.with_suffix(".log"))
    (bench,) = json.loads(report.read_text())["benchmarks"]
    tokens = bench["metrics"]["output_token_count"]["successful"]
    return float(bench["metrics"]["output_tokens_per_second"]["successful"]["mean"]), int(tokens["total_sum"])


def run_replay(url: str, work: Path, c: int, n: int, osl: int, name: str) -> tuple[float, int]:
    """(`agg tok/s` of replay's own spans, their tokens): spec-bench questions, each answered to ``osl``."""
    log = work / "questions.jsonl"
    log.write_text(
        "".join(json.dumps({"question_id": i, "turns": [f"question {i}: say more"]}) + "\n" for i in range(n))
    )
    db = work / f"{name}.client.duckdb"
    argv = _specproxy("replay", str(log), "--target", url, "--db", str(db), "--no-progress")
    argv += ["--concurrency", str(c), "--rounds", "1", "--warmup", "0", "--max-tokens", str(osl)]
    _run(argv, work / f"{name}.replay.log")
    row = _level_row(db)
    return float(row["agg_tok_s"]), int(row["completion_tokens"])


def _run(argv: list[str], log: Path) -> None:
    with log.open("wb") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{Path(argv[0]).name} {argv[1]} failed (exit {rc}); the end of {log}:\n{tail}")


def _level_row(db: Path) -> dict[str, Any]:
    out = subprocess.run(_specproxy("analyze", str(db), "--format", "json"), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"analyze {db} failed: {out.stderr}")
    (run,) = json.loads(out.stdout)["runs"]
    (row,) = [r for r in run["rows"] if r["role"] == "baseline"]
    return dict(row)


def span_tok_s(db: Path) -> float:
    """Tokens over first start to last end of the store's sent calls, apart from the analysis' SQL."""
    sql = (
        "SELECT sum(completion_tokens) FILTER (WHERE status = 'ok') / "
        "(max(t_start_ns / 1e9 + e2e_s) - min(t_start_ns / 1e9)) FROM requests WHERE status <> 'dropped'"
    )
    out = subprocess.run(_specproxy("sql", str(db), sql, "--format", "csv"), capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, sim_url: str, tokenizer: Path, client: str, c: int) -> Measured:
    name = f"{client}-c{c}"
    out = args.work / name
    with serve(sim_url, args.work, name) as (url, db):
        if client == "aiperf":
            client_tok_s, tokens = run_aiperf(
                args.tools, url, tokenizer, c, args.requests, args.output_tokens, out
            )
        elif client == "guidellm":
            client_tok_s, tokens = run_guidellm(
                args.tools, url, tokenizer, c, args.requests, args.output_tokens, out
            )
        else:
            client_tok_s, tokens = run_replay(url, args.work, c, args.requests, args.output_tokens, name)
    row = _level_row(db)
    agg = float(row["agg_tok_s"])
    return Measured(client, c, int(row["ok"]), tokens, client_tok_s, agg, span_tok_s(db))


def two_visits(args: argparse.Namespace, sim_url: str, tokenizer: Path, c: int) -> tuple[float, float, float]:
    """Two AIPerf runs ``--pause`` s apart in one store: (AIPerf's Σ tokens / Σ durations, agg tok/s,
    the same store's tokens over first start to last end)."""
    tokens = duration = 0.0
    with serve(sim_url, args.work, "two-visits") as (url, db):
        for i in (1, 2):
            rate, n = run_aiperf(
                args.tools, url, tokenizer, c, args.requests, args.output_tokens, args.work / f"visit{i}"
            )
            tokens, duration = tokens + n, duration + n / rate
            if i == 1:
                time.sleep(args.pause)  # idle time with nothing in flight, as between two benchmark runs
    return tokens / duration, float(_level_row(db)["agg_tok_s"]), span_tok_s(db)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tools", type=Path, required=True, help="venv holding aiperf and guidellm")
    parser.add_argument("--concurrency", default="8", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--pause", type=float, default=15.0, help="idle seconds between the two visits")
    parser.add_argument("--time-scale", default="1")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    args.work = args.work or Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    args.work.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.concurrency.split(",")]
    print(f"load average before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; work in {args.work}")
    tokenizer = args.work / "tokenizer"
    subprocess.run([str(args.tools / "bin" / "python"), "-c", MAKE_TOKENIZER, str(tokenizer)], check=True)
    port = free_port()
    sim_url = f"http://127.0.0.1:{port}"
    sim = _specproxy("sim", "--port", str(port), "--time-scale", args.time_scale)
    rows: list[Measured] = []
    with process(sim, args.work / "sim.log", f"{sim_url}/health"):
        for c in levels:
            for client in ("aiperf", "guidellm", "replay"):
                rows.append(measure(args, sim_url, tokenizer, client, c))
                print(f"  {client} c={c} done; load {os.getloadavg()[0]:.2f}", flush=True)
        visits = two_visits(args, sim_url, tokenizer, levels[0])
    head = ("client", "c", "calls", "tokens", "client tok/s", "agg tok/s", "off", "span tok/s")
    print(
        "\n"
        + "".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, WIDTHS, strict=True)))
    )
    worst = 0.0
    for m in rows:
        worst = max(worst, abs(m.off), abs(m.span_tok_s / m.client_tok_s - 1))
        print(
            f"{m.client:<9}{m.concurrency:>4}{m.requests:>7}{m.tokens:>8}{m.client_tok_s:>14.1f}"
            f"{m.agg_tok_s:>11.1f}{m.off:>+8.2%}{m.span_tok_s:>12.1f}"
        )
    aiperf_rate, agg, span = visits
    worst = max(worst, abs(agg / aiperf_rate - 1))
    print(
        f"\ntwo AIPerf runs {args.pause:g} s apart, one store: AIPerf Σ tokens / Σ durations "
        f"{aiperf_rate:.1f}, "
        f"agg tok/s {agg:.1f} ({agg / aiperf_rate - 1:+.2%}); first start to last end {span:.1f} "
        f"({span / aiperf_rate - 1:+.2%})"
    )
    print(f"load average after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    ok = worst <= TOLERANCE
    print(
        f"TARGET agg tok/s within {TOLERANCE:.0%} of every client: {'met' if ok else 'MISSED'} "
        f"(worst {worst:.2%})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
