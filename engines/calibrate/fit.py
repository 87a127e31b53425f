"""Fit a simulator cost profile to measured step times (pure numpy; no GPU, no torch).

The profile format is the simulator's contract (engines/profiles/*.json):

    target(T, KV)        = base_s + per_kv_token_s * KV + per_batched_token_s * max(T - knee, 0)
    draft_model(T, KV)   = the same shape, for one forward of the draft model over the batch (T = B)
    eagle-like(B, k, KV) = base_s + per_kv_token_s * KV + per_spec_token_s * B * k
    prefill(T)           = base_s + per_token_s * T

Times span three orders of magnitude (a 4 ms decode step to a 100 ms verification of 2048 tokens),
so every fit minimises *relative* error (least squares weighted by 1/t): an absolute fit would
sacrifice the small-batch steps, which is where speculative decoding lives. Coefficients are kept
non-negative: a negative per-token cost would make the simulator reward bigger batches with
shorter steps outside the measured range.

The raw measurements live in a CSV (`POINT_COLUMNS`), one row per timed configuration, written by
`specproxy.engines.calibrate.measure` on the GPU and re-read here:

    >>> pts = read_points("engines/profiles/h200-llama3.1-8b.points.csv")   # doctest: +SKIP
    >>> profile = build_profile(pts, stack={...}, name="h200-llama3.1-8b")   # doctest: +SKIP
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

# Values the forward-pass timings cannot measure, carried over from the H100 profile
# (SpecDecode-Bench's linear fit of vLLM, `simulator/predictor.py`).
H100_STEP_OVERHEAD_S = 1.207e-3
H100_NGRAM_FRACTION_OF_VERIFY = 0.005875
H100_SUFFIX_FRACTION_OF_VERIFY = 0.01
# The H100 target fit, for the bandwidth-scaled comparison in the profile notes.
H100_TARGET = {"base_s": 5.886e-3, "per_kv_token_s": 3.926e-8, "per_batched_token_s": 2.101e-5}
H100_BANDWIDTH_TBPS = 3.35
H200_BANDWIDTH_TBPS = 4.8

KINDS = ("target", "draft_model", "eagle3", "eagle", "prefill", "copy")


@dataclass(frozen=True)
class Point:
    """One timed configuration (one row of the points CSV).

    `kind` is what was timed: `target` / `draft_model` (one forward over the batch), `eagle3` /
    `eagle` (drafting k tokens for the whole batch), `prefill` (one chunk), `copy` (a
    device-to-device memcpy of `bytes` bytes read plus written).
    """

    kind: str
    batch: int  # B: requests in the step
    query_tokens: int  # tokens per request in the step (1 decode, k+1 verification; k for drafters)
    context: int  # KV-cache tokens per request before the step
    batched_tokens: int  # T
    kv_tokens: int  # KV attended over the batch
    median_s: float
    p20_s: float
    p80_s: float
    reps: int
    bytes: int = 0


POINT_COLUMNS = tuple(f.name for f in fields(Point))


def write_points(path: str | Path, points: Iterable[Point]) -> None:
    """Write points as CSV with a header (POINT_COLUMNS)."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=POINT_COLUMNS)
        writer.writeheader()
        for p in points:
            writer.writerow(asdict(p))


def read_points(path: str | Path) -> list[Point]:
    """Read a points CSV written by `write_points` (or appended to row by row by the calibrator)."""
    out: list[Point] = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            out.append(
                Point(
                    kind=row["kind"],
                    batch=int(row["batch"]),
                    query_tokens=int(row["query_tokens"]),
                    context=int(row["context"]),
                    batched_tokens=int(row["batched_tokens"]),
                    kv_tokens=int(row["kv_tokens"]),
                    median_s=float(row["median_s"]),
                    p20_s=float(row["p20_s"]),
                    p80_s=float(row["p80_s"]),
                    reps=int(row["reps"]),
                    bytes=int(row.get("bytes") or 0),
                )
            )
    return out


@dataclass(frozen=True)
class LinearFit:
    """Non-negative coefficients of `y ≈ X @ coef` with its quality on the points it was fitted to."""

    coef: tuple[float, ...]
    r2: float  # on the raw times (unweighted), the usual coefficient of determination
    max_rel_err: float  # max |pred - y| / y
    n: int


def fit_nonnegative_relative(x: FloatArray, y: FloatArray) -> LinearFit:
    """Least squares on relative error, `min sum(((X c - y) / y)^2)` subject to c >= 0.

    With at most a handful of columns, an exact active-set enumeration (every subset of columns
    allowed to be non-zero, unconstrained least squares on it, keep the best feasible one) is
    simple and exact, where an iterative NNLS would be more code for no gain.
    """
    if x.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"design matrix {x.shape} does not match {y.shape[0]} observations")
    if x.shape[0] < x.shape[1]:
        raise ValueError(f"{x.shape[0]} points cannot fit {x.shape[1]} coefficients")
    if np.any(y <= 0):
        raise ValueError("step times must be positive")
    w = 1.0 / y
    xw = x * w[:, None]
    yw = y * w
    ncol = x.shape[1]
    best: tuple[float, FloatArray] | None = None
    for size in range(ncol, 0, -1):
        for cols in itertools.combinations(range(ncol), size):
            sub, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
            if np.any(sub < 0):
                continue
            coef = np.zeros(ncol)
            coef[list(cols)] = sub
            sse = float(np.sum((xw @ coef - yw) ** 2))
            if best is None or sse < best[0] - 1e-15:
                best = (sse, coef)
    assert best is not None  # a single column with positive y always gives a feasible solution
    coef = best[1]
    pred = x @ coef
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    max_rel = float(np.max(np.abs(pred - y) / y))
    return LinearFit(tuple(float(c) for c in coef), r2, max_rel, int(y.shape[0]))


@dataclass(frozen=True)
class ForwardFit:
    """`base_s + per_kv_token_s * KV + per_batched_token_s * max(T - knee, 0)`."""

    base_s: float
    per_kv_token_s: float
    per_batched_token_s: float
    knee_batched_tokens: int
    r2: float
    max_rel_err: float
    n: int

    def predict(self, batched_tokens: float, kv_tokens: float) -> float:
        return (
            self.base_s
            + self.per_kv_token_s * kv_tokens
            + self.per_batched_token_s * max(batched_tokens - self.knee_batched_tokens, 0)
        )

    def as_profile(self) -> dict[str, float | int]:
        return {
            "base_s": self.base_s,
            "per_kv_token_s": self.per_kv_token_s,
            "per_batched_token_s": self.per_batched_token_s,
            "knee_batched_tokens": self.knee_batched_tokens,
        }


def knee_candidates(batched_tokens: Sequence[int]) -> list[int]:
    """Knees to try: 0, every measured T, and a geometric grid between them (the true knee usually
    falls between two measured batch sizes)."""
    t = sorted({int(v) for v in batched_tokens})
    if not t:
        return [0]
    grid = {0, *t}
    hi = t[-1]
    k = 1.0
    while k < hi:
        grid.add(int(round(k)))
        k *= 1.25
    return sorted(v for v in grid if v < hi)


def fit_forward(
    batched_tokens: Sequence[int], kv_tokens: Sequence[int], times: Sequence[float]
) -> ForwardFit:
    """Fit the piecewise-linear forward model, choosing the knee by relative squared error."""
    t = np.asarray(batched_tokens, dtype=np.float64)
    kv = np.asarray(kv_tokens, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    best: tuple[float, int, LinearFit] | None = None
    for knee in knee_candidates(list(batched_tokens)):
        x = np.column_stack([np.ones_like(t), kv, np.maximum(t - knee, 0.0)])
        fit = fit_nonnegative_relative(x, y)
        rel_sse = float(np.sum(((x @ np.asarray(fit.coef) - y) / y) ** 2))
        if best is None or rel_sse < best[0] - 1e-15:
            best = (rel_sse, knee, fit)
    assert best is not None
    _, knee, fit = best
    base, per_kv, per_t = fit.coef
    return ForwardFit(base, per_kv, per_t, knee, fit.r2, fit.max_rel_err, fit.n)


@dataclass(frozen=True)
class DrafterFit:
    """`base_s + per_kv_token_s * KV + per_spec_token_s * B * k` (all k drafts, whole batch)."""

    base_s: float
    per_kv_token_s: float
    per_spec_token_s: float
    r2: float
    max_rel_err: float
    n: int

    def predict(self, batch: int, k: int, kv_tokens: float) -> float:
        return self.base_s + self.per_kv_token_s * kv_tokens + self.per_spec_token_s * batch * k

    def as_profile(self) -> dict[str, float]:
        return {
            "base_s": self.base_s,
            "per_kv_token_s": self.per_kv_token_s,
            "per_spec_token_s": self.per_spec_token_s,
        }


def _fit_drafter_terms(
    batch: Sequence[int],
    k: Sequence[int],
    kv_tokens: Sequence[int],
    times: Sequence[float],
    terms: Callable[[FloatArray, FloatArray, FloatArray], list[FloatArray]],
) -> LinearFit:
    """A drafter model's fit: ``terms`` makes its columns from the batch, k and KV-token arrays."""
    b, kk, kv = (np.asarray(v, dtype=np.float64) for v in (batch, k, kv_tokens))
    return fit_nonnegative_relative(np.column_stack(terms(b, kk, kv)), np.asarray(times, dtype=np.float64))


def fit_drafter(
    batch: Sequence[int], k: Sequence[int], kv_tokens: Sequence[int], times: Sequence[float]
) -> DrafterFit:
    """Fit the EAGLE-style drafter model."""
    fit = _fit_drafter_terms(batch, k, kv_tokens, times, lambda b, kk, kv: [np.ones_like(b), kv, b * kk])
    base, per_kv, per_spec = fit.coef
    return DrafterFit(base, per_kv, per_spec, fit.r2, fit.max_rel_err, fit.n)


@dataclass(frozen=True)
class ChainDrafterFit:
    """`base_s + k * (per_step_s + per_step_kv_token_s * KV + per_spec_token_s * B)`.

    A chain drafter runs k sequential passes, each paying a fixed latency and reading the draft
    KV cache; the profile format's drafter has no term proportional to k alone, so at small
    batch it cannot tell k=1 from k=5. This richer form is kept in the profile's `fit` section
    for a simulator that wants it."""

    base_s: float
    per_step_s: float
    per_step_kv_token_s: float
    per_spec_token_s: float
    r2: float
    max_rel_err: float
    n: int

    def predict(self, batch: int, k: int, kv_tokens: float) -> float:
        return self.base_s + k * (
            self.per_step_s + self.per_step_kv_token_s * kv_tokens + self.per_spec_token_s * batch
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "base_s": self.base_s,
            "per_step_s": self.per_step_s,
            "per_step_kv_token_s": self.per_step_kv_token_s,
            "per_spec_token_s": self.per_spec_token_s,
            "r2": self.r2,
            "max_rel_err": self.max_rel_err,
        }


def fit_chain_drafter(
    batch: Sequence[int], k: Sequence[int], kv_tokens: Sequence[int], times: Sequence[float]
) -> ChainDrafterFit:
    fit = _fit_drafter_terms(
        batch, k, kv_tokens, times, lambda b, kk, kv: [np.ones_like(b), kk, kk * kv, kk * b]
    )
    base, per_step, per_step_kv, per_spec = fit.coef
    return ChainDrafterFit(base, per_step, per_step_kv, per_spec, fit.r2, fit.max_rel_err, fit.n)


@dataclass(frozen=True)
class PrefillFit:
    """`base_s + per_token_s * T` for one prefill chunk of T tokens."""

    base_s: float
    per_token_s: float
    r2: float
    max_rel_err: float
    n: int

    def predict(self, tokens: float) -> float:
        return self.base_s + self.per_token_s * tokens

    def as_profile(self) -> dict[str, float]:
        return {"base_s": self.base_s, "per_token_s": self.per_token_s}


def fit_prefill(tokens: Sequence[int], times: Sequence[float]) -> PrefillFit:
    t = np.asarray(tokens, dtype=np.float64)
    x = np.column_stack([np.ones_like(t), t])
    fit = fit_nonnegative_relative(x, np.asarray(times, dtype=np.float64))
    base, per_token = fit.coef
    return PrefillFit(base, per_token, fit.r2, fit.max_rel_err, fit.n)


def copy_bandwidth_bps(points: Iterable[Point]) -> float | None:
    """Best measured device-to-device copy rate, counting bytes read plus written."""
    rates = [p.bytes / p.median_s for p in points if p.kind == "copy" and p.bytes > 0]
    return max(rates) if rates else None


def _of(points: Sequence[Point], kind: str) -> list[Point]:
    return [p for p in points if p.kind == kind]


def _fit_drafters(
    points: Sequence[Point], fit_notes: list[str]
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """The profile's drafters (each fitted where its points exist, the CPU-side lookups kept at the
    H100 profile's fraction) and the EAGLE heads' chain-form fits; what was done goes to ``fit_notes``."""
    drafters: dict[str, Any] = {}
    eagle_fits: dict[str, DrafterFit] = {}
    chain_fits: dict[str, dict[str, float]] = {}
    for kind in ("eagle3", "eagle"):
        pts = _of(points, kind)
        if len(pts) >= 3:
            fit = fit_drafter(
                [p.batch for p in pts],
                [p.query_tokens for p in pts],
                [p.kv_tokens for p in pts],
                [p.median_s for p in pts],
            )
            eagle_fits[kind] = fit
            drafters[kind] = fit.as_profile()
            chain = fit_chain_drafter(
                [p.batch for p in pts],
                [p.query_tokens for p in pts],
                [p.kv_tokens for p in pts],
                [p.median_s for p in pts],
            )
            chain_fits[kind] = chain.as_dict()
            fit_notes.append(
                f"{kind}: {fit.n} points (B x k x context), r2={fit.r2:.4f}, "
                f"max_rel_err={fit.max_rel_err:.3f} "
                f"in the format's form; the chain form in fit.chain_drafters (k x per-pass cost) gives "
                f"r2={chain.r2:.4f}, max_rel_err={chain.max_rel_err:.3f}."
            )
    if "eagle" in eagle_fits:
        # Llama-3.1-8B has no MTP head; an MTP module has an EAGLE-1 head's shape (fc over
        # [embedding; hidden] + one decoder layer + the shared LM head), so it costs the same.
        drafters["mtp"] = eagle_fits["eagle"].as_profile()
        fit_notes.append("mtp: no MTP head exists for Llama-3.1-8B; set equal to the EAGLE-1-shaped head.")
    dm_pts = _of(points, "draft_model")
    if len(dm_pts) >= 4:
        dm = fit_forward(
            [p.batched_tokens for p in dm_pts], [p.kv_tokens for p in dm_pts], [p.median_s for p in dm_pts]
        )
        drafters["draft_model"] = dm.as_profile()
        fit_notes.append(
            f"draft_model (Llama-3.2-1B shape): {dm.n} points, r2={dm.r2:.4f}, "
            f"max_rel_err={dm.max_rel_err:.3f}."
        )
    drafters["ngram"] = {"fraction_of_verify": H100_NGRAM_FRACTION_OF_VERIFY}
    drafters["suffix"] = {"fraction_of_verify": H100_SUFFIX_FRACTION_OF_VERIFY}
    fit_notes.append(
        "ngram/suffix: CPU-side lookups, not GPU work, so kept at the H100 profile's fraction of verify time."
    )
    fit_notes.append(
        "step_overhead_s: scheduler/sampler/Python time per engine step is host CPU work that forward "
        "timing cannot see and that does not scale with HBM bandwidth; kept at the H100 fit's value."
    )
    return drafters, chain_fits


def build_profile(
    points: Sequence[Point],
    stack: Mapping[str, Any],
    name: str,
    model: str = "meta-llama/Llama-3.1-8B-Instruct",
    date: str = "",
) -> dict[str, Any]:
    """Fit every part of the profile that the points cover and return the profile as a dict.

    Needs `target` points; drafter and prefill sections are filled where their points exist.
    `stack` is the calibrator's stack record (GPU name, weight bytes read per step, ...).
    """
    target_pts = _of(points, "target")
    if len(target_pts) < 4:
        raise ValueError(f"need at least 4 target points to fit a profile, got {len(target_pts)}")
    target = fit_forward(
        [p.batched_tokens for p in target_pts],
        [p.kv_tokens for p in target_pts],
        [p.median_s for p in target_pts],
    )
    fit_notes: list[str] = [
        f"target: {target.n} points (B x query tokens x context), relative-error least squares, "
        f"r2={target.r2:.4f}, max_rel_err={target.max_rel_err:.3f}, knee at T={target.knee_batched_tokens}."
    ]
    drafters, chain_fits = _fit_drafters(points, fit_notes)
    graphs = ", CUDA graphs" if stack.get("cuda_graphs") else ""
    profile: dict[str, Any] = {
        "name": name,
        "hardware": str(stack.get("gpu", "unknown GPU")),
        "model": model,
        "source": (
            f"measured by engines/calibrate.py{(' on ' + date) if date else ''} "
            f"(random {stack.get('dtype', 'bf16')} weights{graphs}, "
            f"torch {stack.get('torch', '?')}), see {name}.points.csv"
        ),
        "step_overhead_s": H100_STEP_OVERHEAD_S,
        "target": target.as_profile(),
        "drafters": drafters,
        "limits": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
    }
    pre_pts = _of(points, "prefill")
    if len(pre_pts) >= 2:
        pre = fit_prefill([p.batched_tokens for p in pre_pts], [p.median_s for p in pre_pts])
        profile["prefill"] = pre.as_profile()
        fit_notes.append(f"prefill: {pre.n} chunks, r2={pre.r2:.4f}, max_rel_err={pre.max_rel_err:.3f}.")
    fit_notes.extend(sanity_notes(points, target, stack))
    profile["fit"] = {"r2": target.r2, "max_rel_err": target.max_rel_err, "notes": " ".join(fit_notes)}
    if chain_fits:
        profile["fit"]["chain_drafters"] = chain_fits
    return profile


def sanity_notes(points: Sequence[Point], target: ForwardFit, stack: Mapping[str, Any]) -> list[str]:
    """The batch-1 decode step against the weight-read floor and the bandwidth-scaled H100 fit."""
    notes: list[str] = []
    bw = copy_bandwidth_bps(points)
    weight_bytes = stack.get("weight_bytes_read_per_step")
    b1 = sorted(
        (p for p in points if p.kind == "target" and p.batch == 1 and p.query_tokens == 1),
        key=lambda p: p.context,
    )
    if bw and weight_bytes and b1:
        floor = float(weight_bytes) / bw
        parts = ", ".join(
            f"ctx {p.context}: {p.median_s * 1e3:.2f} ms ({p.median_s / floor:.2f}x)" for p in b1
        )
        notes.append(
            f"sanity: copy bandwidth {bw / 1e12:.2f} TB/s (read+write); weight-read floor "
            f"{float(weight_bytes) / 1e9:.2f} GB / that = {floor * 1e3:.2f} ms; batch-1 decode {parts}."
        )
    gemm_b1 = [p for p in points if p.kind == "target_gemm_only" and p.batch == 1]
    if bw and weight_bytes and gemm_b1:
        floor = float(weight_bytes) / bw
        notes.append(
            f"the weight GEMMs alone at batch 1: {gemm_b1[0].median_s * 1e3:.2f} ms "
            f"({gemm_b1[0].median_s / floor:.2f}x the floor); the rest of a step is attention and the "
            f"small per-layer kernels (norms, rotary, SwiGLU, residuals, KV writes)."
        )
    unfused = {(p.batch, p.context): p for p in points if p.kind == "target_unfused" and p.query_tokens == 1}
    fused = {(p.batch, p.context): p for p in points if p.kind == "target" and p.query_tokens == 1}
    pairs = [(key, unfused[key], fused[key]) for key in sorted(unfused) if key in fused]
    if pairs:
        parts = ", ".join(
            f"B={b} ctx {c}: {u.median_s * 1e3:.2f} -> {f.median_s * 1e3:.2f} ms" for (b, c), u, f in pairs
        )
        notes.append(f"unfused kernels vs the profile's compiled step: {parts}.")
    h100_1k = (
        H100_TARGET["base_s"] + H100_TARGET["per_kv_token_s"] * 1024 + H100_TARGET["per_batched_token_s"]
    )
    scaled = h100_1k * H100_BANDWIDTH_TBPS / H200_BANDWIDTH_TBPS
    notes.append(
        f"H100 fit at B=1, 1k context: {h100_1k * 1e3:.2f} ms, scaled by bandwidth (3.35/4.8) "
        f"{scaled * 1e3:.2f} ms; this fit gives {target.predict(1, 1024) * 1e3:.2f} ms."
    )
    return notes


_TARGET_KEYS = ("base_s", "per_kv_token_s", "per_batched_token_s", "knee_batched_tokens")
_EAGLE_KEYS = ("base_s", "per_kv_token_s", "per_spec_token_s")


def profile_problems(profile: Mapping[str, Any]) -> list[str]:
    """Every way `profile` departs from the simulator's profile format; empty when it conforms."""
    problems: list[str] = []

    def number(where: str, value: Any, integer: bool = False) -> None:
        ok = isinstance(value, int) if integer else isinstance(value, int | float)
        if isinstance(value, bool) or not ok:
            problems.append(f"{where}: expected {'an integer' if integer else 'a number'}, got {value!r}")
        elif not math.isfinite(value) or value < 0:
            problems.append(f"{where}: expected a finite non-negative value, got {value!r}")

    for key in ("name", "hardware", "model", "source"):
        if not isinstance(profile.get(key), str) or not profile.get(key):
            problems.append(f"{key}: expected a non-empty string")
    number("step_overhead_s", profile.get("step_overhead_s"))
    target = profile.get("target")
    if not isinstance(target, Mapping):
        problems.append("target: missing")
    else:
        for key in _TARGET_KEYS:
            number(f"target.{key}", target.get(key), integer=key == "knee_batched_tokens")
    drafters = profile.get("drafters")
    if not isinstance(drafters, Mapping):
        problems.append("drafters: missing")
    else:
        for name, spec in drafters.items():
            if not isinstance(spec, Mapping):
                problems.append(f"drafters.{name}: expected an object")
            elif name in ("ngram", "suffix"):
                number(f"drafters.{name}.fraction_of_verify", spec.get("fraction_of_verify"))
            elif name == "draft_model":
                for key in _TARGET_KEYS:
                    number(f"drafters.draft_model.{key}", spec.get(key), integer=key == "knee_batched_tokens")
            else:
                for key in _EAGLE_KEYS:
                    number(f"drafters.{name}.{key}", spec.get(key))
    if "prefill" in profile:
        prefill = profile["prefill"]
        if not isinstance(prefill, Mapping):
            problems.append("prefill: expected an object")
        else:
            for key in ("base_s", "per_token_s"):
                number(f"prefill.{key}", prefill.get(key))
    limits = profile.get("limits")
    if not isinstance(limits, Mapping):
        problems.append("limits: missing")
    else:
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            number(f"limits.{key}", limits.get(key), integer=True)
    if "fit" in profile:
        fit = profile["fit"]
        if not isinstance(fit, Mapping):
            problems.append("fit: expected an object")
        else:
            number("fit.max_rel_err", fit.get("max_rel_err"))
            r2 = fit.get("r2")
            if not isinstance(r2, int | float) or isinstance(r2, bool) or not r2 <= 1:
                problems.append(f"fit.r2: expected a number <= 1, got {r2!r}")
            if not isinstance(fit.get("notes", ""), str):
                problems.append("fit.notes: expected a string")
    return problems
