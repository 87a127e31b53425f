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
requests/s an open-loop level actually sent), ``engine_write_delay_p99_s`` (a simulator's P99 time
from a step to its chunk on the socket; with the loop's lag it sets the tail figures' timing
resolution, :mod:`.resolution`), ``event_loop_lag_p99_s`` (the loop's lag in seconds; stores written
before the share existed held it to 50 ms and say so in their rows), the lab's ``sim_time_scale``
per level. A health row's level is named as the spans'
(:data:`~specproxy.analysis.levels.LEVEL_SQL`): its concurrency, its offered rate ('r=2'), else
``live`` (rows of live traffic, written by ``specproxy serve`` every few seconds).

A round holds every arm, so a level can drop a round that failed a check and be judged on the others,
favouring none: a level is judged on its healthy rounds (those none of whose rows failed) when at
least :data:`~specproxy.schema.MIN_HEALTHY_ROUNDS` of them passed and no row of the
whole level (``round`` NULL) failed; otherwise it is UNRELIABLE. Which rounds a level has comes from
its rows, whatever the plan said: replay may add rounds after the planned ones.

Live traffic has no rounds: ``specproxy serve`` writes its rows every few seconds, each write one
window ending at the rows' ``measured_at`` and starting at the previous write's. A live level is
judged without its failed windows (the calls in flight during one are left out, every arm's) when at
least :data:`~specproxy.schema.MIN_HEALTHY_ROUNDS` windows passed and at most
:data:`MAX_FAILED_WINDOW_SHARE` of them failed (the verdict must describe most of the traffic, not the
quiet moments left between stalls); otherwise it is UNRELIABLE.

Levels a replay sent through the proxy (``replay --target``) are held to the same rule as replay's,
and one that has no health rows at all (a store written before the proxy kept them, or a level it
could not check) is not vouched for: UNRELIABLE (:func:`vouched_live`), where a replay level always
has its rows. Serve's own ``live`` level without rows is named as unchecked and still judged.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from specproxy.analysis.levels import LEVEL_SQL, level_name
from specproxy.analysis.store import SpanStore

# replay and the lab add rounds until this many pass: one constant for both sides
from specproxy.schema import MIN_HEALTHY_ROUNDS as MIN_HEALTHY_ROUNDS
from specproxy.schema import over_limit

DEFAULT_THRESHOLDS: dict[str, float] = {
    "engine_clock_lag": 0.02,
    "loadgen_start_lag_p99_s": 0.05,
    "event_loop_lag_share": 0.02,
    "proxy_queue_p99_s": 0.05,
    "open_loop_rate_shortfall": 0.05,
}
LIVE = "live"  # the level of serve's traffic (no concurrency level of its own)
# A live level may leave out at most this share of its health windows and still be judged.
MAX_FAILED_WINDOW_SHARE = 0.5
UNCHECKED = (
    "no health checks recorded for this level sent through the proxy (serve keeps them per level and "
    "round under replay --target): nothing vouches that the engines kept up"
)


@dataclass(frozen=True)
class HealthFailure:
    check: str
    arm: str | None
    round: int | None
    value: float
    threshold: float
    at: float | None = None  # a live row's window end (epoch seconds); None for replay's rows

    def describe(self, with_round: bool = True) -> str:
        where = " ".join(
            bit
            for bit in (self.arm or "client", f"round {self.round}" if self.round and with_round else "")
            if bit
        )
        return f"{self.check} {over_limit(self.check, self.value, self.threshold)} ({where})"


def _listed(failures: Sequence[HealthFailure], limit: int, with_round: bool = True) -> str:
    shown = "; ".join(f.describe(with_round) for f in failures[:limit])
    more = len(failures) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


@dataclass(frozen=True)
class DroppedRound:
    """A round a level was judged without, and the checks it failed (worst first)."""

    round: int
    failures: tuple[HealthFailure, ...]

    def describe(self, limit: int = 3) -> str:
        return f"round {self.round} dropped: {_listed(self.failures, limit, with_round=False)}"


@dataclass(frozen=True)
class DroppedWindow:
    """A live level's health window (epoch seconds, ``start`` None: from the run's start) it was
    judged without, and the checks the window failed (worst first)."""

    start: float | None
    end: float
    failures: tuple[HealthFailure, ...]

    def describe(self, limit: int = 3) -> str:
        end = datetime.fromtimestamp(self.end, UTC).strftime("%H:%M:%S")
        return f"window to {end} UTC dropped: {_listed(self.failures, limit)}"


@dataclass(frozen=True)
class LevelHealth:
    """A level's health: the checks it was measured with, the ones it failed (worst first), the
    rounds its rows name and, live, the windows of its rows (module docstring: which rounds or
    windows it is judged on)."""

    checks: int
    failures: tuple[HealthFailure, ...]
    rounds: tuple[int, ...] = ()
    time_scale: float | None = None  # the lab's simulators ran this fast against their profile's clock
    windows: tuple[float, ...] = ()  # live: the end of each window its rows were written for, sorted
    unchecked: bool = False  # live traffic with no health rows: nothing vouches for it

    @property
    def level_wide(self) -> tuple[HealthFailure, ...]:
        """Failures of rows that hold for the whole level (no round, no window)."""
        return tuple(f for f in self.failures if f.round is None and f.at is None)

    @property
    def failed_windows(self) -> tuple[float, ...]:
        return tuple(sorted({f.at for f in self.failures if f.at is not None}))

    def _windows_ok(self) -> bool:
        failed = len(self.failed_windows)
        if not failed:
            return True
        healthy = len(self.windows) - failed
        return healthy >= MIN_HEALTHY_ROUNDS and failed <= MAX_FAILED_WINDOW_SHARE * len(self.windows)

    @property
    def dropped_windows(self) -> tuple[DroppedWindow, ...]:
        """The failed windows a reliable live level is judged without."""
        if not self.failed_windows or not self.reliable:
            return ()
        failed = set(self.failed_windows)
        starts = dict(zip(self.windows, (None, *self.windows[:-1]), strict=False))
        return tuple(
            DroppedWindow(starts.get(end), end, tuple(f for f in self.failures if f.at == end))
            for end in sorted(failed)
        )

    @property
    def failed_rounds(self) -> tuple[int, ...]:
        return tuple(sorted({f.round for f in self.failures if f.round is not None}))

    @property
    def healthy_rounds(self) -> tuple[int, ...]:
        failed = set(self.failed_rounds)
        return tuple(r for r in self.rounds if r not in failed)

    @property
    def reliable(self) -> bool:
        if self.unchecked:
            return False
        if not self.failures:
            return True
        rounds_ok = not self.failed_rounds or len(self.healthy_rounds) >= MIN_HEALTHY_ROUNDS
        return not self.level_wide and rounds_ok and self._windows_ok()

    @property
    def dropped(self) -> tuple[DroppedRound, ...]:
        """The failed rounds a reliable level is judged without (none when it is unreliable: its
        figures keep every round, and it gets no verdict)."""
        if not self.reliable:
            return ()
        return tuple(
            DroppedRound(r, tuple(f for f in self.failures if f.round == r)) for r in self.failed_rounds
        )

    @property
    def used_rounds(self) -> tuple[int, ...]:
        """The rounds the level is judged on (all of them when none was dropped)."""
        return self.healthy_rounds if self.dropped else self.rounds

    def describe(self, limit: int = 3) -> str:
        """Why the level is unreliable (its failures), or "" when it is not."""
        if self.reliable:
            return ""
        if self.unchecked:
            return UNCHECKED
        text = _listed(self.failures, limit)
        if self.level_wide:
            return text
        if self.failed_windows:
            healthy = len(self.windows) - len(self.failed_windows)
            return (
                f"{text}; {healthy} of {len(self.windows)} health windows passed every check (the level "
                f"is judged without the others when at least {MIN_HEALTHY_ROUNDS} and half of them pass)"
            )
        if not self.healthy_rounds:
            return text
        return (
            f"{text}; {len(self.healthy_rounds)} of {len(self.rounds)} rounds passed every check "
            f"({MIN_HEALTHY_ROUNDS} needed to judge the level on them)"
        )

    def judged_on(self, level: str, limit: int = 3) -> str:
        """The note of a level judged without some rounds, or "" when it dropped none.

        >>> f = HealthFailure("engine_clock_lag", "eagle3", 3, 0.094, 0.02)
        >>> LevelHealth(10, (f,), (1, 2, 3, 4, 5)).judged_on("256")
        'c=256: judged on rounds 1, 2, 4, 5 of 5; round 3 dropped: engine_clock_lag 9.4% > 2.0% (eagle3)'
        """
        if windows := self.dropped_windows:
            shown = "; ".join(w.describe(limit) for w in windows[:limit])
            more = f"; and {len(windows) - limit} more" if len(windows) > limit else ""
            return (
                f"{level_name(level)}: judged without {len(windows)} of {len(self.windows)} health windows "
                f"(the calls in flight during them left out, every arm's); {shown}{more}"
            )
        if not self.dropped:
            return ""
        used = ", ".join(str(r) for r in self.used_rounds)
        dropped = "; ".join(d.describe(limit) for d in self.dropped)
        return f"{level_name(level)}: judged on rounds {used} of {len(self.rounds)}; {dropped}"


def level_health(store: SpanStore, run_id: str) -> dict[str, LevelHealth]:
    """Per level ('1', '8', 'r=2', ..., 'live'): its checks, failures and rounds. Levels without rows
    are absent."""
    rows = store.query(
        f"""
        SELECT {LEVEL_SQL} AS level, arm, round, check_name,
               value, threshold, epoch_us(measured_at) / 1e6 AS at
        FROM health WHERE run_id = ? AND value IS NOT NULL
        """,
        [run_id],
    )
    checks: dict[str, int] = defaultdict(int)
    rounds: dict[str, set[int]] = defaultdict(set)
    windows: dict[str, set[float]] = defaultdict(set)
    failures: dict[str, list[HealthFailure]] = defaultdict(list)
    scales: dict[str, float] = {}
    for r in rows:
        checks[r["level"]] += 1
        # live rows are written window by window: each measured_at is one window's end
        at = float(r["at"]) if r["level"] == LIVE and r["round"] is None and r["at"] is not None else None
        if at is not None:
            windows[r["level"]].add(at)
        if r["check_name"] == "sim_time_scale":
            scales[r["level"]] = min(float(r["value"]), scales.get(r["level"], math.inf))
        if r["round"] is not None:
            rounds[r["level"]].add(int(r["round"]))
        limit = r["threshold"] if r["threshold"] is not None else DEFAULT_THRESHOLDS.get(r["check_name"])
        if limit is not None and r["value"] > limit:
            failures[r["level"]].append(
                HealthFailure(r["check_name"], r["arm"], r["round"], float(r["value"]), float(limit), at)
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
            tuple(sorted(rounds[level])),
            scales.get(level),
            tuple(sorted(windows[level])),
        )
        for level, n in checks.items()
    }


def vouched_live(health: Mapping[str, LevelHealth], levels: Iterable[str]) -> dict[str, LevelHealth]:
    """``health`` with every level of ``levels`` (the loaded levels of traffic through the proxy) that
    has no rows marked unchecked."""
    return {**{level: LevelHealth(0, (), unchecked=True) for level in levels}, **health}


def dropped_rounds(health: Mapping[str, LevelHealth]) -> list[tuple[str, int]]:
    """(level, round) of every round the levels are judged without."""
    return [(level, d.round) for level, h in health.items() for d in h.dropped]


def dropped_windows(health: Mapping[str, LevelHealth]) -> list[tuple[str, float | None, float]]:
    """(level, start, end) of every live window the levels are judged without (epoch seconds)."""
    return [(level, w.start, w.end) for level, h in health.items() for w in h.dropped_windows]
