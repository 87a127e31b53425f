"""What a level is: a closed-loop concurrency, an open-loop offered rate, or live traffic.

Every query groups calls by one label, :data:`LEVEL_SQL` (:func:`specproxy.schema.level_sql`):

    '16'      closed loop at 16 calls in flight          load 16, unit 'c'
    'r=2'     open loop, Poisson arrivals at 2 req/s     load 2.0, unit 'r'
    'live'    serve's traffic (no level of its own)      no load

Levels sort by kind (concurrency levels, then rates, then the rest) and, within a kind, by load.

>>> sorted(["live", "r=4", "16", "r=0.5", "2"], key=level_sort_key)
['2', '16', 'r=0.5', 'r=4', 'live']
>>> level_name("16"), level_name("r=2"), level_load("r=0.5"), level_unit("r=0.5")
('c=16', 'r=2', 0.5, 'r')
"""

from __future__ import annotations

from collections.abc import Iterable

from specproxy.schema import level_sql, rate_label

__all__ = [
    "LEVEL_SQL",
    "level_load",
    "level_name",
    "level_sort_key",
    "level_unit",
    "load_name",
    "rate_label",
    "run_unit",
]

LEVEL_SQL = level_sql()
RATE_PREFIX = "r="


def level_load(level: str) -> float | None:
    """The level's load: its concurrency or its offered rate (req/s); None for live traffic."""
    if level.isdigit():
        return float(level)
    if level.startswith(RATE_PREFIX):
        try:
            return float(level.removeprefix(RATE_PREFIX))
        except ValueError:
            return None
    return None


def level_unit(level: str) -> str | None:
    """'c' for a concurrency level, 'r' for an offered rate, None for live traffic."""
    if level_load(level) is None:
        return None
    return "c" if level.isdigit() else "r"


def level_sort_key(level: str) -> tuple[int, float, str]:
    load = level_load(level)
    if load is None:
        return (2, 0.0, level)
    return (0 if level.isdigit() else 1, load, "")


def load_name(load: float, unit: str) -> str:
    """A load as people read it: ``c=16``, ``r=2``, ``r=0.5``."""
    return f"c={int(load)}" if unit == "c" else rate_label(load)


# What a chart's load axis is called, per unit.
AXIS_LABEL = {"c": "concurrency", "r": "offered rate (req/s)"}


def run_unit(levels: Iterable[str]) -> str:
    """A run's load axis: 'r' when its levels with a load are offered rates, else 'c' (concurrency).

    A run is one sweep (replay takes one load shape), so its levels share a unit.
    """
    units = {level_unit(level) for level in levels} - {None}
    return "r" if units == {"r"} else "c"


def level_name(level: str) -> str:
    """A level label as people read it: '16' → 'c=16'; 'r=2' and 'live' as they are."""
    return f"c={level}" if level.isdigit() else level
