"""Throughput a client would recognise: `agg tok/s` divides an arm's tokens at a level by the time it
spent at that level (each replay round's first start to last end, summed; outside rounds the stretches
whose pauses with nothing in flight last at most 10 s), never by first start to last end across the
idle time between visits. Synthetic spans in real DuckDB files, checked against an independent
computation in Python; the agreement with AIPerf and GuideLLM is tests/bench/bench_throughput_agreement.py."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

from specproxy.analysis import evaluate, open_store
from specproxy.analysis.slo.goodput import slo_level_figures
from specproxy.record import SpanRecord
from specproxy.slo import parse_slo
from specproxy.visits import IDLE_GAP_S
from tests.spanfactory import ArmSpec, epoch_ns, make_run, write_db

ARMS = [ArmSpec("baseline", "baseline", "none"), ArmSpec("eagle3", speedup=1.5)]


def _moved(span: SpanRecord, seconds: float) -> SpanRecord:
    assert span.t_start is not None
    start = span.t_start + timedelta(seconds=seconds)
    return dataclasses.replace(span, t_start=start, t_start_ns=epoch_ns(start))


def _start_s(span: SpanRecord) -> float:
    assert span.t_start_ns is not None
    return span.t_start_ns / 1e9


def _visits_s(spans: list[SpanRecord], idle_gap_s: float | None) -> float:
    """The time visited, computed apart from the SQL: merge the sent calls' intervals (by start),
    bridging a pause of at most ``idle_gap_s`` (every pause when None: one replay round)."""
    intervals = sorted((_start_s(s), _start_s(s) + (s.e2e_s or 0.0)) for s in spans if s.status != "dropped")
    total, (lo, hi) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if idle_gap_s is not None and start - hi > idle_gap_s:
            total, lo = total + hi - lo, start
        hi = max(hi, end)
    return total + hi - lo


def test_live_agg_tok_s_leaves_out_the_idle_hour_between_two_bursts(tmp_path: Path) -> None:
    """Live traffic in two bursts an hour apart (a client's benchmark run, then another): agg tok/s is
    the tokens over the two bursts' time, as the client measured each; first start to last end would
    have put the hour in (here 100x lower). A pause of 5 s inside a burst counts (a client's think
    time), and a dropped shadow copy counts nothing."""
    run = make_run(ARMS, levels=(None,), n_per_level=120, seed=3)
    spans = []
    for i, s in enumerate(run.spans):
        index = int(s.request_id.rsplit("-", 1)[1])
        shift = 3600.0 if index >= 60 else 5.0 if index >= 30 else 0.0
        spans.append(_moved(s, shift))
        if i == 0:
            spans.append(dataclasses.replace(_moved(s, 1800.0), request_id="dropped-1", status="dropped"))
    store_path = write_db(tmp_path / "live.duckdb", [dataclasses.replace(run, spans=spans)])
    with open_store([store_path]) as store:
        (ev,) = evaluate(store)
    by_arm: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        by_arm[s.arm].append(s)
    for row in ev.rows:
        mine = by_arm[row.arm]
        tokens = sum(s.completion_tokens or 0 for s in mine if s.status == "ok")
        visits = _visits_s(mine, IDLE_GAP_S)
        sent = [s for s in mine if s.status != "dropped"]
        span = max(_start_s(s) + (s.e2e_s or 0) for s in sent) - min(_start_s(s) for s in sent)
        assert row.wall_s is not None and abs(row.wall_s - visits) < 1e-6
        assert row.agg_tok_s is not None and abs(row.agg_tok_s - tokens / visits) < 1e-6 * row.agg_tok_s
        assert span > 3600 and row.agg_tok_s > 50 * tokens / span
        assert visits < _visits_s(mine, None) - 4  # the 5 s pause is inside a visit, the hour is not


def test_replay_level_time_is_its_rounds_summed(tmp_path: Path) -> None:
    """A replay level measured in three rounds with the other levels' rounds in between: its wall time
    is the three rounds' spans summed (the rounds of c=8 do not count toward c=1), for agg tok/s in the
    table and for goodput alike."""
    run = make_run(ARMS, levels=(1, 8), n_per_level=40, rounds=3, seed=5)
    # interleave: level 1's rounds an hour apart, level 8's in between (as a sweep that visits each
    # level once a round would)
    spans = [_moved(s, 3600.0 * (s.round or 0)) if s.concurrency_level == 1 else s for s in run.spans]
    store_path = write_db(tmp_path / "rounds.duckdb", [dataclasses.replace(run, spans=spans)])
    with open_store([store_path]) as store:
        (ev,) = evaluate(store)
        goodput = slo_level_figures(store, run.run_id, parse_slo("ttft_p95=1s"), seed=0, max_sample=1000)
    walls = {(f.arm, f.level): f.wall_s for f in goodput}
    for row in ev.rows:
        mine = [s for s in spans if s.arm == row.arm and str(s.concurrency_level) == row.level]
        expected = sum(_visits_s([s for s in mine if s.round == r], None) for r in (1, 2, 3))
        assert row.wall_s is not None and abs(row.wall_s - expected) < 1e-6
        assert abs(walls[(row.arm, row.level)] - expected) < 1e-6
        if row.level == "1":
            assert row.wall_s < 3600  # not first start to last end, two hours and more
