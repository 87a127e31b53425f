"""How many rounds a level gets: its planned rounds, then extra rounds while too few have passed
every health check (:mod:`.extra_rounds`), then, at the sweep's top level, deciding rounds while the
``decider`` finds a verdict read there unsettled on a copy of the store as written so far. No extra
or deciding round starts that would end after the plan's ``added_until``.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from specproxy.proxy.replay.extra_rounds import LevelRounds, extra_round_due, failed_rounds, why_extra
from specproxy.proxy.replay.planning import Phase, ReplaySettings, phase_label
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.replay.recording import RunRecorder
from specproxy.proxy.spans.sink import HealthRow

# Measures one round of a level (the phase says which).
Measure = Callable[[Phase], Awaitable[None]]


class RoundLoop:
    """Runs each level's rounds and keeps, per level, how they went (``ReplayResult.levels``)."""

    def __init__(
        self, settings: ReplaySettings, recorder: RunRecorder, progress: ReplayProgress, stop: asyncio.Event
    ) -> None:
        self.s = settings
        self.recorder = recorder
        self.progress = progress
        self.stop = stop
        self._round_s = 0.0  # how long the last measured round took (a deciding round's expected cost)

    async def run_level(
        self,
        base: str,
        planned: int,
        measure: Measure,
        *,
        level: int | None = None,
        rate: float | None = None,
    ) -> None:
        """A level's planned rounds, then extra rounds while too few have passed every health check
        and the plan allows more (:func:`.extra_rounds.extra_round_due`), then at the sweep's top level
        deciding rounds while the decider finds a verdict read there unsettled; each at the level's
        pace. ``level``: a closed-loop level's concurrency, ``rate``: an open-loop level's offered rate."""
        result = self.recorder.result

        def of_level(row: HealthRow) -> bool:
            return row.concurrency_level == level and row.offered_rate == rate

        ran = 0
        extra_out_of_time = False
        while not self.stop.is_set():
            if ran >= planned:
                failed = failed_rounds(row for row in result.health if of_level(row))
                if not extra_round_due(planned, ran, ran - len(failed), self.s.load.extra_rounds):
                    break
                if self._out_of_time():
                    extra_out_of_time = True
                    break
                self.progress.console.print(why_extra(base, failed, ran + 1))
            ran += 1
            await self._measure_round(measure, Phase(phase_label(base, ran, planned), level, ran, rate))
        decided: tuple[int, tuple[str, ...], bool] = (0, (), False)
        if self._is_top(level, rate) and self.s.decider is not None and self.s.load.deciding_rounds > 0:
            decided = await self._deciding_rounds(base, planned, ran, measure, level, rate)
        deciding, unsettled, out_of_time = decided
        ran += deciding
        failed = failed_rounds(row for row in result.health if of_level(row))
        result.levels.append(
            LevelRounds(
                base,
                planned,
                ran,
                ran - len(failed),
                budget=self.s.load.extra_rounds,
                deciding=deciding,
                deciding_budget=self.s.load.deciding_rounds,
                unsettled=unsettled,
                out_of_time=out_of_time,
                extra_out_of_time=extra_out_of_time,
            )
        )

    async def _measure_round(self, measure: Measure, phase: Phase) -> None:
        """One round, its duration kept: a deciding round is started only if one more fits the budget."""
        began = time.monotonic()
        await measure(phase)
        self._round_s = time.monotonic() - began

    def _out_of_time(self) -> bool:
        """Would one more round, as long as the last, end after the plan's ``added_until``?"""
        until = self.s.load.added_until
        return until is not None and time.monotonic() + self._round_s > until

    def _is_top(self, level: int | None, rate: float | None) -> bool:
        """Is this the sweep's top level (the highest concurrency, or rate)?"""
        plan = self.s.load
        if level is not None:
            return level == max(plan.levels)
        return rate is not None and rate == max(plan.rates, default=rate)

    async def _deciding_rounds(
        self,
        base: str,
        planned: int,
        ran: int,
        measure: Measure,
        level: int | None,
        rate: float | None,
    ) -> tuple[int, tuple[str, ...], bool]:
        """Rounds added to the top level while a verdict read there is unsettled, up to the plan's
        ``deciding_rounds`` and within its ``added_until``: (how many ran, what was still open when
        they stopped, whether the time budget stopped them)."""
        plan = self.s.load
        added = 0
        while not self.stop.is_set():
            open_ = tuple(await self._open_questions(base))
            out_of_time = self._out_of_time()
            if not open_ or added == plan.deciding_rounds or out_of_time:
                return added, open_, bool(open_) and out_of_time and added < plan.deciding_rounds
            added += 1
            k = ran + added
            self.progress.console.print(
                f"{base}: {'; '.join(open_)}; running deciding round {k} ({added} of {plan.deciding_rounds})",
            )
            await self._measure_round(measure, Phase(phase_label(base, k, planned), level, k, rate))
        return added, (), False

    async def _open_questions(self, base: str) -> list[str]:
        """The decider's answer on a snapshot of the store as written so far; none when it cannot
        answer (said in the run's notes: the level then keeps the rounds it has)."""
        sink = self.recorder.sink
        assert self.s.decider is not None and sink is not None
        with tempfile.TemporaryDirectory(prefix="specproxy-decide-") as tmp:
            snapshot = Path(tmp) / "snapshot.duckdb"
            try:
                await asyncio.to_thread(sink.snapshot, snapshot)
                return list(await asyncio.to_thread(self.s.decider, snapshot, self.recorder.run_id, base))
            except Exception as exc:  # an analysis that fails must not cost the rounds measured
                self.recorder.note(
                    f"{base}: no deciding rounds: the verdicts could not be read mid-run ({exc})"
                )
                return []
