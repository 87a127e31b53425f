"""Scraping each arm's engine ``/metrics`` into ``backend_metrics``, and the counter arithmetic on scrapes.

::

    scraper = MetricsScraper(experiment.arms, sink, session, run_id=run_id, interval_s=5.0)
    task = asyncio.create_task(scraper.run())          # serve: every interval_s, phase 'periodic'
    before = await scraper.scrape_once("c=16:before")  # replay: around each concurrency level
    ...
    after = await scraper.scrape_once("c=16:after")
    spec_decode_summary(before["eagle3"], after["eagle3"])
    # {'num_drafts': 812.0, 'draft_tokens': 2436.0, 'accepted_tokens': 1702.0, 'acceptance_rate': 0.698...,
    #  'mean_acceptance_length': 3.096..., 'per_position_rates': [0.87, 0.70, 0.52]}

A scrape parses the Prometheus text with ``prometheus_client``'s parser and keeps the samples of the
engines it knows (``vllm:*``, ``llamacpp:*``, ``sglang:*``; ``_created`` series are dropped: they are
timestamps, not values). Which engine an arm runs is read from the names it exports, and each engine's
names for its load gauges and speculation counters come from
:data:`~specproxy.proxy.upstream.engines.METRIC_NAMES` (:func:`engine_load`,
:func:`spec_decode_summary`). Each kept sample becomes one ``backend_metrics`` row (arm, scraped_at,
phase, name, labels as sorted JSON with ``engine`` kept, value) sent to the
:class:`~specproxy.proxy.spans.sink.SpanSink`, which never blocks.

Backends without ``/metrics`` (llama.cpp-style servers, vLLM with ``--disable-log-stats``), refused
connections, timeouts and text that does not parse are tolerated: the arm's :class:`Snapshot` has
``ok=False`` and ``error`` set, the problem is logged once per arm (and once when it recovers), and
nothing is raised.

Counter arithmetic (:func:`counter_delta`, :func:`counter_deltas`, :func:`spec_decode_summary`) sums
over vLLM's ``engine`` label (one series per data-parallel engine) and treats a counter that went down
as a restarted engine: its delta is its new value (it counted from zero since the restart).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from specproxy.config import Arm
from specproxy.proxy.spans.sink import BackendMetricRow, SpanSink
from specproxy.proxy.upstream.engines import METRIC_NAMES, MetricNames, engine_of_metrics

log = logging.getLogger(__name__)

# A series' labels as a sorted tuple of (name, value) pairs; hashable and order-independent.
Labels = tuple[tuple[str, str], ...]

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
ENGINE_LABEL = "engine"
# Metric name prefixes kept from a scrape: the engines whose names METRIC_NAMES knows.
KEPT_PREFIXES = ("vllm:", "llamacpp:", "sglang:")


class EngineLoad(NamedTuple):
    """An arm's running and waiting requests at its latest scrape (:func:`engine_load`; None where the
    arm exports no such gauge), and when they were read (``time.monotonic()``, one clock for every
    process of the machine; None: not known)."""

    running: float | None
    waiting: float | None
    read_at: float | None = None


@dataclass(frozen=True)
class Snapshot:
    """One scrape of one arm: every sample of a known engine, by name and then by labels (``engine``
    included)."""

    arm: str
    scraped_at: datetime
    series: Mapping[str, Mapping[Labels, float]] = field(default_factory=lambda: MappingProxyType({}))
    error: str | None = None
    # time.monotonic() when the text arrived: its gauges describe that moment (parsing comes later)
    read_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def engine(self) -> str | None:
        """The engine whose names this scrape holds (vllm, llamacpp, sglang), None if none."""
        return engine_of_metrics(frozenset(self.series))

    def value(self, name: str, **labels: str) -> float | None:
        """Sum of the series of ``name`` whose labels include ``labels`` (so over engines); None if absent."""
        found = [v for lab, v in self.series.get(name, {}).items() if _matches(lab, labels)]
        return sum(found) if found else None


def _matches(labels: Labels, wanted: Mapping[str, str]) -> bool:
    if not wanted:
        return True
    have = dict(labels)
    return all(have.get(k) == v for k, v in wanted.items())


def _without_engine(labels: Labels) -> Labels:
    return tuple(kv for kv in labels if kv[0] != ENGINE_LABEL)


def parse_metrics(arm: str, text: str, scraped_at: datetime | None = None) -> Snapshot:
    """Parse Prometheus exposition text into a :class:`Snapshot` of its known engines' samples.

    Raises ValueError for text that is not Prometheus exposition format.
    """
    series: dict[str, dict[Labels, float]] = {}
    exported: dict[str, str] = {}  # sample name as parsed -> as the engine exports it
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if not name.startswith(KEPT_PREFIXES) or name.endswith("_created"):
                continue
            if family.type == "counter":
                # The parser names a counter's sample `<name>_total` even when the engine did not
                # (llama-server's `llamacpp:n_tokens_max`): the row keeps the name the engine exports.
                if name not in exported:
                    exported[name] = name if _exported(text, name) else name.removesuffix("_total")
                name = exported[name]
            series.setdefault(name, {})[tuple(sorted(sample.labels.items()))] = float(sample.value)
    return Snapshot(
        arm=arm,
        scraped_at=scraped_at or datetime.now(UTC),
        series=MappingProxyType({k: MappingProxyType(v) for k, v in series.items()}),
    )


def _exported(text: str, sample_name: str) -> bool:
    """Whether the exposition text has a sample line under exactly this name."""
    return f"\n{sample_name} " in text or f"\n{sample_name}{{" in text or text.startswith(sample_name)


# Every engine's load gauge names, for the line scan of engine_load_from_text.
_LOAD_GAUGES = frozenset(n for names in METRIC_NAMES.values() for n in (names.running, names.waiting) if n)


def engine_load_from_text(text: str) -> EngineLoad:
    """The running/waiting gauges (summed over engines) from exposition text by a scan of its lines,
    under the names of whichever engine exported them (:data:`METRIC_NAMES`), as :func:`engine_load`
    reads them from a parsed scrape.

    >>> engine_load_from_text('vllm:num_requests_running{engine="0"} 3.0\\nvllm:num_requests_waiting 1\\n')
    EngineLoad(running=3.0, waiting=1.0, read_at=None)
    """
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        name_end = brace if 0 <= brace < space or space < 0 else space
        name = line[:name_end]
        if name not in _LOAD_GAUGES:
            continue
        rest = line[line.rfind("}") + 1 :] if name_end == brace else line[name_end:]
        found[name] = found.get(name, 0.0) + float(rest.split()[0])
    for names in METRIC_NAMES.values():
        if (names.running and names.running in found) or (names.waiting and names.waiting in found):
            return EngineLoad(
                found.get(names.running) if names.running else None,
                found.get(names.waiting) if names.waiting else None,
            )
    return EngineLoad(None, None)


def counter_deltas(before: Snapshot, after: Snapshot, name: str) -> dict[Labels, float] | None:
    """Increase of counter ``name`` between two scrapes, per label set with ``engine`` summed away.

    A series whose value went down belongs to a restarted engine and contributes its new value; a series
    new in ``after`` contributes its value (it started from zero). None when either scrape failed or
    ``after`` lacks the counter (e.g. an arm without speculative decoding).
    """
    if not (before.ok and after.ok) or name not in after.series:
        return None
    previous = before.series.get(name, {})
    totals: dict[Labels, float] = {}
    for labels, now in after.series[name].items():
        then = previous.get(labels)
        delta = now if then is None or now < then else now - then
        key = _without_engine(labels)
        totals[key] = totals.get(key, 0.0) + delta
    return totals


def counter_delta(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float | None:
    """Increase of counter ``name`` summed over ``engine`` (and over other labels unless given).

    Example: ``counter_delta(before, after, "vllm:spec_decode_num_drafts_total")`` → ``812.0``;
    ``counter_delta(before, after, SPEC_ACCEPTED_PER_POS, position="0")`` → ``706.0``.
    """
    deltas = counter_deltas(before, after, name)
    if deltas is None:
        return None
    return sum(v for lab, v in deltas.items() if _matches(lab, labels))


def _names(snapshot: Snapshot) -> MetricNames:
    return METRIC_NAMES.get(snapshot.engine or "vllm", METRIC_NAMES["vllm"])


def _delta(before: Snapshot, after: Snapshot, name: str | None) -> float | None:
    return counter_delta(before, after, name) if name else None


def engine_load(snapshot: Snapshot) -> tuple[float | None, float | None]:
    """The arm's running and waiting requests in this scrape, under its engine's gauge names."""
    names = _names(snapshot)
    running = snapshot.value(names.running) if names.running else None
    waiting = snapshot.value(names.waiting) if names.waiting else None
    return running, waiting


def spec_decode_summary(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """The speculative-decoding figures between two scrapes, as ``vllm bench serve`` computes them,
    under the names of the arm's engine (vLLM's, or llama.cpp's ``llamacpp:spec_decode_*``).

    ``acceptance_rate`` = Δaccepted / Δdraft_tokens; ``mean_acceptance_length`` = 1 + Δaccepted / Δdrafts;
    ``per_position_rates[i]`` = Δaccepted_per_pos{position=i} / Δdrafts. Counts are None when the arm
    exports no speculative counters (or a scrape failed); ratios are None when their denominator is 0.
    """
    names = _names(after)
    drafts = _delta(before, after, names.drafts)
    draft_tokens = _delta(before, after, names.draft_tokens)
    accepted = _delta(before, after, names.accepted)
    per_pos = (
        counter_deltas(before, after, names.accepted_per_pos) if names.accepted_per_pos else None
    ) or {}
    by_position: dict[int, float] = {}
    for labels, value in per_pos.items():
        position = dict(labels).get("position")
        if position is not None and position.isdigit():
            by_position[int(position)] = by_position.get(int(position), 0.0) + value
    per_position_rates: list[float] = []
    if drafts and by_position:
        per_position_rates = [by_position.get(i, 0.0) / drafts for i in range(max(by_position) + 1)]
    return {
        "num_drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if accepted is not None and draft_tokens else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if accepted is not None and drafts else None,
        "per_position_rates": per_position_rates,
    }


def snapshot_rows(snapshot: Snapshot, *, run_id: str | None, phase: str) -> list[BackendMetricRow]:
    """One ``backend_metrics`` row per sample of a successful scrape."""
    return [
        BackendMetricRow(
            run_id=run_id,
            arm=snapshot.arm,
            scraped_at=snapshot.scraped_at,
            phase=phase,
            name=name,
            labels_json=json.dumps(dict(labels), sort_keys=True, separators=(",", ":")),
            value=value,
        )
        for name, by_labels in snapshot.series.items()
        for labels, value in by_labels.items()
    ]


class MetricsScraper:
    """Scrapes every arm's ``/metrics``, keeps the snapshots, and writes them as ``backend_metrics`` rows.

    ``engine_load`` (arm name → :class:`EngineLoad`) holds each arm's running/waiting gauges from its
    latest good scrape, for callers to stamp on the span of a call as it starts (a dict lookup); pass
    ``engine_load=`` to have a dict of the caller's own kept up to date. ``load_read_at`` (arm name →
    ``time.monotonic()``) says when each was read; :meth:`fresh_load` gives only a recent one.
    """

    def __init__(
        self,
        arms: Sequence[Arm],
        sink: SpanSink | None,
        session: aiohttp.ClientSession,
        *,
        run_id: str,
        interval_s: float = 5.0,
        timeout_s: float = 5.0,
        engine_load: dict[str, EngineLoad] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.arms = tuple(arms)
        self.sink = sink
        self.session = session
        self.run_id = run_id
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=min(timeout_s, interval_s * 2))
        self.latest: dict[str, Snapshot] = {}
        self.engine_load: dict[str, EngineLoad] = engine_load if engine_load is not None else {}
        self.load_read_at: dict[str, float] = {}
        self.scrapes = 0
        self._failing: set[str] = set()

    async def scrape_once(self, phase: str = "periodic") -> dict[str, Snapshot]:
        """Scrape all arms at once: a snapshot per arm (``ok`` False where it failed). Never raises."""
        snapshots = await asyncio.gather(*(self._scrape_arm(arm) for arm in self.arms))
        result = {s.arm: s for s in snapshots}
        rows: list[BackendMetricRow] = []
        for snapshot in snapshots:
            if snapshot.ok:
                self.latest[snapshot.arm] = snapshot
                read_at = self.load_read_at[snapshot.arm] = snapshot.read_at or time.monotonic()
                self.engine_load[snapshot.arm] = EngineLoad(*engine_load(snapshot), read_at)
                rows.extend(snapshot_rows(snapshot, run_id=self.run_id, phase=phase))
        if rows and self.sink is not None and not self.sink.emit_backend_metrics(rows):
            log.warning("backend metrics of phase %s dropped: the span queue is full", phase)
        self.scrapes += 1
        return result

    async def run(self) -> None:
        """Scrape every ``interval_s`` (phase ``periodic``) until cancelled."""
        await self._every_interval(lambda: self.scrape_once("periodic"))

    async def run_gauges(self) -> None:
        """Read the arms' two load gauges every ``interval_s`` (:meth:`scrape_engine_load`) until
        cancelled: for a process whose calls need the gauges while another scrapes into the store."""
        await self._every_interval(self.scrape_engine_load)

    async def _every_interval(self, step: Callable[[], Awaitable[object]]) -> None:
        while True:
            started = time.monotonic()
            await step()
            # A slow scrape shortens the wait instead of shifting every later scrape.
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def scrape_engine_load(self) -> None:
        """Update :attr:`engine_load` only: each arm's two gauges read straight from its /metrics text
        (a line scan, not a parse; nothing is written). Cheap enough to run every second during a
        measurement, where a full parse of vLLM's histograms would hold the event loop for tens of ms."""

        async def one(arm: Arm) -> None:
            try:
                async with self.session.get(
                    arm.url.rstrip("/") + "/metrics", headers=self._headers(arm), timeout=self.timeout
                ) as resp:
                    if resp.status == 200:
                        text = await resp.text(errors="replace")
                        read_at = self.load_read_at[arm.name] = time.monotonic()
                        self.engine_load[arm.name] = engine_load_from_text(text)._replace(read_at=read_at)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass  # the full scrapes around it log what is wrong with an arm

        await asyncio.gather(*(one(arm) for arm in self.arms))

    def fresh_load(self, arm: str, max_age_s: float | None = None) -> EngineLoad | None:
        """The arm's gauges if they were read at most ``max_age_s`` ago (default two scrape intervals:
        one late scrape is tolerated), else None. A gauge carries no time of its own: stamped on a call
        long after it was read (a gauge loop that stalled, a scrape that keeps failing), it would say
        the engine was idle while the call's traffic ran."""
        read_at = self.load_read_at.get(arm)
        limit = 2 * self.interval_s if max_age_s is None else max_age_s
        if read_at is None or time.monotonic() - read_at > limit:
            return None
        return self.engine_load.get(arm)

    def _headers(self, arm: Arm) -> dict[str, str]:
        if arm.api_key_env and os.environ.get(arm.api_key_env):
            return {"Authorization": f"Bearer {os.environ[arm.api_key_env]}"}
        return {}

    async def _scrape_arm(self, arm: Arm) -> Snapshot:
        url = arm.url.rstrip("/") + "/metrics"
        scraped_at = datetime.now(UTC)
        try:
            async with self.session.get(url, headers=self._headers(arm), timeout=self.timeout) as resp:
                if resp.status != 200:
                    return self._failed(arm, scraped_at, f"GET {url} answered HTTP {resp.status}")
                text = await resp.text(errors="replace")
                read_at = time.monotonic()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return self._failed(arm, scraped_at, f"GET {url} failed: {exc.__class__.__name__} {exc}".strip())
        try:
            # Off the event loop: parsing vLLM's text (histograms with many buckets) takes 15-60 ms, which
            # would delay every stream the process relays; in a thread the loop still runs between
            # the parser's GIL slices.
            snapshot = await asyncio.to_thread(parse_metrics, arm.name, text, scraped_at)
        except Exception as exc:  # the parser raises ValueError on most garbage, but not only that
            return self._failed(arm, scraped_at, f"{url} is not Prometheus text: {exc!r}")
        if arm.name in self._failing:
            self._failing.discard(arm.name)
            log.info("arm %s: %s answers again", arm.name, url)
        return replace(snapshot, read_at=read_at)

    def _failed(self, arm: Arm, scraped_at: datetime, error: str) -> Snapshot:
        if arm.name not in self._failing:
            self._failing.add(arm.name)
            log.warning("arm %s: no backend metrics (%s); acceptance comes from spans only", arm.name, error)
        return Snapshot(arm=arm.name, scraped_at=scraped_at, error=error)
