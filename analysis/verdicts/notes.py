"""The notes a run's evaluation carries: the health of its levels in one line, what else a reader must
know, and the arms' recorded stacks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from specproxy.analysis.levels import level_name, level_sort_key
from specproxy.analysis.verdicts import rules
from specproxy.analysis.verdicts.measured import RunFigures
from specproxy.analysis.verdicts.rows import LevelRow


def _health_note(run: RunFigures, rows: Sequence[LevelRow]) -> str:
    """Which levels the measurement's own checks vouch for, in one line: a level with no checks recorded
    (a store from before them, traffic nobody checked) is named, not trusted silently; and the time
    scale the lab slowed a level to, which moves its tok/s but not its ratios."""
    levels = sorted({r.level for r in rows if r.level_load is not None}, key=level_sort_key)
    health = {lv: run.health.get(lv) for lv in levels}

    def named(chosen: list[str]) -> str:
        return ", ".join(level_name(lv) for lv in chosen)

    clean = [lv for lv, h in health.items() if h is not None and h.reliable and not h.dropped]
    parts = [f"{named(clean)} passed every check"] if clean else []
    parts += [
        f"{level_name(lv)} judged on {len(h.used_rounds)} of {len(h.rounds)} rounds"
        for lv, h in health.items()
        if h is not None and h.reliable and h.dropped
    ]
    if bad := [lv for lv, h in health.items() if h is not None and not h.reliable]:
        parts.append(f"{named(bad)} UNRELIABLE")
    if unchecked := [lv for lv, h in health.items() if h is None]:
        parts.append(f"{named(unchecked)}: no health checks recorded, not vouched for")
    slowed = [
        f"{level_name(lv)} {h.time_scale:g}"
        for lv, h in health.items()
        if h is not None and h.time_scale is not None and h.time_scale != 1.0
    ]
    if slowed:
        parts.append(f"simulators slowed to keep up (time scale) at {', '.join(slowed)}: tok/s scale with it")
    return "health: " + "; ".join(parts) if parts else ""


def run_notes(run: RunFigures, rows: Sequence[LevelRow]) -> list[str]:
    health = _health_note(run, rows)
    notes = [health] if health else []
    for level, h in sorted(run.health.items(), key=lambda x: level_sort_key(x[0])):
        lv = level_name(level)
        if not h.reliable:
            notes.append(f"{lv} UNRELIABLE: {h.describe()}; no verdicts there, left out of crossovers")
        elif h.dropped or h.dropped_windows:
            notes.append(h.judged_on(level))
    for r in rows:
        if r.load is not None and r.load.unequal and r.verdict is not None:
            at = f"at load {r.load.compared_at:.1f}, {r.load.method}" if r.load.compared_at else ""
            how = f"not compared at matched load ({r.load.describe()})" if r.decode_speedup is None else ""
            notes.append(
                f"{r.arm} {level_name(r.level)}: {how or f'compared at matched load ({at})'}; no by-category "
                "figures (its calls ran at another load than the baseline's)"
            )
    notes += [rules.shadow_note(arm) for arm in sorted({r.arm for r in rows if r.shadow})]
    for r in rows:
        if r.own_tokens_estimated:
            notes.append(
                f"{r.arm} {level_name(r.level)}: token counts "
                f"{r.tokens_source}: its tok/s and the speedups on them (marked ~) are estimates"
            )
    one_round = sorted({r.level for r in rows if r.drift_note and r.verdict is not None}, key=level_sort_key)
    if one_round:
        levels = ", ".join(level_name(lv) for lv in one_round)
        notes.append(
            f"{levels}: 1 round: cannot see between-run drift (the intervals see drift within the run, "
            "in time blocks); replay with --rounds 3 or more"
        )
    return notes


def stacks(info: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    try:
        stacks = json.loads(info["stacks_json"]) if info.get("stacks_json") else {}
    except ValueError:
        notes.append("runs.stacks_json is not valid JSON; stacks not shown")
        return {}
    return stacks if isinstance(stacks, dict) else {}
