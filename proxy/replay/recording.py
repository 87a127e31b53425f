"""What a replay keeps of its calls: one span each (in paired mode with greedy identity against the
baseline's output of the same request_id), the totals per arm, each round's health rows and the
notes the user should read with the figures. Everything goes to the run's :class:`SpanSink`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from specproxy.proxy.health import health_rows
from specproxy.proxy.identity import NOT_COMPARABLE, compare
from specproxy.proxy.replay.extra_rounds import LevelRounds
from specproxy.proxy.replay.loadgen import LoadStats
from specproxy.proxy.replay.planning import Phase
from specproxy.proxy.replay.progress import ReplayProgress
from specproxy.proxy.spans.sink import HealthRow, SpanSink
from specproxy.proxy.upstream.calls import CallResult
from specproxy.record import SpanRecord


@dataclass(slots=True)
class ArmTotals:
    ok: int = 0
    errors: int = 0
    completion_tokens: int = 0
    mismatches: int = 0
    compared: int = 0


@dataclass(slots=True)
class ReplayResult:
    run_id: str
    db_path: Path
    phases: list[str] = field(default_factory=list)
    per_arm: dict[str, ArmTotals] = field(default_factory=dict)
    spans_written: int = 0
    spans_dropped: int = 0
    interrupted: bool = False
    lag_p99_s: float | None = None  # open loops: the calls' start lag behind schedule, over all rounds
    health: list[HealthRow] = field(default_factory=list)
    levels: list[LevelRounds] = field(default_factory=list)  # per level: rounds run and how many passed
    notes: list[str] = field(default_factory=list)  # what the user should know about the figures


class PairJoiner:
    """Holds candidates' spans until the baseline of the same request_id has answered, then compares.

    A baseline output is kept only until every arm of its request has reported, so memory stays
    proportional to the calls in flight, not to the run.
    """

    def __init__(self, n_arms: int, emit: Callable[[SpanRecord], None]) -> None:
        self.n_arms = n_arms
        self.emit = emit
        self._baseline: dict[str, CallResult | None] = {}
        self._waiting: dict[str, list[CallResult]] = {}
        self._reported: dict[str, int] = {}

    def add(self, result: CallResult, comparable: bool) -> None:
        rid = result.record.request_id
        self._reported[rid] = self._reported.get(rid, 0) + 1
        if result.record.arm_role == "baseline":
            self._baseline[rid] = result if comparable and result.ok else None
            self.emit(result.record)
            for cand in self._waiting.pop(rid, ()):
                self._finish(cand, self._baseline[rid])
        elif rid in self._baseline:
            self._finish(result, self._baseline[rid] if comparable else None)
        else:
            self._waiting.setdefault(rid, []).append(result)
        if self._reported[rid] >= self.n_arms:
            self._baseline.pop(rid, None)
            self._reported.pop(rid, None)

    def _finish(self, cand: CallResult, base: CallResult | None) -> None:
        ident = compare(base.tap, cand.tap) if base is not None and cand.ok else NOT_COMPARABLE
        cand.record.identical, cand.record.first_divergence, cand.record.divergence_margin = ident
        self.emit(cand.record)

    def flush(self) -> None:
        """Emit candidates whose baseline never reported (it was cancelled): not comparable."""
        for rid, cands in self._waiting.items():
            for cand in cands:
                self._finish(cand, None)
            self._reported.pop(rid, None)
        self._waiting.clear()


class RunRecorder:
    """The run's spans, totals, health rows and notes. ``recording`` turns False when the run ends:
    a call that ends after that is not counted. ``sink`` is set once the run has opened its store."""

    def __init__(self, run_id: str, db_path: Path, arms: Sequence[str], progress: ReplayProgress) -> None:
        self.run_id = run_id
        self.result = ReplayResult(run_id=run_id, db_path=db_path, per_arm={a: ArmTotals() for a in arms})
        self.progress = progress
        self.sink: SpanSink | None = None
        self.recording = True
        # figures the pacer gave for the level being measured, recorded with each of its rounds
        self.level_notes: Mapping[str, float] = {}
        self._queue_s: list[float] = []  # this phase's calls: handed over → upstream request sent
        self._decode_s: list[float] = []  # this phase's calls: first → last token

    def begin_phase(self, label: str) -> None:
        self.result.phases.append(label)
        self._queue_s = []
        self._decode_s = []

    def call(
        self,
        arm: str,
        result: CallResult,
        queued_s: float,
        joiner: PairJoiner | None,
        comparable: bool,
    ) -> None:
        """A measured call that ended: its timing for the round's health, its arm's totals, its span
        (through ``joiner`` in paired mode, for the identity check)."""
        record = result.record
        self._queue_s.append(queued_s)
        if result.ok and record.ttft_s is not None and record.e2e_s is not None:
            self._decode_s.append(record.e2e_s - record.ttft_s)
        totals = self.result.per_arm[arm]
        if result.ok:
            totals.ok += 1
            totals.completion_tokens += record.completion_tokens or 0
        else:
            totals.errors += 1
        self.progress.record(arm, record.completion_tokens, result.ok)
        if joiner is not None:
            joiner.add(result, comparable)
        else:
            self.emit(record)

    def emit(self, record: SpanRecord) -> None:
        assert self.sink is not None
        if record.identical is False:
            self.result.per_arm[record.arm].mismatches += 1
        if record.identical is not None:
            self.result.per_arm[record.arm].compared += 1
        if self.sink.emit(record):
            self.result.spans_written += 1
        else:
            self.result.spans_dropped += 1

    def note(self, text: str) -> None:
        if text not in self.result.notes:
            self.result.notes.append(text)

    def proxy_health(self, key: Phase, rows: list[dict[str, Any]]) -> list[HealthRow]:
        """The proxy's health rows of a level-round (its loop as ``proxy <check>``, its arms'
        simulator clocks), as this run's: they gate the round here (extra rounds) as in its store."""
        at = datetime.now(UTC)

        def number(v: Any) -> float | None:
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

        out = []
        for r in rows:
            if not isinstance(r, dict) or not isinstance(r.get("check"), str):
                continue
            arm = r.get("arm") if isinstance(r.get("arm"), str) else None
            check = r["check"] if arm is not None else f"proxy {r['check']}"
            value, limit = number(r.get("value")), number(r.get("threshold"))
            out.append(
                HealthRow(self.run_id, arm, key.level, key.round, check, value, limit, at, key.offered_rate)
            )
        return out

    async def health(
        self,
        phase: Phase,
        engine_lag: dict[str, float],
        stats: list[LoadStats],
        loop_lags: list[float],
        write_delay: dict[str, float],
        proxy_rows: Sequence[HealthRow] = (),
    ) -> None:
        """A round's health rows, kept and written to the store."""
        start_lags = [lag for st in stats for lag in st.lag_s]
        rows = health_rows(
            self.run_id,
            phase.level,
            phase.round,
            engine_lag,
            start_lags,
            loop_lags,
            self._queue_s,
            self._decode_s,
            notes=self.level_notes,
            offered_rate=phase.offered_rate,
            rates=[(st.achieved_rate(), st.scheduled_rate()) for st in stats],
            write_delay=write_delay,
        )
        rows += proxy_rows
        self.result.health.extend(rows)
        assert self.sink is not None
        # A handful of rows, written off the event loop between rounds.
        await asyncio.to_thread(self.sink.write_health, rows)
