"""Benchmark: does the interpolated capacity at an SLO agree with a denser sweep around it?

    python tests/bench/bench_capacity.py [--coarse 4,16,64] [--points 5] [--slo ttft_p95=250ms]
                                         [--time-scale 0.25] [--items 64] [--keep]

Runs `specproxy lab --quick` on the coarse levels with the SLO, reads each arm's capacity and its
interval, then runs the lab again on ``--points`` levels evenly spaced across the bracket where the
arms' SLOs stop holding (the lowest holding level to the highest failing one), and prints each arm's
capacity from both sweeps. Target: the dense sweep's capacity lies within the coarse interval. Both
labs run at the same ``--time-scale`` (the lab's probe could otherwise pick different ones, and an SLO
is in measured time).
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


def lab(out: Path, levels: list[int], opts: argparse.Namespace) -> dict[str, Any]:
    """One lab run; the analysis of its span store as JSON (its SLO section)."""
    exe = [sys.executable, "-m", "specproxy"]
    args = ["lab", "--quick", "--no-progress", "--out", str(out), "--concurrency", ",".join(map(str, levels))]
    args += ["--slo", opts.slo, "--time-scale", str(opts.time_scale), "--items", str(opts.items)]
    subprocess.run([*exe, *args], check=True, capture_output=True, text=True)
    analysis = subprocess.run(
        [*exe, "analyze", str(out / "specproxy.duckdb"), "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    )
    slo: dict[str, Any] = json.loads(analysis.stdout)["runs"][0]["slo"]
    return slo


def bracket(slo: dict[str, Any]) -> tuple[float, float] | None:
    """The loads between the lowest holding level and the highest failing one over the arms."""
    lows = [a["capacity"]["crossing"]["holds_at"] for a in slo["arms"] if a["capacity"]]
    highs = [a["capacity"]["crossing"]["fails_at"] for a in slo["arms"] if a["capacity"]]
    lows, highs = [x for x in lows if x], [x for x in highs if x]
    return (min(lows), max(highs)) if lows and highs else None


def capacity_text(arm: dict[str, Any]) -> str:
    c = arm["capacity"]
    if c is None or c["crossing"]["load"] is None:
        return "—"
    return f"{c['crossing']['load']:.1f} [{c['low'] or 0:.1f}, {c['high'] or 0:.1f}] {c['crossing']['state']}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--coarse", default="4,16,64", help="the coarse sweep's levels")
    parser.add_argument("--points", type=int, default=5, help="levels of the dense sweep")
    parser.add_argument("--slo", default="ttft_p95=250ms,e2e_p95=4s", help="the SLO")
    parser.add_argument("--time-scale", type=float, default=0.25, help="simulators' time scale (both labs)")
    parser.add_argument("--items", type=int, default=64, help="requests per arm and level (all rounds)")
    parser.add_argument("--keep", action="store_true", help="keep the labs' folders (printed)")
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specproxy-capacity-"))
    print(f"load average before: {os.getloadavg()[0]:.1f} (on {os.cpu_count()} cores); SLO {opts.slo}")
    coarse = lab(work / "coarse", [int(x) for x in opts.coarse.split(",")], opts)
    span = bracket(coarse)
    if span is None:
        raise SystemExit("no arm crossed its SLO within the coarse sweep: pick another SLO or sweep")
    lo, hi = span
    dense_levels = sorted({round(lo + (hi - lo) * i / (opts.points - 1)) for i in range(opts.points)})
    dense = lab(work / "dense", dense_levels, opts)
    print(f"coarse {opts.coarse}; dense {','.join(map(str, dense_levels))}")
    print(f"{'arm':<12} {'coarse capacity [95% CI]':>34} {'dense capacity':>34}  within")
    for arm in coarse["arms"]:
        other = next(a for a in dense["arms"] if a["arm"] == arm["arm"])
        c, d = arm["capacity"], other["capacity"]
        inside = "—"
        if c and d and d["crossing"]["load"] is not None and c["crossing"]["state"] == "between":
            inside = (
                "yes" if (c["low"] or 0) <= d["crossing"]["load"] <= (c["high"] or float("inf")) else "NO"
            )
        print(f"{arm['arm']:<12} {capacity_text(arm):>34} {capacity_text(other):>34}  {inside}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if opts.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
