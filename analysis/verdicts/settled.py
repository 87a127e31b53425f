"""Is the deploy verdict settled at a level, or would more rounds there decide it?

A true ratio near a margin line (a throughput at peak of 0.96x against a 3 % margin, say) gives an
interval that lands on one side of the line in one run and reaches across it in the next: LOSS once,
NO CLEAR GAIN the next. With more rounds the interval narrows around the true ratio and settles on
one side. So after its sweep a replay measures again the levels the deploy verdict reads while a
figure read there is an open question (:mod:`.margin`): replay's ``deciding_rounds``,
:mod:`specproxy.proxy.replay.rounds`. This module answers replay's question on a copy of its store.

Looking again after each added round is a sequential design: each look gives an arm whose true ratio
sits exactly on a line another chance to land on either side. The looks are few (the plan's budget)
and a null arm sits a whole margin away from the lines where LOSS and WIN begin, so this moves its
false-alarm rate little; ``tests/bench/bench_verdicts.py`` measures it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specproxy.analysis.store import open_store
from specproxy.analysis.verdicts.evaluation import evaluate
from specproxy.analysis.verdicts.margin import OpenQuestion, open_questions, open_questions_by_level
from specproxy.analysis.verdicts.rows import Settings

__all__ = [
    "OpenQuestion",
    "open_questions",
    "open_questions_by_level",
    "open_questions_in_store",
    "replay_label",
]


def replay_label(level: str) -> str:
    """A row's level as replay labels it: ``'256'`` → ``'c=256'``; a rate's ``'r=2'`` stays."""
    return f"c={level}" if level.isdigit() else level


def open_questions_in_store(
    db_path: Path, run_id: str, settings: Settings | None = None, *, peak: int | None = None
) -> dict[str, list[str]]:
    """:func:`open_questions_by_level` of run ``run_id`` in the span store file ``db_path``, as
    sentences keyed by the level as replay labels it (``'c=256'``, ``'r=2'``). ``peak``: the
    concurrency the deploy verdict reads the peak at where the run's own record would not say it yet
    (the lab's moved peak, recorded only once the run is done)."""
    settings = settings or Settings()
    if peak is not None and settings.peak_concurrency is None:
        settings = dataclasses.replace(settings, peak_concurrency=peak)
    with open_store([db_path]) as store:
        (evaluation,) = evaluate(store, run=run_id, settings=settings)
    by_level = open_questions_by_level(evaluation, settings)
    return {replay_label(level): [q.sentence() for q in qs] for level, qs in by_level.items()}
