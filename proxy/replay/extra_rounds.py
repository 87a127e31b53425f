"""Extra rounds: when a level's rounds left too few that passed every health check.

A level whose rounds all passed every check of :mod:`specproxy.proxy.health` is judged on all of
them. Once a round failed, the analysis judges the level on its healthy rounds only when at least
``MIN_HEALTHY_ROUNDS`` passed (fewer cannot show the drift between rounds), else calls it
UNRELIABLE. A loaded machine fails a round now and then while the rounds around it are fine, so
after a level's planned rounds the runner may add rounds of the same level, at the same pace, one at
a time, until enough have passed, the plan's ``extra_rounds`` are spent, or the extras left could no
longer make enough even if all passed. Extra rounds are numbered after the planned ones (round 6 of
a 5-round level) and labelled so (``c=256 r6 extra``).

Example::

    failed = failed_rounds(rows_of_the_level)            # {2: ["engine_clock_lag"], 4: [...]}
    if extra_round_due(planned=5, ran=5, healthy=5 - len(failed), budget=2):
        print(why_extra("c=256", failed, 6))            # c=256: rounds 2 and 4 failed ...
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from specproxy.proxy.health import over_threshold
from specproxy.proxy.spans.sink import HealthRow
from specproxy.schema import MIN_HEALTHY_ROUNDS


def judged(ran: int, healthy: int) -> bool:
    """Can a level with ``healthy`` of ``ran`` rounds passing be judged? Every round passed, or at
    least MIN_HEALTHY_ROUNDS did (the analysis drops the others)."""
    return healthy == ran or healthy >= MIN_HEALTHY_ROUNDS


def failed_rounds(rows: Iterable[HealthRow]) -> dict[int, list[str]]:
    """round → the checks it failed (each once, sorted), for the rounds with at least one failure."""
    failed: dict[int, set[str]] = {}
    for row in over_threshold(rows):
        if row.round is not None:
            failed.setdefault(row.round, set()).add(row.check_name)
    return {round_: sorted(checks) for round_, checks in sorted(failed.items())}


def extra_round_due(planned: int, ran: int, healthy: int, budget: int) -> bool:
    """Is one more round of a level due? ``ran`` rounds have run (the planned ones first, then the
    extras so far), ``healthy`` of them passed every check, and up to ``budget`` extras are allowed.
    Not when even the extras left, all passing, could not make enough: a machine that failed that many
    rounds at this pace would spend them for nothing."""
    if ran < planned or judged(ran, healthy):
        return False
    left = budget - (ran - planned)
    return MIN_HEALTHY_ROUNDS - healthy <= left


def _and(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def why_extra(level: str, failed: Mapping[int, Sequence[str]], next_round: int) -> str:
    """``c=256: rounds 2 and 4 failed engine_clock_lag; running extra round 6``"""
    rounds = _and([str(k) for k in failed])
    checks = _and(sorted({check for found in failed.values() for check in found}))
    noun = "round" if len(failed) == 1 else "rounds"
    return f"{level}: {noun} {rounds} failed {checks}; running extra round {next_round}"


@dataclass(frozen=True, slots=True)
class LevelRounds:
    """How a level's rounds went: ``ran`` = planned + extra rounds run, ``healthy`` of them passed,
    ``budget`` extra rounds were allowed for health; ``deciding`` of the extra rounds ran to settle a
    verdict (of ``deciding_budget``), ``unsettled`` says what was still open when they stopped and
    ``out_of_time`` whether the time budget stopped them."""

    level: str  # c=256, r=2
    planned: int
    ran: int
    healthy: int
    budget: int = 0
    deciding: int = 0
    deciding_budget: int = 0
    unsettled: tuple[str, ...] = ()
    out_of_time: bool = False  # the deciding rounds stopped at the caller's time budget
    extra_out_of_time: bool = False  # extra rounds were due but would have ended past that budget

    @property
    def extra(self) -> int:
        """Extra rounds run for health (the deciding rounds not counted)."""
        return max(0, self.ran - self.planned - self.deciding)

    def deciding_sentence(self) -> str | None:
        """What the deciding rounds did at this level; None where none ran and nothing stayed open."""
        if self.deciding == 0 and not self.unsettled:
            return None
        ran = f"{self.deciding} of {self.deciding_budget} deciding rounds run"
        if self.out_of_time:
            ran += ", no more within the time budget"
        if not self.unsettled:
            return f"{self.level}: {ran}; every verdict read here is settled"
        return f"{self.level}: {ran}; still open: {'; '.join(self.unsettled)}"

    @property
    def enough(self) -> bool:
        return judged(self.ran, self.healthy)

    def sentence(self) -> str | None:
        """What the extra rounds did at this level; None where nothing is worth saying (enough rounds
        passed without any, or the level was stopped before its planned rounds were done)."""
        wanted = MIN_HEALTHY_ROUNDS
        passed = f"{self.healthy} of {self.ran} rounds passed every health check"
        late = ", no more within the time budget" if self.extra_out_of_time else ""
        if self.extra == 0:
            if self.enough or self.ran < self.planned:
                return None
            if self.extra_out_of_time:
                never = "no extra round would end within the time budget"
                return f"{self.level}: {passed}, fewer than {wanted}; {never}"
            if self.budget == 0:
                return f"{self.level}: {passed}, fewer than {wanted}; no extra rounds were allowed"
            return (
                f"{self.level}: {passed}, fewer than {wanted}; no extra round ran, as the {self.budget} "
                "allowed could not make up the difference even if all passed"
            )
        extras = f"{self.extra} of {self.budget} extra rounds run{late}"
        if self.enough:
            return f"{self.level}: {extras}, {passed} ({wanted} needed)"
        return f"{self.level}: {extras}, only {passed}, fewer than the {wanted} needed"
