"""Per-request ITL and TPOT as replay (the proxy's measuring code) records them, against the simulator's
own step timeline, beside what the validity gate says about each level's tails.

    .venv/bin/python tests/bench/bench_latency.py [--levels 1,4,16,64] [--time-scale 0.25]
                                                  [--slow 64:0.0625]

One `specproxy sim` (EAGLE3, k = 3) with two arms on it in split mode: `plain` (no speculative config:
the final usage only, tokens per chunk unknown) and `eagle3` (vLLM's continuous usage: tokens per chunk
exact). Each level runs as one `specproxy replay` (closed loop, ``--requests-per-level`` x c streaming
chat calls, at least 16, after replay's unrecorded warm-up) at the simulator's ``--time-scale``;
``--slow L:S`` (repeatable; ``L`` may be a list, ``16,64:0.0625``) measures level L again at time
scale S (the sim's ``POST /sim/time_scale`` first). Replay measures each call with the proxy's own
code (``call_arm``) and records each round's
health: its event loop's lag P99 and the simulator's clock lag and write delay P99 (``/sim/stats``).
`specproxy analyze --format json` on the store then gives, per arm and level, the gate's verdict on
the level (``reliable``) and its timing resolution (loop lag P99 + write delay P99), with whether it
resolves the pooled ITL P95, P99 and largest stall (the noise at most 2 % of each). Each span is
joined with the simulator's truth for its request (``/sim/requests?timeline=1``): when each engine
step that gave the request tokens landed, and how many it gave.

Per request and level it compares, as relative errors measured / truth - 1:
- TPOT: the span's ``tpot_s`` vs (last step - first step) / (completion_tokens - 1);
- ITL: the per-call mean gap, ``itl_p50_s``, ``itl_p95_s``, ``itl_p99_s``, ``itl_max_s`` vs the same
  statistics (same percentile method) of the gaps between the request's steps.
It prints the median and 90th percentile of |error|, the share of requests within 2 % (the target), how
many streams arrived with one chunk per step (a client that reads two steps at once sees one chunk: a
gap of 0 and a doubled one, a true difference in what was delivered, not a timing error) and the load
average. The error against the steps has two parts, printed apart: the client's measurement (its
figures vs the same figures from when the simulator handed each chunk to its socket, the timeline's
``sent_s``) and the simulator's own delivery (sent vs the steps). Then, gap by gap, the differences
measured - sent and sent - step in milliseconds: a per-request P99 or largest gap is one gap, and
carries its noise whole. The last line: at the levels whose tails the gate calls resolved, the smallest
share of requests within 2 % per figure. ``--save FILE`` writes the joined spans and truths as JSON.

``--time-scale`` < 1 slows the simulated engine (its steps take longer in real time) so that a busy
machine's scheduling jitter, a fraction of a millisecond, is small beside a step; the gate's timing
resolution says when it is small enough.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import duckdb

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from specproxy.proxy.upstream.calls import upstream_request_id  # noqa: E402
from specproxy.proxy.upstream.latency import quantile  # noqa: E402
from tests.support import free_port, start_cli, stop, wait_http  # noqa: E402

EAGLE3 = {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}
QUESTIONS = (
    "Explain how a cache works and when it is a bad idea to use one.",
    "Write a short story about a team that updates a city energy plan.",
    "Help me plan a three day trip to a country with mountains and lakes.",
    "What are the main differences between a market economy and a planned one?",
)
TARGET = 0.02
METRICS = ("tpot", "itl mean", "itl p50", "itl p95", "itl p99", "itl max")


def write_config(path: Path, sim_url: str) -> Path:
    spec = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in EAGLE3.items()) + " }"
    path.write_text(
        '[experiment]\nname = "bench-latency"\nmode = "split"\n\n'
        f'[[arms]]\nname = "plain"\nrole = "baseline"\nurl = "{sim_url}"\nweight = 1\n\n'
        f'[[arms]]\nname = "eagle3"\nurl = "{sim_url}"\nweight = 1\nspeculative = {spec}\n'
    )
    return path


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def timeline_figures(times: list[float], completion_tokens: int) -> dict[str, float] | None:
    """ITL and TPOT figures from one request's times (the steps' landings, or the chunks' sending)."""
    if len(times) < 2 or completion_tokens < 2:
        return None
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return {
        "tpot": (times[-1] - times[0]) / (completion_tokens - 1),
        "itl mean": (times[-1] - times[0]) / len(gaps),
        "itl p50": quantile(gaps, 0.5),
        "itl p95": quantile(gaps, 0.95),
        "itl p99": quantile(gaps, 0.99),
        "itl max": gaps[-1],
    }


def truth_figures(truth: dict[str, Any]) -> dict[str, float] | None:
    """The request's ITL and TPOT figures from the simulator's step timeline."""
    return timeline_figures(truth.get("emit_s") or [], truth["completion_tokens"])


def sent_figures(truth: dict[str, Any]) -> dict[str, float] | None:
    """The same figures from when the simulator handed each chunk to its socket."""
    return timeline_figures(truth.get("sent_s") or [], truth["completion_tokens"])


def span_figures(span: dict[str, Any]) -> dict[str, float] | None:
    if span["tpot_s"] is None or span["chunk_gaps_us"] is None:
        return None
    gaps = [int(g) / 1e6 for g in span["chunk_gaps_us"].split(",")]
    return {
        "tpot": span["tpot_s"],
        "itl mean": sum(gaps) / len(gaps),
        "itl p50": span["itl_p50_s"],
        "itl p95": span["itl_p95_s"],
        "itl p99": span["itl_p99_s"],
        "itl max": span["itl_max_s"],
    }


def print_level(
    name: str, rows: list[tuple[dict[str, Any], dict[str, Any]]], gate: dict[str, dict[str, Any]], load: float
) -> dict[str, float]:
    """One level's comparison; returns each metric's share of requests within 2 % of the steps."""
    one_per_step = sum(1 for span, truth in rows if span["chunks"] == len(truth["emit_s"]))
    sizes_ok = sum(
        1
        for span, truth in rows
        if span["chunk_tokens"] is not None
        and [int(n) for n in span["chunk_tokens"].split(",")] == truth["emit_tokens"]
    )
    sized = sum(1 for span, _ in rows if span["chunk_tokens"] is not None)
    print(
        f"{name}: {len(rows)} requests compared; one chunk per step in {one_per_step}; tokens per chunk "
        f"equal to the steps' in {sizes_ok} of {sized} with counts; load {load:.2f} on {os.cpu_count()} cores"
    )
    for arm, row in sorted(gate.items()):
        print(f"  gate, {arm}: {gate_line(row)}")
    print(f"  the gate calls the ITL tails resolved (every arm): {'yes' if tails_resolved(gate) else 'NO'}")
    print("  measured vs the steps (the target)")
    shares = print_errors([(span_figures(span), truth_figures(truth)) for span, truth in rows])
    print("  measured vs the chunks as the simulator sent them (the client's measurement)")
    print_errors([(span_figures(span), sent_figures(truth)) for span, truth in rows])
    print("  sent vs the steps (the simulator's own delivery)")
    print_errors([(sent_figures(truth), truth_figures(truth)) for _, truth in rows])
    print_gap_noise(rows)
    return shares


def gate_line(row: dict[str, Any]) -> str:
    """What the analysis says of one arm at one level: reliable, its resolution and the tails'."""
    lat = row.get("latency") or {}
    reliable = "reliable" if row["reliable"] else f"UNRELIABLE ({row['health']})"
    resolution = lat.get("timing_resolution_s")
    if resolution is None:
        return f"{reliable}; no timing resolution recorded"
    parts = [
        f"{label} {value * 1000:.2f} ms"
        for label, value in (
            ("loop lag P99", lat.get("resolution_loop_lag_s")),
            ("sim write delay P99", lat.get("resolution_write_delay_s")),
        )
        if value is not None
    ]
    tails = ", ".join(
        f"{label} {lat[figure] * 1000:.1f} ms {'resolved' if lat[flag] else 'NOT resolved'}"
        for label, figure, flag in (
            ("P95", "p95_itl_s", "p95_itl_resolved"),
            ("P99", "p99_itl_s", "p99_itl_resolved"),
            ("max", "max_stall_s", "max_stall_resolved"),
        )
        if lat.get(figure) is not None
    )
    return f"{reliable}; timing resolution {resolution * 1000:.2f} ms ({' + '.join(parts)}); {tails}"


def tails_resolved(gate: dict[str, dict[str, Any]]) -> bool:
    """Whether the gate trusts the level: reliable, and every arm's ITL tails resolved."""
    flags = ("p95_itl_resolved", "p99_itl_resolved", "max_stall_resolved")
    return bool(gate) and all(
        row["reliable"] and all((row.get("latency") or {}).get(f) is True for f in flags)
        for row in gate.values()
    )


def print_gap_noise(rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Gap by gap, how far the proxy's gaps are from the sent chunks' and those from the steps' (ms):
    the noise that a per-request P99 or largest gap, a single gap, carries whole."""
    proxy_sent: list[float] = []
    sent_step: list[float] = []
    for span, truth in rows:
        steps, sent = truth["emit_s"], truth.get("sent_s") or []
        if span["chunk_gaps_us"] is None or not span["chunks"] == len(sent) == len(steps):
            continue
        proxy_gaps = [int(g) / 1e6 for g in span["chunk_gaps_us"].split(",")]
        for i, gap in enumerate(proxy_gaps):
            sent_gap, step_gap = sent[i + 1] - sent[i], steps[i + 1] - steps[i]
            proxy_sent.append((gap - sent_gap) * 1000)
            sent_step.append((sent_gap - step_gap) * 1000)
    for name, diffs in (("proxy - sent", proxy_sent), ("sent - step", sent_step)):
        if diffs:
            diffs.sort()
            print(
                f"   gap {name:<12} ms: p1 {quantile(diffs, 0.01):+6.2f}  p50 {quantile(diffs, 0.5):+6.2f}  "
                f"p99 {quantile(diffs, 0.99):+6.2f}  sd {statistics.pstdev(diffs):5.2f}  ({len(diffs)} gaps)"
            )


def print_errors(pairs: list[tuple[dict[str, float] | None, dict[str, float] | None]]) -> dict[str, float]:
    """Per metric: the median, 90th percentile and largest |error| over the requests, and the share
    within the target (returned)."""
    usable = [(p, t) for p, t in pairs if p is not None and t is not None]
    shares: dict[str, float] = {}
    for metric in METRICS:
        errors = sorted(abs(p[metric] / t[metric] - 1) for p, t in usable if t[metric] > 0)
        if not errors:
            continue
        within = shares[metric] = sum(e <= TARGET for e in errors) / len(errors)
        print(
            f"   {metric:<9} |error| median {statistics.median(errors):7.3%}  "
            f"p90 {quantile(errors, 0.9):7.3%}  max {errors[-1]:7.3%}  within 2 %: {within:6.1%}   "
            f"reference median {statistics.median(t[metric] for _, t in usable) * 1000:7.2f} ms"
        )
    return shares


def parse_slow(values: list[str]) -> list[tuple[int, float]]:
    """``64:0.0625`` → [(64, 0.0625)]; ``16,64:0.0625`` → [(16, 0.0625), (64, 0.0625)]."""
    out = []
    for value in values:
        levels, _, scale = value.partition(":")
        out += [(int(level), float(scale)) for level in levels.split(",")]
    return out


def write_items(path: Path, n: int, max_tokens: int) -> Path:
    """``n`` chat calls as an OpenAI Batch file, each prompt its own (replay streams them)."""
    with path.open("w") as f:
        for i in range(n):
            body = {
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            f.write(json.dumps({"custom_id": f"q{i}", "url": "/v1/chat/completions", "body": body}) + "\n")
    return path


def replay_level(items: Path, config: Path, db: Path, level: int, n: int, rounds: int, name: str) -> None:
    """One level as its own replay run (its spans and health rows under the run name ``name``)."""
    cmd = [sys.executable, "-m", "specproxy", "replay", str(items), "--config", str(config), "--db", str(db)]
    cmd += ["--mode", "split", "--concurrency", str(level), "--limit", str(n), "--rounds", str(rounds)]
    cmd += ["--run-name", name, "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"replay at c={level} failed:\n{done.stdout}\n{done.stderr}")


def post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def read_spans(db: Path) -> list[dict[str, Any]]:
    """Every ok streamed span, with its run's name."""
    with duckdb.connect(str(db), read_only=True) as con:
        rel = con.execute(
            "SELECT r.name AS run_name, q.* FROM requests q JOIN runs r USING (run_id) "
            "WHERE q.status = 'ok' AND q.stream ORDER BY q.t_start_ns"
        )
        columns = [d[0] for d in rel.description]
        return [dict(zip(columns, row, strict=True)) for row in rel.fetchall()]


def print_summary(trusted: dict[str, dict[str, float]]) -> None:
    """At the levels whose tails the gate trusts: per figure, the smallest share within 2 %."""
    if not trusted:
        print("\nthe gate resolved the ITL tails at no level")
        return
    worst = {m: min(shares.get(m, 0.0) for shares in trusted.values()) for m in METRICS}
    if all(v == 1.0 for v in worst.values()):
        verdict = "all requests"
    elif all(v >= 0.95 for v in worst.values()):
        verdict = ">= 95 % of requests (not all)"
    else:
        verdict = "fewer than 95 % of requests"
    print(
        f"\nat the levels whose ITL tails the gate resolves ({'; '.join(trusted)}): TPOT and ITL within 2 % "
        f"of the steps for {verdict}; smallest share per figure: "
        + ", ".join(f"{m} {v:.1%}" for m, v in worst.items())
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,4,16,64", help="concurrency levels")
    ap.add_argument("--time-scale", type=float, default=0.25, help="the simulator's --time-scale")
    ap.add_argument(
        "--slow", action="append", default=[], metavar="L[,L]:S", help="also measure levels L at time scale S"
    )
    ap.add_argument("--requests-per-level", type=int, default=2, help="requests per level, times c (min 16)")
    ap.add_argument("--rounds", type=int, default=1, help="replay's rounds per level")
    ap.add_argument("--max-tokens", type=int, default=96, help="max_tokens of each request")
    ap.add_argument("--save", type=Path, help="write each level's spans and truths here (JSON)")
    args = ap.parse_args()
    plan = [(int(x), args.time_scale) for x in args.levels.split(",")] + parse_slow(args.slow)
    tmp = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    db = tmp / "spans.duckdb"
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    sim = start_cli(
        ["sim", "--port", str(sim_port), "--time-scale", str(args.time_scale), "-sc", json.dumps(EAGLE3)]
    )
    truths: dict[str, dict[str, Any]] = {}
    loads: dict[str, float] = {}
    names: list[tuple[str, int]] = []
    try:
        wait_http(sim_url + "/health", 60, sim)
        config = write_config(tmp / "exp.toml", sim_url)
        items = write_items(
            tmp / "items.jsonl", max(max(16, args.requests_per_level * c) for c, _ in plan), args.max_tokens
        )
        print(
            f"simulator: EAGLE3 k=3, h100-llama3.1-8b; replay: split, arms plain and eagle3 on it, "
            f"{args.rounds} round(s) per level; {os.cpu_count()} cores; "
            f"load average before {os.getloadavg()[0]:.2f}\n"
        )
        for level, scale in plan:
            name = f"c={level} at time scale {scale:g}"
            post_json(sim_url + "/sim/time_scale", {"time_scale": scale})
            n = max(16, args.requests_per_level * level)
            t0 = time.perf_counter()
            replay_level(items, config, db, level, n, args.rounds, name)
            loads[name] = os.getloadavg()[0]
            names.append((name, level))
            print(f"{name}: {n} requests x {args.rounds} round(s) in {time.perf_counter() - t0:.1f} s")
            for t in get_json(sim_url + "/sim/requests?timeline=1&limit=100000")["requests"]:
                truths[t["request_id"]] = t
    finally:
        stop(sim)
    analyzed = subprocess.run(
        [sys.executable, "-m", "specproxy", "analyze", str(db), "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    runs = {run["name"]: run for run in json.loads(analyzed.stdout)["runs"]}
    spans = read_spans(db)
    print()
    saved: dict[str, list[dict[str, Any]]] = {}
    trusted: dict[str, dict[str, float]] = {}
    for name, level in names:
        rows = [
            (s, truths[upstream_request_id(s["request_id"])])
            for s in spans
            if s["run_name"] == name and upstream_request_id(s["request_id"]) in truths
        ]
        gate = {r["arm"]: r for r in runs[name]["rows"] if r["level"] == str(level)}
        shares = print_level(name, rows, gate, loads[name])
        if tails_resolved(gate):
            trusted[name] = shares
        saved[name] = [{"span": span, "truth": truth} for span, truth in rows]
    print_summary(trusted)
    if args.save is not None:
        args.save.write_text(json.dumps(saved, default=str))


if __name__ == "__main__":
    main()
