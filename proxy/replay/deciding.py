"""The question deciding rounds ask after the sweep and after each of them: which verdicts could
more rounds settle, and where?

The runner's ``decider`` (:class:`~.planning.ReplaySettings`) is this function for `specproxy replay`
and the lab: it analyses a snapshot of the span store (:mod:`specproxy.analysis.verdicts.settled`).
The analysis is imported only when a run asks, so that the commands start fast.
"""

from __future__ import annotations

from pathlib import Path


def open_questions(snapshot: Path, run_id: str, peak: int | None) -> dict[str, list[str]]:
    """Per level of run ``run_id`` in ``snapshot`` (``'c=64'``), the verdicts read there that more
    rounds could settle; ``peak``: the concurrency the peak is judged at where the store does not say."""
    from specproxy.analysis.verdicts.settled import open_questions_in_store

    return open_questions_in_store(snapshot, run_id, peak=peak)
