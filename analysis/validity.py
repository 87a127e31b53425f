"""Validity gates: a level measured on a machine that could not keep up gets no verdict.

Replay and the lab write the measurement's own health into the span store's ``health`` table, per
level, round and (for engine checks) arm. A level is UNRELIABLE when any check's value exceeds its
threshold; a row without a threshold is held to the default below:

==========================  =========  ==================================================================
check                       default    what it measures
==========================  =========  ==================================================================
engine_clock_lag            0.02       share of the run a simulator fell behind its own clock (2 %)
loadgen_start_lag_p99_s     0.05 s     P99 delay of the load generator's sends behind their schedule
event_loop_lag_share        0.02       mean lag of the client's event loop over the median decode time
proxy_queue_p99_s           0.05 s     P99 time a call waited in the proxy before its upstream send
open_loop_rate_shortfall    0.05       an open-loop level: 1 − the rate calls left at / the schedule's
==========================  =========  ==================================================================

A check of another name with no threshold is shown and never gates: ``open_loop_achieved_rate`` (the
requests/s an open-loop level actually sent), ``event_loop_lag_p99_s`` (the loop's lag in seconds;
stores written before the share existed held it to 50 ms and say so in their rows), the lab's
``sim_time_scale`` per level. A health row's level is named as the spans'
(:data:`~specproxy.analysis.levels.LEVEL_SQL`): its concurrency, its offered rate ('r=2'), else
``live`` (rows of live traffic, written by ``specproxy serve`` every few seconds).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from specproxy.analysis.levels import LEVEL_SQL
from specproxy.analysis.store import SpanStore

DEFAULT_THRESHOLDS: dict[str, float] = {
    "engine_clock_lag": 0.02,
    "loadgen_start_lag_p99_s": 0.05,
    "event_loop_lag_share": 0.02,
    "proxy_queue_p99_s": 0.05,
    "open_loop_rate_shortfall": 0.05,
}
# Checks whose value is a share (shown as a percentage); the others ending in _s are seconds.
SHARE_CHECKS = frozenset({"engine_clock_lag", "event_loop_lag_share", "open_loop_rate_shortfall"})


@dataclass(frozen=True)
class HealthFailure:
    check: str
    arm: str | None
    round: int | None
    value: float
    threshold: float

    def describe(self) -> str:
        where = " ".join(
            bit for bit in (self.arm or "client", f"round {self.round}" if self.round else "") if bit
        )
        if self.check in SHARE_CHECKS:
            figures = f"{self.value:.1%} > {self.threshold:.1%}"
        elif self.check.endswith("_s"):
            figures = f"{self.value * 1000:.1f} ms > {self.threshold * 1000:.1f} ms"
        else:
            figures = f"{self.value:.3g} > {self.threshold:.3g}"
        return f"{self.check} {figures} ({where})"


@dataclass(frozen=True)
class LevelHealth:
    """A level's health: the checks it was measured with and the ones it failed (worst first)."""

    checks: int
    failures: tuple[HealthFailure, ...]

    @property
    def reliable(self) -> bool:
        return not self.failures

    def describe(self, limit: int = 3) -> str:
        shown = "; ".join(f.describe() for f in self.failures[:limit])
        more = len(self.failures) - limit
        return shown + (f"; and {more} more" if more > 0 else "")


def level_health(store: SpanStore, run_id: str) -> dict[str, LevelHealth]:
    """Per level ('1', '8', 'r=2', ..., 'live'): its checks and failures. Levels without rows are absent."""
    rows = store.query(
        f"""
        SELECT {LEVEL_SQL} AS level, arm, round, check_name,
               value, threshold
        FROM health WHERE run_id = ? AND value IS NOT NULL
        """,
        [run_id],
    )
    checks: dict[str, int] = defaultdict(int)
    failures: dict[str, list[HealthFailure]] = defaultdict(list)
    for r in rows:
        checks[r["level"]] += 1
        limit = r["threshold"] if r["threshold"] is not None else DEFAULT_THRESHOLDS.get(r["check_name"])
        if limit is not None and r["value"] > limit:
            failures[r["level"]].append(
                HealthFailure(r["check_name"], r["arm"], r["round"], float(r["value"]), float(limit))
            )
    return {
        level: LevelHealth(
            n,
            tuple(
                sorted(
                    failures[level],
                    key=lambda f: (-f.value / f.threshold, f.check, f.arm or "", f.round or 0),
                )
            ),
        )
        for level, n in checks.items()
    }
