"""Bootstrap confidence intervals for speedups (numpy, vectorised over resamples).

Definitions used everywhere in analysis (and by the tests' independent checks):
- a percentile is linear interpolation between order statistics: DuckDB's ``quantile_cont``, numpy's
  ``quantile(..., method="linear")`` (its default); the median is its 50th percentile;
- decode speedup = median(candidate decode tok/s) / median(baseline decode tok/s), over the paired
  requests when the level is paired, else over each arm's own calls;
- intervals are percentile bootstrap intervals of the log ratio.

The interval is the full-data estimate plus the percentiles of the resampled log ratios' deviations
from their own mean (a percentile interval re-centred on the estimate: the bootstrap distribution of a
median is off-centre, and without this paired intervals over-cover, 99 % for a nominal 95 % at 120
pairs). Large levels are resampled from a uniform subsample of m ≤ ``max_sample`` units (m-out-of-n
bootstrap), the deviations scaled by sqrt(m / n). This keeps an analysis of millions of spans to a few
million numbers per level.

Between-round variation (:func:`widen_pooled`). A slow moment of one arm's process is shared by
every request of that arm while it lasts, so requests are not independent across a run and a bootstrap
over requests alone is too narrow. A level is therefore measured in blocks: replay rounds (the whole
level replayed, arm order rotated), or, for a level of one round and for live traffic, four consecutive
time blocks of the level. The interval is the request bootstrap's, widened when the blocks disagree
more than their within-block noise explains: a one-way random-effects model on the blocks' log ratios
L_r (Cochran; DerSimonian and Laird's moment estimator),

    tau^2 = var(L_r) - mean(v_r),   v_r = v_w * n / n_r,

where v_w is the request bootstrap's variance of the pooled log ratio (read off its interval) and n_r
the block's size. The arms of a level share its blocks, so tau^2 is pooled over them, each arm's
estimate weighted by the inverse of its variance 2 (v_r + tau^2)^2 / (R - 1) (Paule and Mandel); an
arm whose blocks scatter beyond the 95 % point of what that pooled model predicts for them uses its own
blocks alone, and the others pool without it. The pooled estimate's variance is then
v_w + tau^2 / R; each side of the bootstrap interval becomes t_df * sqrt((d / z)^2 + tau^2 / R) for its
half-width d, with Satterthwaite's degrees of freedom for that sum, whose random part is the blocks'
sample variances (R - 1 degrees of freedom each). One arm whose blocks dominate gets the classical t
interval on its R block estimates (R - 1 degrees of freedom: t = 4.30 for 3 rounds); pooling over a
replica and a null arm whose pairs agree gives an arm whose requests scatter widely the level's drift
at more degrees of freedom. With no excess the interval is the bootstrap's. This is used instead of a
two-stage bootstrap (resample rounds, then requests within them) because with 3 rounds that bootstrap
sees only 10 distinct sets of rounds and its spread is (R - 1) / R of the between-round variance: it
covers a drifting ratio about 75 % of the time for a nominal 95 %. A one-round replay level sees no
drift between runs at all; its rows say so.
"""

from __future__ import annotations

import math
import os
import statistics
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")
# Resample in slices of this many iterations, so memory stays flat whatever --bootstrap-iterations is.
_SLICE = 250
# Beyond this many degrees of freedom a t quantile is the normal's to three digits.
_MAX_DF = 400
# Two blocks give one degree of freedom: a t interval on them is 6.5 times the normal one at 95 %, and
# says nothing. A level needs this many usable blocks for its spread to count.
MIN_BLOCKS = 3
# A log-ratio variance this small (sd 1e-6) is zero for every purpose here.
_VAR_FLOOR = 1e-12


@dataclass(frozen=True)
class Interval:
    """A point estimate with its confidence interval (``low``/``high`` None when not estimable)."""

    point: float
    low: float | None
    high: float | None


def rng_for(seed: int, *keys: str) -> np.random.Generator:
    """A generator that depends on the seed and the names of what is resampled, not on call order."""
    return np.random.default_rng([seed, *(zlib.crc32(k.encode()) for k in keys)])


def parallel_map(fn: Callable[[_Item], _Result], items: Sequence[_Item]) -> list[_Result]:
    """``fn`` over ``items`` on a thread per core, results in the items' order.

    For bootstraps: numpy releases the GIL while it draws, gathers and partitions, so the cores the
    span store's queries use are not left idle between them; each item resamples from its own
    generator (:func:`rng_for`), so the results do not depend on which thread ran it, or when.
    """
    workers = min(len(items), _cores())
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def _cores() -> int:
    """The cores this process may run on (its affinity, where the platform says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _resample_medians(values: FloatArray, idx: npt.NDArray[np.int64]) -> FloatArray:
    # the gathered matrix is this call's own: the median may reorder it in place (no copy)
    return np.median(values[idx], axis=1, overwrite_input=True)


def _percentiles(log_ratios: FloatArray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(log_ratios, [alpha, 1.0 - alpha])
    return math.exp(float(lo)), math.exp(float(hi))


def paired_median_ratio(
    cand: FloatArray,
    base: FloatArray,
    *,
    point: float,
    n_total: int,
    iterations: int,
    rng: np.random.Generator,
    confidence: float = 0.95,
) -> Interval:
    """CI for median(cand)/median(base) where cand[i] and base[i] are the same request.

    ``cand``/``base`` are a uniform subsample (or all) of ``n_total`` pairs; ``point`` is the ratio
    on all pairs.
    """
    m = len(cand)
    if m < 2 or point <= 0 or not math.isfinite(point):
        return Interval(point, None, None)
    # columns of a sample matrix: gathering from contiguous copies is several times faster
    cand, base = np.ascontiguousarray(cand), np.ascontiguousarray(base)
    scale = math.sqrt(m / n_total)
    out = np.empty(iterations)
    for start in range(0, iterations, _SLICE):
        k = min(_SLICE, iterations - start)
        idx = rng.integers(0, m, size=(k, m))
        out[start : start + k] = np.log(_resample_medians(cand, idx) / _resample_medians(base, idx))
    lo, hi = _percentiles(math.log(point) + scale * (out - out.mean()), confidence)
    return Interval(point, lo, hi)


def unpaired_median_ratio(
    cand: FloatArray,
    base: FloatArray,
    *,
    point: float,
    n_cand: int,
    n_base: int,
    iterations: int,
    rng: np.random.Generator,
    confidence: float = 0.95,
) -> Interval:
    """CI for median(cand)/median(base) from two independent samples (split traffic)."""
    if len(cand) < 2 or len(base) < 2 or point <= 0 or not math.isfinite(point):
        return Interval(point, None, None)
    deviations = np.zeros(iterations)
    for values, n, sign in ((cand, n_cand, 1.0), (base, n_base, -1.0)):
        m = len(values)
        logs = np.empty(iterations)
        for start in range(0, iterations, _SLICE):
            k = min(_SLICE, iterations - start)
            logs[start : start + k] = np.log(_resample_medians(values, rng.integers(0, m, size=(k, m))))
        deviations += sign * math.sqrt(m / n) * (logs - logs.mean())
    lo, hi = _percentiles(math.log(point) + deviations, confidence)
    return Interval(point, lo, hi)


def throughput_ratio(
    cand_tokens: FloatArray,
    cand_e2e: FloatArray,
    base_tokens: FloatArray,
    base_e2e: FloatArray,
    *,
    point: float,
    n_cand: int,
    n_base: int,
    paired: bool,
    iterations: int,
    rng: np.random.Generator,
    confidence: float = 0.95,
) -> Interval:
    """CI for the aggregate throughput ratio (wall-clock tok/s, candidate / baseline).

    One run gives one wall time per arm, so the spread comes from the requests instead: by Little's
    law a level's throughput is proportional to Σ tokens / Σ e2e of its calls; the bootstrap
    distribution of that estimator's log ratio (paired resamples when paired) is centred on ``point``.
    It reflects the request mix and per-request latency noise, not run-to-run drift.
    """
    if min(len(cand_tokens), len(base_tokens)) < 2 or point <= 0 or not math.isfinite(point):
        return Interval(point, None, None)
    cand_tokens, cand_e2e, base_tokens, base_e2e = (
        np.ascontiguousarray(a) for a in (cand_tokens, cand_e2e, base_tokens, base_e2e)
    )

    def rate(tokens: FloatArray, e2e: FloatArray, idx: npt.NDArray[np.int64]) -> FloatArray:
        out: FloatArray = np.log(tokens[idx].sum(axis=1) / e2e[idx].sum(axis=1))
        return out

    deviations = np.empty(iterations)
    if paired:
        m = len(cand_tokens)
        for start in range(0, iterations, _SLICE):
            k = min(_SLICE, iterations - start)
            idx = rng.integers(0, m, size=(k, m))
            deviations[start : start + k] = rate(cand_tokens, cand_e2e, idx) - rate(
                base_tokens, base_e2e, idx
            )
        deviations = math.sqrt(m / n_cand) * (deviations - deviations.mean())
    else:
        deviations[:] = 0.0
        for tokens, e2e, n, sign in (
            (cand_tokens, cand_e2e, n_cand, 1.0),
            (base_tokens, base_e2e, n_base, -1.0),
        ):
            m = len(tokens)
            logs = np.empty(iterations)
            for start in range(0, iterations, _SLICE):
                k = min(_SLICE, iterations - start)
                logs[start : start + k] = rate(tokens, e2e, rng.integers(0, m, size=(k, m)))
            deviations += sign * math.sqrt(m / n) * (logs - logs.mean())
    lo, hi = _percentiles(math.log(point) + deviations, confidence)
    return Interval(point, lo, hi)


def percentile(values: Sequence[float], q: float) -> float:
    """The percentile definition of the whole analysis (linear interpolation), for Python callers."""
    return float(np.quantile(np.asarray(values, dtype=np.float64), q))


def normal_quantile(p: float) -> float:
    return statistics.NormalDist().inv_cdf(p)


def _t_central(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` degrees of freedom (Abramowitz and Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:
        term = total = 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0
    for k in range(1, (df - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2 / math.pi * (theta + s * math.cos(theta) * total)


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with ``df`` ≥ 1 degrees of freedom.

    >>> round(t_quantile(0.975, 2), 3)
    4.303
    """
    central = 2 * p - 1
    lo, hi = 0.0, 1.0
    while _t_central(hi, df) < central:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, df) < central else (lo, mid)
    return (lo + hi) / 2


def wilson_interval(successes: int, n: int, confidence: float) -> Interval | None:
    """Wilson's score interval for a proportion (sound at 0 or n successes, unlike the normal one)."""
    if n <= 0:
        return None
    z = normal_quantile(1 - (1 - confidence) / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class Blocks:
    """A level's blocks (rounds or time blocks): each block's log ratio, and the variance of that
    block's estimate as a multiple of the pooled estimate's within-block variance (n / n_r for a
    block of n_r of the pooled estimate's n units)."""

    log_ratios: tuple[float, ...]
    variance_factors: tuple[float, ...]


@dataclass(frozen=True)
class BlockSpread:
    """One figure of one arm at a level, as the between-block term sees it: the request bootstrap's
    variance of the pooled log ratio (``within``), the sample variance of the blocks' log ratios
    (``between``, on ``blocks`` − 1 degrees of freedom) and a block's mean variance factor."""

    within: float
    between: float
    factor: float
    blocks: int

    @property
    def excess(self) -> float:
        """The unbiased (possibly negative) estimate of tau^2: between-block variance beyond noise."""
        return self.between - self.factor * self.within


def block_spread(iv: Interval, blocks: Blocks | None, confidence: float) -> BlockSpread | None:
    """The spread of ``blocks`` around the request bootstrap's interval ``iv`` (None: nothing to add)."""
    if iv.low is None or iv.high is None or blocks is None or len(blocks.log_ratios) < MIN_BLOCKS:
        return None
    logs = np.asarray(blocks.log_ratios, dtype=np.float64)
    factors = np.asarray(blocks.variance_factors, dtype=np.float64)
    if not np.all(np.isfinite(logs)) or np.any(factors <= 0) or iv.low <= 0:
        return None
    z = normal_quantile(1 - (1 - confidence) / 2)
    within = ((math.log(iv.high) - math.log(iv.low)) / (2 * z)) ** 2
    return BlockSpread(within, float(np.var(logs, ddof=1)), float(factors.mean()), len(logs))


def pooled_excess(spreads: Sequence[BlockSpread]) -> tuple[float, float]:
    """tau^2 pooled over ``spreads``, and the Satterthwaite sum Σ (w_a · between_a)^2 / df_a of the
    random part of that estimate.

    Each arm's estimate between_a − factor_a · within_a has variance 2 sigma_a^4 / df_a, sigma_a^2 =
    factor_a · within_a + tau^2: an arm whose requests scatter widely (a real speculative arm's decode
    rates) says little about tau^2, a replica whose pairs agree says much. The weights are the inverse
    of those variances, found by iterating from tau^2 = 0 (Paule and Mandel's fixed point, three steps).
    """
    usable = [s for s in spreads if s.blocks >= 2 and s.factor * s.within + s.between > 0]
    if not usable:
        return 0.0, 0.0
    tau2 = 0.0
    for _ in range(3):
        # the floor keeps an arm whose pairs agree exactly (within 0, no excess yet) finite
        raw = [(s.blocks - 1) / max(s.factor * s.within + max(tau2, 0.0), _VAR_FLOOR) ** 2 for s in usable]
        weights = [w / sum(raw) for w in raw]
        tau2 = sum(w * s.excess for w, s in zip(weights, usable, strict=True))
    random_sq = sum((w * s.between) ** 2 / (s.blocks - 1) for w, s in zip(weights, usable, strict=True))
    return tau2, random_sq


def _drifted_apart(own: BlockSpread, tau2: float) -> bool:
    """Whether an arm's blocks scatter beyond the 95 % point of what the level's pooled model predicts
    for them (between ~ (factor · within + tau^2) · chi^2_{R-1} / (R - 1); Wilson and Hilferty's
    approximation of the quantile): then the others do not vouch for it and its own blocks decide."""
    df = own.blocks - 1
    a = 2 / (9 * df)
    quantile = (1 - a + normal_quantile(0.95) * math.sqrt(a)) ** 3
    return own.between > (own.factor * own.within + max(tau2, 0.0)) * quantile


def widen_pooled(
    iv: Interval, own: BlockSpread | None, spreads: Sequence[BlockSpread], confidence: float
) -> Interval:
    """``iv`` widened by the between-block variance tau^2: the one pooled over ``spreads`` (the level's
    arms, ``own`` among them), or ``own``'s alone when its blocks scatter beyond what the pool predicts
    (an arm that drifted apart from the others is not vouched for by them, nor counted in their pool).

    The pooled estimate's variance is within + tau^2 / R; its random part is (1/R) Σ w_a between_a, so
    Satterthwaite's degrees of freedom are (within + tau^2 / R)^2 / (Σ (w_a between_a)^2 / df_a / R^2):
    R − 1 for one arm whose blocks dominate (the classical t interval on the block estimates), more
    when arms share the estimate or the request bootstrap's part dominates. No excess seen: ``iv``.
    """
    if own is None or iv.low is None or iv.high is None:
        return iv
    first = pooled_excess(spreads)[0]
    apart = [s for s in spreads if _drifted_apart(s, first)]
    pool = [own] if own in apart else [s for s in spreads if s not in apart]
    tau2, random_sq = pooled_excess(pool)
    if tau2 <= 0.0 or random_sq <= 0.0:
        return iv
    z = normal_quantile(1 - (1 - confidence) / 2)
    b = tau2 / own.blocks
    # Satterthwaite's df, at least the fewest blocks' R - 1 (the known −factor · within terms can pull
    # the formula just below it)
    fewest = min(s.blocks for s in pool) - 1
    df = min(_MAX_DF, max(fewest, round((own.within + b) ** 2 / (random_sq / own.blocks**2))))
    t = t_quantile(1 - (1 - confidence) / 2, df)
    log_point = math.log(iv.point)
    down = t * math.sqrt(((log_point - math.log(iv.low)) / z) ** 2 + b)
    up = t * math.sqrt(((math.log(iv.high) - log_point) / z) ** 2 + b)
    return Interval(iv.point, math.exp(log_point - down), math.exp(log_point + up))


def widen_for_blocks(iv: Interval, blocks: Blocks | None, confidence: float) -> Interval:
    """The request bootstrap's interval widened by its own blocks' excess spread (module docstring)."""
    own = block_spread(iv, blocks, confidence)
    return widen_pooled(iv, own, [own] if own else [], confidence)


def with_bias_bound(iv: Interval, down: float, up: float) -> Interval:
    """``iv`` with its bounds moved out by known limits on a systematic error of the ratio (shares):
    the true ratio may lie below the measured one by up to ``down`` (low ÷ (1 + down)) and above it by up
    to ``up`` (high × (1 + up)); the point stays."""
    if (down <= 0.0 and up <= 0.0) or iv.low is None or iv.high is None:
        return iv
    return Interval(iv.point, iv.low / (1.0 + max(down, 0.0)), iv.high * (1.0 + max(up, 0.0)))


def percentile_interval(log_point: float, deviations: FloatArray, confidence: float) -> Interval:
    """The interval of a log estimate from its bootstrap deviations (already centred on zero)."""
    lo, hi = _percentiles(log_point + deviations, confidence)
    return Interval(math.exp(log_point), lo, hi)
