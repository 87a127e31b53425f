"""Benchmark: what the quick lab's peak throughput ratio is when nothing lags, by the length of a round.

    python tests/bench/bench_peak_truth.py [--level 256] [--waves 1,2,3,4,6]

The quick lab reads each arm's peak throughput at its top level (c=256) as a round's tokens over the time
from its first call to its last answer. That figure depends on how many waves of calls a round holds: a
round of one wave is mostly the drain of its longest calls. This drives the simulator's engine on a
virtual clock (nothing lags, all calls arrive when the closed loop sends them, the prefix cache warmed by
one unrecorded pass) with the lab's arms (:data:`specproxy.lab.LAB_ARMS`) and the quick lab's workload
(:func:`specproxy.proxy.replay.workload.mixed_workload`, seed 0, answers at the quick lab's scale), and
prints each arm's throughput over the baseline's for rounds of ``--waves`` × ``--level`` calls:

- ``round``: the round's tokens over first call to last answer, as the lab measures it;
- ``steady``: the tokens emitted while every slot stayed busy (the first call to the last call's start)
  over that stretch, read from the simulator's step timeline: the rate a peak sustains (empty for a
  round of one wave, whose calls all start at once).

Takes 20-60 s of one core.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specproxy.engines.profiles import load_profile
from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.engine import EngineCore
from specproxy.lab.arms import DEFAULT_PROFILE, LAB_ARMS, LAB_MODEL
from specproxy.lab.plan import QUICK
from specproxy.proxy.replay.formats import ReplayItem
from specproxy.proxy.replay.workload import mixed_workload
from tests.bench.bench_verdicts import closed_loop_virtual


@dataclass(frozen=True)
class RoundRates:
    round_tok_s: float  # tokens over first call to last answer
    steady_tok_s: float | None  # tokens while every slot was busy, over that stretch


def closed_round(
    core: EngineCore, config: SimConfig, items: Sequence[ReplayItem], level: int, clock: list[float], tag: str
) -> RoundRates:
    """One closed-loop round of ``items`` at ``level`` from virtual time ``clock[0]``, drained."""
    t0 = clock[0]
    started: list[float] = []
    done = closed_loop_virtual(core, config, items, level, clock, tag, started)
    tokens = sum(seq.n_out for seq in done)
    last_start = max(started, default=t0)
    steady = None
    if last_start > t0:
        emitted = sum(
            n
            for seq in done
            for at, n in zip(seq.truth.emit_times, seq.truth.emit_tokens, strict=True)
            if at <= last_start
        )
        steady = emitted / (last_start - t0)
    return RoundRates(tokens / (clock[0] - t0), steady)


def arm_rates(spec: dict[str, object] | None, items: Sequence[ReplayItem], level: int) -> RoundRates:
    config = SimConfig(
        model=LAB_MODEL,
        profile=DEFAULT_PROFILE,
        speculative=SpeculativeConfig.from_dict(dict(spec)) if spec else None,
    )
    core = EngineCore(config, load_profile(DEFAULT_PROFILE))
    clock = [0.0]
    # An unrecorded pass first: the prefix cache as the lab's warm-up leaves it.
    closed_round(core, config, items, level, clock, "warm")
    return closed_round(core, config, items, level, clock, "round")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--level", type=int, default=max(QUICK.levels), help="calls in flight (default: %(default)s)"
    )
    parser.add_argument("--waves", default="1,2,3,4,6", help="round lengths in waves (default: %(default)s)")
    opts = parser.parse_args()
    waves = [int(w) for w in opts.waves.split(",")]
    names = [name for name, _ in LAB_ARMS if name != "baseline"]
    print(f"lag-free throughput over the baseline's at c={opts.level}, {DEFAULT_PROFILE}, by round length")
    print(f"{'waves':>5} {'calls':>6}  " + "  ".join(f"{n:>21}" for n in names))
    print(f"{'':>5} {'':>6}  " + "  ".join(f"{'round':>10} {'steady':>10}" for _ in names))
    for w in waves:
        items = mixed_workload(w * opts.level, seed=0, max_tokens_scale=QUICK.max_tokens_scale)
        rates = {name: arm_rates(spec, items, opts.level) for name, spec in LAB_ARMS}
        base = rates["baseline"]
        cells = []
        for name in names:
            r = rates[name]
            steady = (
                f"{r.steady_tok_s / base.steady_tok_s:.3f}"
                if r.steady_tok_s is not None and base.steady_tok_s
                else "—"
            )
            cells.append(f"{r.round_tok_s / base.round_tok_s:>10.3f} {steady:>10}")
        print(f"{w:>5} {len(items):>6}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
