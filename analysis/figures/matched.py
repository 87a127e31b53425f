"""Live and split traffic compared at matched engine load.

In shadow mode with ``sample = 0.2`` a candidate gets a fifth of the baseline's requests, so it runs
at a fifth of the load and decodes faster for that reason alone; a split with unequal weights, or a
multi-replica baseline, does the same. So for live and split levels the arms are compared at the load
each engine had while it worked on the call.

**The load of a call** is the mean number of the arm's other calls in flight over the call's decode
window (first token to end; the whole call when it has no first token), read from the spans
themselves: an exact time average, where a count taken at the call's start is not (the first calls of
a closed loop start at load 0..c-1 and then decode at c), and the spans of every worker's file count.
Every call the proxy has at an engine is in its running or waiting queue, so this is the engine's
running + waiting load when the proxy is its only client. An arm whose URL is a service spreading its
calls over several engines (``replicas_behind_url = N`` in the experiment file) gives each engine a
N-th of that count; where the engine's gauges read far less than the proxy's count at the moments
they were read (each span says how old its gauges were) and no such number was given, the figures
say so (the comparison would be at the wrong loads). Where the calls carry
the engine's gauges (``engine_running`` + ``engine_waiting``, stamped by the proxy from a scrape at
most two intervals old) and the engine had more than that (other clients), the median excess is
added to every call's load, and the basis says so.

**The comparison** models each arm's per-token time as a line in its load, fitted to its calls at the
level (decode step time grows about linearly with the batch while decoding is memory-bound: the
weights are read once per step, the KV cache per sequence), after one pass that drops calls whose
residual exceeds :data:`TRIM_MADS` robust deviations (stalls). Both lines are read at the candidate's
mean load, and their ratio is the speedup at the loads the candidate saw; the per-call throughput
ratio (Σ tokens / Σ e2e) is modelled the same way with the calls weighted by their tokens. Inside the
baseline's own load range (as far as :data:`RANGE_CALLS` of its calls reach at either end) that is an
interpolation; beyond it, an extrapolation no farther than the range is wide; farther, nothing is
compared (the arms never ran at comparable loads, and the row says so instead of giving a ratio).

**The interval** resamples each arm's calls within time blocks (replay rounds, or equal time blocks
of a one-round or live level), in whole time cells (:data:`CELLS_PER_BLOCK` to a block: calls that
ran at the same moment shared the engine's state, a stall or a drain, and are not independent draws),
and refits the baseline's line every time, so an extrapolation's uncertainty in the slope is in it
(centred on the resamples' median: those that missed every drain extrapolate wildly);
then it is widened by the spread of the blocks' own estimates beyond that noise
(:func:`~specproxy.analysis.stats.widen_for_blocks`, the drift term of the ordinary comparisons, on
this arm's blocks alone). The evaluation then adds the simulators' lag bounds. Used when the arms'
median loads differ by more than :data:`UNEQUAL_LOAD`; at equal loads the plain (paired) comparison
is sharper, and at near-equal ones :func:`near_equal` stretches it by the load's small effect.

**What the line cannot know** is how much of its slope the load caused. In a closed loop an engine
that slows down for any reason (a busy core, a long prompt) holds its clients longer, so its calls
pile up: slowness raises the load as well as load raising slowness, and a line fitted to one arm's
calls overstates the load's effect (two identical engines split 50/50 at c=64 ran at 28 and 32 calls
and the fitted line called the one at 28 8 % slower). More calls in flight never make a call faster,
so the load's true effect lies between none, the plain comparison of the arms' own calls, and the
fitted line's. :func:`bracketed` stretches each matched interval over the plain one: at unequal
loads a WIN or LOSS needs both comparisons to agree, and an identical arm is not called different
however its load differs.

**Where no line places the candidate's load** (a steady closed loop keeps the baseline at one load),
:func:`bounded` stretches the plain comparison by the most a load difference can do: a batch step over
n calls costs at most n / m times one over m, so among L other calls a call decodes at most
(L + 1) / (l + 1) times slower than among l. Over :data:`MAX_SPREAD` times wide, it places nothing.

Each arm's calls, their loads and the engine's gauges beside them are read by :mod:`.arm_calls`
(gauges that cannot be right are left out there, and said).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from specproxy.analysis.figures.arm_calls import (
    ArmCalls,
    arm_calls,
    broken_note,
    engine_p50,
    few_engines_note,
    outside_load,
)
from specproxy.analysis.stats import Blocks, FloatArray, Interval, percentile_interval, widen_for_blocks
from specproxy.analysis.store import SpanStore

UNEQUAL_LOAD = 1.10
UNEQUAL_CALLS = 1.0
# Each arm's calls with a decode speed at the level, for a line to be fitted to them.
MIN_CALLS = 20
# The baseline's load range reaches as far as this many of its calls do at either end.
RANGE_CALLS = 10
# The share of the baseline's calls, nearest in load to the candidate's, its line is fitted to.
NEAR_SHARE = 0.25
TRIM_MADS = 4.0
# A matched interval whose high end is more than this times its low end places nothing: not compared.
MAX_SPREAD = 2.0
MIN_BLOCK_CALLS = 5
_SLICE = 256  # bootstrap iterations per vectorised slice (memory: slice x time cells)


@dataclass(frozen=True)
class LoadFigures:
    """The load each arm saw, and how the matched comparison was made.

    ``p50`` / ``baseline_p50``: median load of the arm's / the baseline's calls (``basis``);
    ``engine_p50`` / ``engine_baseline_p50``: median of the engines' running + waiting gauges where
    the calls carry them; ``compared_at``: the load the two lines were read at (the candidate's mean);
    ``baseline_range``: the loads the baseline ran at (as far as 10 of its calls reach);
    ``matched_share``: the share of the candidate's calls inside that range; ``method``:
    ``interpolated``, ``extrapolated``, ``bounded``, ``not compared``, ``near-equal`` (loads under
    :data:`UNEQUAL_LOAD` or one call apart: the plain comparison, stretched by ``effect``), or empty."""

    basis: str  # "proxy in-flight" | "proxy in-flight + engine gauges"
    p50: float | None
    baseline_p50: float | None
    matched_share: float | None = None
    engine_p50: float | None = None
    engine_baseline_p50: float | None = None
    compared_at: float | None = None
    baseline_range: tuple[float, float] | None = None
    method: str = ""
    gauge_note: str = ""  # the engine's gauges disagree with the proxy's count: a service of several
    # At near-equal loads: time per token at the candidate's load over that at the baseline's, as the
    # arms' lines read it (< 1: the candidate's calls were that much faster for their load alone).
    effect: float | None = None

    @property
    def unequal(self) -> bool:
        """Loads more than :data:`UNEQUAL_LOAD` apart, and by more than one call (the loads are time
        averages: two arms that each mostly ran alone differ by fractions of a call)."""
        if self.p50 is None or self.baseline_p50 is None:
            return self.p50 != self.baseline_p50
        low, high = sorted((self.p50, self.baseline_p50))
        return high - low > UNEQUAL_CALLS and high / max(low, 1e-9) > UNEQUAL_LOAD

    def describe(self) -> str:
        own = f"load P50 {self.p50:.1f} vs baseline {self.baseline_p50:.1f} ({self.basis})"
        if self.engine_p50 is not None and self.engine_baseline_p50 is not None:
            own += f"; engine running+waiting P50 {self.engine_p50:.1f} vs {self.engine_baseline_p50:.1f}"
        return own + (f"; {self.gauge_note}" if self.gauge_note else "")


@dataclass(frozen=True, eq=False)
class LoadBands:
    """An arm's and the baseline's calls at one level, by load (the name predates the line model)."""

    figures: LoadFigures
    candidate: ArmCalls
    baseline: ArmCalls


@dataclass(frozen=True)
class MatchedLoad:
    """The matched-load comparison of one arm at one level (``decode`` None: nothing compared)."""

    figures: LoadFigures
    decode: Interval | None
    throughput: Interval | None
    note: str
    blocks: str = ""


def load_bands(
    store: SpanStore,
    run_id: str,
    baseline: str,
    keys: Sequence[tuple[str, str]],
    *,
    max_sample: int,
    seed: int,
    engines: Mapping[str, int] | None = None,
) -> dict[tuple[str, str], LoadBands]:
    """Per (arm, level) of ``keys``: the arm's and the baseline's ok calls with the load each of their
    engines saw (``engines``: how many share each arm's calls, 1 where not given). (``max_sample`` and
    ``seed`` are unused: every call's load needs every call.)"""
    del max_sample, seed
    if not keys:
        return {}
    engines = engines or {}
    calls: dict[tuple[str, str], ArmCalls] = {}
    for arm in sorted({a for a, _ in keys} | {baseline}):
        calls.update(arm_calls(store, run_id, arm, engines.get(arm, 1)))
    basis = "proxy in-flight" + _per_engine(engines, baseline)
    out = {}
    for arm, level in keys:
        c, b = calls.get((arm, level)), calls.get((baseline, level))
        if c is None or b is None or not len(c.load) or not len(b.load):
            continue
        extra_c, extra_b = outside_load(c), outside_load(b)
        engine_c, engine_b = engine_p50(c), engine_p50(b)
        both = engine_c is not None and engine_b is not None
        figures = LoadFigures(
            basis=basis + (" + engine gauges" if extra_c or extra_b else ""),
            p50=float(np.median(c.load + extra_c)),
            baseline_p50=float(np.median(b.load + extra_b)),
            engine_p50=engine_c if both else None,
            engine_baseline_p50=engine_b if both else None,
            gauge_note="; ".join(
                n
                for n in (
                    broken_note(arm, c),
                    broken_note(baseline, b),
                    few_engines_note(arm, c, engines),
                    few_engines_note(baseline, b, engines),
                )
                if n
            ),
        )
        out[(arm, level)] = LoadBands(figures, _shifted(c, extra_c), _shifted(b, extra_b))
    return out


def _per_engine(engines: Mapping[str, int], baseline: str) -> str:
    shared = {arm: n for arm, n in engines.items() if n > 1}
    if not shared:
        return ""
    parts = ", ".join(f"{arm}'s ÷ {n}" for arm, n in sorted(shared.items()))
    return f" per engine ({parts}: replicas_behind_url)"


def _shifted(calls: ArmCalls, extra: float) -> ArmCalls:
    if not extra:
        return calls
    return replace(calls, load=calls.load + extra)


@dataclass(frozen=True)
class _Line:
    """A weighted least-squares line y = a + b x, with the calls it kept (residuals within the trim)."""

    a: float
    b: float
    keep: npt.NDArray[np.bool_]

    def at(self, x: float) -> float:
        return self.a + self.b * x


def _fit(x: FloatArray, y: FloatArray, w: FloatArray) -> tuple[float, float]:
    sw = w.sum()
    mx, my = (w @ x) / sw, (w @ y) / sw
    sxx = w @ ((x - mx) ** 2)
    # one load for every call (a steady closed loop): no slope to see; the line is its mean
    b = float((w @ ((x - mx) * (y - my))) / sxx) if sxx > 1e-9 * sw else 0.0
    return float(my - b * mx), b


def robust_line(x: FloatArray, y: FloatArray, w: FloatArray) -> _Line:
    """The line, refitted once without the calls whose relative residual exceeds TRIM_MADS robust
    deviations (stalls)."""
    a, b = _fit(x, y, w)
    fitted = a + b * x
    # relative residuals: a call's time per token scatters in proportion to it (a slower engine's
    # calls scatter more), so a trim on absolute ones would cut the low-load calls' tail less
    resid = np.where(fitted > 0, y / np.where(fitted > 0, fitted, 1.0) - 1.0, y - fitted)
    mad = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
    keep = np.abs(resid) <= TRIM_MADS * mad if mad > 0 else np.ones(len(x), dtype=bool)
    if keep.sum() >= 2:
        a, b = _fit(x[keep], y[keep], w[keep])
    return _Line(a, b, keep)


SPANNED = "the load's effect lies between none and the fitted line's"
INTERPOLATED, EXTRAPOLATED, NOT_COMPARED = "interpolated", "extrapolated", "not compared"
BOUNDED, NEAR_EQUAL = "bounded", "near-equal"
# A load effect at near-equal loads is named in the row's reason from this size on (the JSON always
# carries it).
NAMED_EFFECT = 0.001
# Each block (round, or time block) is cut into this many time cells, resampled whole.
CELLS_PER_BLOCK = 10


@dataclass(frozen=True, eq=False)
class _Figure:
    """One arm's calls for one figure: load x, time per token y, weight w, block label."""

    x: FloatArray
    y: FloatArray
    w: FloatArray
    block: FloatArray
    cell: FloatArray  # the time cell of the call's start within its block (:func:`_cells`)

    def take(self, mask: npt.NDArray[np.bool_]) -> _Figure:
        return _Figure(self.x[mask], self.y[mask], self.w[mask], self.block[mask], self.cell[mask])


def _figures(calls: ArmCalls, blocks: FloatArray) -> tuple[_Figure, _Figure]:
    """Per-token time (1 / decode speed, each call alike) and e2e per token (weighted by tokens, so
    the mean is Σ e2e / Σ tokens) against the load."""
    d = np.isfinite(calls.decode) & (calls.decode > 0)
    t = np.isfinite(calls.tokens) & (calls.tokens > 0) & np.isfinite(calls.e2e) & (calls.e2e > 0)
    cells = _cells(calls.start_s, blocks)
    decode = _Figure(calls.load[d], 1.0 / calls.decode[d], np.ones(int(d.sum())), blocks[d], cells[d])
    tokens = calls.tokens[t]
    throughput = _Figure(calls.load[t], calls.e2e[t] / tokens, tokens, blocks[t], cells[t])
    return decode, throughput


def _blocks(c: ArmCalls, b: ArmCalls, n_blocks: int) -> tuple[FloatArray, FloatArray, str]:
    """Each call's block: its replay round when the level has several, else its time block."""
    rounds = {float(r) for r in np.unique(np.concatenate([c.round, b.round])) if math.isfinite(r)}
    if len(rounds) >= 2 and np.isfinite(c.round).all() and np.isfinite(b.round).all():
        return c.round, b.round, f"{len(rounds)} rounds"
    t0 = float(min(c.start_s.min(), b.start_s.min()))
    span = float(max(c.start_s.max(), b.start_s.max())) - t0

    def cut(s: FloatArray) -> FloatArray:
        if span <= 0:
            return np.zeros(len(s))
        out: FloatArray = np.minimum(n_blocks - 1, np.floor(n_blocks * (s - t0) / span))
        return out

    return cut(c.start_s), cut(b.start_s), f"{n_blocks} time blocks"


@dataclass(frozen=True)
class _Point:
    log_ratio: float
    at: float
    base: _Line
    cand: _Figure  # the calls kept
    kept_base: _Figure


def _point(cand: _Figure, base: _Figure) -> _Point | None:
    """The baseline's line read at the candidate's mean load, over the candidate's mean time per
    token there (a line through its own calls passes through that mean), as a log speedup."""
    lc = robust_line(cand.x, cand.y, cand.w)
    kc = cand.take(lc.keep)
    at = float(kc.w @ kc.x / kc.w.sum())
    # the baseline's line is local: over its calls nearest that load (a quarter of them, at least
    # 2 x MIN_CALLS), since time per token is linear in the load over a stretch, not over every load
    near = np.argsort(np.abs(base.x - at), kind="stable")[
        : max(2 * MIN_CALLS, math.ceil(NEAR_SHARE * len(base.x)))
    ]
    near_mask = np.zeros(len(base.x), dtype=bool)
    near_mask[near] = True
    base = base.take(near_mask)
    lb = robust_line(base.x, base.y, base.w)
    kb = base.take(lb.keep)
    own, theirs = float(kc.w @ kc.y / kc.w.sum()), lb.at(at)
    if own <= 0 or theirs <= 0:
        return None
    return _Point(math.log(theirs / own), at, lb, kc, kb)


def _cells(start: FloatArray, blocks: FloatArray) -> FloatArray:
    """Each call's time cell: its block cut into :data:`CELLS_PER_BLOCK` equal spans of time by the
    calls' starts, numbered across blocks."""
    out = np.zeros(len(start))
    for i, g in enumerate(np.unique(blocks)):
        m = blocks == g
        t0, span = float(start[m].min()), float(np.ptp(start[m]))
        within = np.floor(CELLS_PER_BLOCK * (start[m] - t0) / span) if span > 0 else np.zeros(int(m.sum()))
        out[m] = i * CELLS_PER_BLOCK + np.minimum(within, CELLS_PER_BLOCK - 1)
    return out


def _cell_sums(fig: _Figure) -> tuple[FloatArray, FloatArray]:
    """Per time cell of ``fig``: Σw, Σwx, Σwy, Σwxx, Σwxy (a line's sufficient statistics), and the
    cell's block."""
    cells, inverse = np.unique(fig.cell, return_inverse=True)
    wx = fig.w * fig.x
    columns = (fig.w, wx, fig.w * fig.y, wx * fig.x, wx * fig.y)
    sums: FloatArray = np.stack(
        [np.bincount(inverse, weights=c, minlength=len(cells)).astype(np.float64) for c in columns], axis=1
    )
    block = np.zeros(len(cells))
    block[inverse] = fig.block
    return sums, block


def _resampled_sums(fig: _Figure, k: int, rng: np.random.Generator) -> FloatArray:
    """``k`` resamples of ``fig``'s sums (k x 5): its time cells drawn with replacement, whole, within
    each block (calls of one cell share the engine's moment; the blocks' spread is the drift term's)."""
    sums, block = _cell_sums(fig)
    n = len(sums)
    counts = np.zeros(k * n)
    for g in np.unique(block):
        idx = np.flatnonzero(block == g)
        drawn = idx[rng.integers(0, len(idx), size=(k, len(idx)))] + n * np.arange(k)[:, None]
        counts += np.bincount(drawn.ravel(), minlength=k * n)
    out: FloatArray = counts.reshape(k, n) @ sums
    return out


def _boot_logs(p: _Point, iterations: int, rng: np.random.Generator) -> FloatArray:
    """Bootstrap deviations of the log speedup: both arms' time cells resampled within blocks, the
    baseline's line refitted each time (so the slope's uncertainty, and the autocorrelation of calls
    that ran at the same moment, are in it)."""
    out = np.empty(iterations)
    for start in range(0, iterations, _SLICE):
        k = min(_SLICE, iterations - start)
        c, b = _resampled_sums(p.cand, k, rng), _resampled_sums(p.kept_base, k, rng)
        at, own = c[:, 1] / c[:, 0], c[:, 2] / c[:, 0]
        sw = b[:, 0]
        mx, my = b[:, 1] / sw, b[:, 2] / sw
        sxx, sxy = b[:, 3] - sw * mx * mx, b[:, 4] - sw * mx * my
        slope = np.where(sxx > 1e-9 * sw, sxy / np.maximum(sxx, 1e-300), 0.0)
        theirs = np.maximum(my + slope * (at - mx), 1e-12)
        out[start : start + k] = np.log(theirs / np.maximum(own, 1e-12))
    # Centred on the median, not the mean: a resample that drew none of the few cells where the
    # baseline's load moved (a closed loop's drains) fits its slope to one load and extrapolates it
    # anywhere, and a handful of those drag the mean so far that the interval would miss its own point.
    dev: FloatArray = out - np.median(out)
    return dev


def _block_estimates(p: _Point) -> Blocks | None:
    """Each block's own log speedup, the baseline's line shifted to its calls in the block (the slope
    stays the level's: a block's calls span too little load to fit one), for the drift term."""
    logs, factors = [], []
    pooled = 1 / len(p.cand.x) + 1 / len(p.kept_base.x)
    for g in np.unique(p.cand.block):
        c, b = p.cand.take(p.cand.block == g), p.kept_base.take(p.kept_base.block == g)
        if min(len(c.x), len(b.x)) < MIN_BLOCK_CALLS:
            continue
        at, own = c.w @ c.x / c.w.sum(), c.w @ c.y / c.w.sum()
        theirs = b.w @ b.y / b.w.sum() + p.base.b * (at - b.w @ b.x / b.w.sum())
        if own > 0 and theirs > 0:
            logs.append(math.log(theirs / own))
            factors.append((1 / len(c.x) + 1 / len(b.x)) / pooled)
    return Blocks(tuple(logs), tuple(factors)) if len(logs) >= 2 else None


def _interval(
    cand: _Figure, base: _Figure, iterations: int, confidence: float, rng: np.random.Generator
) -> tuple[Interval, _Point] | None:
    p = _point(cand, base)
    if p is None:
        return None
    iv = percentile_interval(p.log_ratio, _boot_logs(p, iterations, rng), confidence)
    return widen_for_blocks(iv, _block_estimates(p), confidence), p


def compare(
    bands: LoadBands, *, iterations: int, confidence: float, rng: np.random.Generator, blocks: int = 4
) -> MatchedLoad:
    """The speedups at matched load (module docstring), or why there are none."""
    fig = bands.figures
    if not fig.unequal:
        return MatchedLoad(fig, None, None, "")
    block_c, block_b, kind = _blocks(bands.candidate, bands.baseline, blocks)
    dc, tc = _figures(bands.candidate, block_c)
    db, tb = _figures(bands.baseline, block_b)
    if min(len(dc.x), len(db.x)) < MIN_CALLS:
        few = replace(fig, method=NOT_COMPARED)
        why = f"fewer than {MIN_CALLS} calls with a decode speed in an arm"
        return MatchedLoad(few, None, None, f"not compared at matched load ({fig.describe()}): {why}", kind)
    ranked = np.sort(db.x)
    lo, hi = float(ranked[RANGE_CALLS - 1]), float(ranked[-RANGE_CALLS])
    decode = _interval(dc, db, iterations, confidence, rng)
    at = decode[1].at if decode is not None else float(dc.x.mean())
    away = max(lo - at, at - hi, 0.0)
    fig = replace(
        fig,
        compared_at=at,
        baseline_range=(lo, hi),
        matched_share=float(np.mean((dc.x >= lo) & (dc.x <= hi))),
        method=NOT_COMPARED if decode is None or away > hi - lo else EXTRAPOLATED if away else INTERPOLATED,
    )
    loads = f"{fig.describe()}; candidate's mean {at:.1f}, baseline's range {lo:.1f}-{hi:.1f}"
    if fig.method == NOT_COMPARED:
        why = "the baseline never ran near the candidate's load"
        return MatchedLoad(fig, None, None, f"not compared at matched load ({loads}): {why}", kind)
    if decode is not None and _unplaced(decode[0]):
        why = f"the baseline's line cannot place that load (its interval is over {MAX_SPREAD:g}x wide)"
        fig = replace(fig, method=NOT_COMPARED)
        return MatchedLoad(fig, None, None, f"not compared at matched load ({loads}): {why}", kind)
    throughput = _interval(tc, tb, iterations, confidence, rng)
    how = "within the baseline's range" if fig.method == INTERPOLATED else "the baseline's line extrapolated"
    note = f"arms ran at different loads ({loads}): compared at matched load {at:.1f}, {how}"
    return MatchedLoad(fig, decode[0] if decode else None, throughput[0] if throughput else None, note, kind)


def _unplaced(iv: Interval) -> bool:
    """An interval whose ends are more than :data:`MAX_SPREAD` apart: the line says nothing there."""
    return iv.low is None or iv.high is None or iv.high > MAX_SPREAD * iv.low


def _spanning(iv: Interval | None, plain: Interval | None) -> Interval | None:
    if iv is None or plain is None:
        return iv
    lows = [x for x in (iv.low, plain.low) if x is not None]
    highs = [x for x in (iv.high, plain.high) if x is not None]
    return Interval(iv.point, min(lows) if lows else None, max(highs) if highs else None)


def bracketed(load: MatchedLoad, decode: Interval | None, throughput: Interval | None) -> MatchedLoad:
    """``load``'s intervals stretched over the plain comparison's (``decode``, ``throughput``: the arms'
    own calls, each at its own load): the load's effect lies between none and the fitted line's
    (module docstring), so the speedup at matched load lies between the two comparisons.

    >>> fig = LoadFigures("proxy in-flight", 28.4, 32.4)
    >>> fitted = MatchedLoad(fig, Interval(0.92, 0.91, 0.94), None, "")
    >>> bracketed(fitted, Interval(1.04, 1.01, 1.08), None).decode
    Interval(point=0.92, low=0.91, high=1.08)
    """
    if load.decode is None and load.throughput is None:
        return load
    return replace(
        load,
        decode=_spanning(load.decode, decode),
        throughput=_spanning(load.throughput, throughput),
        note=f"{load.note}; the interval spans the plain comparison's too ({SPANNED})",
    )


def bounded(load: MatchedLoad, decode: Interval | None, throughput: Interval | None) -> MatchedLoad:
    """Where :func:`compare` placed nothing: the plain comparison's intervals (``decode``,
    ``throughput``: each arm at its own load) stretched by the load's largest effect (module docstring)."""
    fig = load.figures
    if fig.method != NOT_COMPARED or fig.p50 is None or fig.baseline_p50 is None or decode is None:
        return load
    # the candidate's batch over the baseline's: a lighter candidate decodes faster for its load
    # alone, so the truth lies below the plain figure
    factor = (fig.p50 + 1) / (fig.baseline_p50 + 1)
    wide = stretched(decode, factor)
    if wide is None or _unplaced(wide):
        return load  # the loads differ so much that even the bound places nothing
    heavier = "candidate" if factor > 1 else "baseline"
    bound = max(factor, 1 / factor)
    note = (
        f"{load.note}; compared instead with the load's effect bounded: the {heavier}'s calls decode at "
        f"most {bound:.2f}x slower for their load (a batch step costs at most in proportion to its "
        "calls), and the interval spans that and the plain comparison"
    )
    return replace(load, figures=replace(fig, method=BOUNDED), decode=wide,
                   throughput=stretched(throughput, factor), note=note)  # fmt: skip


def near_equal(bands: LoadBands, decode: Interval | None, throughput: Interval | None) -> MatchedLoad:
    """At loads too close for a matched comparison (not :attr:`LoadFigures.unequal`) but not the same:
    the plain comparison's intervals (``decode``, ``throughput``) stretched over the load's effect
    (:func:`load_effect`). Under one call apart the effect is small, but a paired comparison resolves
    it: a shadow twin at 2.3 calls beside a baseline at 3.0 decoded 0.2 % faster, every interval above
    1.0. As at unequal loads, the truth lies between no effect and the lines'."""
    fig = bands.figures
    if fig.unequal or (decode is None and throughput is None):
        return MatchedLoad(fig, None, None, "")
    dc, tc = _figures(bands.candidate, np.zeros(len(bands.candidate.load)))
    db, tb = _figures(bands.baseline, np.zeros(len(bands.baseline.load)))
    f_decode, f_throughput = load_effect(dc, db), load_effect(tc, tb)
    load = replace(fig, method=NEAR_EQUAL, effect=f_decode)
    note = ""
    if abs(f_decode - 1.0) >= NAMED_EFFECT:
        lighter = "candidate" if f_decode < 1 else "baseline"
        note = (
            f"loads near-equal ({fig.describe()}): compared call by call, the interval spanning the "
            f"load's effect as the arms' lines read it (the {lighter}'s calls up to {abs(1 - f_decode):.1%} "
            "faster for their lighter load)"
        )
    return MatchedLoad(load, stretched(decode, f_decode), stretched(throughput, f_throughput), note)


def stretched(iv: Interval | None, effect: float) -> Interval | None:
    """``iv`` widened on one side to hold ``iv`` times ``effect`` too (the speedup had the load's effect
    been taken out), its point kept.

    >>> stretched(Interval(1.01, 1.0, 1.02), 0.5)
    Interval(point=1.01, low=0.5, high=1.02)
    """
    if iv is None or iv.low is None or iv.high is None:
        return iv
    return Interval(iv.point, iv.low * min(effect, 1.0), iv.high * max(effect, 1.0))


def load_effect(cand: _Figure, base: _Figure) -> float:
    """How much faster (< 1) or slower the candidate's calls were for their load alone: each arm's line
    read at the candidate's mean load over the same line at the baseline's (the speedup at the
    baseline's load, and at the candidate's), the one farther from 1. Each is held between 1 (more
    calls in flight never make a call faster) and the most a batch step's cost allows,
    (l + 1) / (L + 1) (module docstring), which is also the answer where neither arm has the calls
    for a line. Both lines are read: a closed loop keeps the baseline at one load, where its own line
    sees no slope."""
    if not len(cand.x) or not len(base.x):
        return 1.0
    at = float(cand.w @ cand.x / cand.w.sum())
    own = float(base.w @ base.x / base.w.sum())
    bound = (at + 1) / (own + 1)

    def read(fig: _Figure) -> float | None:
        if len(fig.x) < MIN_CALLS:
            return None
        line = robust_line(fig.x, fig.y, fig.w)
        there, here = line.at(at), line.at(own)
        if line.b <= 0 or there <= 0 or here <= 0:
            return 1.0
        return min(max(there / here, min(bound, 1.0)), max(bound, 1.0))

    readings = [f for f in (read(base), read(cand)) if f is not None]
    return max(readings, key=lambda f: abs(math.log(f))) if readings else bound
