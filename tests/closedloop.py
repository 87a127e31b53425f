"""Synthetic live traffic from a closed loop: the spans `specproxy serve` writes when `replay --target`
drives it at a concurrency level, in split or shadow mode, with ground truth known.

:func:`make_design` draws a design from a seed (mode, split weights or shadow samples, level, output
length, arms' true speedups); :func:`make_closed_loop_run` simulates it. ``c`` clients each send a
request as soon as their previous one ended; in split mode the request goes to one arm (by weight),
in shadow mode to the baseline, with a copy to each candidate at its ``sample`` (the client waits
for the baseline only). A call's time per token is ``BASE_TPT * (1 + load / KNEE)`` at its engine's
calls in flight when it starts, divided by the arm's speedup, times the engine's slowness of the
moment (a per-engine AR(1) factor over 0.5 s slices, a busy core) and a per-call draw. The slowness
is what makes a closed loop hard: an engine that slows down holds its clients longer and its calls
pile up, so load and slowness move together for reasons other than the load.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from specproxy.record import RoutedAs, SpanRecord
from tests.spanfactory import T0, SyntheticRun, epoch_ns

BASE_TPT = 0.008  # seconds per token at no load
KNEE = 96.0  # the load at which a token takes twice as long (the H100 profile: about 300)
SLICE_S = 0.5
SLOW_SIGMA = 0.06  # the engines' slowness: AR(1) in log, its stationary deviation
SLOW_RHO = 0.9
CALL_SIGMA = 0.08


@dataclass(frozen=True)
class Design:
    """One live experiment: ``weights`` (split) or ``samples`` (shadow) per non-baseline arm, the
    baseline's split weight, the arms' true speedups (1.0: identical to the baseline)."""

    mode: str  # split | shadow
    level: int
    rounds: int = 3
    requests: int = 200  # per round
    tokens: tuple[int, int] = (16, 128)
    baseline_weight: float = 0.5
    weights: dict[str, float] = field(default_factory=dict)
    samples: dict[str, float] = field(default_factory=dict)
    speedups: dict[str, float] = field(default_factory=dict)
    clock_lag: dict[str, float] = field(default_factory=dict)  # arm -> the lag its health rows say
    noise: float = 1.0  # the engines' slowness and step jitter, as a share of the defaults

    @property
    def arms(self) -> list[str]:
        return ["baseline", *sorted(self.weights or self.samples)]

    def describe(self) -> str:
        if self.mode == "split":
            shares = "/".join(f"{w:.2f}" for w in (self.baseline_weight, *self.weights.values()))
        else:
            shares = "sample " + "/".join(f"{s:.2f}" for s in self.samples.values())
        gains = ",".join(f"{a}={s:g}" for a, s in self.speedups.items() if s != 1.0)
        return f"{self.mode} {shares} c={self.level} tokens {self.tokens}" + (f" {gains}" if gains else "")


def make_design(rng: random.Random, speedup: float = 1.0, level: int | None = None) -> Design:
    """A design drawn at random: split 50/50..90/10 or three-way, or shadow at 0.2-1.0; level 2-64
    (or ``level``); short or long outputs. ``speedup``: the candidate's truth (``twin``: 1.0 always)."""
    level = level or rng.choice((2, 4, 8, 16, 32, 64))
    tokens = rng.choice(((16, 64), (64, 256)))
    requests = max(150, min(400, 6 * level))
    if rng.random() < 0.5:
        three = rng.random() < 0.3
        if three:
            w = rng.uniform(0.2, 0.5)
            rest = (1 - w) / 2
            return Design(
                "split", level, requests=requests, tokens=tokens, baseline_weight=w,
                weights={"twin": rest, "candidate": rest}, speedups={"candidate": speedup},
            )  # fmt: skip
        base = rng.uniform(0.5, 0.9)
        if rng.random() < 0.5:
            base = 1 - base  # the candidate gets the larger share as often as the smaller
        return Design(
            "split", level, requests=requests, tokens=tokens, baseline_weight=base,
            weights={"candidate": 1 - base}, speedups={"candidate": speedup},
        )  # fmt: skip
    sample = rng.uniform(0.2, 1.0)
    return Design(
        "shadow", level, requests=requests, tokens=tokens,
        samples={"candidate": sample}, speedups={"candidate": speedup},
    )  # fmt: skip


class _Slowness:
    """Each engine's slowness factor per time slice (AR(1) in log), drawn lazily."""

    def __init__(self, rng: random.Random, arms: list[str], sigma: float = SLOW_SIGMA) -> None:
        self.rng = rng
        self.sigma = sigma
        self.values: dict[str, list[float]] = {a: [0.0] for a in arms}

    def at(self, arm: str, t: float) -> float:
        k = int(t / SLICE_S)
        series = self.values[arm]
        while len(series) <= k:
            noise = self.rng.gauss(0.0, self.sigma * math.sqrt(1 - SLOW_RHO**2))
            series.append(SLOW_RHO * series[-1] + noise)
        return math.exp(series[k])


def make_closed_loop_run(design: Design, seed: int, run_id: str = "live-aa") -> SyntheticRun:
    """The design's spans and health rows (``engine_clock_lag`` per arm and round from
    ``design.clock_lag``, 0.4 % where not given; the proxy's loop lag share 0.3 %)."""
    rng = random.Random(seed)
    slow = _Slowness(rng, design.arms, SLOW_SIGMA * design.noise)
    spans: list[SpanRecord] = []
    health: list[tuple[Any, ...]] = []
    t = 0.0
    for round_no in range(1, design.rounds + 1):
        t = _round(design, round_no, t, rng, slow, spans, run_id) + 1.0
        at = T0 + timedelta(seconds=t)
        for arm in design.arms:
            lag = design.clock_lag.get(arm, 0.004)
            health.append((run_id, arm, design.level, round_no, "engine_clock_lag", lag, 0.02, at, None))
        health.append((run_id, None, design.level, round_no, "event_loop_lag_share", 0.003, 0.02, at, None))
    config = '{"arms": []}'
    run_row = (run_id, "live aa", design.mode, "live", T0, T0, config, "{}", "testhost", "0.1.0")
    return SyntheticRun(run_id, "live aa", spans, [], run_row, health)


@dataclass
class _Call:
    arm: str
    request_id: str
    start: float
    tokens: int
    load: int
    routed: RoutedAs
    produced: float = 0.0
    first: float | None = None


@dataclass
class _Engine:
    running: list[_Call] = field(default_factory=list)
    joining: list[_Call] = field(default_factory=list)
    busy: bool = False


def _round(
    design: Design,
    round_no: int,
    t0: float,
    rng: random.Random,
    slow: _Slowness,
    spans: list[SpanRecord],
    run_id: str,
) -> float:
    """One round: ``design.requests`` requests from ``design.level`` clients, on engines that step
    all their calls at once (one token each a step, more for a speculative arm); returns its end."""
    engines = {a: _Engine() for a in design.arms}
    events: list[tuple[float, int, str]] = [(t0 + 0.001 * k, k, "") for k in range(design.level)]
    heapq.heapify(events)
    sent, seq, end = 0, design.level, t0

    def step(arm: str, t: float) -> None:
        engine = engines[arm]
        n = len(engine.running) + len(engine.joining)
        engine.busy = n > 0
        if n:
            nonlocal seq
            seq += 1
            jitter = math.exp(rng.gauss(0.0, CALL_SIGMA * design.noise))
            heapq.heappush(events, (t + BASE_TPT * (1 + n / KNEE) * slow.at(arm, t) * jitter, seq, arm))

    while events:
        t, _, arm = heapq.heappop(events)
        if not arm:  # a client sends its next request
            if sent >= design.requests:
                continue
            request_id, tokens = f"{run_id}-r{round_no}-{sent}", rng.randint(*design.tokens)
            sent += 1
            primary = _primary(design, rng)
            copies = (
                [a for a, x in design.samples.items() if rng.random() < x] if design.mode == "shadow" else []
            )
            for target in [primary, *copies]:
                engine = engines[target]
                split = design.mode == "split"
                routed: RoutedAs = "split" if split else "primary" if target == primary else "shadow"
                load = len(engine.running) + len(engine.joining)
                engine.joining.append(_Call(target, request_id, t, tokens, load, routed))
                if not engine.busy:
                    step(target, t + 0.002)
            continue
        engine = engines[arm]
        speedup = design.speedups.get(arm, 1.0)
        for call in list(engine.running):
            call.produced += 1 + (rng.random() < speedup - 1)
            call.first = call.first if call.first is not None else t
            if call.produced >= call.tokens:
                engine.running.remove(call)
                spans.append(_span(run_id, call, design, round_no, t))
                end = max(end, t)
                if call.routed != "shadow":
                    seq += 1
                    heapq.heappush(events, (t, seq, ""))
        engine.running += engine.joining
        engine.joining = []
        step(arm, t)
    return end


def _primary(design: Design, rng: random.Random) -> str:
    if design.mode == "shadow":
        return "baseline"
    x = rng.random() - design.baseline_weight
    for arm, w in sorted(design.weights.items()):
        if x < 0:
            break
        x -= w
        if x < 0:
            return arm
    return "baseline"


def _span(run_id: str, call: _Call, design: Design, round_no: int, end: float) -> SpanRecord:
    start = T0 + timedelta(seconds=call.start)
    baseline = call.arm == "baseline"
    first = call.first if call.first is not None else end
    ttft = first - call.start
    return SpanRecord(
        run_id=run_id,
        request_id=call.request_id,
        arm=call.arm,
        arm_role="baseline" if baseline else "replica" if call.arm == "twin" else "candidate",
        backend_url=f"http://127.0.0.1:{9001 + design.arms.index(call.arm)}",
        spec_method="none" if baseline or call.arm == "twin" else "eagle3",
        source="live",
        routed_as=call.routed,
        category="chat",
        endpoint="chat",
        model="m",
        stream=True,
        temperature=0.0,
        concurrency_level=design.level,
        round=round_no,
        t_start=start,
        t_start_ns=epoch_ns(start),
        ttft_s=ttft,
        e2e_s=end - call.start,
        decode_tok_s=(call.tokens - 1) / (end - first) if end > first else None,
        completion_tokens=call.tokens,
        finish_reason="length",
        output_sha256=f"out-{call.request_id}",
        identical=None if baseline or design.mode == "split" else True,
        status="ok",
        inflight_at_start=call.load,
    )
