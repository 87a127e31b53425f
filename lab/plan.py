"""The lab's sweep: its levels (or rates), rounds and items per round, and the load it sends."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import click

from specproxy.engines.profiles import ProfileError, load_profile
from specproxy.lab.pacing import SimPacer
from specproxy.proxy.replay.formats import ReplayItem
from specproxy.proxy.replay.runner import LoadPlan

# Rounds a level may add when too few of its rounds passed every health check. At c=256 of a quick lab
# on two loaded cores one to three of five rounds failed while the others were fine; three extras can
# make up even for four failed rounds when the machine calms down, and none runs where they could not
# make enough. A c=256 round of a quick lab (three waves) takes about 17 s at time scale 1/4, where one
# or two of its five rounds fail with a clock lag of 2.1-3.0 % on two cores: the quick lab starts none
# past its time budget (a lower level's round costs 1-3.5 s at full speed).
EXTRA_ROUNDS = 3
# Rounds added after the sweep while a verdict the deploy verdict reads reaches across a margin line
# (draft_model's throughput at c=256 of a quick lab, 0.957x against a 3 % margin, came out LOSS in
# one lab and NO CLEAR GAIN in five, in rounds of one wave). Each costs a round of the level it goes to
# (about 17 s at c=256 of a quick lab at time scale 1/4, so the quick lab's budget leaves room for one
# there at most; 1-3.5 s at its operating point c=1) and a look at the verdicts so far (a copy of the
# store and its analysis, 1-2 s).
DECIDING_ROUNDS = 12
# The quick lab starts no extra or deciding round that would end after it has run this long: with the
# analysis and the report after the sweep (5-10 s), it stays within 3 minutes. Its planned rounds take
# 140-146 s on two cores (c=256 at 1/4), so this leaves room for one more round of c=256 (about 17 s).
QUICK_TIME_BUDGET_S = 160.0
# ... and, on a machine so busy that its planned rounds would run longer, cuts the rounds of a level
# (never below the 3 it can be judged on) that would end after this: with the analysis and the report
# it stays within 3 minutes. On a quiet machine the planned rounds end by 140-155 s and none is cut.
QUICK_ROUNDS_BUDGET_S = 170.0


@dataclass(frozen=True, slots=True)
class LabPlan:
    """How big a lab run is."""

    levels: tuple[int, ...]
    min_items_per_level: int  # over all rounds
    waves_per_level: int  # items per level ≥ waves × concurrency, so each level reaches steady state
    time_scale: float
    max_tokens_scale: float
    rounds: int
    # The highest concurrency level's rounds (None: ``rounds``). The deploy verdict reads the peak's
    # throughput there, and with 3 rounds that interval is mostly the drift between rounds times a t
    # quantile on 4-7 degrees of freedom (3.5-4.6 for a 99 % interval): a true ratio a few percent from
    # the margin's line lands on either side of it from run to run. More rounds shrink both factors.
    top_rounds: int | None = None
    # Waves each round of the highest level sends at least (items ≥ waves × concurrency). The deploy
    # verdict reads the peak's throughput there; a round of one wave is mostly the drain of its longest
    # calls (draft_model/baseline 0.960x over one wave of the quick lab's c=256, 0.995x over three, on
    # the simulator's lag-free clock), not the sustained rate a peak runs at.
    top_waves: int = 1
    # Rounds a level may add when too few of its rounds passed every health check (a loaded machine
    # fails a round now and then while the rounds around it are fine); each costs one round's time.
    extra_rounds: int = 0
    # Rounds added after the sweep, in all, where a verdict the deploy verdict reads is unsettled (the
    # operating point, the peak: :mod:`specproxy.proxy.replay.rounds`), none starting that would end
    # after the lab has run ``time_budget_s`` (None: no limit).
    deciding_rounds: int = 0
    time_budget_s: float | None = None
    # No level's planned rounds beyond what ends within this (None: no limit; see QUICK_ROUNDS_BUDGET_S).
    rounds_budget_s: float | None = None
    # Open-loop sweeps: default rates as shares of the baseline's estimated capacity, and how many
    # seconds of arrivals a rate level sends per round.
    rate_shares: tuple[float, ...] = (1 / 32, 1 / 8, 1 / 2, 1.0)
    rate_window_s: float = 4.0

    def level_rounds(self, level: int) -> int:
        if self.top_rounds is not None and level == max(self.levels):
            return self.top_rounds
        return self.rounds

    def items_per_round(self, level: int) -> int:
        """A level's items split over its rounds; every round fills the level's slots at least once,
        the top level's ``top_waves`` times."""
        waves = self.top_waves if level == max(self.levels) else 1
        return max(waves * level, self._split_items(level))

    def _split_items(self, level: int) -> int:
        total = max(self.min_items_per_level, self.waves_per_level * level)
        return max(level, -(-total // self.level_rounds(level)))

    def arrivals_per_round(self, rate: float) -> int:
        """A rate level's arrivals per round: ``rate_window_s`` seconds of them, at least the level's
        share of ``min_items_per_level`` and at most one wave of the top concurrency level's rounds."""
        low = -(-self.min_items_per_level // self.rounds)
        high = max(low, self._split_items(max(self.levels)))
        return min(high, max(low, math.ceil(rate * self.rate_window_s)))


QUICK = LabPlan(
    levels=(1, 4, 16, 64, 256),
    min_items_per_level=20,
    waves_per_level=2,
    time_scale=1.0,
    max_tokens_scale=0.5,
    rounds=3,
    top_rounds=5,
    top_waves=3,
    extra_rounds=EXTRA_ROUNDS,
    deciding_rounds=DECIDING_ROUNDS,
    time_budget_s=QUICK_TIME_BUDGET_S,
    rounds_budget_s=QUICK_ROUNDS_BUDGET_S,
)
FULL = LabPlan(
    levels=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    min_items_per_level=40,
    waves_per_level=3,
    time_scale=1.0,
    max_tokens_scale=1.0,
    rounds=3,
    rate_shares=(1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0),
    rate_window_s=8.0,
    top_waves=3,
    extra_rounds=EXTRA_ROUNDS,
    deciding_rounds=DECIDING_ROUNDS,
)


def estimated_capacity(
    profile: str, time_scale: float, items: Sequence[ReplayItem], batch: int, max_tokens: int | None
) -> float:
    """The baseline's requests/s with ``batch`` calls in flight, from the cost profile: ``batch`` tokens
    per decode step over the workload's mean answer length, at ``time_scale``. Prefill and early stops
    are left out: a rough figure, good for placing a sweep, not for a verdict."""
    try:
        cost = load_profile(profile)
    except ProfileError as exc:
        raise click.ClickException(str(exc)) from None
    answers = [float(max_tokens or it.body.get("max_tokens") or 256) for it in items]
    answer = sum(answers) / len(answers)
    # Context per call: the prompt (about 4 characters a token) and half the answer, on average.
    prompt = sum(len(json.dumps(it.body.get("messages") or it.body.get("prompt"))) / 4 for it in items)
    kv_tokens = int(batch * (prompt / len(items) + answer / 2))
    batch = min(batch, cost.max_num_seqs)
    return batch / cost.step_time(batch, kv_tokens) / answer * time_scale


def default_rates(capacity: float, shares: Sequence[float]) -> tuple[float, ...]:
    """The shares of ``capacity``, each to two significant digits (labels people can read: r=6.6)."""
    return tuple(sorted({float(f"{capacity * share:.2g}") for share in shares}))


def load_plan(
    plan: LabPlan, rates: tuple[float, ...] | None, started: float, pacer: SimPacer | None
) -> LoadPlan:
    """The replay's load for the lab's plan; ``started``: when the lab began (``time.monotonic()``);
    a level the ``pacer`` skipped gets no rounds, and none that would end past the rounds' budget."""
    until = None if plan.time_budget_s is None else started + plan.time_budget_s
    rounds_until = None if plan.rounds_budget_s is None else started + plan.rounds_budget_s
    if rates is None:
        return LoadPlan(
            kind="closed",
            levels=plan.levels,
            items_per_level=plan.items_per_round,
            rounds=plan.rounds,
            rounds_per_level=plan.level_rounds
            if pacer is None
            else lambda c: pacer.rounds(
                c, plan.level_rounds(c), waves=plan.items_per_round(c) / c, until=rounds_until
            ),
            extra_rounds=plan.extra_rounds,
            deciding_rounds=plan.deciding_rounds,
            added_until=until,
            warm_fresh_prompts=True,
        )
    return LoadPlan(
        kind="rate",
        rates=rates,
        items_per_rate=plan.arrivals_per_round,
        rounds=plan.rounds,
        extra_rounds=plan.extra_rounds,
        deciding_rounds=plan.deciding_rounds,
        added_until=until,
        warm_fresh_prompts=True,
    )


def sweep_sentence(plan: LabPlan, rates: tuple[float, ...] | None) -> str:
    if rates is None:
        n_calls = sum(plan.level_rounds(c) * plan.items_per_round(c) for c in plan.levels)
        levels = ",".join(map(str, plan.levels))
        top = max(plan.levels)
        at_top = [f"{plan.level_rounds(top)} at c={top}"] if plan.level_rounds(top) != plan.rounds else []
        if plan.items_per_round(top) > top:
            at_top.append(f"{plan.items_per_round(top)} calls a round at c={top}")
        if at_top:
            levels += f" in paired mode, {plan.rounds} rounds per level ({', '.join(at_top)})"
            return f"sweep {levels}, {n_calls} requests per arm"
    else:
        n_calls = plan.rounds * sum(plan.arrivals_per_round(r) for r in rates)
        levels = "open-loop rates " + ",".join(f"{r:g}" for r in rates) + " req/s"
    return f"sweep {levels} in paired mode, {plan.rounds} rounds per level, {n_calls} requests per arm"


def extra_sentence(plan: LabPlan) -> str:
    parts = []
    if plan.extra_rounds:
        parts.append(
            f"; up to {plan.extra_rounds} extra round{'s' if plan.extra_rounds > 1 else ''} at a level "
            "whose rounds leave too few that pass every health check"
        )
    if plan.deciding_rounds:
        parts.append(
            f"; up to {plan.deciding_rounds} deciding round{'s' if plan.deciding_rounds > 1 else ''} after "
            "the sweep where a verdict the deploy verdict reads is unsettled"
            + (f", within {plan.time_budget_s:.0f} s of the lab's start" if plan.time_budget_s else "")
        )
    return "".join(parts)
