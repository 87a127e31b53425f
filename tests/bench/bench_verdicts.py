"""Benchmark: can a verdict be trusted? A/A false alarms, power, interval coverage, stability and cost.

    python tests/bench/bench_verdicts.py [--runs 20] [--levels 1,8,32,64] [--rounds 3] [--per-round 6]
                                         [--deciding-rounds 12]
                                         [--time-scale 1:0.25,8:0.25,32:0.1,64:0.05]
                                         [--stability-runs 3] [--keep] [--work DIR]
    python tests/bench/bench_verdicts.py --from DIR    # the figures again from a --keep folder's stores

Starts four simulators on 127.0.0.1 (``specproxy sim`` subprocesses, stopped at the end whatever
happens): a plain baseline, a plain ``replica`` (role replica), a plain arm labelled EAGLE3 in the
experiment file (``eagle3-null``: a null arm that looks like a candidate) and a real EAGLE3 simulator
(``eagle3``), at the time scale of the levels they serve: levels with different ``--time-scale`` are
replayed by separate simulator sets (a busy two-core machine keeps up with c=1 at a quarter of
full speed and c=64 at a twentieth), each level group ``--runs`` times into its own store
(``run-NN-gK.duckdb``, a deploy verdict per group). Then ``--runs`` times: a paired replay (replay's
own runner, in this process) of a small
mixed workload over the levels, ``--rounds`` rounds each of max(c, ``--per-round``) items, so every arm
gets the same items, into a fresh span store, with up to ``--deciding-rounds`` more rounds, after the
sweep, at each group's levels where the null or EAGLE3 arm's deploy verdict reads and is open (as the
lab does:
:mod:`specproxy.analysis.verdicts.settled`), and ``specproxy analyze --format json`` on it (a subprocess). It
prints each target's detail with ``met`` / ``NOT met`` and a Wilson 95 % interval on the share:

- A/A, judged on each null arm on its own (each ≤ 5 %), the two pooled printed beside but not judged:
  the replica sets the run's margin (its own deviation from 1x is part of the noise floor), so it is
  hardly ever WIN or LOSS and pooling it would halve ``eagle3-null``'s false-alarm rate. Deploy: one
  verdict per run and arm (n = ``--runs``), WIN or LOSS when any scale group's deploy verdict in that
  run is; per level: one verdict per run, arm and level (n = ``--runs`` × levels). An UNRELIABLE
  verdict counts as neither; a missing one counts as a false alarm (no evidence either way);
- power: the share of runs in which EAGLE3's true ≥ 1.5x decode effect at c=1 is a WIN (≥ 95 %,
  judged on the observed share as the issue states it; the Wilson lower bound is printed beside);
- coverage: per level and arm, the share of runs whose decode and throughput intervals contain the
  true ratio (≥ 90 % in every cell; the target counts every run: UNRELIABLE ones too, and a run
  without the row or the interval as a miss, how many printed; the runs where the level was judged
  are shown below it): 1 for the null arms (they are the baseline's configuration), and for EAGLE3
  the ratio on the simulator's lag-free timeline: the same items through the simulator's engine on a
  virtual clock (:mod:`specproxy.engines.sim.virtual`'s way), at the same concurrency, with a warm
  prefix cache;
- health: the share of level-rounds over a health limit (table ``health``), which the analysis may
  hold back as UNRELIABLE;
- stability: ``--stability-runs`` consecutive ``specproxy lab --quick`` runs, each arm's deploy verdict
  per lab, and after each lab every arm's throughput ratio at the top level with its verdict there and
  the rounds it was judged on (what the deploy verdict's peak half reads). Met when every arm but the
  baseline has a deploy verdict in every lab (a missing one fails) and the same one in every lab that
  judged it (UNRELIABLE judged nothing; WIN in one lab and NO CLEAR GAIN in another "differs", WIN and
  LOSS "FLIPS"), and was judged in one lab at least ("not judged in any lab" fails: no evidence);
  also how many labs judged every arm at their top level (the rest read their labels from a lower one);
- cost: each ``lab --quick`` run's wall time and the longest (target ≤ 180 s each; written into the
  lab's folder, so ``--from`` reads it again).

It ends with one line per target, ``TARGET  A/A deploy``, ``TARGET  A/A per level``, ``TARGET  power``,
``TARGET  coverage``, ``TARGET  stability``, ``TARGET  cost`` (each ``met``, ``NOT met`` or ``not
measured``), then ``TARGETS all 6 met (...)`` or ``TARGETS NOT all met (NOT met: ...; not measured:
...)``.

The default invocation (no arguments) measures everything: on the 2-core VM about 50 minutes, ~40 of
them the 20 replays (each run replays its three scale groups: ~2 minutes) and then 3 labs of ~150 s.
``--runs 0`` skips the replays (A/A, power and coverage then read "not measured"), ``--stability-runs
0`` the labs (stability and cost "not measured").

Say what the machine was doing (``uptime``) next to the figures: a busy machine makes simulators lag.
``--keep`` keeps the span stores; ``--from`` analyses them again (with the same ``--levels`` and
``--items``), e.g. after the verdict rule changed, without measuring anything.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import duckdb

from specproxy.analysis.stats import wilson_interval
from specproxy.commandline import run_async
from specproxy.config import load_experiment
from specproxy.engines.profiles import load_profile
from specproxy.engines.sim.api_request import parse_request
from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.engine import EngineCore, RequestSpec
from specproxy.engines.sim.text import request_key
from specproxy.proxy.replay.deciding import open_questions
from specproxy.proxy.replay.formats import ReplayItem
from specproxy.proxy.replay.runner import LoadPlan, ReplaySettings, run_replay
from specproxy.proxy.replay.workload import mixed_workload
from tests.support import free_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROFILE = "h100-llama3.1-8b"
EAGLE3 = {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}
NULL_ARMS = ("replica", "eagle3-null")
REAL_ARM = "eagle3"
DECISIVE = ("WIN", "LOSS")
MISSING = "missing"  # no verdict where one was due: never evidence that a target is met
COST_S = 180.0  # lab --quick wall time target
WALL_FILE = "bench-wall-s.txt"  # a lab's wall time, written into its folder (read again by --from)


# -- simulators ----------------------------------------------------------------------------------


@dataclass
class Sim:
    name: str
    role: str
    label: dict[str, Any] | None  # the arm's speculative config in the experiment file
    runs: dict[str, Any] | None  # what the simulator really runs
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def bench_arms() -> list[Sim]:
    return [
        Sim("baseline", "baseline", None, None),
        Sim("replica", "replica", None, None),
        Sim("eagle3-null", "candidate", EAGLE3, None),
        Sim(REAL_ARM, "candidate", EAGLE3, EAGLE3),
    ]


@contextlib.contextmanager
def running_sims(sims: list[Sim], workdir: Path, time_scale: float) -> Iterator[list[Sim]]:
    try:
        for sim in sims:
            sim.port = free_port()
            argv = [sys.executable, "-m", "specproxy", "sim", "--port", str(sim.port), "--model", MODEL]
            argv += ["--profile", PROFILE, "--time-scale", str(time_scale)]
            if sim.runs:
                argv += [
                    "--speculative-config",
                    json.dumps(sim.runs),
                    "--per-request-spec-decode-metrics",
                    "summary",
                ]
            log = (workdir / f"sim-{sim.name}.log").open("wb")
            sim.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        for sim in sims:
            wait_healthy(sim)
        yield sims
    finally:
        for sim in sims:
            if sim.proc is not None:
                sim.proc.terminate()
        for sim in sims:
            if sim.proc is not None:
                sim.proc.wait(15)


def wait_healthy(sim: Sim, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(sim.url + "/health", timeout=2):
                return
        except OSError:
            if sim.proc is not None and sim.proc.poll() is not None:
                raise SystemExit(f"simulator {sim.name} exited ({sim.proc.returncode})") from None
            time.sleep(0.1)
    raise SystemExit(f"simulator {sim.name} did not answer /health within {timeout_s:.0f} s")


def write_experiment(path: Path, sims: Sequence[Sim]) -> None:
    lines = ['[experiment]\nname = "bench-verdicts"\n']
    for sim in sims:
        lines.append(f'[[arms]]\nname = "{sim.name}"\nrole = "{sim.role}"\nurl = "{sim.url}"\n')
        if sim.label:
            spec = ", ".join(f"{k} = {json.dumps(v)}" for k, v in sim.label.items())
            lines.append(f"speculative = {{ {spec} }}\n")
    path.write_text("\n".join(lines))


def write_workload(path: Path, items: Sequence[ReplayItem]) -> None:
    with path.open("w") as f:
        for it in items:
            body = {**it.body, "metadata": {"category": it.category}}
            f.write(json.dumps({"custom_id": it.item_id, "body": body}) + "\n")


# -- ground truth on the virtual clock -----------------------------------------------------------


def virtual_figures(
    items: Sequence[ReplayItem], level: int, spec: dict[str, Any] | None, rounds: int
) -> tuple[float, float]:
    """(median per-request decode tok/s, output tok/s) of ``items`` on the simulator's engine with a
    virtual clock, what the arm does when nothing lags: as replay sends a level, one pass that warms the
    prefix cache, then ``rounds`` closed loops at ``level`` over the items, each drained before the next;
    throughput is each round's tokens over its own duration, summed over rounds."""
    config = SimConfig(
        model=MODEL, profile=PROFILE, speculative=SpeculativeConfig.from_dict(dict(spec)) if spec else None
    )
    core = EngineCore(config, load_profile(PROFILE))
    clock = [0.0]
    rates: list[float] = []
    tokens, busy = 0, 0.0
    for pass_ in range(rounds + 1):
        started = clock[0]
        done = closed_loop_virtual(core, config, items, level, clock, tag=f"p{pass_}")
        if pass_ == 0:
            continue
        busy += clock[0] - started
        for seq in done:
            t = seq.truth
            tokens += seq.n_out
            if t.first_token is not None and t.finished is not None and seq.n_out > 1:
                if t.finished > t.first_token:
                    rates.append((seq.n_out - 1) / (t.finished - t.first_token))
    return statistics.median(rates), tokens / busy


def closed_loop_virtual(
    core: EngineCore,
    config: SimConfig,
    items: Sequence[ReplayItem],
    level: int,
    clock: list[float],
    tag: str,
    started: list[float] | None = None,
) -> list[Any]:
    """Send ``items`` with ``level`` in flight until all finished; ``clock[0]`` is the virtual time.
    ``started`` collects each call's start time, in the order sent."""
    issued = 0
    done: list[Any] = []

    def issue() -> None:
        nonlocal issued
        body = {**items[issued].body, "temperature": 0, "stream": True}
        req = parse_request(config, {}, body, True)
        key = request_key(config.model, req.prompt.text, "")
        rid = f"{tag}-{issued}"
        spec = RequestSpec(rid, req.prompt, req.category, key, req.max_tokens, req.min_tokens, req.ignore_eos)
        done.append(core.add(spec, clock[0]))
        if started is not None:
            started.append(clock[0])
        issued += 1

    while issued < min(level, len(items)):
        issue()
    while core.has_work():
        plan = core.plan_step(clock[0])
        if plan is None:
            break
        clock[0] += plan.duration_s
        for seq in core.finish_step(plan, clock[0]):
            if seq.finished and issued < len(items):
                issue()
    return done


def true_ratios(
    items: Sequence[ReplayItem], levels: Sequence[int], minimum: int, rounds: int
) -> dict[int, tuple[float, float]]:
    """level → (decode, throughput) ratio of the real EAGLE3 arm over the baseline, lag-free, on the
    items a round of that level sends."""
    out = {}
    for level in levels:
        sent = level_items(items, level, minimum)
        base = virtual_figures(sent, level, None, rounds)
        cand = virtual_figures(sent, level, EAGLE3, rounds)
        out[level] = (cand[0] / base[0], cand[1] / base[1])
    return out


# -- one replay and its verdicts -----------------------------------------------------------------


@dataclass
class RunVerdicts:
    level: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)  # (arm, level) → row
    deploy: dict[str, str] = field(default_factory=dict)
    arms: list[str] = field(default_factory=list)  # every arm but the baseline: each owes a deploy verdict
    groups: int = 1  # scale groups merged into this run, each with its own deploy verdicts
    health_over: int = 0
    health_total: int = 0
    deciding: int = 0  # deciding rounds run (a level the deploy verdict reads, again, while it was open)


def specproxy(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [sys.executable, "-m", "specproxy", *args], capture_output=True, text=True, timeout=timeout
    )
    if res.returncode != 0:
        raise SystemExit(f"specproxy {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return res


def verdicts_of(db: Path) -> RunVerdicts:
    doc = json.loads(specproxy("analyze", str(db), "--format", "json", timeout=300).stdout)
    run = doc["runs"][0] if "runs" in doc else doc
    out = RunVerdicts()
    for row in run["rows"]:
        if row.get("concurrency_level") is not None:
            out.level[(row["arm"], int(row["concurrency_level"]))] = row
    for arm in run.get("arms", doc.get("arms", [])):
        if arm.get("kind") != "baseline" and arm["arm"] != run.get("baseline"):
            out.arms.append(arm["arm"])
        if arm.get("deploy"):
            out.deploy[arm["arm"]] = arm["deploy"]["verdict"]
    with duckdb.connect(str(db), read_only=True) as conn:
        over, total = conn.execute(
            "SELECT count(DISTINCT (concurrency_level, round)) FILTER (value > threshold), "
            "count(DISTINCT (concurrency_level, round)) FROM health"
        ).fetchone() or (0, 0)
    out.health_over, out.health_total = int(over), int(total)
    return out


def per_round(minimum: int, level: int) -> int:
    """Items each round of a level sends: at least one per slot."""
    return max(level, minimum)


def level_items(items: Sequence[ReplayItem], level: int, minimum: int) -> list[ReplayItem]:
    """The items one round of ``level`` sends (replay cycles the list from its start)."""
    return [items[i % len(items)] for i in range(per_round(minimum, level))]


def replay_once(
    name: str,
    work: Path,
    exp_path: Path,
    items: list[ReplayItem],
    levels: Sequence[int],
    opts: argparse.Namespace,
) -> RunVerdicts:
    db = work / f"{name}.duckdb"
    exp = load_experiment(exp_path)
    plan = LoadPlan(
        kind="closed",
        levels=tuple(levels),
        items_per_level=functools.partial(per_round, opts.per_round),
        rounds=opts.rounds,
        deciding_rounds=opts.deciding_rounds,
    )
    settings = ReplaySettings(
        arms=exp.arms,
        db_path=db,
        run_name=f"bench-{name}",
        load=plan,
        seed=int(name.split("-")[1]),
        experiment=exp,
        show_progress=False,
        decider=open_questions,
    )
    result = run_async(run_replay(settings, items))
    verdicts = verdicts_of(db)
    verdicts.deciding = sum(level.deciding for level in result.levels)
    return verdicts


def level_scales(text: str, levels: Sequence[int]) -> dict[int, float]:
    """``--time-scale``: one scale for every level ("0.25"), or one per level ("1:0.5,64:0.1"; a level
    not named runs at 1)."""
    if ":" not in text:
        return {c: float(text) for c in levels}
    given = {int(k): float(v) for k, v in (part.split(":") for part in text.split(","))}
    return {c: given.get(c, 1.0) for c in levels}


def scale_groups(scales: dict[int, float]) -> list[tuple[float, list[int]]]:
    """Levels that share a time scale, replayed together by one set of simulators (fastest first)."""
    groups: dict[float, list[int]] = {}
    for c, scale in sorted(scales.items()):
        groups.setdefault(scale, []).append(c)
    return sorted(groups.items(), reverse=True)


def merged(parts: Sequence[RunVerdicts]) -> RunVerdicts:
    """One run's verdicts over its scale groups: every level's row; a deploy verdict per group."""
    out = RunVerdicts(groups=len(parts))
    for g, part in enumerate(parts):
        out.level.update(part.level)
        out.arms += [arm for arm in part.arms if arm not in out.arms]
        out.deploy.update({f"{arm}#{g}": v for arm, v in part.deploy.items()})
        out.health_over += part.health_over
        out.health_total += part.health_total
        out.deciding += part.deciding
    return out


@dataclass
class Target:
    """One of the issue's targets as the closing ``TARGET`` lines print it (``met`` None: not measured)."""

    name: str
    met: bool | None
    detail: str


def contains(interval: dict[str, Any] | None, truth: float) -> bool | None:
    if not interval or interval.get("low") is None or interval.get("high") is None:
        return None
    return bool(interval["low"] <= truth <= interval["high"])


def share(hits: Sequence[bool]) -> str:
    if not hits:
        return "—"
    ci = wilson_interval(sum(hits), len(hits), 0.95)
    spread = f" [{100 * ci.low:.0f}–{100 * ci.high:.0f} %]" if ci and ci.low is not None and ci.high else ""
    return f"{sum(hits)}/{len(hits)} ({100 * sum(hits) / len(hits):.0f} %{spread})"


def wilson_low(hits: Sequence[bool]) -> float:
    """The Wilson 95 % interval's lower bound on the share of hits (nan with none)."""
    ci = wilson_interval(sum(hits), len(hits), 0.95)
    return ci.low if ci is not None and ci.low is not None else float("nan")


def tally(seen: Sequence[str]) -> str:
    return str(dict(sorted((v, seen.count(v)) for v in set(seen))))


def target(name: str, hits: Sequence[bool], goal: float, at_most: bool) -> bool:
    """Print one target's line; met when the observed share is on the right side of ``goal``."""
    rate = sum(hits) / len(hits) if hits else float("nan")
    met = bool(hits) and (rate <= goal if at_most else rate >= goal)
    bound = f"{'≤' if at_most else '≥'} {goal:.0%}"
    print(f"{'met    ' if met else 'NOT met'}  {name}: {share(hits)}   (target {bound})")
    return met


# -- report --------------------------------------------------------------------------------------


def deploy_of(run: RunVerdicts, arm: str) -> list[str]:
    """The arm's deploy verdicts in one run (one per scale group: "arm#0", "arm#1", ...)."""
    return [v for k, v in run.deploy.items() if k.split("#")[0] == arm]


def run_deploy(run: RunVerdicts, arm: str) -> str:
    """The arm's one deploy verdict in a run over its scale groups: WIN or LOSS when any group's is (a
    false alarm in one group is one for the run; "WIN+LOSS" when two groups say both), else ``missing``
    when a group gave none, else a judged verdict (NO CLEAR GAIN, ...), else UNRELIABLE."""
    seen = deploy_of(run, arm)
    decisive = sorted({v for v in seen if v in DECISIVE}, reverse=True)  # WIN before LOSS
    if decisive:
        return "+".join(decisive)
    if len(seen) < run.groups:
        return MISSING
    judged = [v for v in seen if v != "UNRELIABLE"]
    return judged[0] if judged else "UNRELIABLE"


def level_verdict(run: RunVerdicts, arm: str, c: int) -> str:
    row = run.level.get((arm, c))
    return str(row.get("verdict") or MISSING) if row else MISSING


def alarm(verdict: str) -> bool:
    """A null arm's verdict against the A/A target: WIN or LOSS, or none at all (no evidence either)."""
    return verdict == MISSING or any(v in DECISIVE for v in verdict.split("+"))


def null_target(name: str, what: str, seen: dict[str, list[str]]) -> Target:
    """Judge each null arm's share of ``seen`` verdicts that are WIN or LOSS (≤ 5 % each); the pooled
    share is printed, not judged."""
    met: list[bool] = []
    cells: list[str] = []
    for arm, verdicts in seen.items():
        hits = [alarm(v) for v in verdicts]
        met.append(target(f"{name} {arm}: {what} WIN or LOSS (or missing)", hits, 0.05, True))
        print(f"           counts: {tally(verdicts)}")
        cells.append(f"{arm} {share(hits)}")
    pooled = share([alarm(v) for verdicts in seen.values() for v in verdicts])
    print(f"           pooled over {' and '.join(seen)} (printed, not judged): {pooled}")
    return Target(name, all(met), "; ".join(cells) + f"   (each ≤ 5 %; pooled {pooled}, not judged)")


def report_null(runs: list[RunVerdicts], levels: list[int]) -> list[Target]:
    """A/A, judged per null arm: one deploy verdict per run and arm (n = runs), and one verdict per
    run, arm and level (n = runs × levels); a missing verdict counts as a false alarm."""
    print(
        "A/A: the replica sets the run's margin (its own deviation from 1x is part of the noise floor), "
        "so it is hardly ever WIN or LOSS: each null arm is judged on its own, the pooled share is not"
    )
    deploy = {arm: [run_deploy(run, arm) for run in runs] for arm in NULL_ARMS}
    level = {arm: [level_verdict(run, arm, c) for run in runs for c in levels] for arm in NULL_ARMS}
    return [
        null_target("A/A deploy", "deploy verdicts (one per run)", deploy),
        null_target("A/A per level", "per-level verdicts", level),
    ]


def report_power(runs: list[RunVerdicts], low: int, truth: dict[int, tuple[float, float]]) -> Target:
    rows = [run.level.get((REAL_ARM, low)) or {} for run in runs]
    hits = [r.get("verdict") == "WIN" for r in rows]
    met = target(f"power: eagle3 WIN at c={low} (true decode {truth[low][0]:.2f}x)", hits, 0.95, False)
    bound = f"Wilson 95 % lower bound {100 * wilson_low(hits):.0f} %"
    print(f"           {bound}; the target is judged on the observed share, as the issue states it")
    seen = [str(r.get("verdict") or MISSING) for r in rows]
    print(f"           verdicts: {tally(seen)}")
    for r in rows:
        if r.get("verdict") not in ("WIN", None):
            print(f"           not WIN: {r.get('verdict')}: {r.get('reason', '')[:160]}")
    detail = f"eagle3 WIN at c={low} in {share(hits)}, {bound}   (observed share ≥ 95 %, as the issue says)"
    return Target("power", met, detail)


def coverage_hits(
    runs: list[RunVerdicts], arm: str, c: int, key: str, truth: float, reliable_only: bool
) -> tuple[list[bool], int]:
    """Whether each run's interval contains ``truth``, and how many runs had no row or no interval:
    misses for the target; with ``reliable_only``, only runs where the level was judged (not
    UNRELIABLE) and has an interval."""
    out: list[bool] = []
    missing = 0
    for run in runs:
        row = run.level.get((arm, c)) or {}
        hit = contains(row.get(key), truth)
        if hit is None:
            missing += 1
            if not reliable_only:
                out.append(False)
        elif not reliable_only or row.get("verdict") != "UNRELIABLE":
            out.append(hit)
    return out, missing


def report_coverage(
    runs: list[RunVerdicts], levels: list[int], truth: dict[int, tuple[float, float]]
) -> Target:
    """Per level: every arm's decode and throughput intervals against the truth, over all runs (the
    target; a run without the row or interval is a miss) and over the runs where the level was judged."""
    met: list[bool] = []
    missing_total = 0
    for c in levels:
        for arm in (*NULL_ARMS, REAL_ARM):
            truths = (1.0, 1.0) if arm in NULL_ARMS else truth[c]
            for key, t in zip(("decode_speedup", "throughput_speedup"), truths, strict=True):
                name = f"coverage c={c:<3} {arm:<12} {key.split('_')[0]:<10} (true {t:.3f}x)"
                hits, missing = coverage_hits(runs, arm, c, key, t, False)
                met.append(target(name, hits, 0.90, False))
                missing_total += missing
                judged = share(coverage_hits(runs, arm, c, key, t, True)[0])
                print(f"           reliable runs only: {judged}; no row or interval: {missing} (missed)")
    detail = (
        f"{met.count(True)} of {len(met)} cells (level × arm × decode/throughput) ≥ 90 % at "
        f"c={min(levels)}..{max(levels)}; {missing_total} without a row or interval, counted as misses"
    )
    return Target("coverage", all(met), detail)


def report_replays(
    runs: list[RunVerdicts], levels: list[int], truth: dict[int, tuple[float, float]]
) -> list[Target]:
    """The replays' targets: A/A deploy, A/A per level, power, coverage (not measured without runs)."""
    if not runs:
        names = ("A/A deploy", "A/A per level", "power", "coverage")
        return [Target(name, None, "no replay (--runs 0)") for name in names]
    null = report_null(runs, levels)
    power = report_power(runs, min(levels), truth)
    coverage = report_coverage(runs, levels, truth)
    over = sum(r.health_over for r in runs)
    total = sum(r.health_total for r in runs)
    print(f"health: level-rounds over a limit: {over}/{total}")
    return [*null, power, coverage]


def stability_mark(seen: list[str]) -> str:
    """``same`` when every judged lab agrees (an UNRELIABLE lab judged nothing), else why not: a lab
    without the arm's deploy verdict, no lab that judged it (no evidence), FLIPS (WIN in one lab and
    LOSS in another) or differs (say WIN and NO CLEAR GAIN: not the same deploy verdict)."""
    if MISSING in seen:
        return f"MISSING in {seen.count(MISSING)} of {len(seen)} labs"
    judged = {v for v in seen if v != "UNRELIABLE"}
    unjudged = seen.count("UNRELIABLE")
    if not judged:
        return "not judged in any lab"
    if len(judged) == 1:
        return "same" + (f" ({unjudged} UNRELIABLE)" if unjudged else "")
    return "FLIPS" if {"WIN", "LOSS"} <= judged else "differs"


def top_level(run: RunVerdicts) -> int | None:
    """The highest concurrency level the run has rows for (None: no level rows)."""
    return max((level for _, level in run.level), default=None)


def peak_figures(run: RunVerdicts) -> str:
    """Each arm's throughput ratio at the run's top level, its verdict there and the rounds it was
    judged on (of those measured): what a deploy verdict's peak half was read from."""
    top = top_level(run)
    cells = []
    for (arm, level), row in sorted(run.level.items()):
        iv = row.get("throughput_speedup") or {}
        if level != top or iv.get("low") is None:
            continue
        rounds = f"{row.get('rounds')} of {row.get('rounds_measured')} rounds"
        if row.get("verdict") == "UNRELIABLE":  # judged on none: too few rounds passed every check
            rounds = f"{row.get('rounds_measured')} rounds measured, too few sound"
        ratio = f"{iv['point']:.3f}x [{iv['low']:.3f}, {iv['high']:.3f}]"
        cells.append(f"{arm} {ratio} (level {row.get('verdict')}), {rounds}")
    return f"c={top}: " + "; ".join(cells) if cells else "none"


def lab_folders(work: Path, n: int, measure: bool) -> list[Path]:
    """work/lab-0 .. lab-(n-1) to measure into, or the kept ones there, in the order they ran."""
    if measure:
        return [work / f"lab-{i}" for i in range(n)]
    kept = [p for p in work.glob("lab-*") if p.is_dir() and p.name[4:].isdigit()]
    return sorted(kept, key=lambda p: int(p.name[4:]))


def run_labs(n: int, work: Path, measure: bool) -> tuple[list[RunVerdicts], list[float]]:
    """``n`` lab --quick runs into work/lab-i (or, without ``measure``, the ones already there): each
    lab's verdicts, and the wall times known (written to the lab's folder, so ``--from`` has them)."""
    labs: list[RunVerdicts] = []
    walls: list[float] = []
    for i, out in enumerate(lab_folders(work, n, measure)):
        if measure:
            t0 = time.monotonic()
            res = specproxy("lab", "--quick", "--no-progress", "--out", str(out), timeout=1800)
            (out / WALL_FILE).write_text(f"{time.monotonic() - t0:.1f}\n")
            # what the lab printed, for reading its verdicts and health lines as a user would
            (out / "lab-stdout.txt").write_text(res.stdout)
            (out / "lab-stderr.txt").write_text(res.stderr)
        if (out / WALL_FILE).exists():
            walls.append(float((out / WALL_FILE).read_text()))
            print(f"  lab --quick #{i + 1}: {walls[-1]:.0f} s", flush=True)
        labs.append(verdicts_of(out / "specproxy.duckdb"))
        print(f"    peak throughput: {peak_figures(labs[-1])}", flush=True)
    return labs, walls


def stability_target(labs: list[RunVerdicts]) -> Target:
    """Every arm but the baseline: the same deploy verdict in every lab (or UNRELIABLE), judged in one
    lab at least, present in all."""
    if not labs:
        return Target("stability", None, "no lab (--stability-runs 0)")
    arms = sorted({arm for lab in labs for arm in (*lab.arms, *lab.deploy)})
    marks: dict[str, str] = {}
    for arm in arms:
        seen = [lab.deploy.get(arm, MISSING) for lab in labs]
        marks[arm] = stability_mark(seen)
        print(f"stability {arm:<12} {' / '.join(seen)}   {marks[arm]}")
    unsteady = [f"{arm}: {mark}" for arm, mark in marks.items() if not mark.startswith("same")]
    at_top = sum(top_level_judged(lab) for lab in labs)
    print(f"stability top level judged for every arm in {at_top} of {len(labs)} labs")
    detail = (
        f"{len(arms) - len(unsteady)} of {len(arms)} arms the same deploy verdict (UNRELIABLE aside) "
        f"in {len(labs)} consecutive labs" + "".join(f"; {u}" for u in unsteady)
    )
    if at_top < len(labs):
        # The same labels can come from a lower level when the top one was UNRELIABLE: steady, but not
        # what the lab planned to measure. Said beside the target, which is about the labels.
        detail += f"; the top level judged in {at_top} of {len(labs)} labs (the rest judged lower)"
    return Target("stability", bool(arms) and not unsteady, detail)


def top_level_judged(run: RunVerdicts) -> bool:
    """Every arm's row at the run's top level has a verdict other than UNRELIABLE."""
    top = top_level(run)
    rows = [row for (_, level), row in run.level.items() if level == top]
    return bool(rows) and all(row.get("verdict") != "UNRELIABLE" for row in rows)


def cost_target(walls: list[float], labs: int) -> Target:
    if not labs:
        return Target("cost", None, "no lab (--stability-runs 0)")
    if len(walls) < labs:
        return Target("cost", None, f"wall time known for {len(walls)} of {labs} labs")
    detail = (
        f"lab --quick wall time {', '.join(f'{w:.0f}' for w in walls)} s, max {max(walls):.0f} s"
        f"   (target ≤ {COST_S:.0f} s each)"
    )
    return Target("cost", max(walls) <= COST_S, detail)


def print_targets(targets: Sequence[Target]) -> None:
    """One ``TARGET`` line per target, then the ``TARGETS`` line: all met, or which not and which were
    not measured."""
    for t in targets:
        status = "not measured" if t.met is None else "met" if t.met else "NOT met"
        print(f"TARGET  {t.name:<14} {status:<12}  {t.detail}")
    failed = [t.name for t in targets if t.met is False]
    skipped = [t.name for t in targets if t.met is None]
    if not failed and not skipped:
        print(f"TARGETS all {len(targets)} met ({', '.join(t.name for t in targets)})")
        return
    why = [f"NOT met: {', '.join(failed)}"] if failed else []
    why += [f"not measured: {', '.join(skipped)}"] if skipped else []
    print(f"TARGETS NOT all met ({'; '.join(why)})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=20,
        help="repeated replays, ~2 min each (A/A, power, coverage; 0: skip them)",
    )
    parser.add_argument("--levels", default="1,8,32,64", help="concurrency levels of each replay")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per level")
    parser.add_argument(
        "--per-round", type=int, default=6, help="items per round at least (and one per slot)"
    )
    parser.add_argument("--items", type=int, default=0, help="workload items (default: the top level)")
    parser.add_argument(
        "--time-scale",
        default="1:0.25,8:0.25,32:0.1,64:0.05",
        help='simulators\' time scale: one for all ("0.25") or per level ("1:0.5,64:0.1", others 1)',
    )
    parser.add_argument(
        "--deciding-rounds",
        type=int,
        default=12,
        help="deciding rounds each replay may add after its sweep, as the lab does (0: none)",
    )
    parser.add_argument(
        "--stability-runs",
        type=int,
        default=3,
        help="consecutive lab --quick runs, ~150 s each (stability, cost; 0: skip them)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (printed)")
    parser.add_argument("--work", type=Path, help="the work folder (default: a new temporary one)")
    parser.add_argument(
        "--from", dest="from_dir", type=Path, help="analyse a kept folder again; measure nothing"
    )
    return parser.parse_args()


def kept_runs(folder: Path) -> list[RunVerdicts]:
    """A kept folder's runs: run-NN-gK.duckdb (one per scale group) merged per NN."""
    by_run: dict[str, list[Path]] = {}
    for db in sorted(folder.glob("run-*.duckdb")):
        by_run.setdefault(db.stem.split("-")[1], []).append(db)
    return [merged([verdicts_of(db) for db in dbs]) for _, dbs in sorted(by_run.items())]


def measure_group(
    g: int, scale: float, levels: list[int], work: Path, items: list[ReplayItem], opts: argparse.Namespace
) -> list[RunVerdicts]:
    """``opts.runs`` replays of ``levels`` against simulators at ``scale``."""
    out = []
    with running_sims(bench_arms(), work, scale) as sims:
        exp = work / f"exp-g{g}.toml"
        write_experiment(exp, sims)
        for i in range(opts.runs):
            t0 = time.monotonic()
            out.append(replay_once(f"run-{i:02d}-g{g}", work, exp, items, levels, opts))
            r = out[-1]
            print(
                f"  scale {scale:g} c={','.join(map(str, levels))} replay #{i + 1}: "
                f"{time.monotonic() - t0:.0f} s; "
                f"deploy {r.deploy}; health over limit {r.health_over}/{r.health_total}; "
                f"deciding rounds {r.deciding}; "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    return out


def measure_replays(
    work: Path, items: list[ReplayItem], levels: list[int], opts: argparse.Namespace
) -> tuple[list[RunVerdicts], dict[int, tuple[float, float]]]:
    """``opts.runs`` replays of every scale group, merged per run, and the lag-free true ratios."""
    if opts.runs <= 0:
        return [], {}
    t0 = time.monotonic()
    truth = true_ratios(items, levels, opts.per_round, opts.rounds)
    print(
        f"lag-free true eagle3/baseline ratios (decode, throughput), {time.monotonic() - t0:.0f} s: "
        + ", ".join(f"c={c} {d:.3f}x {t:.3f}x" for c, (d, t) in truth.items())
    )
    groups = scale_groups(level_scales(opts.time_scale, levels))
    parts = [measure_group(g, scale, lv, work, items, opts) for g, (scale, lv) in enumerate(groups)]
    return [merged(run_parts) for run_parts in zip(*parts, strict=True)], truth


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def lab_targets(labs: list[RunVerdicts], walls: list[float]) -> list[Target]:
    return [stability_target(labs), cost_target(walls, len(labs))]


def main() -> None:
    opts = parse_args()
    levels = [int(x) for x in opts.levels.split(",")]
    # SIGTERM ends the run like Ctrl-C: the simulators are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    items = mixed_workload(opts.items or max(levels), seed=0, max_tokens_scale=0.5)
    if opts.from_dir is not None:
        runs = kept_runs(opts.from_dir)
        truth = true_ratios(items, levels, opts.per_round, opts.rounds) if runs else {}
        targets = report_replays(runs, levels, truth)
        print_targets([*targets, *lab_targets(*run_labs(0, opts.from_dir, measure=False))])
        return
    work = opts.work or Path(tempfile.mkdtemp(prefix="specproxy-bench-verdicts-"))
    work.mkdir(parents=True, exist_ok=True)
    if opts.keep:
        print(f"work folder (kept): {work}")
    print(f"load average (1, 5, 15 min): {load_average()} on {os.cpu_count()} cores")
    try:
        write_workload(
            work / "workload.jsonl", items
        )  # for specproxy replay by hand, and a record of what was sent
        runs, truth = measure_replays(work, items, levels, opts)
        targets = report_replays(runs, levels, truth)
        print(f"load average after the replays (1, 5, 15 min): {load_average()}")
        targets += lab_targets(*run_labs(opts.stability_runs, work, measure=True))
        print(f"load average at the end (1, 5, 15 min): {load_average()}")
        print_targets(targets)
    finally:
        if opts.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
