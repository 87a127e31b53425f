"""Benchmark: `specproxy analyze` and `report` on millions of synthetic spans, against their targets.

    python tests/bench/bench_analysis.py [--rows 10000000] [--repeat 3] [--keep]

Generates one paired replay run (4 arms × 4 concurrency levels) inside DuckDB (tests/spanfactory.py's
``generate_sql``), then runs each command as a subprocess `--repeat` times and prints the median wall
time and the peak RSS (the child's ru_maxrss from wait4). Targets: analyze ≤ 10 s (also with an SLO,
its goodput, capacity and fleet), report ≤ 30 s, all within 2 GiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.spanfactory import generate_sql

TARGETS = {"analyze": (10.0, 2048.0), "analyze+slo": (10.0, 2048.0), "report": (30.0, 2048.0)}
SLO = ["--slo", "ttft_p95=100ms,e2e_p95=4s", "--peak-concurrency", "128", "--gpu-hour-usd", "2.5"]


def measure(args: list[str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MiB) of one subprocess."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        err = proc.stderr.read().decode() if proc.stderr else ""
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}): {err}")
    if proc.stderr:
        proc.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024.0  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000, help="synthetic spans to generate")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command (median reported)")
    parser.add_argument("--keep", action="store_true", help="keep the generated file (printed) for reuse")
    parser.add_argument("--db", type=Path, help="use this existing file instead of generating one")
    opts = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="specproxy-bench-"))
    db = opts.db
    if db is None:
        db = workdir / "bench.duckdb"
        t0 = time.perf_counter()
        generate_sql(db, opts.rows)
        print(f"generated {opts.rows:,} spans in {time.perf_counter() - t0:.1f} s: {db}")
    exe = [sys.executable, "-m", "specproxy"]
    commands = {
        "analyze": [*exe, "analyze", str(db)],
        "analyze+slo": [*exe, "analyze", str(db), *SLO],
        "report": [*exe, "report", str(db), "-o", str(workdir / "report.html")],
    }
    print(f"load average before: {os.getloadavg()[0]:.1f} (on {os.cpu_count()} cores)")
    header = ("command", "median s", "runs s", "CPU s", "peak RSS MiB", "target")
    print(f"{header[0]:<12} {header[1]:>9} {header[2]:>22} {header[3]:>7} {header[4]:>13} {header[5]:>18} ok")
    failed = False
    for name, args in commands.items():
        runs = [measure(args) for _ in range(opts.repeat)]
        walls = [w for w, _, _ in runs]
        cpu = statistics.median(c for _, c, _ in runs)
        rss = max(r for _, _, r in runs)
        limit_s, limit_mib = TARGETS[name]
        ok = statistics.median(walls) <= limit_s and rss <= limit_mib
        failed |= not ok
        print(
            f"{name:<12} {statistics.median(walls):>9.2f} {', '.join(f'{w:.2f}' for w in walls):>22} "
            f"{cpu:>7.1f} {rss:>13.0f} {f'≤{limit_s:.0f} s, ≤{limit_mib:.0f} MiB':>18}  "
            f"{'yes' if ok else 'NO'}"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if opts.keep:
        print(f"kept {workdir}")
    else:
        shutil.rmtree(workdir)  # the generated store and the report (never a --db file: it lives elsewhere)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
