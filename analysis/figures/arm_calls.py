"""Each arm's calls at a level with the load each saw, and the engine's own gauges beside it.

**The load of a call** is the mean number of the arm's other calls in flight over the call's decode
window (first token to end; the whole call when it has no first token), read from the spans
themselves (:func:`call_loads`): an exact time average, and the spans of every worker's file count.
An arm whose URL spreads its calls over N engines (``replicas_behind_url``) gives each engine an N-th.

**The engine's gauges** (``engine_running`` + ``engine_waiting``, stamped by the proxy from a scrape
at most two intervals old, with their age in ``engine_load_age_s``) are read beside that count:
where the engine had clearly more (other clients) the excess is added (:func:`outside_load`); where
it had far less than the proxy's count at the moments the gauges were read, the URL probably serves
several engines (:func:`few_engines_note`). A gauge reading 0 while the proxy had many calls in
flight is a failed or stale scrape: left out, and said (:func:`broken_note`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from specproxy.analysis.levels import LEVEL_SQL
from specproxy.analysis.stats import FloatArray
from specproxy.analysis.store import SpanStore
from specproxy.schema import start_s_sql

# A share of the calls carrying the engine's gauges for them to be read.
MIN_COVERAGE = 0.9
# Engine load beyond the proxy's own count is read as other clients' only when it is at least this
# many requests and this share of the proxy's count: behind the proxy alone a gauge and the proxy's
# count at its reading differ by the calls that started or ended while the scrape was answered.
OUTSIDE_MIN = 2.0
OUTSIDE_SHARE = 0.5
# Engine gauges under this share of the proxy's per-engine count (at a load of at least
# FEW_ENGINES_MIN) suggest more engines behind the URL than the experiment file says.
FEW_ENGINES_SHARE = 0.6
FEW_ENGINES_MIN = 4.0
# ... over at least this many distinct readings at that load: one scrape is stamped on every call
# until the next, and a reading taken as a burst of calls starts finds the engine behind the proxy
# (an identical twin's last-round reading said 1 where the proxy had 4, and most calls carried it).
FEW_ENGINES_READINGS = 5
# Stamps of one reading, their moments computed from each call's start and age, agree to this.
READING_GRID_S = 0.01
# A gauge reading 0 running + waiting while the proxy had this many calls in flight on the engine as
# it was read (where the span does not say when: as the call was sent) is a scrape that failed, or
# one from before a burst. At a few calls in flight a short call's neighbours turn over faster than
# the gauge is read, and 0 can be a true reading; stamped on a call long after, it is still true of
# its moment (the first calls of a round carry a reading of the pause before it).
BROKEN_GAUGE_INFLIGHT = 8


@dataclass(frozen=True, eq=False)
class ArmCalls:
    """One arm's ok calls at one level: the load each saw and its figures (NaN where missing)."""

    load: FloatArray
    decode: FloatArray
    tokens: FloatArray
    e2e: FloatArray
    start_s: FloatArray
    round: FloatArray
    engine: FloatArray = field(repr=False)  # running + waiting gauges stamped at the call's start
    broken: int = 0  # gauges read 0 while the proxy had calls in flight: left out of ``engine`` (NaN)
    # the proxy's own count of the arm's calls in flight (per engine) at the moment those gauges were
    # read; NaN where the span does not say when (written before schema 16)
    engine_at_read: FloatArray | None = field(default=None, repr=False)
    engine_read_s: FloatArray | None = field(default=None, repr=False)  # when, on the calls' clock


def _integral(starts: FloatArray, ends: FloatArray, t: FloatArray) -> FloatArray:
    """∫ (calls in flight) dt from -inf to each t: Σ clip(t - start, 0, end - start), by sorted sums."""
    s, e = np.sort(starts), np.sort(ends)
    cs, ce = np.concatenate([[0.0], np.cumsum(s)]), np.concatenate([[0.0], np.cumsum(e)])
    ks, ke = np.searchsorted(s, t, side="right"), np.searchsorted(e, t, side="right")
    out: FloatArray = (ks * t - cs[ks]) - (ke * t - ce[ke])
    return out


def call_loads(start: FloatArray, ttft: FloatArray, e2e: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Per call of one arm: the mean number of the arm's other calls in flight over its decode window,
    and the number in flight at its start (both excluding itself)."""
    dur = np.where(np.isfinite(e2e) & (e2e > 0), e2e, 0.0)
    end = start + dur
    first = np.where(np.isfinite(ttft) & (ttft >= 0) & (ttft < dur), ttft, 0.0)
    a = start + first
    span = end - a
    area = _integral(start, end, end) - _integral(start, end, a)
    at_start = (np.searchsorted(np.sort(start), start, side="right") - 1) - np.searchsorted(
        np.sort(end), start, side="right"
    )
    mean: FloatArray = np.where(span > 0, area / np.where(span > 0, span, 1.0) - 1.0, at_start)
    return np.maximum(mean, 0.0), at_start.astype(np.float64)


def in_flight_at(start: FloatArray, e2e: FloatArray, t: FloatArray) -> FloatArray:
    """Per moment of ``t``: how many of the calls (``start``, ``e2e``) were in flight, started before
    it and not yet ended (NaN where ``t`` is NaN). A call's own moment at its start counts it out."""
    end = start + np.where(np.isfinite(e2e) & (e2e > 0), e2e, 0.0)
    known = np.isfinite(t)
    at = np.where(known, t, 0.0)
    started = np.searchsorted(np.sort(start), at, side="left")
    ended = np.searchsorted(np.sort(end), at, side="right")
    out: FloatArray = np.where(known, (started - ended).astype(np.float64), np.nan)
    return out


def broken_note(arm: str, calls: ArmCalls) -> str:
    """What was left out of the arm's gauges, for the figures' notes: all of them (scrapes that fail
    or never refresh), or those that read 0 under load; empty where nothing was."""
    have = np.isfinite(calls.engine)
    if have.any() and _dead(calls, calls.engine[have]):
        return (
            f"{arm}'s engine gauges read 0 running+waiting at the median of its calls while the proxy had "
            f"{_proxy_count(calls):.1f} others in flight on it (failed or stale /metrics scrapes): "
            "not read"
        )
    if not calls.broken:
        return ""
    return (
        f"{arm}'s engine gauges read 0 running+waiting on {calls.broken} of {len(calls.load)} calls "
        f"where the proxy had {BROKEN_GAUGE_INFLIGHT} or more others in flight on it (a failed or stale "
        "/metrics scrape): those readings left out"
    )


def few_engines_note(arm: str, calls: ArmCalls, engines: Mapping[str, int]) -> str:
    """A warning when the engine's gauges read far below the proxy's per-engine count at the moments
    they were read: the URL probably spreads the calls over more engines than the experiment file
    says. Compared at the reading, not over each call's decode: a gauge is up to two scrape intervals
    old, and calls shorter than that come and go between readings (a wave's start reads the last
    wave's end)."""
    paired = _paired(calls) if _gauges(calls) is not None else None
    if paired is None or paired.moment is None:
        return ""  # no gauges to read, or spans that do not say when they were read (before schema 16)
    # each reading once, however many calls carried it
    _, first = np.unique(np.round(paired.moment / READING_GRID_S), return_index=True)
    gauge, own = paired.gauge[first], paired.inflight[first]
    busy = own >= FEW_ENGINES_MIN
    if busy.sum() < FEW_ENGINES_READINGS or np.median(gauge[busy] / own[busy]) >= FEW_ENGINES_SHARE:
        return ""
    return (
        f"{arm}'s engine gauges read {float(np.median(gauge[busy])):.1f} running+waiting where the proxy "
        f"had {float(np.median(own[busy])):.1f} per engine in flight as they were read ({int(busy.sum())} "
        f"readings): more engines behind its URL? set replicas_behind_url (now {engines.get(arm, 1)})"
    )


# Every call the arm had makes the loads, read from the store's calls before any round or health
# window is left out (the engine had those calls all the same); ``kept``: the call is in ``requests``,
# the calls the level is judged on.
_CALLS_SQL = """
    SELECT {level} AS level, status = 'ok' AS ok, start_s, ttft_s, e2e_s, decode_tok_s,
           completion_tokens, round, engine_running + coalesce(engine_waiting, 0) AS engine,
           engine_load_age_s AS engine_age,
           CAST(inflight_at_start IS NOT NULL AS DOUBLE) AS counted,
           EXISTS (SELECT 1 FROM requests k
                   WHERE k.run_id = q.run_id AND k.arm = q.arm AND k.request_id = q.request_id
                     AND k.round IS NOT DISTINCT FROM q.round
                     AND k.t_start IS NOT DISTINCT FROM q.t_start) AS kept
    FROM (SELECT *, {start_s} AS start_s FROM ({every_call})
          WHERE run_id = ? AND arm = ? AND status <> 'dropped') q
    WHERE start_s IS NOT NULL
"""


def arm_calls(store: SpanStore, run_id: str, arm: str, engines: int = 1) -> dict[tuple[str, str], ArmCalls]:
    """Every call of ``arm`` in the run that was sent (any status but ``dropped``) makes its load; the
    ok ones are returned per level, with the load each saw (per engine, of ``engines`` sharing them)."""
    sql = _CALLS_SQL.format(level=LEVEL_SQL, start_s=start_s_sql(), every_call=store.views["requests"])
    # as columns: a live store's arm can have millions of calls, too many to convert row by row
    cols = store.conn.execute(sql, [run_id, arm]).fetchnumpy()
    if not len(cols["level"]):
        return {}
    levels = np.asarray(cols["level"], dtype=object)
    ok = _column(cols["ok"], False).astype(bool) & _column(cols["kept"], False).astype(bool)
    start, ttft, e2e, decode, tokens, round_, engine, counted = (
        _column(cols[name], np.nan)
        for name in (
            "start_s",
            "ttft_s",
            "e2e_s",
            "decode_tok_s",
            "completion_tokens",
            "round",
            "engine",
            "counted",
        )
    )
    load, at_start = call_loads(start, ttft, e2e)
    load = load / engines
    read_s = start - _column(cols["engine_age"], np.nan)
    at_read = in_flight_at(start, e2e, read_s) / engines
    # the proxy's count as the gauges were read, or as the call was sent where the span does not say
    reference = np.where(np.isfinite(at_read), at_read, at_start / engines)
    broken = (engine == 0) & (reference >= BROKEN_GAUGE_INFLIGHT)
    engine = np.where(broken, np.nan, engine)
    out = {}
    for level in sorted(set(levels[ok].tolist())):
        m = ok & (levels == level)
        # Spans the proxy did not count in flight were not timed by it (written by other tools): their
        # start and end times need not be the engine's, so they say nothing of its load.
        if counted[m].mean() < MIN_COVERAGE:
            continue
        out[(arm, str(level))] = ArmCalls(
            load[m],
            decode[m],
            tokens[m],
            e2e[m],
            start[m],
            round_[m],
            engine[m],
            int(broken[m].sum()),
            at_read[m],
            read_s[m],
        )
    return out


def _column(values: npt.ArrayLike, missing: float | bool) -> FloatArray:
    """A fetched column as floats, its NULLs (masked by DuckDB) as ``missing``."""
    column = np.ma.masked_array(values)
    out: FloatArray = np.ma.filled(column.astype(np.float64), float(missing))
    return out


def _gauges(calls: ArmCalls) -> FloatArray | None:
    """The engine's good gauge readings, where at least :data:`MIN_COVERAGE` of the calls were
    stamped with one and the broken ones (left out) are fewer than the good."""
    have = np.isfinite(calls.engine)
    good = int(have.sum())
    if not good or good + calls.broken < MIN_COVERAGE * len(calls.engine) or calls.broken > good:
        return None
    out: FloatArray = calls.engine[have]
    return None if _dead(calls, out) else out


def _dead(calls: ArmCalls, gauges: FloatArray) -> bool:
    """Gauges whose median is 0 while the proxy had a median of :data:`FEW_ENGINES_MIN` or more calls
    in flight as they were read (where the spans do not say when: over the calls' decode): scrapes
    that fail or never refresh, not an idle engine."""
    return float(np.median(gauges)) == 0 and _proxy_count(calls) >= FEW_ENGINES_MIN


def _proxy_count(calls: ArmCalls) -> float:
    """The proxy's median count of calls in flight as the gauges were read, or over the calls' decode
    where the spans do not say when they were read."""
    paired = _paired(calls)
    return float(np.median(paired.inflight if paired is not None else calls.load))


def outside_load(calls: ArmCalls) -> float:
    """The engine's load beyond the proxy's own calls (other clients), where enough calls carry gauges
    and the excess is not negligible: the median of each gauge less the proxy's count as it was read,
    or, where the spans do not say when (before schema 16), the gauges' median less the calls' median
    load."""
    gauges = _gauges(calls)
    if gauges is None:
        return 0.0
    own = float(np.median(calls.load))
    paired = _paired(calls)
    if paired is None:
        excess = float(np.median(gauges)) - own
    else:
        excess = float(np.median(paired.gauge - paired.inflight))
    return excess if excess >= max(OUTSIDE_MIN, OUTSIDE_SHARE * own) else 0.0


class _Readings(NamedTuple):
    """The calls' good gauge readings, the proxy's per-engine count at each one's moment, and that
    moment (None where the calls do not carry it)."""

    gauge: FloatArray
    inflight: FloatArray
    moment: FloatArray | None


def _paired(calls: ArmCalls) -> _Readings | None:
    """The good gauge readings with the proxy's count at their moments, where nearly every reading
    says when it was made (:data:`MIN_COVERAGE`); else None."""
    if calls.engine_at_read is None:
        return None
    have = np.isfinite(calls.engine)
    both = have & np.isfinite(calls.engine_at_read)
    if not both.any() or both.sum() < MIN_COVERAGE * have.sum():
        return None
    moment = calls.engine_read_s[both] if calls.engine_read_s is not None else None
    return _Readings(calls.engine[both], calls.engine_at_read[both], moment)


def engine_p50(calls: ArmCalls) -> float | None:
    gauges = _gauges(calls)
    return None if gauges is None else float(np.median(gauges))
