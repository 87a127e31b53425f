"""Benchmark: does the interpolated capacity at an SLO agree with a denser sweep around it?

    python tests/bench/bench_capacity.py [--coarse 4,16,64 | --rates 1,4,16,30] [--points 5]
                                         [--slo ttft_p95=250ms] [--time-scale 0.125] [--items 64]
                                         [--keep] [--coarse-from KEPT/coarse]

Runs `specproxy lab --quick` (no replica: it plays no part in a capacity) on the coarse levels with the
SLO, reads each arm's capacity and its interval, then runs the lab again on ``--points`` levels evenly
spaced across the bracket where the arms' SLOs stop holding (the lowest holding level to the highest
failing one), and prints each arm's capacity from both sweeps. ``--rates`` sweeps open-loop request
rates instead of concurrency (capacity in req/s). Target: for every arm whose SLO stops holding
between two reliable coarse levels, the dense sweep's capacity lies within the coarse interval. Both
labs run at the same ``--time-scale`` (the lab's probe could otherwise pick different ones, and an SLO
is in measured time). Levels the validity gates mark UNRELIABLE are left out of a capacity; the bench
prints them. ``--coarse-from`` analyses a kept coarse lab at another ``--slo`` instead of running it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def lab(out: Path, levels: list[float], opts: argparse.Namespace) -> dict[str, Any]:
    """One lab run; the analysis of its span store as JSON (its SLO section)."""
    exe = [sys.executable, "-m", "specproxy"]
    sweep = ["--rates", ",".join(f"{x:g}" for x in levels)] if opts.rates else ["--concurrency"]
    if not opts.rates:
        sweep.append(",".join(str(int(x)) for x in levels))
    args = ["lab", "--quick", "--no-progress", "--no-replica", "--out", str(out), *sweep]
    args += ["--slo", opts.slo, "--time-scale", str(opts.time_scale), "--items", str(opts.items)]
    if not (out / "specproxy.duckdb").exists():
        subprocess.run([*exe, *args], check=True, capture_output=True, text=True)
    analysis = subprocess.run(
        [*exe, "analyze", str(out / "specproxy.duckdb"), "--format", "json", "--slo", opts.slo],
        check=True,
        capture_output=True,
        text=True,
    )
    slo: dict[str, Any] = json.loads(analysis.stdout)["runs"][0]["slo"]
    return slo


def bracket(slo: dict[str, Any]) -> tuple[float, float] | None:
    """The loads between the lowest holding level and the highest failing one over the arms that
    stop holding between two tested levels."""
    crossings = [a["capacity"]["crossing"] for a in slo["arms"] if a["capacity"]]
    between = [c for c in crossings if c["state"] == "between"]
    if not between:
        return None
    return min(c["holds_at"] for c in between), max(c["fails_at"] for c in between)


def dense_levels(lo: float, hi: float, points: int, rates: bool) -> list[float]:
    """``points`` loads evenly across [lo, hi]: whole concurrencies, or rates to two significant digits."""
    raw = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
    return sorted({float(f"{x:.2g}") if rates else float(round(x)) for x in raw})


def capacity_text(arm: dict[str, Any]) -> str:
    c = arm["capacity"]
    if c is None or c["crossing"]["load"] is None:
        return "—"
    low = f"{c['low']:.3g}" if c["low"] is not None else f"<{min(c['loads']):g}"
    high = "—" if c["high"] is None else f"{'≥' if c['high_open'] else ''}{c['high']:.3g}"
    return f"{c['crossing']['load']:.3g} [{low}, {high}] {c['crossing']['state']}"


def within(coarse: dict[str, Any], dense: dict[str, Any]) -> str:
    """yes / NO: the dense capacity inside the coarse interval; — when either sweep gives no crossing
    between two of its levels (a capacity that held at every dense level is only a lower bound)."""
    c, d = coarse["capacity"], dense["capacity"]
    if not c or not d or c["crossing"]["state"] != "between" or d["crossing"]["state"] != "between":
        return "—"
    low, high = c["low"] or 0.0, c["high"] if c["high"] is not None else float("inf")
    return "yes" if low <= d["crossing"]["load"] <= high else "NO"


def print_left_out(name: str, slo: dict[str, Any]) -> None:
    for arm in slo["arms"]:
        if arm["left_out"]:
            print(f"  {name} {arm['arm']}: left out {', '.join(arm['left_out'])}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--coarse", default="4,16,64", help="the coarse sweep's concurrency levels")
    parser.add_argument("--rates", default="", help="a coarse sweep of request rates (req/s) instead")
    parser.add_argument("--points", type=int, default=5, help="levels of the dense sweep")
    parser.add_argument("--slo", default="e2e_p95=6s", help="the SLO")
    parser.add_argument("--time-scale", type=float, default=0.125, help="simulators' time scale (both labs)")
    parser.add_argument("--items", type=int, default=64, help="requests per arm and level (all rounds)")
    parser.add_argument("--keep", action="store_true", help="keep the labs' folders (printed)")
    parser.add_argument(
        "--coarse-from", type=Path, help="a kept coarse lab folder to analyse at --slo instead of a new lab"
    )
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specproxy-capacity-"))
    if opts.coarse_from:
        shutil.copytree(opts.coarse_from, work / "coarse")
    coarse_levels = [float(x) for x in (opts.rates or opts.coarse).split(",")]
    axis = "rates (req/s)" if opts.rates else "concurrency"
    print(f"load average before: {os.getloadavg()[0]:.1f} (on {os.cpu_count()} cores); SLO {opts.slo}")
    print(f"axis {axis}, time scale {opts.time_scale:g}, {opts.items} items per arm and level")
    coarse = lab(work / "coarse", coarse_levels, opts)
    print(f"load average after the coarse lab: {os.getloadavg()[0]:.1f}")
    span = bracket(coarse)
    if span is None:
        for arm in coarse["arms"]:
            print(f"  {arm['arm']}: {arm['text']}")
        print_left_out("coarse", coarse)
        raise SystemExit("no arm crossed its SLO between two reliable coarse levels: pick another SLO")
    dense_at = dense_levels(*span, opts.points, bool(opts.rates))
    dense = lab(work / "dense", dense_at, opts)
    print(f"coarse {','.join(f'{x:g}' for x in coarse_levels)}; dense {','.join(f'{x:g}' for x in dense_at)}")
    print(f"{'arm':<12} {'coarse capacity [95% CI]':>32} {'dense capacity [95% CI]':>32}  within")
    verdicts = []
    for arm in coarse["arms"]:
        other = next(a for a in dense["arms"] if a["arm"] == arm["arm"])
        verdicts.append(within(arm, other))
        print(f"{arm['arm']:<12} {capacity_text(arm):>32} {capacity_text(other):>32}  {verdicts[-1]}")
    print_left_out("coarse", coarse)
    print_left_out("dense", dense)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    checked = [v for v in verdicts if v != "—"]
    outcome = "not measured" if not checked else "met" if all(v == "yes" for v in checked) else "NOT met"
    print(
        f"target (dense capacity within the coarse interval): {outcome}, {checked.count('yes')} of "
        f"{len(checked)} arms with a crossing between levels in both sweeps "
        f"({len(verdicts) - len(checked)} not checkable)"
    )
    if opts.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
