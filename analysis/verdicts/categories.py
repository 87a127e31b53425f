"""The per-category rows: each candidate's decode speedup within a workload category, beside the level
row it belongs to, judged on that level's margin."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from specproxy.analysis.figures.matched import NEAR_EQUAL, stretched
from specproxy.analysis.figures.run_figures import IdentityCounts
from specproxy.analysis.levels import level_sort_key
from specproxy.analysis.stats import rng_for
from specproxy.analysis.verdicts import comparison
from specproxy.analysis.verdicts.comparison import Bootstrap, Comparison
from specproxy.analysis.verdicts.measured import (
    RunFigures,
    bootstrapped,
    lag_bounded,
    one_round,
)
from specproxy.analysis.verdicts.rows import CategoryRow, LevelRow, Settings
from specproxy.analysis.verdicts.rules import (
    UNRELIABLE,
    Margin,
    Thresholds,
    check_identity,
    level_verdict,
)


@dataclass(frozen=True)
class CategoryFigures:
    """A category's comparison and its counts, before it is judged."""

    category: str
    comparison: Comparison
    calls: int
    baseline_calls: int
    p50: float | None
    baseline_p50: float | None
    identity: IdentityCounts


def category_rows(
    run: RunFigures,
    rows: Sequence[LevelRow],
    margins: dict[str, Margin],
    confidence: dict[str, float],
    settings: Settings,
) -> list[CategoryRow]:
    """The category rows of paired levels (from the pairs) and of unpaired ones (from each arm's
    calls); each judged on its own decode speedup and identity against the level's throughput."""
    # Categories of a level compared at matched load are left out: their calls ran at other loads.
    by_key = {(r.arm, r.level): r for r in rows if r.load is None or not r.load.unequal}

    def boot(arm: str, level: str, category: str) -> Bootstrap:
        rng = rng_for(settings.bootstrap_seed, run.run_id, arm, level, category)
        return Bootstrap(settings.bootstrap_iterations, confidence[arm], rng)

    jobs: dict[tuple[str, str, str], Callable[[], Comparison]] = {}
    counts: dict[
        tuple[str, str, str], tuple[LevelRow, int, int, float | None, float | None, IdentityCounts]
    ] = {}
    for g in run.pairs:
        row = by_key.get((g.arm, g.level))
        if g.category is None or row is None or not row.paired or g.kind == "repeat":
            continue
        key = (g.arm, g.level, g.category)
        jobs[key] = partial(comparison.paired, g, None, None, row.blocks, boot(*key))
        counts[key] = (row, g.n_decode, g.n_decode, g.c_med, g.b_med, g.identity)
    for (arm, level, cat), c in run.calls.items():
        row = by_key.get((arm, level))
        b = run.calls.get((run.baseline, level, cat))
        if cat is None or row is None or row.paired is not False or b is None or arm == run.baseline:
            continue
        jobs[(arm, level, cat)] = partial(comparison.unpaired, c, b, row.blocks, boot(arm, level, cat))
        counts[(arm, level, cat)] = (
            row,
            c.n_decode,
            b.n_decode,
            c.p50_decode,
            b.p50_decode,
            IdentityCounts(),
        )
    # The arms' categories at a level share its blocks: their between-block terms are pooled.
    pooled = comparison.pooled(bootstrapped(jobs), lambda key: key[1:])
    widened = {
        key: _load_stretched(lag_bounded(run, c, *key[:2]), by_key[key[:2]]) for key, c in pooled.items()
    }
    figures = [
        (row, CategoryFigures(key[2], widened[key], calls, base_calls, p50, base_p50, identity))
        for key, (row, calls, base_calls, p50, base_p50, identity) in counts.items()
    ]
    out = [_category_row(row, fig, margins[row.level], settings.thresholds) for row, fig in figures]
    return sorted(out, key=lambda c: (c.arm, c.category, level_sort_key(c.level)))


def _load_stretched(comp: Comparison, row: LevelRow) -> Comparison:
    """A category of a level at near-equal loads spans the load's effect as its level does."""
    if row.load is None or row.load.method != NEAR_EQUAL or row.load.effect is None:
        return comp
    return replace(comp, decode=stretched(comp.decode, row.load.effect))


def _category_row(row: LevelRow, fig: CategoryFigures, margin: Margin, thresholds: Thresholds) -> CategoryRow:
    counts = fig.identity
    check = check_identity(counts.identical, counts.compared, row.confidence or 0.95, thresholds)
    set_by_level = False
    if not row.reliable:
        verdict, reason = UNRELIABLE, row.reason
    else:
        # Aggregate throughput is the level's, shared by every category in the batch: a category has
        # no wall-clock throughput of its own, and an arm that lowers the level's throughput costs
        # every category's users.
        decode = fig.comparison.decode
        verdict, reason = level_verdict(
            decode, row.throughput_speedup, check, margin, row.estimate_note, shadow=row.shadow
        )
        # The category's own figures judged without the level's throughput (as a shadow arm is).
        own, _ = level_verdict(decode, None, check, margin, row.estimate_note, shadow=True)
        set_by_level = own != verdict
        if row.rounds == 1:
            verdict, reason = one_round(verdict, reason, check)
    return CategoryRow(
        arm=row.arm,
        category=fig.category,
        level=row.level,
        concurrency_level=row.concurrency_level,
        offered_rate=row.offered_rate,
        paired=fig.comparison.paired,
        calls=fig.calls,
        baseline_calls=fig.baseline_calls,
        p50_decode_tok_s=fig.p50,
        baseline_p50_decode_tok_s=fig.baseline_p50,
        compared=counts.compared,
        identical=counts.identical,
        decode_speedup=fig.comparison.decode,
        throughput_speedup=fig.comparison.throughput,
        verdict=verdict,
        reason=reason,
        tokens_estimated=row.tokens_estimated,
        set_by_level=set_by_level,
    )
