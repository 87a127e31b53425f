"""Benchmark: live verdicts on real pieces, designs drawn at random from a seed.

    python tests/bench/bench_live_aa.py [--designs 30] [--power 10] [--seed 26] [--jobs 1]
                                        [--keep DIR | --from DIR] [--synthetic]

Each design starts `specproxy sim` arms behind `specproxy serve` and drives the proxy with
`specproxy replay --target` at one concurrency level (3 rounds), then reads `specproxy analyze
--format json` of the proxy's span store. Null designs run arms identical to the baseline: split
50/50 to 90/10 either way, three-way (a plain twin and a `role = "replica"` one), or shadow at a
sample of 0.2-1.0; levels 2-64; short (32) or long (128) outputs. Power designs put a real EAGLE3
simulator (about 1.6x decode at low load) beside the baseline at c=2, split or shadow with a sample
of 0.3 or more. ``--synthetic`` analyses synthetic closed loops instead (tests/closedloop.py: the
same kinds of designs on a model engine whose slowness wanders, a few seconds for 60 designs), to
see a change to the analysis at once. ``--jobs N`` runs N designs at a time (each is 4-6 processes:
give it the cores, or its health checks will say the machine fell behind).

Prints one line per design, then:
- null WIN/LOSS: the share of judged per-level verdicts (and of deploy verdicts) that are WIN or LOSS
  for an identical arm (target ≤ 5 %);
- null judged: the share of the identical arms' levels that got a decode interval and passed every
  health check (target ≥ 60 % on a quiet machine);
- coverage: the share of those intervals that hold 1.0 (target ≥ 90 %);
- power: the share of EAGLE3 levels at c=2 that are WIN (target ≥ 95 %).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specproxy.analysis import analyze_text
from tests.closedloop import Design, make_closed_loop_run, make_design
from tests.spanfactory import write_db
from tests.support import replay_target_argv, serving, simulators

SIM = ["--time-scale", "1"]
EAGLE3 = (
    'speculative = { method = "eagle3", model = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", '
    "num_speculative_tokens = 3 }\n"
)


@dataclass(frozen=True)
class LiveDesign:
    mode: str  # split | shadow
    level: int
    max_tokens: int
    shares: dict[str, float]  # split: every arm's weight; shadow: each candidate's sample
    power: bool = False

    def describe(self) -> str:
        shares = "/".join(f"{a}={v:.2f}" for a, v in self.shares.items())
        kind = "power" if self.power else "null"
        return f"{kind} {self.mode} {shares} c={self.level} max_tokens {self.max_tokens}"


def draw(rng: random.Random, power: bool) -> LiveDesign:
    level = 2 if power else rng.choice((2, 4, 8, 16, 32, 64))
    max_tokens = rng.choice((32, 128))
    cand = "eagle3" if power else "twin"
    if rng.random() < 0.5:
        low = 0.3 if power else 0.2
        return LiveDesign("shadow", level, max_tokens, {cand: round(rng.uniform(low, 1.0), 2)}, power)
    if not power and rng.random() < 0.3:
        w = round(rng.uniform(0.2, 0.5), 2)
        rest = round((1 - w) / 2, 2)
        return LiveDesign("split", level, max_tokens, {"baseline": w, "twin": rest, "replica": rest})
    base = round(rng.uniform(0.5, 0.9), 2)
    base = base if rng.random() < 0.5 else round(1 - base, 2)
    return LiveDesign("split", level, max_tokens, {"baseline": base, cand: round(1 - base, 2)}, power)


def config(design: LiveDesign, urls: dict[str, str], db: Path) -> str:
    arms = [f'[[arms]]\nname = "baseline"\nrole = "baseline"\nurl = "{urls["baseline"]}"\n']
    if design.mode == "split":
        arms[0] += f"weight = {design.shares['baseline']}\n"
    for arm, share in design.shares.items():
        if arm == "baseline":
            continue
        field_ = f"weight = {share}" if design.mode == "split" else f"sample = {share}"
        role = 'role = "replica"\n' if arm == "replica" else ""
        spec = EAGLE3 if arm == "eagle3" else ""
        arms.append(f'[[arms]]\nname = "{arm}"\nurl = "{urls[arm]}"\n{role}{field_}\n{spec}')
    head = f'[experiment]\nname = "live-aa"\nmode = "{design.mode}"\ndb = "{db}"\nscrape_interval_s = 1\n\n'
    return head + "\n".join(arms)


def items(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    topics = ("a lighthouse", "a river", "a market", "an old clock", "a mountain road", "a kitchen")
    path.write_text(
        "".join(
            json.dumps({"question_id": i, "turns": [f"Tell a story about {rng.choice(topics)} number {i}"]})
            + "\n"
            for i in range(n)
        )
    )
    return path


@dataclass
class Tally:
    null_levels: int = 0
    null_judged: int = 0
    null_different: list[str] = field(default_factory=list)
    covered: int = 0
    null_deploys: int = 0
    null_deploy_different: list[str] = field(default_factory=list)
    power_levels: int = 0
    power_wins: int = 0


def run_design(design: LiveDesign, work: Path, seed: int) -> dict[str, Any]:
    arms = {
        "baseline": SIM,
        **{a: [*SIM, "--method", "eagle3"] if a == "eagle3" else SIM for a in design.shares},
    }
    db = work / "proxy.duckdb"
    log = items(work / "items.jsonl", max(60, 4 * design.level), seed)
    with simulators(**arms) as urls:
        (work / "exp.toml").write_text(config(design, urls, db))
        with serving(work / "exp.toml") as proxy:
            argv = replay_target_argv(
                log, proxy.url, work / "client.duckdb", "--concurrency", str(design.level)
            )
            argv += ["--max-tokens", str(design.max_tokens), "--seed", str(seed)]
            replay = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
            if replay.returncode != 0:
                raise RuntimeError(f"replay failed: {replay.stderr[-2000:]}")
        if proxy.returncode != 0:
            raise RuntimeError(f"serve failed: {proxy.output[-2000:]}")
    return analysed(db)


def analysed(db: Path) -> dict[str, Any]:
    """``specproxy analyze --format json`` of one design's proxy store: its one run."""
    out = subprocess.run(
        [sys.executable, "-m", "specproxy", "analyze", str(db), "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (run,) = json.loads(out)["runs"]
    return run  # type: ignore[no-any-return]


def synthetic_run(design: Design, work: Path, seed: int) -> dict[str, Any]:
    """The same analysis of a synthetic closed loop (tests/closedloop.py) instead of real pieces."""
    db = write_db(work / "synthetic.duckdb", [make_closed_loop_run(design, seed)])
    (run,) = json.loads(analyze_text([db], fmt="json"))["runs"]
    return run  # type: ignore[no-any-return]


def _real_arms(design: LiveDesign | Design) -> set[str]:
    """The arms that differ from the baseline (none in a null design)."""
    if isinstance(design, LiveDesign):
        return {"eagle3"} if design.power else set()
    return {arm for arm, speedup in design.speedups.items() if speedup != 1.0}


def tally_design(design: LiveDesign | Design, run: dict[str, Any], tally: Tally) -> str:
    real = _real_arms(design)
    parts = []
    for row in run["rows"]:
        if row["arm"] == "baseline" or row["level"] != str(design.level):
            continue
        dec = row.get("decode_speedup")
        shown = f"{dec['point']:.2f} [{dec['low']:.2f}, {dec['high']:.2f}]" if dec and dec["low"] else "—"
        load = row.get("load") or {}
        parts.append(f"{row['arm']} {row['verdict']} {shown} {load.get('method') or ''}".rstrip())
        if row["arm"] in real:
            tally.power_levels += 1
            tally.power_wins += row["verdict"] == "WIN"
            continue
        tally.null_levels += 1
        if row["verdict"] in ("WIN", "LOSS"):
            tally.null_different.append(f"{design.describe()}: {row['arm']} {row['verdict']} {row['reason']}")
        if dec and dec["low"] is not None and row["verdict"] != "UNRELIABLE":
            tally.null_judged += 1
            tally.covered += dec["low"] <= 1.0 <= dec["high"]
    for arm in run["arms"]:
        deploy = arm.get("deploy")
        if arm["arm"] in ("baseline", *real) or not deploy or deploy["verdict"] == "UNRELIABLE":
            continue
        tally.null_deploys += 1
        if deploy["verdict"] in ("WIN", "LOSS"):
            tally.null_deploy_different.append(f"{design.describe()}: {arm['arm']} deploy {deploy['text']}")
    return "; ".join(parts)


def run_one(
    design: LiveDesign | Design, work: Path, seed: int, again: bool = False
) -> tuple[dict[str, Any] | None, float, str]:
    """One design's analysed run (or why it failed) and how long it took; ``again``: analyse the
    store a kept run left in ``work`` instead of running the design."""
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        if again:
            run = analysed(work / "proxy.duckdb")
        elif isinstance(design, Design):
            run = synthetic_run(design, work, seed)
        else:
            run = run_design(design, work, seed)
    except (RuntimeError, subprocess.SubprocessError) as exc:
        return None, time.monotonic() - started, str(exc)
    return run, time.monotonic() - started, ""


def share(n: int, d: int) -> str:
    return f"{n}/{d} = {n / d:.0%}" if d else "0/0"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--designs", type=int, default=30, help="null designs (identical arms)")
    parser.add_argument("--power", type=int, default=10, help="power designs (EAGLE3 at c=2)")
    parser.add_argument("--seed", type=int, default=26, help="seed the designs are drawn from")
    parser.add_argument("--jobs", type=int, default=1, help="designs run at a time (default 1)")
    parser.add_argument("--keep", type=Path, help="keep each design's stores under this folder")
    parser.add_argument(
        "--from",
        dest="again",
        type=Path,
        help="analyse again the stores a run with --keep left in this folder (same --seed and counts)",
    )
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="analyse synthetic closed loops (tests/closedloop.py) instead of running real pieces: seconds",
    )
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    designs: list[LiveDesign | Design]
    if opts.synthetic:
        designs = [make_design(rng) for _ in range(opts.designs)]
        designs += [make_design(rng, speedup=1.6, level=2) for _ in range(opts.power)]
    else:
        designs = [draw(rng, power=False) for _ in range(opts.designs)]
        designs += [draw(rng, power=True) for _ in range(opts.power)]
    tally = Tally()
    root = opts.again or opts.keep or Path(tempfile.mkdtemp(prefix="specproxy-live-aa-"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        jobs = [
            pool.submit(
                run_one, design, root / f"design{k:02d}", opts.seed * 1000 + k, opts.again is not None
            )
            for k, design in enumerate(designs)
        ]
        for k, (design, job) in enumerate(zip(designs, jobs, strict=True)):
            run, seconds, failure = job.result()
            line = tally_design(design, run, tally) if run is not None else f"failed: {failure}"
            print(f"{k:2d} {design.describe()} ({seconds:.0f} s): {line}", flush=True)
    t = tally
    judged_wl = len(t.null_different)
    print(f"null WIN/LOSS: {share(judged_wl, t.null_judged)} of judged per-level verdicts", end="")
    print(f"; deploy {share(len(t.null_deploy_different), t.null_deploys)} (target ≤ 5 %)")
    print(f"null judged: {share(t.null_judged, t.null_levels)} of the identical arms' levels (target ≥ 60 %)")
    print(f"coverage of 1.0: {share(t.covered, t.null_judged)} (target ≥ 90 %)")
    print(f"power: EAGLE3 at c=2 WIN in {share(t.power_wins, t.power_levels)} (target ≥ 95 %)")
    for line in t.null_different + t.null_deploy_different:
        print(f"  {line}")


if __name__ == "__main__":
    main()
