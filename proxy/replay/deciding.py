"""The question deciding rounds ask after each round: which verdicts could more rounds settle?

The runner's ``decider`` (:class:`~.runner.ReplaySettings`) is this function for `specproxy replay`
and the lab: it analyses a snapshot of the span store (:mod:`specproxy.analysis.verdicts.settled`).
The analysis is imported only when a run asks, so that the commands start fast.
"""

from __future__ import annotations

from pathlib import Path


def open_questions(snapshot: Path, run_id: str, level: str) -> list[str]:
    """The verdicts read at ``level`` of run ``run_id`` in ``snapshot`` that more rounds could settle."""
    from specproxy.analysis.verdicts.settled import open_questions_in_store

    return open_questions_in_store(snapshot, run_id, level)
