"""The few lines a replay prints when it ends: per arm, calls and identity; where the spans went."""

from __future__ import annotations

from collections.abc import Sequence

from specproxy.proxy.health import ACHIEVED_RATE, RATE_SHORTFALL, over_threshold
from specproxy.proxy.replay.console import Console
from specproxy.proxy.replay.extra_rounds import LevelRounds
from specproxy.proxy.replay.formats import ItemSet
from specproxy.proxy.replay.runner import ReplayResult
from specproxy.proxy.spans.sink import HealthRow
from specproxy.schema import health_figure, rate_label


def print_summary(
    result: ReplayResult, items: ItemSet | None, console: Console, *, compact: bool = False
) -> None:
    """What the run did, per arm, and where its spans are. ``compact``: arms that all served the same
    calls without an error in one line, and the rounds over a health limit left to the caller (the
    lab says them one line per level)."""
    if not (compact and _print_alike(result, console)):
        for arm, t in result.per_arm.items():
            ident = f"  identical {t.compared - t.mismatches}/{t.compared}" if t.compared else ""
            console.print(
                f"  {arm:<14} ok {t.ok:>6}  errors {t.errors:>4}  tokens {t.completion_tokens:>8}{ident}",
            )
    if items is not None and items.skipped:
        console.print(f"skipped {items.skipped} bad record(s); first: {items.first_skip}")
    if result.lag_p99_s is not None:
        console.print(f"open-loop start lag p99: {result.lag_p99_s * 1000:.2f} ms")
    for rate, (achieved, shortfall) in _rate_levels(result.health).items():
        console.print(
            f"  {rate_label(rate):<8} achieved {achieved:.3g} req/s at the slowest round "
            f"(sends behind schedule by {shortfall:.1%} at most)",
        )
    for row in () if compact else over_threshold(result.health):
        if row.concurrency_level is not None:
            level = f"c={row.concurrency_level}"
        else:
            level = rate_label(row.offered_rate) if row.offered_rate is not None else "the open loop"
        who = f" ({row.arm})" if row.arm else ""
        console.print(
            f"health: {level} round {row.round}: {row.check_name}{who} = "
            f"{health_figure(row.check_name, row.value)}, over its limit of "
            f"{health_figure(row.check_name, row.threshold)}: the machine did not keep up, this round's "
            "figures are stretched",
            warning=True,
        )
    for note in result.notes:
        console.print(note, warning=True)
    dropped = (
        f" ({result.spans_dropped} dropped: the writer fell behind or failed, see the log)"
        if result.spans_dropped
        else ""
    )
    console.print(f"run {result.run_id}: {result.spans_written} spans in {result.db_path}{dropped}")


def _print_alike(result: ReplayResult, console: Console) -> bool:
    """One line for arms that all served the same calls and tokens without an error; False if not."""
    totals = list(result.per_arm.values())
    if not totals or any(t.errors for t in totals) or len({(t.ok, t.completion_tokens) for t in totals}) > 1:
        return False
    ident = ", ".join(
        f"{arm} {t.compared - t.mismatches}/{t.compared}" for arm, t in result.per_arm.items() if t.compared
    )
    console.print(
        f"  every arm: ok {totals[0].ok}, errors 0, tokens {totals[0].completion_tokens}"
        + (f"; identical to the baseline: {ident}" if ident else ""),
    )
    return True


def print_rounds(levels: Sequence[LevelRounds], console: Console, *, say_none: bool = False) -> None:
    """What extra rounds did, per level that needed them (``say_none``: also say when none did)."""
    sentences = (s for level in levels for s in (level.sentence(), level.deciding_sentence()))
    said = [s for s in sentences if s is not None]
    for sentence in said:
        console.print(f"rounds: {sentence}")
    if not said and say_none and levels:
        console.print(
            "rounds: every level had enough rounds that passed every health check; no extra round ran",
        )


def _rate_levels(health: list[HealthRow]) -> dict[float, tuple[float, float]]:
    """offered rate → (the lowest achieved rate over its rounds, the largest shortfall), by rate."""
    achieved: dict[float, float] = {}
    shortfall: dict[float, float] = {}
    for row in health:
        if row.offered_rate is None or row.value is None:
            continue
        if row.check_name == ACHIEVED_RATE:
            achieved[row.offered_rate] = min(achieved.get(row.offered_rate, row.value), row.value)
        elif row.check_name == RATE_SHORTFALL:
            shortfall[row.offered_rate] = max(shortfall.get(row.offered_rate, 0.0), row.value)
    return {rate: (achieved[rate], shortfall.get(rate, 0.0)) for rate in sorted(achieved)}
