"""Replay's live progress display: per arm, calls done of the phase, output tok/s and errors.

On a terminal it is a live table (:class:`~specproxy.proxy.replay.console.LiveBlock`) refreshed a few
times a second; on a terminal and elsewhere (a pipe, a CI log) one line per level is printed when its
last round ends (a phase ``c=16 r2/3`` is round 2 of level ``c=16``), every arm's calls, tok/s and
errors in it, so the history stays readable and a sweep's stays one screen. Counting is a few
integer additions per finished call; rendering happens on the block's refresh thread, off the event
loop's path.

Example::

    with ReplayProgress(["baseline", "eagle3"]) as progress:
        progress.begin_phase("c=16", calls_per_arm=64)
        progress.record("eagle3", completion_tokens=128, ok=True)
        progress.end_phase()
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType

from specproxy.proxy.replay.console import RED, Console, LiveBlock
from specproxy.proxy.replay.planning import parse_phase_label


@dataclass(slots=True)
class ArmProgress:
    done: int = 0
    errors: int = 0
    tokens: int = 0
    last_done: float | None = None  # monotonic time of the latest finished call

    def tok_s(self, t0: float, until: float) -> float:
        return self.tokens / max(until - t0, 1e-9)


@dataclass
class LevelHistory:
    """One level's rounds so far: per arm, calls, tokens and errors, and the seconds the arm worked."""

    label: str
    totals: dict[str, ArmProgress] = field(default_factory=dict)
    rounds: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, per_arm: dict[str, ArmProgress], t0: float) -> None:
        self.rounds += 1
        for arm, p in per_arm.items():
            total = self.totals.setdefault(arm, ArmProgress())
            total.done, total.tokens, total.errors = (
                total.done + p.done,
                total.tokens + p.tokens,
                total.errors + p.errors,
            )
            # up to the arm's last call: a fast arm's rate does not decay while slower arms finish
            self.seconds[arm] = self.seconds.get(arm, 0.0) + max((p.last_done or t0) - t0, 0.0)

    def line(self) -> str:
        """``c=4  3 rounds  done 21 per arm  tok/s: baseline 447.0, eagle3 709.0  errors 0``."""
        dones = {p.done for p in self.totals.values()}
        done = (
            f"done {dones.pop()} per arm"
            if len(dones) == 1
            else "done " + ", ".join(f"{a} {p.done}" for a, p in self.totals.items())
        )
        rates = ", ".join(
            f"{a} {p.tokens / max(self.seconds.get(a, 0.0), 1e-9):.1f}" for a, p in self.totals.items()
        )
        failed = {a: p.errors for a, p in self.totals.items() if p.errors}
        errors = "errors " + (", ".join(f"{a} {n}" for a, n in failed.items()) if failed else "0")
        rounds = f"{self.rounds} round{'s' if self.rounds != 1 else ''}"
        return f"{self.label:>6}  {rounds}  {done}  tok/s: {rates}  {errors}"


class ReplayProgress:
    def __init__(self, arms: list[str], console: Console | None = None, *, enabled: bool = True) -> None:
        self.arms = arms
        self.console = console or Console()
        self.enabled = enabled
        self.label = ""
        self.calls_per_arm: int | None = None
        self.per_arm: dict[str, ArmProgress] = {a: ArmProgress() for a in arms}
        self._t0 = time.monotonic()
        self._live: LiveBlock | None = None
        self._level: LevelHistory | None = None  # the rounds of the level in progress, for its line

    def __enter__(self) -> ReplayProgress:
        if self.enabled:
            self._live = LiveBlock(self.console, self.table_lines)
            self._live.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._print_level()
        if self._live is not None:
            self._live.stop()
            self._live = None

    def begin_phase(self, label: str, calls_per_arm: int | None) -> None:
        self.label = label
        self.calls_per_arm = calls_per_arm
        self.per_arm = {a: ArmProgress() for a in self.arms}
        self._t0 = time.monotonic()

    def record(self, arm: str, completion_tokens: int | None, ok: bool) -> None:
        p = self.per_arm[arm]
        p.done += 1
        p.last_done = time.monotonic()
        p.tokens += completion_tokens or 0
        if not ok:
            p.errors += 1

    def end_phase(self) -> None:
        """Adds the phase to its level's history line, printed after the level's last planned round
        (extra rounds get a line of their own, printed when the next level starts or the display
        closes); under the live table it prints above it."""
        if not self.enabled:
            return
        base, round_, planned = parse_phase_label(self.label)
        level = base if planned is not None else f"{base} extra"
        if self._level is not None and self._level.label != level:
            self._print_level()
        self._level = self._level or LevelHistory(level)
        self._level.add(self.per_arm, self._t0)
        if round_ == planned:
            self._print_level()  # the level's last planned round (or its only one)

    def _print_level(self) -> None:
        if self._level is not None:
            self.console.print(self._level.line())
            self._level = None

    def table_lines(self) -> list[str]:
        """The live table: a title line, a header and one row per arm (errors in red when any)."""
        now = time.monotonic()
        total = f"/{self.calls_per_arm}" if self.calls_per_arm is not None else ""
        width = max([len("arm"), *(len(a) for a in self.per_arm)])
        lines = [
            f"replay {self.label}  {now - self._t0:5.1f} s",
            f"{'arm':<{width}}  {'done':>11}  {'tok/s':>9}  {'errors':>6}",
        ]
        for arm, p in self.per_arm.items():
            finished = self.calls_per_arm is not None and p.done >= self.calls_per_arm
            rate = p.tok_s(self._t0, (p.last_done or now) if finished else now)
            errors = self.console.colour(f"{p.errors:>6}", RED) if p.errors else f"{0:>6}"
            lines.append(f"{arm:<{width}}  {f'{p.done}{total}':>11}  {rate:>9.1f}  {errors}")
        return lines
