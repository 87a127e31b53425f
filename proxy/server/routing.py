"""Which arms a request goes to: the arm that serves the client, and the copies sent alongside.

- shadow mode: the baseline serves; each candidate gets a copy with probability ``arm.sample``.
- split mode: one arm by weight. With ``sticky_key`` set (``"user"``: the body's ``user`` field;
  ``"header:X-Session-ID"``: that header) the same key always maps to the same arm: the key's hash is
  a point in [0, 1) and the arms' weights cut [0, 1) into consecutive intervals, so the mapping is
  deterministic and stable while the weights are unchanged. ``verify_fraction``: that share of
  greedy requests routed to a candidate also go to the baseline so that identity is still checked.

Example::

    router = ArmRouter(experiment)
    plan = router.plan(body, request.headers, comparable=True)
    plan.primary.name, [(c.arm.name, c.routed_as) for c in plan.copies]
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from specproxy.config import Arm, Experiment


@dataclass(frozen=True, slots=True)
class Copy:
    """A copy of the request sent to another arm, read to the end, timed and discarded."""

    arm: Arm
    routed_as: Literal["shadow", "verify"]


@dataclass(frozen=True, slots=True)
class RoutePlan:
    primary: Arm
    primary_routed_as: Literal["primary", "split"]  # primary in shadow mode
    copies: tuple[Copy, ...]


def key_point(key: str) -> float:
    """A stable point in [0, 1) for a sticky key (the same on every process and machine)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class ArmRouter:
    def __init__(self, experiment: Experiment, rng: random.Random | None = None) -> None:
        self.experiment = experiment
        self._rng = rng or random.Random()
        self._baseline = experiment.baseline
        self._candidates = experiment.candidates
        weighted = [a for a in experiment.arms if a.weight > 0]
        total = sum(a.weight for a in weighted)
        self._cumulative: list[tuple[float, Arm]] = []
        acc = 0.0
        for a in weighted:
            acc += a.weight / total if total else 0.0
            self._cumulative.append((acc, a))
        sticky = experiment.sticky_key
        self._sticky_header = sticky[len("header:") :] if sticky.startswith("header:") else None
        self._sticky_user = sticky == "user"
        self._shadow_plans_full = RoutePlan(
            self._baseline, "primary", tuple(Copy(a, "shadow") for a in self._candidates)
        )

    def sticky_key(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
        if self._sticky_user:
            user = body.get("user")
            return str(user) if user not in (None, "") else None
        if self._sticky_header is not None:
            return headers.get(self._sticky_header) or None
        return None

    def choose_split_arm(self, point: float) -> Arm:
        for edge, arm in self._cumulative:
            if point < edge:
                return arm
        return self._cumulative[-1][1]

    def plan(self, body: Mapping[str, Any], headers: Mapping[str, str], *, comparable: bool) -> RoutePlan:
        if self.experiment.mode == "shadow":
            if all(a.sample >= 1.0 for a in self._candidates):
                return self._shadow_plans_full
            rnd = self._rng.random
            sampled = tuple(
                Copy(a, "shadow") for a in self._candidates if a.sample >= 1.0 or rnd() < a.sample
            )
            return RoutePlan(self._baseline, "primary", sampled)
        key = self.sticky_key(body, headers)
        arm = self.choose_split_arm(key_point(key) if key is not None else self._rng.random())
        copies: tuple[Copy, ...] = ()
        if (
            arm.role != "baseline"
            and comparable
            and self.experiment.verify_fraction > 0
            and self._rng.random() < self.experiment.verify_fraction
        ):
            copies = (Copy(self._baseline, "verify"),)
        return RoutePlan(arm, "split", copies)
