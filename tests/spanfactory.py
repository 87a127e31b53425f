"""Synthetic spans with known ground truth, for tests and benchmarks of the span store and analysis.

Two generators:
- :func:`make_run` builds :class:`SpanRecord` rows in Python (small runs; every value known), with the
  matching `runs` row and `backend_metrics` scrapes (two engines each);
- :func:`generate_sql` fills a DuckDB file inside DuckDB (``generate_series``), for millions of rows.

The population truth is simple on purpose: per arm and level, decode tok/s is lognormal with median
``BASE_DECODE_MEDIAN / (1 + level / 32) * speedup`` (paired runs multiply the baseline's own draw, so the
true ratio of medians is exactly ``speedup``), TTFT is lognormal, outputs are identical with
probability ``identical_p``. With ``rounds`` each level is replayed that many times (the same
request ids, ``round`` set); ``round_sigma`` gives each arm a slow or fast moment per round (its decode
speed and e2e scaled by one lognormal draw for the whole round): drift that requests within a round
share. :func:`make_live_load_run` builds shadow traffic whose arms ran at different loads, and
:func:`health_row` the measurement's health checks.
"""

from __future__ import annotations

import atexit
import json
import math
import random
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

from specproxy import schema
from specproxy.record import SpanRecord, SpecSource, Status, TokensSource

BASE_DECODE_MEDIAN = 80.0
DECODE_SIGMA = 0.35
PAIR_SIGMA = 0.15
T0 = datetime(2026, 11, 29, 9, 0, 0, tzinfo=UTC)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def epoch_ns(at: datetime) -> int:
    """``at`` as a span's t_start_ns: nanoseconds since the epoch, to the microsecond a datetime holds."""
    return (at - EPOCH) // timedelta(microseconds=1) * 1000


SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


@dataclass(frozen=True)
class ArmSpec:
    """One synthetic arm: its true speedup per level (default for levels not listed) and behaviour."""

    name: str
    role: str = "candidate"
    spec_method: str = "eagle3"
    speedup: float = 1.0
    speedup_by_level: dict[float, float] = field(default_factory=dict)
    identical_p: float = 1.0
    # acceptance per drafted token and tokens drafted per step, for the /metrics counters
    acceptance_rate: float = 0.6
    k: int = 3
    # where completion_tokens and the speculation figures came from (None: reported, or "none")
    tokens_source: TokensSource | None = "usage"
    spec_source: SpecSource | None = None
    # every call fails with this HTTP status (an upstream that rejects everything), else 1 % time out
    http_error: int | None = None

    def true_speedup(self, level: float | None) -> float:
        if level is not None and level in self.speedup_by_level:
            return self.speedup_by_level[level]
        return self.speedup


@dataclass
class SyntheticRun:
    run_id: str
    name: str
    spans: list[SpanRecord]
    metrics: list[tuple[Any, ...]]
    run_row: tuple[Any, ...]
    health: list[tuple[Any, ...]] = field(default_factory=list)


def health_row(
    run_id: str,
    level: int | None,
    check: str,
    value: float,
    *,
    threshold: float | None = None,
    arm: str | None = None,
    round_: int | None = None,
    offered_rate: float | None = None,
) -> tuple[Any, ...]:
    """One row of the `health` table (run_id, arm, concurrency_level, round, check_name, value,
    threshold, measured_at, offered_rate)."""
    return (run_id, arm, level, round_, check, value, threshold, T0, offered_rate)


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def make_run(
    arms: Sequence[ArmSpec],
    levels: Sequence[float | None] = (1, 8),
    n_per_level: int = 200,
    *,
    run_id: str = "run-1",
    name: str = "synthetic",
    paired: bool = True,
    seed: int = 1,
    categories: Sequence[str] = ("chat", "code"),
    margins: bool = True,
    capture_text: bool = False,
    restart_engine: str | None = None,
    split_cycle: Sequence[int] | None = None,
    shadow_sample: float = 1.0,
    rounds: int = 1,
    round_sigma: float = 0.0,
    health: Sequence[tuple[Any, ...]] = (),
    open_loop: bool = False,
) -> SyntheticRun:
    """A run: every request goes to every arm (paired) or to one arm (split): round robin, or the arm
    indices of ``split_cycle`` in turn (``[0, 0, 0, 1]``: the first arm gets 3 requests in 4).
    ``open_loop``: the levels are offered rates (req/s, ``replay --rates``), not concurrencies."""
    rng = random.Random(seed)
    spans: list[SpanRecord] = []
    metrics: list[tuple[Any, ...]] = []
    baseline = next(a for a in arms if a.role == "baseline")
    t_level = T0
    for level, round_no in [(lv, r) for lv in levels for r in range(1, rounds + 1)]:
        level_end = t_level
        counters: dict[str, dict[str, float]] = {}
        shock = {a.name: math.exp(rng.gauss(0.0, round_sigma)) for a in arms}
        for i in range(n_per_level):
            request_id = f"{run_id}-{level}-{i}"
            category = categories[i % len(categories)]
            tokens = rng.randint(16, 256)
            base_decode = _lognormal(rng, BASE_DECODE_MEDIAN / (1 + (level or 0) / 32), DECODE_SIGMA)
            cycle = split_cycle or range(len(arms))
            targets = list(arms) if paired else [arms[cycle[i % len(cycle)]]]
            if paired and shadow_sample < 1.0 and i % round(1 / shadow_sample):
                targets = [baseline]  # shadow mode with `sample`: most requests reach only the baseline
            start = t_level + timedelta(microseconds=rng.randint(0, 2_000_000))
            for arm in targets:
                if arm is baseline:
                    decode = base_decode * shock[arm.name]
                elif paired:
                    decode = (
                        base_decode
                        * arm.true_speedup(level)
                        * math.exp(rng.gauss(0.0, PAIR_SIGMA))
                        * shock[arm.name]
                    )
                else:
                    decode = (
                        _lognormal(
                            rng,
                            BASE_DECODE_MEDIAN / (1 + (level or 0) / 32) * arm.true_speedup(level),
                            DECODE_SIGMA,
                        )
                        * shock[arm.name]
                    )
                ttft = _lognormal(rng, 0.05 * (1 + (level or 0) / 8), 0.5)
                e2e = ttft + (tokens - 1) / decode
                status: Status = "ok" if rng.random() > 0.01 else "timeout"
                if arm.http_error is not None:
                    status = "http_error"
                same = rng.random() < arm.identical_p
                comparable = arm is not baseline and paired and status == "ok"
                drafts = (
                    math.ceil(tokens / (1 + arm.acceptance_rate * arm.k)) if arm.spec_method != "none" else 0
                )
                accepted = round(drafts * arm.k * arm.acceptance_rate)
                if arm.spec_method != "none" and status == "ok":
                    c = counters.setdefault(arm.name, dict.fromkeys(SPEC_COUNTERS, 0.0))
                    c[SPEC_COUNTERS[0]] += drafts
                    c[SPEC_COUNTERS[1]] += drafts * arm.k
                    c[SPEC_COUNTERS[2]] += accepted
                end = start + timedelta(seconds=e2e)
                level_end = max(level_end, end)
                spans.append(
                    SpanRecord(
                        run_id=run_id,
                        request_id=request_id,
                        arm=arm.name,
                        arm_role=arm.role,
                        backend_url=f"http://127.0.0.1:90{len(arm.name):02d}",
                        spec_method=arm.spec_method,
                        num_speculative_tokens=arm.k if arm.spec_method != "none" else None,
                        source="replay" if level is not None else "live",
                        routed_as=("primary" if arm is baseline else "shadow") if paired else "split",
                        category=category,
                        concurrency_level=None if open_loop or level is None else int(level),
                        offered_rate=float(level) if open_loop and level is not None else None,
                        endpoint="chat",
                        model="m",
                        stream=True,
                        temperature=0.0,
                        max_tokens=256,
                        prompt_tokens=100,
                        t_start=start,
                        t_start_ns=epoch_ns(start),
                        ttft_s=ttft if status == "ok" else None,
                        e2e_s=e2e,
                        decode_tok_s=decode if status == "ok" else None,
                        completion_tokens=tokens if status == "ok" else None,
                        finish_reason="stop" if status == "ok" else None,
                        output_sha256=f"out-{request_id}"
                        if (same or arm is baseline)
                        else f"diff-{arm.name}",
                        output_text=(
                            f"text of {request_id}" if same or arm is baseline else f"other {arm.name}"
                        )
                        if capture_text
                        else None,
                        num_drafts=drafts if arm.spec_method != "none" else None,
                        draft_tokens=drafts * arm.k if arm.spec_method != "none" else None,
                        accepted_tokens=accepted if arm.spec_method != "none" else None,
                        acceptance_length=(1 + accepted / drafts) if drafts else None,
                        spec_source=arm.spec_source
                        or ("vllm_request_metrics" if arm.spec_method != "none" else "none"),
                        tokens_source=arm.tokens_source if status == "ok" else None,
                        http_status=arm.http_error,
                        identical=(same if comparable else None),
                        first_divergence=None if (same or not comparable) else rng.randint(0, tokens - 1),
                        divergence_margin=(
                            None
                            if (same or not comparable or not margins)
                            else rng.choice([0.05, 0.2, 2.5, 4.0])
                        ),
                        status=status,
                        round=round_no if level is not None else None,
                    )
                )
        # before/after scrapes of the level, split over two engines; with restart_engine, that engine
        # restarted during the level: its counter went back to zero, so "after" is below "before".
        # one before/after window per level, or per round of it ('c=16 r2/3') when measured in rounds
        name_ = None if level is None else schema.rate_label(level) if open_loop else f"c={level}"
        window = None if name_ is None else name_ if rounds == 1 else f"{name_} r{round_no}/{rounds}"
        for arm_name, c in counters.items():
            for cname, total in c.items():
                share0 = math.floor(total * 0.6)
                for engine, part in (("0", share0), ("1", total - share0)):
                    labels = json.dumps({"engine": engine, "model_name": "m"}, sort_keys=True)
                    restarted = engine == restart_engine
                    before = 10.0**9 if restarted else 1000.0 + (level or 0)
                    after = part if restarted else before + part
                    phases = (
                        ("periodic", "periodic")
                        if window is None
                        else (f"{window}:before", f"{window}:after")
                    )
                    metrics.append((run_id, arm_name, t_level, phases[0], cname, labels, before))
                    metrics.append((run_id, arm_name, level_end, phases[1], cname, labels, after))
        t_level = level_end + timedelta(seconds=1)
    stacks = {
        a.name: {"version": "0.33.0", "spec_method": a.spec_method, "description": f"{a.name} arm"}
        for a in arms
    }
    run_row = (
        run_id,
        name,
        "replay-paired" if paired else "replay-split",
        "replay" if levels and levels[0] is not None else "live",
        T0,
        t_level,
        json.dumps({"experiment": {"name": name}}),
        json.dumps(stacks),
        "testhost",
        "0.1.0",
    )
    return SyntheticRun(run_id, name, spans, metrics, run_row, list(health))


def make_live_load_run(
    n_requests: int = 2000,
    *,
    sample: float = 0.2,
    speedup: float = 1.0,
    load_column: str = "inflight_at_start",
    run_id: str = "live-load",
    seed: int = 5,
    steady: bool = False,
) -> SyntheticRun:
    """Shadow traffic in front of two engines that differ only by ``speedup``; the candidate gets a
    copy of one request in ``1 / sample``, so it runs at about ``sample`` times the baseline's load.

    Timed like the proxy's spans: the baseline keeps a target number of calls in flight that wanders
    over 1-40 (a 40 s cycle: traffic comes and goes, so the two loads overlap at the low end), or with
    ``steady`` stays at 28-32 (they never overlap). Each call's decode speed depends on its engine's
    calls in flight at its start (median ``BASE_DECODE_MEDIAN / (1 + load / 32) * speedup``), recorded
    as ``inflight_at_start`` and, with ``load_column="engine_running"``, as the engine's gauges too.
    """
    rng = random.Random(seed)
    arms = (
        ArmSpec("baseline", "baseline", "none"),
        ArmSpec("candidate", spec_method="eagle3", speedup=speedup),
    )
    spans: list[SpanRecord] = []
    every = round(1 / sample)
    ends: dict[str, list[float]] = {"baseline": [], "candidate": []}
    t, i, step = 0.0, 0, 0.01
    while i < n_requests:
        for name in ends:
            ends[name] = [e for e in ends[name] if e > t]
        cycle = 0.5 - 0.5 * math.cos(2 * math.pi * t / 40.0)
        target = 30 + 2 * (2 * cycle - 1) if steady else 1 + 39 * cycle
        while len(ends["baseline"]) < target and i < n_requests:
            tokens = rng.randint(16, 256)
            for arm in arms if i % every == 0 else arms[:1]:
                load = len(ends[arm.name])
                decode = _lognormal(rng, BASE_DECODE_MEDIAN / (1 + load / 32) * arm.speedup, DECODE_SIGMA)
                ttft = _lognormal(rng, 0.05 * (1 + load / 8), 0.5)
                e2e = ttft + (tokens - 1) / decode
                ends[arm.name].append(t + e2e)
                spans.append(_live_span(run_id, i, arm, t, ttft, e2e, decode, tokens, load, load_column))
            i += 1
        t += step
    run_row = (run_id, "live load", "shadow", "live", T0, T0, "{}", "{}", "testhost", "0.1.0")
    return SyntheticRun(run_id, "live load", spans, [], run_row)


def make_wave_run(
    n_waves: int = 150,
    *,
    per_wave: int = 16,
    sample: float = 0.2,
    engines: int = 1,
    read_at: tuple[float, float] = (0.28, 0.32),
    seed: int = 5,
) -> SyntheticRun:
    """Shadow traffic of short calls in waves: ``per_wave`` calls start within 50 ms of each second
    and last 0.15-0.4 s. The engine's gauges are scraped once a second, ``read_at`` seconds after a
    wave starts (by default in its tail), and stamped with their age on the calls that start before
    the next scrape, as ``serve`` stamps them: every wave carries a reading of the last one.
    ``engines``: how many engines the baseline's URL spreads its calls over (its gauges read one)."""
    rng = random.Random(seed)
    arms = (ArmSpec("baseline", "baseline", "none"), ArmSpec("candidate", spec_method="eagle3"))
    every = round(1 / sample)
    spans: list[SpanRecord] = []
    i = 0
    for k in range(n_waves):
        for _ in range(per_wave):
            t = k + rng.uniform(0.0, 0.05)
            for arm in arms if i % every == 0 else arms[:1]:
                decode = _lognormal(rng, BASE_DECODE_MEDIAN, DECODE_SIGMA / 2)
                tokens = max(4, round(rng.uniform(0.12, 0.36) * decode))
                ttft = _lognormal(rng, 0.02, 0.3)
                e2e = ttft + (tokens - 1) / decode
                spans.append(
                    _live_span("waves", i, arm, t, ttft, e2e, decode, tokens, 0, "inflight_at_start")
                )
            i += 1
    spans.sort(key=lambda s: since_t0(s)[0])
    for arm in arms:
        own = [s for s in spans if s.arm == arm.name]
        times = [since_t0(s) for s in own]
        scrapes = [k + rng.uniform(*read_at) for k in range(n_waves)]
        for span, (start, _) in zip(own, times, strict=True):
            span.inflight_at_start = sum(1 for a, b in times if a < start < b)
            read = max((r for r in scrapes if r < start), default=None)
            if read is not None:
                count = sum(1 for a, b in times if a < read < b)
                share = count / engines if arm.role == "baseline" else count
                span.engine_running, span.engine_waiting = float(round(share)), 0.0
                span.engine_load_age_s = start - read
    run_row = ("waves", "waves", "shadow", "live", T0, T0, "{}", "{}", "testhost", "0.1.0")
    return SyntheticRun("waves", "waves", spans, [], run_row)


def _live_span(
    run_id: str,
    i: int,
    arm: ArmSpec,
    t: float,
    ttft: float,
    e2e: float,
    decode: float,
    tokens: int,
    load: int,
    load_column: str,
) -> SpanRecord:
    start = T0 + timedelta(seconds=t)
    record = SpanRecord(
        run_id=run_id,
        request_id=f"{run_id}-{i}",
        arm=arm.name,
        arm_role=arm.role,
        backend_url="http://127.0.0.1:9001",
        spec_method=arm.spec_method,
        source="live",
        routed_as="primary" if arm.role == "baseline" else "shadow",
        category="chat",
        endpoint="chat",
        model="m",
        stream=True,
        temperature=0.0,
        t_start=start,
        t_start_ns=epoch_ns(start),
        ttft_s=ttft,
        e2e_s=e2e,
        decode_tok_s=decode,
        completion_tokens=tokens,
        finish_reason="stop",
        output_sha256=f"out-{i}",
        identical=True if arm.role != "baseline" else None,
        status="ok",
        inflight_at_start=load,
    )
    if load_column == "engine_running":
        # read the moment the call started: the proxy's count then is ``load``
        record.engine_running, record.engine_waiting, record.engine_load_age_s = float(load), 0.0, 0.0
    return record


def add_latency(run: SyntheticRun, *, seed: int = 3, queue_arms: Sequence[str] = ()) -> SyntheticRun:
    """Fill each ok streamed span's latency columns as the proxy would, from its own figures.

    A speculative arm's chunks hold 1 token (the first) then 1 to k + 1 tokens each, counts known
    (``chunk_tokens``); a plain arm's chunks one token each, counts not reported. The decode time
    (e2e - ttft) is shared among the gaps in proportion to each chunk's tokens, with lognormal jitter,
    and one call in 50 has a stall of 0.5 s in the middle. ``queue_arms`` report ``queue_s``.
    """
    from specproxy.proxy.upstream.latency import chunk_latency, tpot_s

    rng = random.Random(seed)
    for s in run.spans:
        if s.status != "ok" or s.completion_tokens is None or s.ttft_s is None or s.e2e_s is None:
            continue
        k = s.num_speculative_tokens or 0
        sizes = [1]
        while sum(sizes) < s.completion_tokens:
            sizes.append(min(rng.randint(1, k + 1), s.completion_tokens - sum(sizes)))
        decode = s.e2e_s - s.ttft_s
        weights = [n * math.exp(rng.gauss(0.0, 0.3)) for n in sizes[1:]]
        gaps = [decode * w / sum(weights) for w in weights]
        if gaps and rng.random() < 0.02:
            gaps[len(gaps) // 2] += 0.5
        times = [0.0]
        for g in gaps:
            times.append(times[-1] + g)
        lat = chunk_latency(times, sizes, tokens_exact=k > 0)
        s.chunks = len(sizes)
        s.chunk_gaps_us, s.chunk_tokens = lat.gaps_us, lat.tokens
        s.itl_p50_s, s.itl_p95_s, s.itl_p99_s, s.itl_max_s = lat.p50_s, lat.p95_s, lat.p99_s, lat.max_s
        s.tpot_s = tpot_s(s.e2e_s, s.ttft_s, s.completion_tokens)
        if s.arm in queue_arms:
            s.queue_s = round(rng.uniform(0.0, 0.02), 6)
    return run


_empty_store: Path | None = None


def new_store(path: Path) -> None:
    """An empty span store at ``path`` (a file that does not exist yet), at the current schema version.
    Migrating a new file (every version's DDL) costs ~0.2 s; a copy of one migrated once per process is
    the same file in under a millisecond, and the suite writes hundreds of stores."""
    global _empty_store
    if _empty_store is None:
        folder = Path(tempfile.mkdtemp(prefix="specproxy-empty-store-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        store = folder / "empty.duckdb"
        with duckdb.connect(str(store)) as conn:
            schema.migrate(conn)
        _empty_store = store
    shutil.copyfile(_empty_store, path)


def write_db(path: str | Path, runs: Iterable[SyntheticRun]) -> Path:
    """Write synthetic runs into a (new or existing) span store file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        new_store(path)
    with duckdb.connect(str(path)) as conn:
        schema.migrate(conn)  # an existing file may be older
        for run in runs:
            _insert(conn, "requests", [s.as_row() for s in run.spans])
            _insert(conn, "backend_metrics", run.metrics)
            _insert(conn, "runs", [run.run_row])
            _insert(conn, "health", run.health)
    return path


def _insert(conn: duckdb.DuckDBPyConnection, table: str, rows: Sequence[tuple[Any, ...]]) -> None:
    """Rows into a table through one NDJSON file (executemany is ~5 ms a row)."""
    if not rows:
        return
    types = {name: kind for name, kind, *_ in conn.execute(f"DESCRIBE {table}").fetchall()}
    names = list(types)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / f"{table}.ndjson"
        with file.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(dict(zip(names, row, strict=True)), default=_iso) + "\n")
        columns = "{" + ", ".join(f"'{n}': '{t}'" for n, t in types.items()) + "}"
        conn.execute(f"INSERT INTO {table} SELECT * FROM read_json('{file}', columns = {columns})")


def _iso(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot serialise {value!r}")


def generate_sql(
    path: str | Path,
    n_rows: int,
    *,
    levels: Sequence[int] = (1, 4, 16, 64),
    arms: Sequence[tuple[str, str, float]] = (
        ("baseline", "baseline", 1.0),
        ("eagle3", "candidate", 1.6),
        ("ngram", "candidate", 1.2),
        ("replica", "replica", 1.0),
    ),
    run_id: str = "bench",
) -> Path:
    """About ``n_rows`` spans of one paired replay run, generated inside DuckDB.

    Each request goes to every arm; arm a's decode tok/s is the baseline's times its speedup and a
    lognormal noise. Deterministic (hash-based pseudo-random numbers).
    """
    path = Path(path)
    n_requests = n_rows // (len(arms) * len(levels))
    if not path.exists():
        new_store(path)
    with duckdb.connect(str(path)) as conn:
        schema.migrate(conn)
        conn.execute("CREATE TEMP TABLE arm_spec(arm_idx INTEGER, arm VARCHAR, role VARCHAR, speedup DOUBLE)")
        conn.executemany(
            "INSERT INTO arm_spec VALUES (?, ?, ?, ?)", [(i, a, r, s) for i, (a, r, s) in enumerate(arms)]
        )
        conn.execute("CREATE TEMP TABLE level_spec(level_idx INTEGER, level INTEGER)")
        conn.executemany("INSERT INTO level_spec VALUES (?, ?)", list(enumerate(levels)))
        # u(k, salt): a uniform (0,1) number from a hash; z: a standard normal by Box-Muller
        conn.execute(f"""
        INSERT INTO requests BY NAME
        WITH req AS (
            SELECT l.level, l.level_idx, g.i,
                   (hash(g.i, l.level, 1) % 1000000 + 0.5) / 1000000 AS u1,
                   (hash(g.i, l.level, 2) % 1000000 + 0.5) / 1000000 AS u2,
                   (hash(g.i, l.level, 3) % 1000000 + 0.5) / 1000000 AS u3,
                   16 + hash(g.i, l.level, 4) % 240 AS tokens
            FROM level_spec l, generate_series(0, {n_requests - 1}) AS g(i)
        ), calls AS (
            SELECT r.*, a.*,
                   sqrt(-2 * ln(r.u1)) * cos(2 * pi() * r.u2) AS z_base,
                   sqrt(-2 * ln((hash(r.i, r.level, a.arm_idx, 5) % 1000000 + 0.5) / 1000000))
                       * cos(2 * pi() * r.u3) AS z_arm
            FROM req r, arm_spec a
        )
        SELECT '{run_id}' AS run_id,
               'q' || level || '-' || i AS request_id,
               arm, role AS arm_role, 'http://127.0.0.1:9000' AS backend_url,
               CASE WHEN arm = 'baseline' OR arm = 'replica' THEN 'none' ELSE arm END AS spec_method,
               'replay' AS source, 'replay' AS routed_as,
               CASE WHEN i % 3 = 0 THEN 'code' ELSE 'chat' END AS category,
               level AS concurrency_level, 'chat' AS endpoint, true AS stream, 0.0 AS temperature,
               TIMESTAMPTZ '2026-11-29 09:00:00+00'
                   + to_microseconds(CAST(level_idx * 3600e6 + i * 1000 AS BIGINT))
                   AS t_start,
               0.05 * exp(0.5 * z_arm) AS ttft_s,
               {BASE_DECODE_MEDIAN} / (1 + level / 32) * speedup * exp({DECODE_SIGMA} * z_base
                   + CASE WHEN arm = 'baseline' THEN 0 ELSE {PAIR_SIGMA} * z_arm END) AS decode_tok_s,
               tokens AS completion_tokens,
               0.05 + tokens / 80.0 AS e2e_s,
               'out-' || i AS output_sha256,
               CASE WHEN arm = 'baseline' THEN NULL
                    ELSE hash(i, level, arm_idx, 6) % 1000 <> 0 END AS identical,
               CASE WHEN arm IN ('eagle3', 'ngram') THEN 1 + 2 * u3 END AS acceptance_length,
               'ok' AS status
        FROM calls
        """)
    return path


def since_t0(span: SpanRecord) -> tuple[float, float]:
    """A span's start and end, in seconds after T0."""
    assert span.t_start is not None
    start = (span.t_start - T0).total_seconds()
    return start, start + (span.e2e_s or 0.0)


def live_health_rows(run: SyntheticRun, failing: set[int], every_s: float = 10.0) -> list[tuple[Any, ...]]:
    """serve's health rows for ``run``: a write every ``every_s`` while calls ran, the proxy's loop lag
    share 0.4 % of decode (5 % in the windows numbered in ``failing``, from 0)."""
    n = math.ceil(max(since_t0(s)[1] for s in run.spans) / every_s)
    return [
        (
            run.run_id,
            None,
            None,
            None,
            "event_loop_lag_share",
            0.05 if k in failing else 0.004,
            0.02,
            T0 + timedelta(seconds=every_s * (k + 1)),
            None,
        )
        for k in range(n)
    ]
