"""Replay's live progress display: per arm, calls done of the phase, output tok/s and errors.

On a terminal it is a live table (:class:`~specproxy.proxy.replay.console.LiveBlock`) refreshed a few
times a second; on a terminal and elsewhere (a pipe, a CI log) one line per arm is printed when each
phase ends, so the history stays readable. Counting is a few integer additions per finished call;
rendering happens on the block's refresh thread, off the event loop's path.

Example::

    with ReplayProgress(["baseline", "eagle3"]) as progress:
        progress.begin_phase("c=16", calls_per_arm=64)
        progress.record("eagle3", completion_tokens=128, ok=True)
        progress.end_phase()
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType

from specproxy.proxy.replay.console import RED, Console, LiveBlock


@dataclass(slots=True)
class ArmProgress:
    done: int = 0
    errors: int = 0
    tokens: int = 0
    last_done: float | None = None  # monotonic time of the latest finished call

    def tok_s(self, t0: float, until: float) -> float:
        return self.tokens / max(until - t0, 1e-9)


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

    def __enter__(self) -> ReplayProgress:
        if self.enabled:
            self._live = LiveBlock(self.console, self.table_lines)
            self._live.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
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
        # One line per arm and phase; under the live table they print above it.
        if not self.enabled:
            return
        for arm, p in self.per_arm.items():
            # Up to the arm's last call: a fast arm's rate does not decay while slower arms finish.
            rate = p.tok_s(self._t0, p.last_done or self._t0)
            self.console.print(
                f"{self.label:>8}  {arm:<14} done {p.done:>5}  {rate:>9.1f} tok/s  errors {p.errors}"
            )

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
