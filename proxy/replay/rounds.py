"""How many rounds a level gets: its planned rounds, then extra rounds while too few have passed
every health check (:mod:`.extra_rounds`); then, after the sweep, deciding rounds at the levels where
the ``decider`` finds a verdict the deploy verdict reads unsettled on a copy of the store as written
so far. No extra or deciding round starts that would end after the plan's ``added_until``.

Deciding rounds come after the sweep, not inside it, because where the deploy verdict reads is known
only then: the operating point is a low level, and the peak is the top level unless that level could
not be judged (the lab then judges it lower, :mod:`specproxy.lab.peak`). Each deciding round goes to
the open level that has had the fewest so far (the higher one on a tie), at that level's own pace
(the pacer's :meth:`~.planning.LevelPacer.resume`) after a warm-up at its concurrency; after each, the
decider looks again. So a verdict near a margin line is settled by rounds where it is read, and one
still open when the budget or the time runs out is said to be (:meth:`.LevelRounds.deciding_sentence`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from specproxy.proxy.replay.extra_rounds import LevelRounds, extra_round_due, failed_rounds, why_extra
from specproxy.proxy.replay.planning import Phase, ReplaySettings, phase_label
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.replay.recording import RunRecorder
from specproxy.proxy.spans.sink import HealthRow

# Measures one round of a level (the phase says which).
Measure = Callable[[Phase], Awaitable[None]]
# Gets a level measured earlier ready for another round: its pace again, a warm-up at its concurrency.
Resume = Callable[[], Awaitable[None]]


async def _ready() -> None:
    """A level that needs nothing before another round."""


@dataclass(slots=True)
class _Measured:
    """A level measured in the sweep, as a deciding round there needs it."""

    index: int  # its entry in ``ReplayResult.levels``
    measure: Measure
    resume: Resume
    level: int | None
    rate: float | None
    round_s: float  # how long its last round took: the next one's expected cost

    def of_level(self, row: HealthRow) -> bool:
        return row.concurrency_level == self.level and row.offered_rate == self.rate


class RoundLoop:
    """Runs each level's rounds and keeps, per level, how they went (``ReplayResult.levels``)."""

    def __init__(
        self, settings: ReplaySettings, recorder: RunRecorder, progress: ReplayProgress, stop: asyncio.Event
    ) -> None:
        self.s = settings
        self.recorder = recorder
        self.progress = progress
        self.stop = stop
        self._measured: dict[str, _Measured] = {}  # by level label, in sweep order
        self._current = ""  # the level the arms were last paced for

    async def run_level(
        self,
        base: str,
        planned: int,
        measure: Measure,
        *,
        level: int | None = None,
        rate: float | None = None,
        resume: Resume = _ready,
    ) -> None:
        """A level's planned rounds, then extra rounds while too few have passed every health check
        and the plan allows more (:func:`.extra_rounds.extra_round_due`), each at the level's pace.
        ``level``: a closed-loop level's concurrency, ``rate``: an open-loop level's offered rate;
        ``resume``: what a deciding round at this level after the sweep needs first."""
        result = self.recorder.result
        here = _Measured(len(result.levels), measure, resume, level, rate, 0.0)
        self._current = base
        ran = 0
        extra_out_of_time = False
        while not self.stop.is_set():
            if ran >= planned:
                failed = failed_rounds(row for row in result.health if here.of_level(row))
                if not extra_round_due(planned, ran, ran - len(failed), self.s.load.extra_rounds):
                    break
                if self._out_of_time(here.round_s):
                    extra_out_of_time = True
                    break
                self.progress.console.print(why_extra(base, failed, ran + 1))
            ran += 1
            await self._measure_round(here, Phase(phase_label(base, ran, planned), level, ran, rate))
        failed = failed_rounds(row for row in result.health if here.of_level(row))
        result.levels.append(
            LevelRounds(
                base,
                planned,
                ran,
                ran - len(failed),
                budget=self.s.load.extra_rounds,
                deciding_budget=self.s.load.deciding_rounds,
                extra_out_of_time=extra_out_of_time,
            )
        )
        self._measured[base] = here

    async def decide(self, peak: int | None = None) -> None:
        """After the sweep: deciding rounds while the decider finds a verdict unsettled at a level
        measured in it, up to the plan's ``deciding_rounds`` in all and within its ``added_until``
        (module docstring); then each level's entry says what they did and what is still open.
        ``peak``: the concurrency the peak is judged at where it is not the top level."""
        budget = self.s.load.deciding_rounds
        if self.s.decider is None or budget <= 0 or not self._measured:
            return
        added = dict.fromkeys(self._measured, 0)
        order = list(self._measured)
        open_: Mapping[str, Sequence[str]] = {}
        late: set[str] = set()
        while not self.stop.is_set():
            open_ = {b: qs for b, qs in (await self._open_questions(peak)).items() if b in added and qs}
            late = {b for b in open_ if self._out_of_time(self._measured[b].round_s)}
            due = [b for b in open_ if b not in late]
            if not due or sum(added.values()) >= budget:
                break
            base = min(due, key=lambda b: (added[b], -order.index(b)))
            added[base] += 1
            self.progress.console.print(
                f"{base}: {'; '.join(open_[base])}; running deciding round "
                f"{self._round_of(base, added[base])} ({sum(added.values())} of {budget})",
            )
            await self._deciding_round(base, added[base])
        spent = sum(added.values()) >= budget
        for base, n in added.items():
            self._record(base, n, tuple(open_.get(base, ())), out_of_time=base in late and not spent)

    def _round_of(self, base: str, n: int) -> int:
        """The number of the ``n``-th deciding round at ``base``: after every round it ran before."""
        return self.recorder.result.levels[self._measured[base].index].ran + n

    async def _deciding_round(self, base: str, n: int) -> None:
        here = self._measured[base]
        if self._current != base:
            await here.resume()
            self._current = base
        k = self._round_of(base, n)
        planned = self.recorder.result.levels[here.index].planned
        await self._measure_round(here, Phase(phase_label(base, k, planned), here.level, k, here.rate))

    def _record(self, base: str, deciding: int, unsettled: tuple[str, ...], *, out_of_time: bool) -> None:
        """A level's entry in ``ReplayResult.levels`` with its deciding rounds and what is still open."""
        here, levels = self._measured[base], self.recorder.result.levels
        ran = levels[here.index].ran + deciding
        failed = failed_rounds(row for row in self.recorder.result.health if here.of_level(row))
        levels[here.index] = dataclasses.replace(
            levels[here.index],
            ran=ran,
            healthy=ran - len(failed),
            deciding=deciding,
            unsettled=unsettled,
            out_of_time=out_of_time,
        )

    async def _measure_round(self, here: _Measured, phase: Phase) -> None:
        """One round, its duration kept: a deciding round is started only if one more fits the budget."""
        began = time.monotonic()
        await here.measure(phase)
        here.round_s = time.monotonic() - began

    def _out_of_time(self, round_s: float) -> bool:
        """Would one more round, ``round_s`` long, end after the plan's ``added_until``?"""
        until = self.s.load.added_until
        return until is not None and time.monotonic() + round_s > until

    async def _open_questions(self, peak: int | None) -> Mapping[str, Sequence[str]]:
        """The decider's answer on a snapshot of the store as written so far; none when it cannot
        answer (said in the run's notes: the levels then keep the rounds they have)."""
        sink = self.recorder.sink
        assert self.s.decider is not None and sink is not None
        with tempfile.TemporaryDirectory(prefix="specproxy-decide-") as tmp:
            snapshot = Path(tmp) / "snapshot.duckdb"
            try:
                await asyncio.to_thread(sink.snapshot, snapshot)
                return await asyncio.to_thread(self.s.decider, snapshot, self.recorder.run_id, peak)
            except Exception as exc:  # an analysis that fails must not cost the rounds measured
                self.recorder.note(f"no deciding rounds: the verdicts could not be read ({exc})")
                return {}
