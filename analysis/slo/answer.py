"""The answer at the user's SLO, in pure stages: figures per arm and level (:mod:`.goodput`) →
frozen level rows (goodput, share, each target's percentile and whether it holds) → each arm's
capacity at the SLO and its ratio to the baseline (:mod:`.capacity`) → the fleet at the peak
(:mod:`.fleet`).

UNRELIABLE levels (:mod:`.validity`) keep their goodput rows (marked) and are left out of
capacities; so are levels where a target could not be checked (a value not recorded), and levels of
live traffic (no load to place them on).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specproxy.analysis.slo import capacity as cap
from specproxy.analysis.slo.fleet import ArmFleet, Peak, arm_fleet, candidate_fleet
from specproxy.analysis.slo.goodput import (
    LevelReplicates,
    SloLevelFigures,
    interval,
    level_replicates,
    slo_level_figures,
)
from specproxy.analysis.stats import FloatArray, Interval, parallel_map, rng_for
from specproxy.analysis.store import SpanStore
from specproxy.slo import Slo


@dataclass(frozen=True)
class SloInputs:
    """What the SLO stage is told: the SLO and where it came from, the peak, the GPU price, and each
    arm's GPUs per replica (count, where that came from)."""

    slo: Slo
    source: str
    peak_concurrency: int | None = None
    peak_rate: float | None = None
    peak_sources: tuple[str, str] = ("", "")  # where the peak concurrency and the peak rate came from
    gpu_hour_usd: float | None = None
    gpus: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    confidence: float = 0.95
    iterations: int = 1000
    seed: int = 0
    max_sample: int = 2000


@dataclass(frozen=True)
class TargetFigure:
    """One target at one arm and level: its percentile over the calls (None: not checked, because
    ``missing`` calls lacked the value) and whether it holds there."""

    name: str
    threshold_s: float
    value: Interval | None
    holds: bool | None
    missing: int


@dataclass(frozen=True)
class SloLevelRow:
    """An arm at a level against the SLO. ``holds`` None: a target could not be checked."""

    arm: str
    level: str
    load: float | None
    calls: int
    ok: int
    met: int
    share: Interval | None
    requests_per_s: Interval | None
    tokens_per_s: Interval | None
    targets: tuple[TargetFigure, ...]
    holds: bool | None
    reliable: bool
    note: str = ""


@dataclass(frozen=True)
class ArmCapacity:
    """An arm's capacity at the SLO, its ratio to the baseline's, and the sentence that says so."""

    arm: str
    kind: str
    capacity: cap.Capacity | None
    binding: str
    ratio: cap.CapacityRatio | None
    left_out: tuple[str, ...]
    text: str
    headline: str = ""


@dataclass(frozen=True)
class SloEvaluation:
    """Everything at the SLO for one run: where the SLO came from, the load axis of the sweep, the level
    rows, each arm's capacity, and the fleet at the peak (empty without one; ``notes`` say why)."""

    slo: Slo
    source: str
    axis: str
    levels: list[SloLevelRow]
    arms: list[ArmCapacity]
    peak: Peak | None
    fleet: list[ArmFleet]
    gpu_hour_usd: float | None
    notes: list[str]


def _target_figures(
    fig: SloLevelFigures, reps: LevelReplicates | None, slo: Slo, confidence: float
) -> tuple[TargetFigure, ...]:
    out = []
    for i, t in enumerate(slo.targets):
        point, logs = fig.percentiles[i], reps.log_percentiles[i] if reps is not None else None
        value = None if point is None else interval(point, None if logs is None else np.exp(logs), confidence)
        holds = None if point is None else point <= t.threshold_s
        out.append(TargetFigure(t.name, t.threshold_s, value, holds, fig.missing[i]))
    return tuple(out)


def _per_second(count: float, wall: float, reps: FloatArray | None, confidence: float) -> Interval | None:
    return interval(count / wall, reps, confidence) if wall > 0 else None


def level_row(
    fig: SloLevelFigures, reps: LevelReplicates | None, slo: Slo, reliable: bool, confidence: float
) -> SloLevelRow:
    """The frozen row of one arm at one level."""
    targets = _target_figures(fig, reps, slo, confidence)
    known = [tf.holds for tf in targets]
    missing = [
        f"{tf.name.split('_')[0]} not recorded for {tf.missing} of {fig.ok} ok calls"
        for tf in targets
        if tf.missing
    ]
    share = (
        interval(fig.met / fig.calls, reps.share if reps else None, confidence, 0.0, 1.0)
        if fig.calls
        else None
    )
    return SloLevelRow(
        arm=fig.arm,
        level=fig.level,
        load=fig.load,
        calls=fig.calls,
        ok=fig.ok,
        met=fig.met,
        share=share,
        requests_per_s=_per_second(fig.met, fig.wall_s, reps.requests_per_s if reps else None, confidence),
        tokens_per_s=_per_second(fig.met_tokens, fig.wall_s, reps.tokens_per_s if reps else None, confidence),
        targets=targets,
        holds=None if None in known else all(known),
        reliable=reliable,
        note="; ".join(missing) + ("; could not be checked, not counted as met" if missing else ""),
    )


def describe_load(load: float | None, axis: str) -> str:
    if load is None:
        return "—"
    return f"c={load:g}" if axis == "concurrency" else f"{load:g} req/s"


def fmt_approx(load: float, axis: str) -> str:
    return f"c≈{load:.3g}" if axis == "concurrency" else f"≈{load:.3g} req/s"


def fails_everywhere(c: cap.Capacity, axis: str) -> str:
    """ "fails at every tested level (lowest c=1)"."""
    return f"fails at every tested level (lowest {describe_load(min(c.loads), axis)})"


def describe_capacity(c: cap.Capacity, axis: str) -> str:
    """ "c≈83 [70, 95]", "≥ c=256 (held at every tested level)", or for an arm that held it nowhere
    "none measured: fails at every tested level (lowest c=1)" (with the top of its interval when some
    replicates held at the lowest)."""
    x = c.crossing
    if x.state == cap.NONE or x.load is None:
        reach = f"; 95% interval up to {fmt_approx(c.high, axis)}" if c.high is not None else ""
        return f"none measured: {fails_everywhere(c, axis)}{reach}"
    lo = "<" + describe_load(min(c.loads), axis) if c.low is None else f"{c.low:.3g}"
    hi = "" if c.high is None else (f"≥{c.high:.3g}" if c.high_open else f"{c.high:.3g}")
    band = f" [{lo}, {hi}]" if hi and hi.lstrip("≥") != lo else ""
    if x.state == cap.EVERY:
        return f"≥ {describe_load(x.load, axis)}{band} (held at every tested level)"
    where = f"holds at {describe_load(x.holds_at, axis)}, not at {describe_load(x.fails_at, axis)}"
    return f"{fmt_approx(x.load, axis)}{band} ({where})"


@dataclass(frozen=True, eq=False)
class _ArmPoints:
    """An arm's levels usable for its capacity: loads, each target's percentiles and log replicates."""

    loads: list[float]
    values: list[list[float]]
    replicates: list[list[FloatArray]] | None
    left_out: tuple[str, ...]


def _arm_points(
    rows: Sequence[SloLevelRow], reps: Mapping[str, LevelReplicates | None], axis: str
) -> _ArmPoints:
    used = [r for r in rows if r.reliable and r.load is not None and r.holds is not None]
    left = [
        f"{describe_load(r.load, axis)}: {_left_out_why(r)}"
        for r in rows
        if r.load is not None and r not in used
    ]
    used.sort(key=lambda r: r.load or 0.0)
    k = len(used[0].targets) if used else 0
    values = [[_point(r.targets[t].value) for r in used] for t in range(k)]
    replicates: list[list[FloatArray]] | None = []
    for t in range(k):
        per_level = [_log_replicates(reps.get(r.level), t) for r in used]
        if replicates is None or any(x is None for x in per_level):
            replicates = None
            break
        replicates.append([x for x in per_level if x is not None])
    return _ArmPoints([r.load or 0.0 for r in used], values, replicates if used else None, tuple(left))


def _left_out_why(row: SloLevelRow) -> str:
    if not row.reliable:
        return "UNRELIABLE"
    unchecked = [t.name for t in row.targets if t.holds is None]
    return f"{', '.join(unchecked)} not recorded, so not checked"


def _point(value: Interval | None) -> float:
    return value.point if value is not None else float("inf")


def _log_replicates(reps: LevelReplicates | None, target: int) -> FloatArray | None:
    return reps.log_percentiles[target] if reps is not None else None


def _capacity_replicates(points: _ArmPoints, thresholds: Sequence[float]) -> FloatArray | None:
    if points.replicates is None or not points.loads:
        return None
    return cap.replicate_loads(points.loads, points.replicates, thresholds)


def _ratio_text(ratio: cap.CapacityRatio, unit: str, baseline: str) -> str:
    """ "serves 1.30x [1.20, 1.40] more concurrent users than baseline"; more or fewer only where the
    interval says so (an interval across 1 is no clear difference)."""
    assert ratio.point is not None
    band = f" [{ratio.low:.2f}, {ratio.high:.2f}]" if ratio.low is not None and ratio.high is not None else ""
    figure = f"{ratio.bound}{ratio.point:.2f}x{band}"
    low, high = (
        (ratio.low, ratio.high) if ratio.low is not None and ratio.high is not None else (ratio.point,) * 2
    )
    if low > 1 or (not band and ratio.point >= 1):
        more = f"more {unit} than {baseline}"
    elif high < 1:
        more = f"the {unit} of {baseline} (fewer)"
    else:
        more = f"the {unit} of {baseline} (no clear difference)"
    note = f" ({ratio.note})" if ratio.note else ""
    return f"serves {figure} {more}{note}"


def _bound_text(ratio: cap.CapacityRatio, unit: str, baseline: str) -> str:
    """A ratio known only on one side, because one arm failed everywhere: "serves < 0.50x the
    concurrent users of baseline (fewer)" ("" where nothing measured bounds it)."""
    if ratio.bound == "<" and ratio.high is not None:
        fewer = " (fewer)" if ratio.high <= 1 else ""
        return f"serves < {ratio.high:.2f}x the {unit} of {baseline}{fewer}"
    if ratio.bound == ">" and ratio.low is not None:
        if ratio.low >= 1:
            return f"serves > {ratio.low:.2f}x more {unit} than {baseline}"
        return f"serves > {ratio.low:.2f}x the {unit} of {baseline}"
    return ""


def _headline(
    arm: str, kind: str, c: cap.Capacity | None, ratio: cap.CapacityRatio | None, ctx: tuple[str, str, str]
) -> str:
    """The arm's answer at the SLO in one sentence, the SLO stated."""
    slo_text, axis, baseline = ctx
    unit = "concurrent users" if axis == "concurrency" else "requests/s"
    if c is None:
        return f"{arm}: no capacity at your SLO ({slo_text}): no reliable level with every target checked"
    if c.crossing.load is None:
        return _failing_headline(arm, c, ratio, ctx)
    own = f"capacity {describe_capacity(c, axis)}"
    if ratio is not None and ratio.point is not None:
        return f"{arm} {_ratio_text(ratio, unit, baseline)} at your SLO ({slo_text}): {own}"
    if ratio is not None and ratio.bound == ">":
        bounded = _bound_text(ratio, unit, baseline)
        failing = f"{baseline} fails it at every tested level"
        if bounded:
            return f"{arm} {bounded} at your SLO ({slo_text}): {own}; {failing}"
        return f"{arm} at your SLO ({slo_text}): {own}; {failing}, so no ratio"
    why = f"; no ratio to {baseline}: {ratio.note}" if ratio is not None else ""
    return f"{arm} at your SLO ({slo_text}): {own}{why}"


def _failing_headline(
    arm: str, c: cap.Capacity, ratio: cap.CapacityRatio | None, ctx: tuple[str, str, str]
) -> str:
    """An arm that failed the SLO at every tested level: nothing measured, and what that bounds."""
    slo_text, axis, baseline = ctx
    unit = "concurrent users" if axis == "concurrency" else "requests/s"
    reach = f" (95% interval up to {fmt_approx(c.high, axis)})" if c.high is not None else ""
    lowest = describe_load(min(c.loads), axis)
    text = f"{arm} fails your SLO ({slo_text}) at every tested level (lowest {lowest}): no capacity measured"
    text += reach
    if ratio is None:
        return text
    if ratio.bound != "<":
        return f"{text}; nor for {baseline}, which fails it at every tested level too"
    bounded = _bound_text(ratio, unit, baseline)
    return f"{text}; it {bounded}" if bounded else text


def _axis(figs: Sequence[SloLevelFigures]) -> str:
    """The sweep's load axis: the one most levels were run on ("" for live traffic only)."""
    axes = [f.axis for f in figs if f.axis]
    return max(sorted(set(axes)), key=axes.count) if axes else ""


def _replicates(
    figs: Sequence[SloLevelFigures], inputs: SloInputs, run_id: str
) -> dict[tuple[str, str], LevelReplicates | None]:
    """Each arm and level's bootstrap replicates (the levels on parallel threads)."""

    def one(f: SloLevelFigures) -> LevelReplicates | None:
        rng = rng_for(inputs.seed, run_id, f.arm, f.level, "slo")
        return level_replicates(f, inputs.slo, iterations=inputs.iterations, rng=rng)

    return dict(zip([(f.arm, f.level) for f in figs], parallel_map(one, figs), strict=True))


def evaluate_slo(
    store: SpanStore,
    run_id: str,
    inputs: SloInputs,
    baseline: str,
    kinds: Mapping[str, str],
    unreliable: set[str],
) -> SloEvaluation:
    """Every arm's goodput per level, capacity at the SLO, and fleet at the peak."""
    slo = inputs.slo
    figs = slo_level_figures(store, run_id, slo, seed=inputs.seed, max_sample=inputs.max_sample)
    axis = _axis(figs)
    reps = _replicates(figs, inputs, run_id)
    rows = [
        level_row(f, reps[(f.arm, f.level)], slo, f.level not in unreliable, inputs.confidence) for f in figs
    ]
    on_axis = {(f.arm, f.level) for f in figs if f.axis == axis and axis}
    thresholds = [t.threshold_s for t in slo.targets]
    points = {
        arm: _arm_points(
            [r for r in rows if r.arm == arm and (arm, r.level) in on_axis],
            {lv: rp for (a, lv), rp in reps.items() if a == arm},
            axis,
        )
        for arm in kinds
    }
    creps = {arm: _capacity_replicates(p, thresholds) for arm, p in points.items()}
    caps = {
        arm: cap.capacity(p.loads, p.values, creps[arm], thresholds, inputs.confidence) if p.loads else None
        for arm, p in points.items()
    }
    arms = [
        _arm_capacity(arm, kind, caps, creps, points[arm].left_out, baseline, inputs.confidence, (slo, axis))
        for arm, kind in kinds.items()
    ]
    peak, fleet, notes = _fleet(inputs, axis, rows, caps, baseline, on_axis)
    return SloEvaluation(slo, inputs.source, axis, rows, arms, peak, fleet, inputs.gpu_hour_usd, notes)


def _arm_capacity(
    arm: str,
    kind: str,
    caps: Mapping[str, cap.Capacity | None],
    creps: Mapping[str, FloatArray | None],
    left_out: tuple[str, ...],
    baseline: str,
    confidence: float,
    ctx: tuple[Slo, str],
) -> ArmCapacity:
    slo, axis = ctx
    c, base = caps.get(arm), caps.get(baseline)
    ratio = None
    if kind != "baseline" and c is not None and base is not None:
        ratio = cap.capacity_ratio(c, base, creps.get(arm), creps.get(baseline), confidence)
    binding = slo.targets[c.crossing.target].name if c is not None and c.crossing.target is not None else ""
    text = (
        describe_capacity(c, axis) if c is not None else "n/a (no reliable level with every target checked)"
    )
    headline = _headline(arm, kind, c, ratio, (slo.describe(), axis, baseline))
    return ArmCapacity(arm, kind, c, binding, ratio, left_out, text, headline)


def _peak(inputs: SloInputs, axis: str) -> tuple[Peak | None, str]:
    if axis == "concurrency" and inputs.peak_concurrency is not None:
        return Peak(float(inputs.peak_concurrency), axis, inputs.peak_sources[0]), ""
    if axis == "rate" and inputs.peak_rate is not None:
        return Peak(inputs.peak_rate, axis, inputs.peak_sources[1]), ""
    given = inputs.peak_rate is not None or inputs.peak_concurrency is not None
    if given and axis:
        other = "--peak-rate" if axis == "concurrency" else "--peak-concurrency"
        return (
            None,
            f"fleet: the levels are on the {axis} axis; a peak given as {other} cannot be placed on it",
        )
    return None, "fleet: no peak given (--peak-concurrency N or --peak-rate R)" if axis else ""


def _fleet(
    inputs: SloInputs,
    axis: str,
    rows: Sequence[SloLevelRow],
    caps: Mapping[str, cap.Capacity | None],
    baseline: str,
    on_axis: set[tuple[str, str]],
) -> tuple[Peak | None, list[ArmFleet], list[str]]:
    peak, note = _peak(inputs, axis)
    if peak is None:
        return None, [], [note] if note else []
    fleets: dict[str, ArmFleet] = {}
    for arm, c in caps.items():
        goodput = [
            (r.load, r.tokens_per_s.point)
            for r in rows
            if r.arm == arm
            and r.reliable
            and r.load is not None
            and r.tokens_per_s
            and (arm, r.level) in on_axis
        ]
        gpus = inputs.gpus.get(arm, (1, "default: 1, not in the experiment file"))
        fleets[arm] = arm_fleet(arm, peak, c, goodput, gpus, inputs.gpu_hour_usd)
    base = fleets.get(baseline)
    out = [f if arm == baseline or base is None else candidate_fleet(f, base) for arm, f in fleets.items()]
    return peak, out, []


def slo_inputs_from_run(experiment: Mapping[str, Any]) -> dict[str, Any]:
    """What a run's recorded experiment says about the SLO stage: its ``slo``, ``peak_rate``,
    ``gpu_hour_usd``, and each arm's GPUs per replica from its engine section."""
    from specproxy.slo import slo_from_json

    out: dict[str, Any] = {"slo": slo_from_json(experiment.get("slo")), "gpus": {}}
    for key in ("peak_rate", "gpu_hour_usd"):
        value = experiment.get(key)
        out[key] = (
            float(value)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0
            else None
        )
    arms = experiment.get("arms")
    for arm in arms if isinstance(arms, list) else []:
        if isinstance(arm, dict) and isinstance(arm.get("name"), str):
            out["gpus"][arm["name"]] = arm_gpus(arm.get("engine"))
    return out


def arm_gpus(engine: Any) -> tuple[int, str]:
    """GPUs per replica from an arm's engine section: its ``gpus`` list, else tensor × pipeline
    parallel size (``--pipeline-parallel-size`` in ``extra_args``), else 1 (said)."""
    if not isinstance(engine, dict):
        return 1, "default: 1, not in the experiment file"
    gpus = engine.get("gpus")
    if isinstance(gpus, list) and gpus:
        return len(gpus), "engine.gpus"
    tp = engine.get("tensor_parallel_size")
    tp = tp if isinstance(tp, int) and tp > 0 else 1
    pp, extra = 1, engine.get("extra_args") or []
    for i, arg in enumerate(extra):
        if arg in ("--pipeline-parallel-size", "-pp") and i + 1 < len(extra) and str(extra[i + 1]).isdigit():
            pp = int(extra[i + 1])
    if tp == 1 and pp == 1:
        return 1, "engine: tensor_parallel_size 1"
    return tp * pp, f"engine: tensor_parallel_size {tp}" + (
        f" × pipeline_parallel_size {pp}" if pp > 1 else ""
    )


def parse_config(config_json: str | None) -> dict[str, Any]:
    try:
        value = json.loads(config_json or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
