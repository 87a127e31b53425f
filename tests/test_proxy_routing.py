"""ArmRouter: shadow sampling, split weights, sticky keys, verify copies."""

from __future__ import annotations

import random
from typing import Any

from specproxy.config import parse_experiment
from specproxy.proxy.server.routing import ArmRouter, key_point


def _router(mode: str, arms: list[dict[str, Any]], **exp: Any) -> ArmRouter:
    experiment = parse_experiment({"experiment": {"mode": mode, **exp}, "arms": arms})
    return ArmRouter(experiment, rng=random.Random(7))


ARMS: list[dict[str, Any]] = [
    {"name": "base", "role": "baseline", "url": "http://b"},
    {"name": "half", "url": "http://h", "sample": 0.5, "weight": 3},
    {"name": "never", "url": "http://n", "sample": 0.0, "weight": 0},
]


def test_shadow_mode_serves_from_the_baseline_and_samples_copies() -> None:
    router = _router("shadow", ARMS)
    plans = [router.plan({}, {}, comparable=True) for _ in range(2000)]
    assert {p.primary.name for p in plans} == {"base"} and {p.primary_routed_as for p in plans} == {"primary"}
    copies = [c.arm.name for p in plans for c in p.copies]
    assert "never" not in copies and 900 < copies.count("half") < 1100
    assert all(c.routed_as == "shadow" for p in plans for c in p.copies)


def test_split_mode_weights_and_sticky_keys() -> None:
    router = _router("split", ARMS, sticky_key="user")
    chosen = [router.plan({"user": f"u{i}"}, {}, comparable=False).primary.name for i in range(4000)]
    assert "never" not in chosen and 2850 < chosen.count("half") < 3150  # weight 3 of 4
    # The same key always lands on the same arm, on any router built from the same weights.
    other = _router("split", ARMS, sticky_key="user")
    assert all(
        other.plan({"user": f"u{i}"}, {}, comparable=False).primary.name == chosen[i] for i in range(200)
    )
    assert key_point("u1") == key_point("u1") and 0 <= key_point("x") < 1


def test_split_header_stickiness_and_verify_copies_only_for_greedy_candidates() -> None:
    router = _router("split", ARMS, sticky_key="header:X-Session-ID", verify_fraction=1.0)
    seen: dict[str, set[str]] = {}
    for i in range(300):
        sid = f"s{i % 30}"
        plan = router.plan({}, {"X-Session-ID": sid}, comparable=i % 2 == 0)
        seen.setdefault(sid, set()).add(plan.primary.name)
        if plan.primary.name == "half":
            expected = (("base", "verify"),) if i % 2 == 0 else ()
            assert tuple((c.arm.name, c.routed_as) for c in plan.copies) == expected
        else:
            assert plan.copies == ()
    assert all(len(arms) == 1 for arms in seen.values())
