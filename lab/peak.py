"""Where the lab judges the peak when this machine could not measure its top level soundly.

Without ``--peak-concurrency`` the deploy verdict reads peak throughput at the sweep's top level. On
a busy machine that level can fail: its pacing wave at the slowest time scale still found the machine
short of room (the lab then skips it, see :class:`~specproxy.lab.pacing.SimPacer`), or too few of its
rounds passed the health checks. The lab then judges the peak at the highest level it measured
soundly and says so in a label that stands in the run's title, beside the deploy verdicts and on the
lab's own lines ("judged at c=64: c=256 could not be measured on this machine (...)"): the question
changes only in the open. A peak the user gave is never moved: its verdict stays UNRELIABLE, with the
way to judge elsewhere.

The move is recorded with the run (:func:`record_move`: ``runs.config_json``'s
:data:`~specproxy.schema.JUDGED_PEAK_KEY`), and the lab's own table is ``analyze``'s reading of it: a
later ``specproxy analyze`` of the store judges the peak at the same level, with the same label and
why, until ``--peak-concurrency`` asks for another.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb

from specproxy.lab.pacing import SimPacer
from specproxy.proxy.replay.extra_rounds import LevelRounds, judged
from specproxy.proxy.replay.planning import PeakJudge
from specproxy.schema import JUDGED_PEAK_KEY


@dataclass(frozen=True, slots=True)
class PeakMove:
    """The level the peak is judged at instead of the sweep's top one, and why."""

    level: int
    label: str  # judged at c=64: c=256 could not be measured on this machine
    why: str  # what each level above it showed


def _failed(level: int, rounds: LevelRounds | None, pacer: SimPacer | None) -> str:
    """Why a level was not measured soundly."""
    skipped = next((p for p in pacer.skipped if p.level == level), None) if pacer is not None else None
    if skipped is not None:
        return f"{skipped.why_skipped()}: skipped"
    if rounds is None or rounds.ran == 0:
        return "not measured"
    return f"{rounds.healthy} of {rounds.ran} rounds passed the health checks"


def judged_peak(
    planned: Sequence[int], measured: Sequence[LevelRounds], pacer: SimPacer | None
) -> PeakMove | None:
    """The highest level of the closed-loop sweep ``planned`` that was measured soundly, when the top
    one was not; None when the top one was, or when no level was (then nothing can be judged)."""
    by_level = {int(lv.level[2:]): lv for lv in measured if lv.level.startswith("c=")}
    sound = [c for c, lv in by_level.items() if c in planned and lv.ran > 0 and judged(lv.ran, lv.healthy)]
    top = max(planned)
    if not sound or top in sound:
        return None
    peak = max(sound)
    failed = [c for c in sorted(planned) if c > peak]
    levels = ", ".join(f"c={c}" for c in failed)
    why = "; ".join(
        f"c={c}: {_failed(c, by_level.get(c), pacer)}"
        if len(failed) > 1
        else _failed(c, by_level.get(c), pacer)
        for c in failed
    )
    return PeakMove(peak, f"judged at c={peak}: {levels} could not be measured on this machine", why)


def peak_judge(planned: Sequence[int], pacer: SimPacer | None) -> PeakJudge:
    """:func:`judged_peak`'s level, as replay's deciding rounds ask for it after the sweep (None: the
    top level, or no level measured soundly)."""

    def level(measured: Sequence[LevelRounds]) -> int | None:
        move = judged_peak(planned, measured, pacer)
        return None if move is None else move.level

    return level


def record_move(db_path: Path, run_id: str, move: PeakMove) -> None:
    """Record ``move`` with the run in the span store, where ``analyze`` reads it back."""
    with duckdb.connect(str(db_path)) as conn:
        found = conn.execute("SELECT config_json FROM runs WHERE run_id = ?", [run_id]).fetchone()
        if found is None:
            return  # a run interrupted before its row was written has nothing to judge
        config = json.loads(found[0] or "{}")
        config[JUDGED_PEAK_KEY] = {"concurrency": move.level, "label": move.label, "why": move.why}
        conn.execute(
            "UPDATE runs SET config_json = ? WHERE run_id = ?", [json.dumps(config, sort_keys=True), run_id]
        )
