"""From the span store to the verdict table: one :class:`RunEvaluation` per run, in pure stages.

0. health (:mod:`.validity`): per level, the checks it failed and the rounds it is judged on; the
   rounds a level is judged without are left out of the store's views (every arm's calls of them, and
   their engine counters) before any figure is read;
1. figures (:mod:`.figures`, SQL): per arm and level the summary, per replay round the wall-clock
   figures, the pairs (or each arm's calls) with a sample for the bootstrap;
2. comparisons (:mod:`.comparison`, :mod:`.matched`): speedup intervals per arm and level, widened by
   the level's rounds (or time blocks), simultaneous over the levels the arm's deploy verdict reads
   (Bonferroni: each interval at 1 − (1 − confidence) / L for the L tested levels around the operating
   point and the peak, usually 2), at matched engine load for live and split traffic;
3. verdicts (:mod:`.verdict`): the margin per level from the replica arms' noise floor over the run's
   reliable levels, each row's verdict, the crossover and the deploy verdict at the operating point.

Rows are frozen and built once, with their verdict. Beside this module: :mod:`.measured` (stage 1's
figures of a run and what every later stage does to a comparison of them), :mod:`.categories` (the
per-category rows), :mod:`.outcome` (the operating point and each arm's deploy verdict), :mod:`.notes`
(the run's notes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from specproxy.analysis.figures import matched
from specproxy.analysis.figures.provenance import estimate_note
from specproxy.analysis.figures.run_figures import (
    BlockKey,
    IdentityCounts,
    LevelSummary,
    PairGroup,
    RoundFigures,
    call_groups,
    engine_lags,
    failed_arms,
    latency_figures,
    level_summaries,
    pair_groups,
    round_figures,
)
from specproxy.analysis.figures.validity import (
    LevelHealth,
    dropped_rounds,
    dropped_windows,
    level_health,
    vouched_live,
)
from specproxy.analysis.levels import level_sort_key, level_unit, run_unit
from specproxy.analysis.slo.answer import (
    SloEvaluation,
    SloInputs,
    evaluate_slo,
    parse_config,
    slo_inputs_from_run,
)
from specproxy.analysis.stats import Interval, rng_for
from specproxy.analysis.store import SpanStore, StoreError
from specproxy.analysis.verdicts import comparison, rules
from specproxy.analysis.verdicts.categories import category_rows
from specproxy.analysis.verdicts.comparison import Bootstrap, Comparison
from specproxy.analysis.verdicts.margin import with_margins
from specproxy.analysis.verdicts.measured import (
    ONE_ROUND,
    RunFigures,
    arm_kind,
    arm_order,
    block_kind,
    bootstrapped,
    lag_bounded,
    one_round,
    round_count,
    rounds_of,
)
from specproxy.analysis.verdicts.notes import run_notes, stacks
from specproxy.analysis.verdicts.outcome import arm_outcome, operating_point
from specproxy.analysis.verdicts.rows import (
    SUMMARY_FIELDS,
    ArmOutcome,
    CategoryRow,
    LevelRow,
    RunEvaluation,
    Settings,
)
from specproxy.analysis.verdicts.rules import (
    FAILED,
    NO_CLEAR_GAIN,
    UNRELIABLE,
    IdentityCheck,
    Margin,
    OperatingPoint,
    ReplicaLevel,
    Thresholds,
    check_identity,
    level_verdict,
    noise_floor,
    tested_around,
)
from specproxy.analysis.verdicts.runs import list_runs, select_runs

__all__ = [
    "ArmOutcome",
    "CategoryRow",
    "LevelRow",
    "RunEvaluation",
    "Settings",
    "evaluate",
    "level_sort_key",
    "list_runs",
    "select_runs",
]

# Pairs must cover at least this share of a candidate level's calls with a decode speed for the level to
# be analysed paired (a split run with a small verify fraction has a few pairs: they would not represent
# the level).
PAIRED_MIN_SHARE = 0.5
# A level's wall-clock throughput compares arms only when they served the same work: a shadow sampled
# at 0.2 (even one driven by replay through the proxy, which carries the replay's level) served a fifth.
SAME_WORK_SHARE = 0.9
_Pair = tuple[str, str]  # (arm, level)


def evaluate(
    store: SpanStore,
    run: str | None = None,
    settings: Settings | None = None,
    skipped: list[str] | None = None,
) -> list[RunEvaluation]:
    """Evaluate every run (or the one named by name or id).

    Without ``run``, a run that cannot be evaluated (no baseline arm) is left out and its reason
    appended to ``skipped``, as long as another run can be; a named run that cannot be is an error.
    """
    settings = settings or Settings()
    out: list[RunEvaluation] = []
    errors: list[StoreError] = []
    runs = select_runs(store, run)
    health = {info["run_id"]: level_health(store, info["run_id"]) for info in runs}
    store.leave_out_rounds(
        ((run_id, level, round_) for run_id, h in health.items() for level, round_ in dropped_rounds(h)),
        ((run_id, *window) for run_id, h in health.items() for window in dropped_windows(h)),
    )
    for info in runs:
        try:
            out.append(_evaluate_run(store, info, settings, health[info["run_id"]]))
        except StoreError as exc:
            if run is not None:
                raise
            errors.append(exc)
    if errors and not out:
        raise errors[0]
    if skipped is not None:
        skipped.extend(f"skipped: {exc}" for exc in errors)
    return out


def _evaluate_run(
    store: SpanStore, info: dict[str, Any], settings: Settings, health: dict[str, LevelHealth]
) -> RunEvaluation:
    notes: list[str] = []
    run = _run_figures(store, info, settings, notes, health)
    point, point_text, moved = operating_point(settings, info, run_unit(s.level for s in run.summaries))
    if moved is not None:
        notes.append(moved.note())
    confidence = _confidences(run, settings, point)
    comparisons = _comparisons(run, confidence, settings)
    loads = _matched_loads(run, comparisons, confidence, settings)
    margins = _margins(run, comparisons, loads, settings.thresholds)
    identity = _identity_counts(run)
    rows = [
        _level_row(
            run,
            s,
            comparisons.get((s.arm, s.level)),
            loads.get((s.arm, s.level)),
            margins,
            identity,
            confidence,
            settings,
        )
        for s in run.summaries
    ]
    categories = category_rows(run, rows, margins, confidence, settings)
    failed = {f.arm: f.describe() for f in failed_arms(store, run.run_id)}
    arms = [arm_outcome(run, arm, rows, point, confidence, settings, failed) for arm in arm_order(run)]
    loaded = [r.level for r in rows if r.level_load is not None]
    evaluation = RunEvaluation(
        run_id=run.run_id,
        name=info["name"],
        mode=info.get("mode"),
        source=info.get("source"),
        started_at=info.get("started_at"),
        baseline=run.baseline,
        peak_level=max(loaded, key=level_sort_key, default="live"),
        rows=rows,
        arms=arms,
        categories=categories,
        noise_compared=sum(
            c.compared for (arm, _), c in identity.items() if arm_kind(run, arm) != "candidate"
        ),
        noise_mismatched=sum(
            c.compared - c.identical for (arm, _), c in identity.items() if arm_kind(run, arm) != "candidate"
        ),
        stacks=stacks(info, notes),
        notes=notes + run_notes(run, rows),
        at_concurrency=int(point.at) if point.at is not None and point.unit == "c" else None,
        peak_concurrency=int(point.peak) if point.peak is not None and point.unit == "c" else None,
        at_rate=point.at if point.unit == "r" else None,
        peak_rate=point.peak if point.unit == "r" else None,
        operating_point=point_text,
        peak_label=moved.label if moved is not None else _given_peak_label(settings),
        time_scales={lv: h.time_scale for lv, h in run.health.items() if h.time_scale not in (None, 1.0)},
        unreliable_levels=sorted((lv for lv, h in run.health.items() if not h.reliable), key=level_sort_key),
        failed_arms=list(failed.values()),
        slo=_at_slo(store, run, info, settings, arms, point),
    )
    return with_margins(evaluation, settings)


def _given_peak_label(settings: Settings) -> str:
    """The label a caller gave with its peak (the lab's, before it recorded its moves); "" for none."""
    given = settings.peak_concurrency and settings.peak_source != Settings.peak_source
    return settings.peak_source if given else ""


def _at_slo(
    store: SpanStore,
    run: RunFigures,
    info: dict[str, Any],
    settings: Settings,
    arms: Sequence[ArmOutcome],
    point: OperatingPoint,
) -> SloEvaluation | None:
    """Goodput, capacity and fleet at the SLO of the command line, else of the run's experiment file."""
    recorded = slo_inputs_from_run(parse_config(info.get("config_json")))
    slo = settings.slo or recorded["slo"]
    if slo is None:
        return None
    inputs = SloInputs(
        slo=slo,
        source="command line" if settings.slo else "run's experiment",
        peak_concurrency=int(point.peak) if point.peak is not None and point.unit == "c" else None,
        peak_rate=settings.peak_rate or recorded["peak_rate"],
        peak_sources=(
            "command line" if settings.peak_concurrency else "run's experiment",
            "command line" if settings.peak_rate else "run's experiment",
        ),
        gpu_hour_usd=settings.gpu_hour_usd or recorded["gpu_hour_usd"],
        gpus=recorded["gpus"],
        confidence=settings.confidence,
        iterations=settings.bootstrap_iterations,
        seed=settings.bootstrap_seed,
        max_sample=settings.bootstrap_max_sample,
    )
    kinds = {a.arm: a.kind for a in arms}
    unreliable = {lv for lv, h in run.health.items() if not h.reliable}
    return evaluate_slo(store, run.run_id, inputs, run.baseline, kinds, unreliable)


def _run_figures(
    store: SpanStore,
    info: dict[str, Any],
    settings: Settings,
    notes: list[str],
    health: dict[str, LevelHealth],
) -> RunFigures:
    """Stage 1: the run's figures, read from a store whose views already leave out the rounds each
    level is judged without (``health``)."""
    run_id = info["run_id"]
    summaries = level_summaries(store, run_id)
    if info.get("source") == "live":  # levels sent through the proxy by replay --target
        health = vouched_live(health, {s.level for s in summaries if s.level_load is not None})
    baselines = sorted({s.arm for s in summaries if s.role == "baseline"})
    if not baselines:
        raise StoreError(
            f"run {info['name']!r} has no baseline arm (no span with arm_role = 'baseline'); speedups need "
            'one: give one arm role = "baseline" in the experiment file'
        )
    baseline = baselines[0]
    if len(baselines) > 1:
        notes.append(f"several baseline arms ({', '.join(baselines)}); speedups are against {baseline}")
    rounds = round_figures(store, run_id)
    keys = _block_keys(summaries, rounds, settings.bootstrap_max_sample)
    pairs = pair_groups(
        store,
        run_id,
        baseline,
        keys,
        near_tie_margin=settings.near_tie_margin,
        seed=settings.bootstrap_seed,
        blocks=settings.time_blocks,
    )
    unpaired = _unpaired_levels(summaries, pairs, baseline)
    needed = {(arm, lv) for arm, lv in unpaired} | {(baseline, lv) for _, lv in unpaired}
    calls = call_groups(
        store,
        run_id,
        [k for k in keys if (k.arm, k.level) in needed],
        seed=settings.bootstrap_seed,
        blocks=settings.time_blocks,
    )
    base_of = {s.level: s for s in summaries if s.arm == baseline}
    engines = _engines_behind_urls(info)
    live_or_split = {
        (s.arm, s.level)
        for s in summaries
        if s.arm != baseline
        and s.level in base_of
        and (
            s.level_load is None
            or (s.arm, s.level) in unpaired
            or not _same_work(s, base_of[s.level])
            or engines.get(s.arm, 1) != engines.get(baseline, 1)
        )
    }
    loads = matched.load_bands(
        store,
        run_id,
        baseline,
        sorted(live_or_split),
        max_sample=settings.bootstrap_max_sample,
        seed=settings.bootstrap_seed,
        engines=engines,
    )
    return RunFigures(
        run_id,
        baseline,
        summaries,
        rounds,
        health,
        pairs,
        calls,
        loads,
        engine_lags(store, run_id, dropped_rounds(health)),
        latency=latency_figures(store, run_id),
    )


def _block_keys(
    summaries: Sequence[LevelSummary], rounds: dict[tuple[str, str], RoundFigures], max_sample: int
) -> list[BlockKey]:
    spans: dict[str, tuple[float, float]] = {}
    for s in summaries:
        if s.first_start_s is None or s.last_end_s is None:
            continue
        lo, hi = spans.get(s.level, (s.first_start_s, s.last_end_s))
        spans[s.level] = (min(lo, s.first_start_s), max(hi, s.last_end_s))
    keys = []
    for s in summaries:
        t0, t1 = spans.get(s.level, (0.0, 0.0))
        r = rounds.get((s.arm, s.level))
        keys.append(
            BlockKey(
                arm=s.arm,
                level=s.level,
                keep=min(1.0, max_sample / max(s.ok, 1)),
                by_round=r is not None and len(r.rounds) >= 2,
                t0=t0,
                span_s=t1 - t0,
            )
        )
    return keys


def _engines_behind_urls(info: Mapping[str, Any]) -> dict[str, int]:
    """Each arm's ``replicas_behind_url`` from the run's recorded experiment (1 where not given)."""
    arms = parse_config(info.get("config_json")).get("arms")
    out = {}
    for arm in arms if isinstance(arms, list) else []:
        n = arm.get("replicas_behind_url") if isinstance(arm, dict) else None
        if isinstance(arm, dict) and isinstance(n, int) and not isinstance(n, bool) and n > 1:
            out[str(arm.get("name"))] = n
    return out


def _same_work(cand: LevelSummary, base: LevelSummary) -> bool:
    return cand.calls >= SAME_WORK_SHARE * base.calls


def _unpaired_levels(
    summaries: Sequence[LevelSummary], pairs: Sequence[PairGroup], baseline: str
) -> set[tuple[str, str]]:
    """(arm, level) of non-baseline arms without enough pairs to represent the level."""
    n_decode = {(g.arm, g.level): g.n_decode for g in pairs if g.category is None and g.kind != "repeat"}
    levels_with_baseline = {s.level for s in summaries if s.arm == baseline}
    return {
        (s.arm, s.level)
        for s in summaries
        if s.arm != baseline
        and s.level in levels_with_baseline
        and n_decode.get((s.arm, s.level), 0) < max(2, PAIRED_MIN_SHARE * s.decode_calls)
    }


def _confidences(run: RunFigures, settings: Settings, point: OperatingPoint) -> dict[str, float]:
    """Each arm's per-interval confidence: Bonferroni over the levels its deploy verdict reads.

    The deploy verdict's WIN and LOSS come from the tested levels around the operating point and
    around the peak (the lowest and the highest tested level when not given; a point between two
    levels reads both), whatever their health: two levels in a sweep, up to four. Correcting for
    those keeps the deploy verdict's false alarms within 1 − confidence; each other level's verdict
    (and the crossover's) is a single comparison at that confidence, not a joint one. Correcting for
    every tested level instead widened the peak's interval by a quarter at 5 levels and 5 rounds
    (t at 1 − 0.05 / 5 against 1 − 0.05 / 2, 4 degrees of freedom), and a true ratio near the margin
    came out LOSS in one lab and NO CLEAR GAIN in the next.
    """
    out = {}
    for arm in arm_order(run):
        loads = (
            s.level_load
            for s in run.summaries
            if s.arm == arm and level_unit(s.level) == point.unit and run.summary(run.baseline, s.level)
        )
        tested = sorted({x for x in loads if x is not None})
        read = 1
        if tested:
            at, peak = point.resolved(tested)
            read = len(set(tested_around(at, tested)) | set(tested_around(peak, tested)))
        out[arm] = 1.0 - (1.0 - settings.confidence) / read
    return out


def _comparisons(
    run: RunFigures, confidence: dict[str, float], settings: Settings
) -> dict[tuple[str, str], Comparison]:
    """Per non-baseline arm and level: paired or unpaired, then at matched load where loads differ."""
    out: dict[tuple[str, str], Comparison] = {}

    def boot(arm: str, *keys: str) -> Bootstrap:
        rng = rng_for(settings.bootstrap_seed, run.run_id, arm, *keys)
        return Bootstrap(settings.bootstrap_iterations, confidence[arm], rng)

    jobs: dict[tuple[str, str], Callable[[], Comparison]] = {}
    unpaired = _unpaired_levels(run.summaries, run.pairs, run.baseline)
    for g in run.pairs:
        if g.category is not None or g.kind == "repeat" or (g.arm, g.level) in unpaired:
            continue
        cand, base = run.summary(g.arm, g.level), run.summary(run.baseline, g.level)
        if cand is None or base is None:
            continue
        wall, rounds = _wall_point(run, cand, base)
        kind = block_kind(run, g.arm, g.level, settings)
        jobs[(g.arm, g.level)] = partial(comparison.paired, g, wall, rounds, kind, boot(g.arm, g.level))
    for arm, level in sorted(unpaired):
        c, b = run.calls.get((arm, level, None)), run.calls.get((run.baseline, level, None))
        if c is not None and b is not None:
            kind = block_kind(run, arm, level, settings)
            jobs[(arm, level)] = partial(comparison.unpaired, c, b, kind, boot(arm, level))
    out = bootstrapped(jobs)
    # The arms at a level share its rounds (or time blocks): their between-block terms are pooled.
    pooled = comparison.pooled(out, lambda key: key[1])
    return {key: lag_bounded(run, c, *key) for key, c in pooled.items()}


def _wall_point(
    run: RunFigures, cand: LevelSummary, base: LevelSummary
) -> tuple[float | None, tuple[RoundFigures, RoundFigures] | None]:
    """A replay level's wall-clock throughput ratio (None for live traffic, or when the arms did not
    serve the same work): over the rounds when it has several (Σ tokens / Σ wall per arm, with the
    per-round figures for the drift term), else the level's agg tok/s ratio."""
    if cand.level_load is None or not _same_work(cand, base):
        return None, None
    rc, rb = run.rounds.get((cand.arm, cand.level)), run.rounds.get((base.arm, base.level))
    if rc is not None and rb is not None and len(rc.rounds) >= 2:
        return comparison.wall_ratio(rc, rb), (rc, rb)
    if cand.agg_tok_s and base.agg_tok_s:
        return cand.agg_tok_s / base.agg_tok_s, None
    return None, None


def _margins(
    run: RunFigures,
    comparisons: dict[tuple[str, str], Comparison],
    loads: Mapping[tuple[str, str], matched.MatchedLoad],
    thresholds: Thresholds,
) -> dict[str, Margin]:
    """Per level: the default margin, raised to the replica arms' noise floor
    (:func:`~specproxy.analysis.verdicts.rules.noise_floor`, from their ratios at the run's reliable levels).
    A replica that ran at another load than the baseline's counts with its matched-load ratios (its
    plain ones hold the load's effect, not noise), and not at all where it was not compared."""
    replicas = []
    for s in run.summaries:
        key = (s.arm, s.level)
        if arm_kind(run, s.arm) != "replica" or key not in comparisons or not run.reliable(s.level):
            continue
        load = loads.get(key)
        if load is not None and load.figures.unequal:
            if load.decode is not None:
                replicas.append(ReplicaLevel(s.level, load.decode, load.throughput))
            continue
        replicas.append(ReplicaLevel(s.level, comparisons[key].decode, comparisons[key].throughput))
    return {level: noise_floor(replicas, level, thresholds) for level in {s.level for s in run.summaries}}


def _identity_counts(run: RunFigures) -> dict[tuple[str, str], IdentityCounts]:
    """Per arm and level (the baseline's own repeats under the baseline), summed over kinds."""
    out: dict[tuple[str, str], IdentityCounts] = {}
    for g in run.pairs:
        if g.category is not None:
            continue
        prev = out.get((g.arm, g.level), IdentityCounts())
        c = g.identity
        out[(g.arm, g.level)] = IdentityCounts(
            prev.compared + c.compared,
            prev.identical + c.identical,
            prev.near_tie + c.near_tie,
            prev.gross + c.gross,
            prev.margin_unknown + c.margin_unknown,
        )
    return out


def _matched_loads(
    run: RunFigures, plain: Mapping[_Pair, Comparison], confidence: dict[str, float], settings: Settings
) -> dict[_Pair, matched.MatchedLoad]:
    """Each live or split level at matched load (:mod:`.matched`: its intervals carry the blocks'
    drift term), moved out by the arms' simulator lag bounds as the ordinary comparisons are, then
    stretched over the ``plain`` comparison's (the load's effect lies between none and the line's);
    where no line placed the load, the ``plain`` comparison stretched by the load's largest effect; at
    near-equal loads, the ``plain`` comparison stretched by the effect the arms' lines read."""
    out = {}
    for (arm, level), bands in run.loads.items():
        if not bands.figures.unequal:
            own = plain.get((arm, level))
            out[(arm, level)] = matched.near_equal(
                bands, own.decode if own else None, own.throughput if own else None
            )
            continue
        load = matched.compare(
            bands,
            iterations=settings.bootstrap_iterations,
            confidence=confidence[arm],
            rng=rng_for(settings.bootstrap_seed, run.run_id, arm, level, "matched load"),
            blocks=settings.time_blocks,
        )
        if load.decode is not None or load.throughput is not None:
            comp = Comparison(False, 0, load.decode, load.throughput, "per call", load.blocks)
            lagged = lag_bounded(run, comp, arm, level)
            load = replace(load, decode=lagged.decode, throughput=lagged.throughput)
            if (own := plain.get((arm, level))) is not None:
                load = matched.bracketed(load, own.decode, own.throughput)
        elif (own := plain.get((arm, level))) is not None:
            load = matched.bounded(load, own.decode, own.throughput)
        out[(arm, level)] = load
    return out


def _level_row(
    run: RunFigures,
    s: LevelSummary,
    comp: Comparison | None,
    load: matched.MatchedLoad | None,
    margins: dict[str, Margin],
    identity: dict[tuple[str, str], IdentityCounts],
    confidence: dict[str, float],
    settings: Settings,
) -> LevelRow:
    counts = identity.get((s.arm, s.level), IdentityCounts())
    health = run.health.get(s.level)
    margin = margins[s.level]
    decode, throughput = (comp.decode, comp.throughput) if comp else (None, None)
    basis = rules.SHADOW_BASIS if s.shadow else comp.throughput_basis if comp else "wall"
    # At unequal loads only the matched figures are shown: none where the arms were not compared (the
    # plain ones, kept as unmatched_*, hold the load's own effect on speed).
    unequal = load is not None and load.figures.unequal
    if load is not None and unequal:
        decode, throughput, basis = load.decode, load.throughput, basis if s.shadow else "per call"
    elif load is not None and load.figures.method == matched.NEAR_EQUAL:
        decode, throughput = load.decode, load.throughput  # the plain ones, stretched over the load's effect
    check = check_identity(counts.identical, counts.compared, confidence[s.arm], settings.thresholds)
    base = run.summary(run.baseline, s.level) if s.arm != run.baseline else None
    estimated = estimate_note(s.tokens, base.tokens if base is not None else None)
    verdict, reason = _row_verdict(run, s, comp, decode, throughput, check, margin, load, estimated)
    rounds = round_count(run, s.arm, s.level)
    dropped = health.dropped if health is not None else ()
    return LevelRow(
        **{name: getattr(s, name) for name in SUMMARY_FIELDS},
        compared=counts.compared,
        identical=counts.identical,
        near_tie=counts.near_tie,
        gross=counts.gross,
        margin_unknown=counts.margin_unknown,
        paired=comp.paired if comp else (None if s.arm == run.baseline else False),
        pairs=comp.pairs if comp else 0,
        decode_speedup=decode,
        throughput_speedup=None if s.shadow else throughput,  # no comparison: rules.SHADOW_THROUGHPUT
        throughput_basis=basis,
        verdict=verdict,
        reason=reason,
        rounds=rounds,
        rounds_measured=len(health.rounds) if health is not None and dropped else rounds,
        rounds_used=health.used_rounds if health is not None and dropped else rounds_of(run, s),
        rounds_dropped=dropped,
        blocks=comp.blocks if comp else "",
        drift_note=ONE_ROUND if rounds == 1 and s.arm != run.baseline else "",
        confidence=confidence[s.arm] if comp else None,
        decode_margin=margin.decode if comp else None,
        throughput_margin=margin.throughput if comp else None,
        margin_source=margin.source if comp else "",
        identity_mismatch=check.mismatch,
        reliable=health is None or health.reliable,
        health=health.describe() if health is not None else "",
        health_checks=health.checks if health is not None else 0,
        load=load.figures if load is not None else None,
        unmatched_decode_speedup=comp.decode if comp and unequal else None,
        unmatched_throughput_speedup=comp.throughput if comp and unequal and not s.shadow else None,
        tokens_source=s.tokens.describe(),
        own_tokens_estimated=s.tokens.estimated > 0,
        tokens_estimated=bool(estimated),
        estimate_note=estimated,
        req_acceptance_source=s.spec.source(),
        req_acceptance_not_measured=s.spec.not_measured(),
        latency=run.latency.get((s.arm, s.level)),
    )


def _row_verdict(
    run: RunFigures,
    s: LevelSummary,
    comp: Comparison | None,
    decode: Interval | None,
    throughput: Interval | None,
    identity: IdentityCheck,
    margin: Margin,
    load: matched.MatchedLoad | None,
    estimated: str,
) -> tuple[str | None, str]:
    if s.arm == run.baseline or s.role == "baseline":
        return None, ""
    if s.calls and not s.ok:
        return FAILED, f"every call failed ({s.calls} of {s.calls}); the run's notes give the first error"
    if comp is None:
        return None, ""
    health = run.health.get(s.level)
    if health is not None and not health.reliable:
        return UNRELIABLE, f"the measurement failed its health checks: {health.describe()}"
    if load is not None and load.decode is None and load.note:
        return NO_CLEAR_GAIN, load.note
    verdict, reason = level_verdict(decode, throughput, identity, margin, estimated, shadow=s.shadow)
    if load is not None and load.note:
        reason += f"; {load.note}"
    if round_count(run, s.arm, s.level) == 1:
        return one_round(verdict, reason, identity)
    return verdict, reason
