"""An arm against the baseline at one level (or category): the speedup intervals, from frozen figures.

Paired levels (every request went to both arms) resample pairs; unpaired levels (split traffic) resample
each arm's calls. That gives :func:`paired` / :func:`unpaired` a comparison with the request bootstrap's
intervals and each figure's block spread (rounds, or time blocks); :func:`pooled` then widens every arm
at a level by the between-block variance pooled over the level's arms
(:func:`~specproxy.analysis.stats.widen_pooled`). Everything here is pure: figures in, frozen
:class:`Comparison` objects out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from specproxy.analysis.figures.run_figures import CallGroup, PairGroup, RoundFigures
from specproxy.analysis.stats import (
    Blocks,
    BlockSpread,
    FloatArray,
    Interval,
    block_spread,
    paired_median_ratio,
    throughput_ratio,
    unpaired_median_ratio,
    widen_pooled,
    with_bias_bound,
)

# A block with fewer units than this says little about drift and is left out of the spread.
MIN_BLOCK_UNITS = 5


@dataclass(frozen=True)
class Bootstrap:
    iterations: int
    confidence: float
    rng: np.random.Generator

    @property
    def draws(self) -> dict[str, Any]:
        """The keyword arguments of every bootstrap interval in :mod:`specproxy.analysis.stats`."""
        return {"iterations": self.iterations, "rng": self.rng, "confidence": self.confidence}


@dataclass(frozen=True)
class Spread:
    """What the between-block term needs of a comparison: each figure's block spread (None: fewer
    than two usable blocks) and the confidence of its intervals."""

    decode: BlockSpread | None
    throughput: BlockSpread | None
    confidence: float


@dataclass(frozen=True)
class Comparison:
    """The figures a verdict is made from. ``blocks`` says what the intervals' drift term came from
    ("3 rounds", "4 time blocks"); ``throughput_basis`` is "wall" (a closed-loop replay level's
    wall-clock tok/s) or "per call" (Σ tokens / Σ e2e: live or split traffic)."""

    paired: bool
    pairs: int
    decode: Interval | None
    throughput: Interval | None
    throughput_basis: str
    blocks: str
    spread: Spread | None = None  # set while the intervals are the request bootstrap's; None after pooled


def _block_logs(
    sample: FloatArray, block_col: int, log_ratio: Callable[[FloatArray], float | None], per_unit: float
) -> Blocks | None:
    """Per block of ``sample``: the log ratio and its variance factor ``per_unit / units``."""
    logs, factors = [], []
    for b in np.unique(sample[:, block_col]) if len(sample) else []:
        part = sample[sample[:, block_col] == b]
        if len(part) < MIN_BLOCK_UNITS:
            continue
        value = log_ratio(part)
        if value is not None and math.isfinite(value):
            logs.append(value)
            factors.append(per_unit / len(part))
    return Blocks(tuple(logs), tuple(factors)) if len(logs) >= 2 else None


def _log_median_ratio(c_col: int, b_col: int) -> Callable[[FloatArray], float | None]:
    def f(part: FloatArray) -> float | None:
        ok = part[(part[:, c_col] > 0) & (part[:, b_col] > 0)]
        return math.log(np.median(ok[:, c_col]) / np.median(ok[:, b_col])) if len(ok) else None

    return f


def _log_rate_ratio(part: FloatArray) -> float | None:
    """Σ tokens / Σ e2e, candidate over baseline (pair sample columns 2-5)."""
    ok = part[np.isfinite(part[:, 2]) & np.isfinite(part[:, 3]) & (part[:, 4] > 0) & (part[:, 5] > 0)]
    if not len(ok) or ok[:, 2].sum() <= 0 or ok[:, 3].sum() <= 0:
        return None
    return math.log(ok[:, 2].sum() / ok[:, 4].sum()) - math.log(ok[:, 3].sum() / ok[:, 5].sum())


def _round_wall_blocks(cand: RoundFigures, base: RoundFigures) -> Blocks | None:
    """Per replay round: the log ratio of the arms' wall-clock tok/s (variance factor 1 / calls)."""
    logs, factors = [], []
    for i, r in enumerate(cand.rounds):
        if r not in base.rounds:
            continue
        c, b = cand.rate(r), base.rate(r)
        if c and b and cand.ok[i] >= MIN_BLOCK_UNITS:
            logs.append(math.log(c / b))
            factors.append(1.0 / cand.ok[i])
    return Blocks(tuple(logs), tuple(factors)) if len(logs) >= 2 else None


def wall_ratio(cand: RoundFigures, base: RoundFigures) -> float | None:
    """Σ tokens / Σ wall over the rounds both arms ran, candidate over baseline."""
    common = [r for r in cand.rounds if r in base.rounds]

    def rate(f: RoundFigures) -> float | None:
        idx = [f.rounds.index(r) for r in common]
        wall = sum(f.wall_s[i] for i in idx)
        return sum(f.tokens[i] for i in idx) / wall if wall > 0 else None

    c, b = rate(cand), rate(base)
    return c / b if c and b else None


def _scaled(blocks: Blocks | None, total: int) -> Blocks | None:
    """Variance factors relative to the pooled estimate over ``total`` units."""
    if blocks is None:
        return None
    return Blocks(blocks.log_ratios, tuple(f * total for f in blocks.variance_factors))


def paired(
    group: PairGroup,
    wall_point: float | None,
    rounds: tuple[RoundFigures, RoundFigures] | None,
    block_kind: str,
    boot: Bootstrap,
) -> Comparison:
    """A paired level (or category: ``wall_point`` None gives the per-call throughput ratio).

    With ``rounds`` (the candidate's and the baseline's per-round figures), the throughput ratio's
    drift term comes from each round's wall-clock ratio; otherwise from the blocks' Σ tokens / Σ e2e.
    """
    sample = group.sample
    decode, d_spread, throughput, t_spread = None, None, None, None
    if group.c_med and group.b_med:
        dec = sample[(sample[:, 0] > 0) & (sample[:, 1] > 0)]
        decode = paired_median_ratio(
            dec[:, 0],
            dec[:, 1],
            point=group.c_med / group.b_med,
            n_total=group.n_decode,
            **boot.draws,
        )
        d_spread = block_spread(
            decode,
            _scaled(_block_logs(dec, 6, _log_median_ratio(0, 1), 1.0), group.n_decode),
            boot.confidence,
        )
    point = wall_point if wall_point is not None else group.per_call_ratio
    if point is not None:
        thr = sample[
            np.isfinite(sample[:, 2]) & np.isfinite(sample[:, 3]) & (sample[:, 4] > 0) & (sample[:, 5] > 0)
        ]
        throughput = throughput_ratio(
            thr[:, 2],
            thr[:, 4],
            thr[:, 3],
            thr[:, 5],
            point=point,
            n_cand=max(group.n_thr, 1),
            n_base=max(group.n_thr, 1),
            paired=True,
            **boot.draws,
        )
        if rounds is not None:
            t_blocks = _scaled(_round_wall_blocks(*rounds), max(group.n_thr, 1))
        else:
            t_blocks = _scaled(_block_logs(thr, 6, _log_rate_ratio, 1.0), max(group.n_thr, 1))
        t_spread = block_spread(throughput, t_blocks, boot.confidence)
    return Comparison(
        paired=True,
        pairs=group.n_decode,
        decode=decode,
        throughput=throughput,
        throughput_basis="wall" if wall_point is not None else "per call",
        blocks=block_kind,
        spread=Spread(d_spread, t_spread, boot.confidence),
    )


def _unpaired_blocks(
    cs: FloatArray,
    bs: FloatArray,
    value: Callable[[FloatArray, FloatArray], float | None],
    n_cand: int,
    n_base: int,
) -> Blocks | None:
    """Per block present in both samples: the log ratio, and its variance factor relative to the
    pooled estimate over all n_cand and n_base calls, (1/m_c + 1/m_b) / (1/n_cand + 1/n_base)."""
    logs, factors = [], []
    pooled = 1 / max(n_cand, 1) + 1 / max(n_base, 1)
    for b in np.unique(cs[:, 3]) if len(cs) else []:
        c_part, b_part = cs[cs[:, 3] == b], bs[bs[:, 3] == b]
        if min(len(c_part), len(b_part)) < MIN_BLOCK_UNITS:
            continue
        v = value(c_part, b_part)
        if v is not None and math.isfinite(v):
            logs.append(v)
            factors.append((1 / len(c_part) + 1 / len(b_part)) / pooled)
    return Blocks(tuple(logs), tuple(factors)) if len(logs) >= 2 else None


def _log_median_of(c: FloatArray, b: FloatArray) -> float | None:
    c, b = c[c[:, 0] > 0, 0], b[b[:, 0] > 0, 0]
    return math.log(np.median(c) / np.median(b)) if len(c) and len(b) else None


def _log_rate_of(c: FloatArray, b: FloatArray) -> float | None:
    def rate(x: FloatArray) -> float:
        ok = x[np.isfinite(x[:, 1]) & (x[:, 2] > 0)]
        return float(ok[:, 1].sum() / ok[:, 2].sum()) if len(ok) and ok[:, 1].sum() > 0 else 0.0

    rc, rb = rate(c), rate(b)
    return math.log(rc / rb) if rc > 0 and rb > 0 else None


def unpaired(cand: CallGroup, base: CallGroup, block_kind: str, boot: Bootstrap) -> Comparison:
    """Two independent groups of calls (split traffic): the decode speedup of their own P50s and the
    per-call throughput ratio (the arms got different shares of the traffic, so wall-clock tok/s say
    more about the split than about speed; Σ tokens / Σ e2e is throughput per concurrent call)."""
    cs, bs = cand.sample, base.sample
    decode, d_spread, throughput, t_spread = None, None, None, None
    if cand.p50_decode and base.p50_decode:
        decode = unpaired_median_ratio(
            cs[cs[:, 0] > 0, 0],
            bs[bs[:, 0] > 0, 0],
            point=cand.p50_decode / base.p50_decode,
            n_cand=cand.n_decode,
            n_base=base.n_decode,
            **boot.draws,
        )
        blocks = _unpaired_blocks(cs, bs, _log_median_of, cand.n_decode, base.n_decode)
        d_spread = block_spread(decode, blocks, boot.confidence)
    c_rate, b_rate = cand.per_call_rate, base.per_call_rate
    if c_rate and b_rate:
        c_ok = np.isfinite(cs[:, 1]) & (cs[:, 2] > 0)
        b_ok = np.isfinite(bs[:, 1]) & (bs[:, 2] > 0)
        throughput = throughput_ratio(
            cs[c_ok, 1],
            cs[c_ok, 2],
            bs[b_ok, 1],
            bs[b_ok, 2],
            point=c_rate / b_rate,
            n_cand=max(cand.n_thr, 1),
            n_base=max(base.n_thr, 1),
            paired=False,
            **boot.draws,
        )
        blocks = _unpaired_blocks(cs, bs, _log_rate_of, cand.n_thr, base.n_thr)
        t_spread = block_spread(throughput, blocks, boot.confidence)
    return Comparison(
        paired=False,
        pairs=0,
        decode=decode,
        throughput=throughput,
        throughput_basis="per call",
        blocks=block_kind,
        spread=Spread(d_spread, t_spread, boot.confidence),
    )


K = TypeVar("K", bound=Hashable)


def pooled(comparisons: Mapping[K, Comparison], group: Callable[[K], Hashable]) -> dict[K, Comparison]:
    """Every comparison widened by the between-block variance pooled over its group: the arms measured
    in the same blocks at the same level (``group`` of a key: its level, or level and category) with
    the same pairing. The arms share the rounds (or time blocks), so a drift the machine puts on them
    is estimated from all their blocks at once: R − 1 degrees of freedom per arm instead of R − 1 in
    all (stats.widen_pooled, analysis README)."""
    members: dict[Hashable, list[BlockSpread]] = {}
    for key, comp in comparisons.items():
        if comp.spread is not None:
            for name, spread in (("decode", comp.spread.decode), ("throughput", comp.spread.throughput)):
                if spread is not None:
                    members.setdefault((group(key), comp.blocks, comp.paired, name), []).append(spread)

    def widened(key: K, comp: Comparison) -> Comparison:
        if comp.spread is None:
            return comp
        sp, where = comp.spread, (group(key), comp.blocks, comp.paired)
        decode = _widen(comp.decode, sp.decode, members.get((*where, "decode"), []), sp.confidence)
        throughput = _widen(
            comp.throughput, sp.throughput, members.get((*where, "throughput"), []), sp.confidence
        )
        return replace(comp, decode=decode, throughput=throughput, spread=None)

    return {key: widened(key, comp) for key, comp in comparisons.items()}


def _widen(
    iv: Interval | None, own: BlockSpread | None, spreads: list[BlockSpread], confidence: float
) -> Interval | None:
    return None if iv is None else widen_pooled(iv, own, spreads, confidence)


@dataclass(frozen=True)
class LagBounds:
    """How much a simulator that fell behind its own clock can have slowed one arm's figures at a level
    (shares). A simulator that lags by x % of its busy time serves x % slower than its profile, never
    faster; engines without such a clock have none.

    ``worst``: the largest lag over the level's judged rounds; a call's decode speed (and a per-call
    throughput) was slowed by at most about that. ``busy_mean``: the rounds' lags weighted by their busy
    time on the simulator's clock, by how much Σ wall over the rounds was stretched, which is the
    wall-clock throughput's whole bias (the rounds' differences in lag are part of their spread)."""

    worst: float = 0.0
    busy_mean: float = 0.0

    @classmethod
    def of_rounds(cls, lags: Mapping[int, float], walls: Mapping[int, float]) -> LagBounds:
        """From each round's lag and the arm's wall time in it (a round without one weighs 1 s)."""
        if not lags:
            return cls()
        busy = {r: walls.get(r, 1.0) / (1.0 + max(lag, 0.0)) for r, lag in lags.items()}
        total = sum(busy.values())
        mean = sum(busy[r] * lag for r, lag in lags.items()) / total if total > 0 else max(lags.values())
        return cls(max(lags.values()), mean)


def lag_bounded(comp: Comparison, cand: LagBounds, base: LagBounds) -> Comparison:
    """The intervals moved out by how much the arms' simulators can have slowed them. A lagging
    candidate looks slower than it is, so its lag moves only the upper bound out; a lagging baseline
    makes the candidate look better, so its lag moves only the lower bound. A level lagging beyond the
    validity gate's limit is UNRELIABLE anyway; one below it carries these bounds."""
    decode = None if comp.decode is None else with_bias_bound(comp.decode, base.worst, cand.worst)
    throughput = comp.throughput
    if throughput is not None:
        wall = comp.throughput_basis == "wall"
        down, up = (base.busy_mean, cand.busy_mean) if wall else (base.worst, cand.worst)
        throughput = with_bias_bound(throughput, down, up)
    return replace(comp, decode=decode, throughput=throughput)
