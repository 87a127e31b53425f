"""How long the README's first command takes: `specproxy lab --quick`, end to end, as a user runs it.

    python tests/bench/bench_lab.py [--repeats 1] [-- extra lab options]

Prints the wall time of each run, the machine's load average before and after (a busy machine runs the
simulators slower), and the simulator clock lag the lab itself reports. The tests check what the lab
finds, not how fast: this is where the time quoted in the README comes from.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one_run(extra: list[str]) -> tuple[float, int, str]:
    """(seconds, exit code, the lab's clock-lag line) of one `specproxy lab --quick`."""
    with tempfile.TemporaryDirectory(prefix="bench-lab-") as tmp:
        cmd = [sys.executable, "-m", "specproxy", "lab", "--quick", "--no-progress", "--out", tmp, *extra]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
        seconds = time.perf_counter() - t0
    lag = next((line.strip() for line in res.stderr.splitlines() if "clock lag" in line), "no clock lag line")
    if res.returncode != 0:
        print(res.stdout + res.stderr, file=sys.stderr)
    return seconds, res.returncode, lag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("extra", nargs="*", help="more `specproxy lab` options, after --")
    args = ap.parse_args()
    print(f"cores: {os.cpu_count()}, load average before: {os.getloadavg()[0]:.2f}")
    for i in range(args.repeats):
        seconds, code, lag = one_run(args.extra)
        print(f"run {i + 1}: {seconds:.1f} s, exit {code}; {lag}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
