"""Benchmark: `specproxy analyze` on a large store of live shadow traffic, compared at matched load.

    python tests/bench/bench_live_analysis.py [--calls 1000000] [--repeat 3] [--work DIR]

Generates serve-like shadow traffic in front of two identical engines, the candidate sampled at 0.2
(tests/spanfactory.py's ``make_live_load_run``: ``--calls`` baseline calls and a fifth as many
copies), with the proxy's 10 s health windows: once all passing, once with three failed (left out,
with the calls in flight during them). Runs `analyze` on each `--repeat` times, alternating, and
prints the median wall time, CPU time and peak RSS, and the candidate's row (a ratio near 1.00x,
NO CLEAR GAIN). What it measures: the matched-load comparison's cost (every call's load from every
other call) and the windows' anti-join, which a paired replay store (bench_analysis.py) never reaches.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.bench_analysis import measure
from tests.spanfactory import live_health_rows, make_live_load_run, write_db

FAILED_WINDOWS = {3, 7, 11}


def candidate_row(db: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "specproxy", "analyze", str(db)], capture_output=True, text=True, check=True
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("live ") and " candidate " in x)
    return " ".join(line.split())


def generate(work: Path, calls: int) -> dict[str, Path]:
    """The two stores (in a child process: a parent holding a million spans would lend its resident
    pages to each child it forks, and the children's peak RSS would count them)."""
    stores = {
        "all windows pass": work / "clean.duckdb",
        f"{len(FAILED_WINDOWS)} windows failed": work / "windows.duckdb",
    }
    if not all(p.exists() for p in stores.values()):
        subprocess.run(
            [sys.executable, __file__, "--generate-into", str(work), "--calls", str(calls)], check=True
        )
    return stores


def write_stores(work: Path, calls: int) -> None:
    start = time.perf_counter()
    run = make_live_load_run(calls, sample=0.2, seed=8)
    write_db(work / "clean.duckdb", [dataclasses.replace(run, health=live_health_rows(run, set()))])
    write_db(
        work / "windows.duckdb", [dataclasses.replace(run, health=live_health_rows(run, FAILED_WINDOWS))]
    )
    print(f"generated {len(run.spans):,} spans in {time.perf_counter() - start:.0f} s: {work}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1_000_000, help="baseline calls to generate")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each analysis (median reported)")
    parser.add_argument("--work", type=Path, help="a folder to keep the stores in (reused when there)")
    parser.add_argument("--generate-into", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.generate_into is not None:
        write_stores(opts.generate_into, opts.calls)
        return
    work = opts.work or Path(tempfile.mkdtemp(prefix="specproxy-live-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    stores = generate(work, opts.calls)
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in stores}
    for _ in range(opts.repeat):
        for name, db in stores.items():
            runs[name].append(measure([sys.executable, "-m", "specproxy", "analyze", str(db)]))
    for name, db in stores.items():
        wall = statistics.median(w for w, _, _ in runs[name])
        cpu = statistics.median(c for _, c, _ in runs[name])
        rss = max(r for _, _, r in runs[name])
        times = ", ".join(f"{w:.1f}" for w, _, _ in runs[name])
        print(f"{name:>18}: analyze median {wall:.1f} s ({times}), CPU {cpu:.1f} s, peak RSS {rss:.0f} MiB")
        print(f"{'':>18}  {candidate_row(db)}")


if __name__ == "__main__":
    main()
