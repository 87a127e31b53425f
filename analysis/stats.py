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
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
# Resample in slices of this many iterations, so memory stays flat whatever --bootstrap-iterations is.
_SLICE = 250


@dataclass(frozen=True)
class Interval:
    """A point estimate with its confidence interval (``low``/``high`` None when not estimable)."""

    point: float
    low: float | None
    high: float | None


def rng_for(seed: int, *keys: str) -> np.random.Generator:
    """A generator that depends on the seed and the names of what is resampled, not on call order."""
    return np.random.default_rng([seed, *(zlib.crc32(k.encode()) for k in keys)])


def _resample_medians(values: FloatArray, idx: npt.NDArray[np.int64]) -> FloatArray:
    return np.median(values[idx], axis=1)


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
