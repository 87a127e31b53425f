"""Timing resolution: the noise one inter-token gap can carry, and the tail figures it leaves unresolved.

A chunk's arrival is stamped when the measuring process's event loop gets to it, and a simulator hands
a chunk to its socket some time after the step that made it landed. Both are small and vary from
chunk to chunk, so a gap (the difference of two arrivals) is off by up to their sum either way. A mean,
a median or TPOT averages that away; an ITL P95, P99 or the largest stall is a single gap, or a few,
and carries it whole. Per level and round the health table holds the two bounds:

    event_loop_lag_p99_s       the measuring loop's P99 lag: replay's client, or serve's proxy (level
                               ``live``)
    engine_write_delay_p99_s   per simulator arm: the P99 time from a step landing to its chunk going
                               to the socket (real engines report none; then the loop lag alone counts)

The loop lag is sampled by sleeping and timing the wake-up, so it also holds the loop's timer
granularity (a timer fires up to about a millisecond past its time: ~1.7 ms P99 on an idle loop here),
which a socket read does not wait for: the resolution errs on the side of calling a tail unresolved.
An arm's resolution at a level is the worst round's sum. A tail figure is *resolved* when the
resolution is at most :data:`RESOLVED_SHARE` of it: then no single late stamp moves it by more than
that. An unresolved figure is still what was measured; it says as much about the machine as about the
engine, and its note says by how much.

>>> r = TimingResolution(0.0012, 0.0019)
>>> round(r.total_s, 4), r.resolves(0.200), r.resolves(0.060), r.resolves(None)
(0.0031, True, False, None)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from specproxy.analysis.levels import LEVEL_SQL, level_name
from specproxy.analysis.store import SpanStore

LOOP_LAG = "event_loop_lag_p99_s"
WRITE_DELAY = "engine_write_delay_p99_s"
# The share of a tail figure that its level's timing noise may reach: the accuracy asked of the
# per-request ITL figures against the engine's own step timeline.
RESOLVED_SHARE = 0.02


@dataclass(frozen=True)
class TimingResolution:
    """The noise a single gap can carry at one level: the measuring loop's lag P99 plus the engine's
    write delay P99 (None: not a simulator), from the same round (the level's worst)."""

    loop_lag_p99_s: float | None
    write_delay_p99_s: float | None

    @property
    def total_s(self) -> float:
        return (self.loop_lag_p99_s or 0.0) + (self.write_delay_p99_s or 0.0)

    def resolves(self, figure_s: float | None) -> bool | None:
        """Whether a figure of ``figure_s`` seconds is resolved (None for no figure)."""
        if figure_s is None:
            return None
        return self.total_s <= RESOLVED_SHARE * figure_s


def timing_resolutions(store: SpanStore, run_id: str) -> dict[tuple[str | None, str], TimingResolution]:
    """(arm, level) → the worst round's resolution for arms with a write delay; (None, level) → the
    loop lag's alone, for the other arms. Levels without either row are absent."""
    rows = store.query(
        f"""
        SELECT {LEVEL_SQL} AS level, round, arm, check_name, max(value) AS value
        FROM health
        WHERE run_id = ? AND check_name IN ('{LOOP_LAG}', '{WRITE_DELAY}') AND value IS NOT NULL
        GROUP BY ALL
        """,
        [run_id],
    )
    loop: dict[tuple[str, int | None], float] = {}
    write: dict[tuple[str, int | None], dict[str, float]] = defaultdict(dict)
    for r in rows:
        key = (r["level"], r["round"])
        if r["check_name"] == LOOP_LAG and r["arm"] is None:
            loop[key] = max(loop.get(key, 0.0), float(r["value"]))
        elif r["check_name"] == WRITE_DELAY and r["arm"] is not None:
            write[key][r["arm"]] = float(r["value"])
    candidates: dict[tuple[str | None, str], list[TimingResolution]] = defaultdict(list)
    for key in loop.keys() | write.keys():
        level, lag = key[0], loop.get(key)
        if lag is not None:
            candidates[(None, level)].append(TimingResolution(lag, None))
        for arm, delay in write.get(key, {}).items():
            candidates[(arm, level)].append(TimingResolution(lag, delay))
    return {key: max(found, key=lambda r: r.total_s) for key, found in candidates.items()}


def resolution_for(
    resolutions: dict[tuple[str | None, str], TimingResolution], arm: str, level: str
) -> TimingResolution | None:
    """The arm's resolution at the level: its own (a simulator's), else the loop lag's alone."""
    return resolutions.get((arm, level)) or resolutions.get((None, level))


ArmTails = tuple[str, TimingResolution, dict[str, float | None]]  # arm, its resolution, its tail figures


def resolution_note(level: str, arms: Sequence[ArmTails]) -> str | None:
    """One sentence for a level: which ITL tails its timing noise leaves unresolved, for which of
    ``arms`` ((arm, its resolution, its tails: name → seconds)), and by how much (the noise as a share
    of the smallest unresolved tail, arm by arm, as a range). None when every tail is resolved."""
    unresolved = []
    for arm, resolution, tails in arms:
        missed = {name: v for name, v in tails.items() if v is not None and resolution.resolves(v) is False}
        if missed:
            unresolved.append((arm, resolution, missed))
    if not unresolved:
        return None
    names = [n for n in ("P95", "P99", "max") if any(n in missed for _, _, missed in unresolved)]
    noise = [r.total_s for _, r, _ in unresolved]
    shares = [r.total_s / min(missed.values()) for _, r, missed in unresolved]
    loop = [r.loop_lag_p99_s for _, r, _ in unresolved if r.loop_lag_p99_s is not None]
    write = [r.write_delay_p99_s for _, r, _ in unresolved if r.write_delay_p99_s is not None]
    measurer = "proxy" if level == "live" else "client"
    parts = [f"{measurer} loop lag P99 {_ms_range(loop)}"] if loop else []
    parts += [f"simulator write delay P99 {_ms_range(write)}"] if write else []
    who = "every arm" if len(unresolved) == len(arms) else ", ".join(arm for arm, _, _ in unresolved)
    where = level if level == "live" else level_name(level)
    return (
        f"ITL {'/'.join(names)} at {where} carry up to ±{_ms_range(noise)} of timing noise "
        f"({' + '.join(parts)}): ±{_pct_range(shares)} of the figures ({who}; trusted at ≤ "
        f"{RESOLVED_SHARE * 100:.0f} %)"
    )


def _ms_range(values_s: Sequence[float]) -> str:
    low, high = min(values_s) * 1000, max(values_s) * 1000
    return f"{high:.1f} ms" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}–{high:.1f} ms"


def _pct_range(shares: Sequence[float]) -> str:
    low, high = min(shares) * 100, max(shares) * 100
    return f"{high:.0f} %" if f"{low:.0f}" == f"{high:.0f}" else f"{low:.0f}–{high:.0f} %"
