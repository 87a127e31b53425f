"""The lab's pace: per level, the fastest time scale at which this machine keeps up with the sweep.

Before each level of the sweep (in place of its warm-up), :class:`SimPacer` sends one unrecorded wave of
full-length calls at that level and reads how the machine kept up: each simulator's clock lag and the
client loop's lag as a share of the wave's median decode time. While either is over half its health
limit, the simulators are slowed to half their speed (``POST /sim/time_scale``: same processes, same
ports) and the wave is sent again, down to ``slowest`` (``slowest_for_client`` when the simulators
keep up and only the client's loop lags: 5 arms × 256 streams in one Python process). A level is then
measured at the scale its last wave ran at; the next level starts from there, since load only grows
along the sweep, and from half of it when a measured round of the level still failed a health check
(a wave is one sample of a machine whose load can change from one minute to the next).

With ``skip_unmeasurable`` (the lab, when no peak was given), a level above the sweep's first whose
wave at the slowest scale was over a round's own health limit (:func:`would_fail`) is not measured
at all, nor is any level above it: its rounds would fail as the wave did, each at a round's cost, and
the time goes to the levels that can be judged (:mod:`specproxy.lab.peak` then says where the peak
was judged instead). A level above the first whose wave there was short of room to spare (and not
skipped) is measured in the fewest
rounds it can be judged on (``MIN_HEALTHY_ROUNDS``), leaving time for the extra rounds that replace a
failed one. :meth:`SimPacer.rounds` says how many a level gets.

A wave also counts as not kept up when it kept the client's event loop busy over
:data:`LOOP_BUSY_LIMIT` of its time (never slowed below ``slowest`` for that alone): the rounds after it
have more to do than the wave had.

Half the limit (an eighth for the client's loop lag: :data:`LOOP_TRIAL_MARGIN`), because a wave
predicts a round only roughly: the rounds that follow vary, and a level measured at the edge of its
limit comes out UNRELIABLE as often as not. Each level's scale is recorded with its rounds (health
check ``sim_time_scale``, which never gates), and :meth:`SimPacer.sentences` says what was tried.

Why per level rather than one probe up front: a short probe at the top level does not see the lag a
whole sweep builds up, and slowing every level for the top one's sake makes the cheap low levels cost
several times as long.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from specproxy.config import Arm
from specproxy.proxy.health import ENGINE_CLOCK_LAG, EVENT_LOOP_LAG_SHARE, THRESHOLDS, over_threshold
from specproxy.proxy.replay.console import Console
from specproxy.proxy.replay.runner import LevelTrial, ReplayError
from specproxy.proxy.spans.sink import HealthRow
from specproxy.schema import MIN_HEALTHY_ROUNDS

TIME_SCALE_CHECK = "sim_time_scale"
TRIAL_MARGIN = 0.5
CLOCK_LIMIT = (THRESHOLDS[ENGINE_CLOCK_LAG] or 0.02) * TRIAL_MARGIN
# The client's loop lag in a wave predicts a round's far less well than a clock lag does: near its
# saturation the loop's lag piles up rather than grows, and a round adds the spans' recording to the
# wave's work. Quick labs at c=256 on two cores: waves at 0.3-0.8 % of decode were followed by rounds
# at 1.6-11 % (over the 2 % limit in 6 of 9), waves at 0.1-0.3 % at half speed by rounds at 0.2-0.6 %.
LOOP_TRIAL_MARGIN = 0.125
LOOP_LIMIT = (THRESHOLDS[EVENT_LOOP_LAG_SHARE] or 0.02) * LOOP_TRIAL_MARGIN
# The client's one event loop, busy this share of a wave's wall time, has too little room left for the
# rounds after it: a round several waves long refills slots without pause and records spans besides,
# and the machine's other work takes its share. Quick labs at c=256 on two cores: waves at half speed
# kept the loop 40-43 % busy with its lag under LOOP_LIMIT, and the three-wave rounds after one of them,
# with other work running, stalled the loop for 0.3-0.6 s (P99) and moved every candidate's throughput
# ratio up by 1.5-7 % with no check over its limit; at a quarter speed waves kept it 18-23 % busy and
# the rounds' ratios stayed within 1 % of the lag-free ones. Once the client's calls grew cheaper, a
# wave at full speed read 34-35 % busy (a quiet 2-core VM, 2026-12-06), under a limit of 37.5 %, and
# every three-wave round after it failed its loop-lag check (4-10 % of decode, P99 stalls of 0.6 s):
# a wave's busy share averages over its drain, when few calls are left, and a round has no drain until
# its end. Waves at 19-21 % (c=64 at full speed, c=256 at a quarter) were followed by rounds that passed.
LOOP_BUSY_LIMIT = 0.25


def _loop_ok(trial: LevelTrial) -> bool:
    return trial.loop_lag_share is None or trial.loop_lag_share <= LOOP_LIMIT


def kept_up(trial: LevelTrial) -> bool:
    """Did the machine keep up with a trial wave, with room to spare?"""
    busy_ok = trial.loop_busy_share is None or trial.loop_busy_share <= LOOP_BUSY_LIMIT
    return trial.worst_engine_lag <= CLOCK_LIMIT and _loop_ok(trial) and busy_ok


def would_fail(trial: LevelTrial) -> bool:
    """Was a wave over a round's own health limit (not only short of room to spare)? A round like it
    would fail its checks."""
    loop_limit = THRESHOLDS[EVENT_LOOP_LAG_SHARE] or 0.02
    loop_over = trial.loop_lag_share is not None and trial.loop_lag_share > loop_limit
    return trial.worst_engine_lag > (THRESHOLDS[ENGINE_CLOCK_LAG] or 0.02) or loop_over


def describe(trial: LevelTrial) -> str:
    """``clock lag 3.1 % (ngram), loop lag 0.8 % of decode``"""
    worst = max(trial.engine_lag.items(), key=lambda kv: kv[1], default=None)
    clock = f"clock lag {worst[1]:.1%} ({worst[0]})" if worst is not None else "no simulator clock"
    loop = f"loop lag {trial.loop_lag_share:.1%} of decode" if trial.loop_lag_share is not None else ""
    busy = f"loop busy {trial.loop_busy_share:.0%}" if trial.loop_busy_share is not None else ""
    return ", ".join(x for x in (clock, loop, busy) if x)


@dataclass(frozen=True, slots=True)
class LevelPace:
    level: int
    time_scale: float
    trials: tuple[tuple[float, LevelTrial], ...]  # (time scale, what its wave saw), in order

    def kept_up(self) -> bool:
        """Did the level's last wave leave room to spare?"""
        return bool(self.trials) and kept_up(self.trials[-1][1])

    def sentence(self) -> str:
        tried = "; ".join(f"{describe(t)} at {scale:g}" for scale, t in self.trials)
        verdict = "" if self.kept_up() else " (still short of room to spare at the slowest scale tried)"
        return f"c={self.level} at time scale {self.time_scale:g}{verdict}: {tried}"

    def why_skipped(self) -> str:
        """``a wave at time scale 0.25 saw clock lag 5.9% (replica), ...``"""
        if not self.trials:
            return "a lower level could not be measured"
        scale, seen = self.trials[-1]
        return f"a wave at time scale {scale:g} saw {describe(seen)}"


async def set_time_scale(session: aiohttp.ClientSession, arms: Sequence[Arm], scale: float) -> None:
    """Every simulator runs at ``scale`` from its next step; ReplayError naming an arm that refuses."""
    for arm in arms:
        try:
            async with session.post(
                f"{arm.url}/sim/time_scale",
                json={"time_scale": scale},
                timeout=aiohttp.ClientTimeout(total=10.0),
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise ReplayError(f"arm {arm.name!r} refused time scale {scale:g}: {resp.status} {text}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ReplayError(f"arm {arm.name!r} at {arm.url} did not take a new time scale: {exc}") from exc


class SimPacer:
    """A :class:`~specproxy.proxy.replay.runner.LevelPacer` for simulated arms (see the module docstring)."""

    def __init__(
        self,
        arms: Sequence[Arm],
        start: float,
        slowest: float,
        console: Console,
        slowest_for_client: float | None = None,
        *,
        skip_unmeasurable: bool = False,
        never_skip: Collection[int] = (),
    ) -> None:
        self.arms = tuple(arms)
        self.scale = start
        self.slowest = slowest
        # A wave whose only excess is the client's loop lag may go slower still: each halving halves the
        # client's chunks per second and doubles the decode time its lag is a share of.
        self.slowest_for_client = min(slowest, slowest_for_client or slowest)
        self.console = console
        self.paces: list[LevelPace] = []
        # Levels not measured: their wave at the slowest scale was over a round's health limit (their
        # rounds would fail as it did, at a round's cost each), and every level above the first of
        # them (load only grows along the sweep). A level whose wave there was within the limit but
        # short of room to spare is shortened to the fewest rounds it can be judged on, leaving time
        # for the extra rounds that replace a failed one.
        self.skip_unmeasurable = skip_unmeasurable
        self.never_skip = frozenset(never_skip)  # levels the user named (the operating point)
        self.skipped: list[LevelPace] = []
        self.shortened: set[int] = set()
        self.wave_s = 0.0  # how long the last wave took: a round of w waves takes about w times that
        self._rounds: dict[int, int] = {}  # each settled level's rounds, decided once

    def _floor(self, seen: LevelTrial) -> float:
        """The slowest scale a wave that saw ``seen`` may be slowed to (below ``slowest`` only for the
        client loop's lag alone; a loop merely busy is no reason to go that slow)."""
        client_lag_only = seen.worst_engine_lag <= CLOCK_LIMIT and not _loop_ok(seen)
        return self.slowest_for_client if client_lag_only else self.slowest

    async def settle(self, level: int, trial: Callable[[], Awaitable[LevelTrial]]) -> Mapping[str, float]:
        if self.skipped:
            self.skipped.append(LevelPace(level, self.scale, ()))
            return {TIME_SCALE_CHECK: self.scale}
        scale = self.scale
        trials: list[tuple[float, LevelTrial]] = []
        async with aiohttp.ClientSession() as session:
            while True:
                await set_time_scale(session, self.arms, scale)
                began = time.monotonic()
                seen = await trial()
                self.wave_s = time.monotonic() - began
                trials.append((scale, seen))
                if kept_up(seen) or scale / 2 < self._floor(seen):
                    break
                said = f"c={level}: a wave at time scale {scale:g} saw {describe(seen)}"
                self.console.print(f"{said}; slowing to {scale / 2:g}")
                scale /= 2
        self.scale = scale
        pace = LevelPace(level, scale, tuple(trials))
        # The sweep's first level is always measured: it is where the deploy verdict answers by default.
        if self.skip_unmeasurable and self.paces and would_fail(seen) and level not in self.never_skip:
            self.skipped.append(pace)
            self.console.print(f"c={level}: {pace.why_skipped()} at the slowest scale: skipped")
            return {TIME_SCALE_CHECK: scale}
        if self.paces and not pace.kept_up():
            self.shortened.add(level)
            self.console.print(
                f"c={level}: {pace.why_skipped()} at the slowest scale, short of room to spare: at most "
                f"{MIN_HEALTHY_ROUNDS} rounds",
            )
        self.paces.append(pace)
        return {TIME_SCALE_CHECK: scale}

    def rounds(self, level: int, planned: int, *, waves: float = 1.0, until: float | None = None) -> int:
        """A level's rounds: none for a level skipped (:attr:`skipped`), at most MIN_HEALTHY_ROUNDS for
        one shortened, else ``planned``; and with a deadline (``until``, ``time.monotonic()``) no more
        than would end by it, at ``waves`` waves a round, but never fewer than the level can be judged
        on. Decided once a level is settled; ``planned`` before."""
        if level in self._rounds:
            return self._rounds[level]
        if not any(p.level == level for p in (*self.paces, *self.skipped)):
            return planned
        if any(p.level == level for p in self.skipped):
            n = 0
        else:
            n = min(planned, MIN_HEALTHY_ROUNDS) if level in self.shortened else planned
            n = self._within(level, n, planned, self.wave_s * waves, until)
        self._rounds[level] = n
        return n

    def _within(self, level: int, n: int, planned: int, round_s: float, until: float | None) -> int:
        """``n`` rounds, or as many as end by ``until`` at ``round_s`` each (never fewer than the level
        can be judged on)."""
        if until is None or round_s <= 0 or n <= MIN_HEALTHY_ROUNDS:
            return n
        fits = int((until - time.monotonic()) / round_s)
        if fits >= n:
            return n
        cut = max(MIN_HEALTHY_ROUNDS, fits)
        self.console.print(
            f"c={level}: {cut} of {planned} rounds (about {round_s:.0f} s each): more would end past the "
            "lab's time budget",
        )
        return cut

    def measured(self, level: int, health: Sequence[HealthRow]) -> None:
        # ``health`` holds every round of the level, its extra rounds too. A level that extra rounds
        # brought to enough healthy rounds still slows the next one: its failed rounds showed this
        # machine struggling at this pace, and the next level only adds load.
        failed = sorted({r.check_name for r in over_threshold(health)})
        if failed and self.scale / 2 >= self.slowest:
            self.scale /= 2
            self.console.print(
                f"c={level} failed {', '.join(failed)} in a measured round: the next level starts at time "
                f"scale {self.scale:g}",
            )

    async def resume(self, level: int) -> Mapping[str, float]:
        """Back to the scale ``level`` was measured at, for a deciding round there after the sweep
        (the sweep's later levels may have slowed the simulators since)."""
        scale = self.scales().get(level, self.scale)
        async with aiohttp.ClientSession() as session:
            await set_time_scale(session, self.arms, scale)
        return {TIME_SCALE_CHECK: scale}

    def scales(self) -> dict[int, float]:
        return {p.level: p.time_scale for p in self.paces}

    def sentences(self) -> list[str]:
        return [p.sentence() for p in self.paces]
