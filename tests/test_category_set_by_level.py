"""A category's verdict beside its level's: the `†` that says the level's throughput set it."""

from __future__ import annotations

import pytest

from specproxy.analysis.figures.run_figures import IdentityCounts
from specproxy.analysis.render.table import category_cell
from specproxy.analysis.stats import Interval
from specproxy.analysis.verdicts.categories import CategoryFigures, _category_row
from specproxy.analysis.verdicts.comparison import Comparison
from specproxy.analysis.verdicts.rows import LevelRow
from specproxy.analysis.verdicts.rules import Margin, Thresholds


def _level(throughput: Interval, basis: str = "wall") -> LevelRow:
    return LevelRow(
        arm="ngram",
        role="candidate",
        spec_method="ngram",
        level="64",
        concurrency_level=64,
        offered_rate=None,
        calls=192,
        ok=192,
        completion_tokens=19200,
        decode_calls=192,
        wall_s=10.0,
        agg_tok_s=1920.0,
        p50_decode_tok_s=100.0,
        p50_ttft_s=0.05,
        p95_ttft_s=0.1,
        acceptance_rate=None,
        acceptance_length=None,
        req_acceptance_rate=None,
        req_acceptance_length=None,
        throughput_speedup=throughput,
        throughput_basis=basis,
        rounds=3,
        confidence=0.95,
    )


def _figures(decode: Interval) -> CategoryFigures:
    comparison = Comparison(True, 40, decode, None, "wall", "3 rounds")
    return CategoryFigures("code_edit", comparison, 40, 40, 150.0, 100.0, IdentityCounts(40, 40))


FASTER = Interval(1.5, 1.4, 1.6)
SLOWER = Interval(0.8, 0.7, 0.9)
LOWER_TPUT = Interval(0.9, 0.86, 0.95)  # surely below 1 - 3 %: the level's LOSS
UNSURE_TPUT = Interval(0.99, 0.95, 1.03)  # may be below the margin: no WIN
SAME_TPUT = Interval(1.0, 0.99, 1.01)


@pytest.mark.parametrize(
    ("decode", "throughput", "basis", "verdict", "set_by_level", "cell"),
    [
        (FASTER, LOWER_TPUT, "wall", "LOSS", True, "1.50x LOSS†"),  # faster per call, the level lost
        (FASTER, UNSURE_TPUT, "wall", "NO CLEAR GAIN", True, "1.50x NCG†"),
        (FASTER, SAME_TPUT, "wall", "WIN", False, "1.50x WIN"),
        (SLOWER, LOWER_TPUT, "wall", "LOSS", False, "0.80x LOSS"),  # a LOSS on its own figures too
        (SLOWER, SAME_TPUT, "wall", "LOSS", False, "0.80x LOSS"),
        (FASTER, LOWER_TPUT, "shadow", "WIN", False, "1.50x WIN"),  # a shadow level has no throughput
    ],
)
def test_the_mark_says_when_the_levels_throughput_set_a_categorys_verdict(
    decode: Interval, throughput: Interval, basis: str, verdict: str, set_by_level: bool, cell: str
) -> None:
    thresholds = Thresholds()
    row = _category_row(_level(throughput, basis), _figures(decode), Margin.default(thresholds), thresholds)
    assert (row.verdict, row.set_by_level) == (verdict, set_by_level), row.reason
    assert category_cell(row) == cell
