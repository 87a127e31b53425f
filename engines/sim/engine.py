"""The simulated vLLM engine: a continuous-batching scheduler whose step times come from a cost profile.

`EngineCore` is clock-agnostic and synchronous: `plan_step()` picks the batch for the next step
(running requests first, then waiting ones, within max_num_seqs and the max_num_batched_tokens budget,
prefill in chunks) and prices it with the profile; `finish_step(plan, now)` applies its outcome:
verification of each request's drafts, the accepted tokens plus one bonus token emitted, stop
conditions, new drafts. `SimEngine` drives the core in real time on asyncio (`--time-scale` divides
the step times); the fidelity bench drives the same core on a virtual clock.

Per step, work is O(requests in the step) with small constants: tokens are generated lazily, n-gram
lookups are dict hits, and listeners are plain callbacks.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specproxy.engines.profiles import CostProfile
from specproxy.engines.sim.config import SimConfig, SpeculativeConfig
from specproxy.engines.sim.metrics import EngineMetrics
from specproxy.engines.sim.prefix_cache import PrefixCache
from specproxy.engines.sim.proposers import (
    NgramIndex,
    SuffixCache,
    SuffixProposer,
    acceptance_rates,
    draw_accepted,
)
from specproxy.engines.sim.text import EOS_ID, Prompt, TargetText

LOOKUP_METHODS = ("ngram", "suffix")

# The write delay histogram's upper bounds: 20 µs to ~1.3 s in steps of 10 %, so a P99 read from it
# is at most 10 % above the true one (a bucket's upper bound is what it reports).
WRITE_DELAY_BOUNDS_S = tuple(20e-6 * 1.1**i for i in range(117))


@dataclass
class RequestSpec:
    """What the HTTP layer asks the engine to generate."""

    request_id: str
    prompt: Prompt
    category: str
    key: int
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    lossy: bool = False


@dataclass
class SeqTruth:
    """Ground truth for one request: what the engine really did (exposed on /sim/requests)."""

    request_id: str
    category: str
    method: str | None
    num_speculative_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    completion_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    acceptance_histogram: list[int] = field(default_factory=list)
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    lossy: bool = False
    divergence_position: int | None = None
    arrival: float = 0.0
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    # The step timeline: when each step that gave this request tokens landed (a fine clock: the
    # server's monotonic clock, or the virtual one), and how many tokens it gave; what a client's
    # chunks would show with no network at all.
    emit_times: list[float] = field(default_factory=list)
    emit_tokens: list[int] = field(default_factory=list)
    # When each streamed chunk that carried new tokens was handed to the socket (same clock): the
    # step's landing plus the server's own delivery (waking the stream's handler, formatting, the
    # handlers of the other streams that landed in the same step before it).
    sent_times: list[float] = field(default_factory=list)

    def timeline(self) -> dict[str, Any]:
        """The step timeline (``/sim/requests?timeline=1``): ``emit_s``, each step's landing in seconds
        since the first token's, ``emit_tokens``, the tokens it gave, and ``sent_s``, when each
        streamed chunk with new tokens was written (same origin; empty for a non-streamed request)."""
        first = self.emit_times[0] if self.emit_times else 0.0
        return {
            "emit_s": [t - first for t in self.emit_times],
            "emit_tokens": list(self.emit_tokens),
            "sent_s": [t - first for t in self.sent_times],
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "category": self.category,
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "preemptions": self.preemptions,
            "completion_tokens": self.completion_tokens,
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "num_drafts": self.num_drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_pos": self.accepted_per_pos,
            "acceptance_length": (1 + self.accepted_tokens / self.num_drafts) if self.num_drafts else None,
            "acceptance_histogram": self.acceptance_histogram,
            "finish_reason": self.finish_reason,
            "lossy": self.lossy,
            "divergence_position": self.divergence_position,
            "queue_s": (self.scheduled - self.arrival) if self.scheduled is not None else None,
            "ttft_s": (self.first_token - self.arrival) if self.first_token is not None else None,
            "e2e_s": (self.finished - self.arrival) if self.finished is not None else None,
        }

    def spec_decoding_metrics(self, detailed: bool) -> dict[str, Any]:
        """vLLM's `metrics.speculative_decoding` payload (RequestSpecDecodeMetrics.to_dict)."""
        steps = sum(self.acceptance_histogram)
        accepted = sum(j * c for j, c in enumerate(self.acceptance_histogram))
        out: dict[str, Any] = {
            "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "acceptance_histogram": list(self.acceptance_histogram),
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": self.draft_tokens,
            "num_spec_tokens": self.num_speculative_tokens,
        }
        if detailed and self.per_step_accepted:
            out["per_step_accepted"] = list(self.per_step_accepted)
            out["per_step_drafted"] = list(self.per_step_drafted)
        return out


class Sequence:
    """One request inside the engine."""

    __slots__ = (
        "spec",
        "target",
        "truth",
        "prompt_len",
        "computed",
        "n_out",
        "drafts",
        "n_drafts",
        "finish_reason",
        "stop_reason",
        "trim_chars",
        "listener",
        "aborted",
        "proposer",
        "rng",
        "rates",
        "last_emit",
        "_text_tail",
        "block_hashes",
        "prefill_len",
    )

    def __init__(
        self,
        spec: RequestSpec,
        truth: SeqTruth,
        proposer: NgramIndex | SuffixProposer | None,
        rates: tuple[float, ...],
        rng: random.Random,
    ) -> None:
        self.spec = spec
        self.target = TargetText(spec.key, spec.prompt, spec.category, flip=spec.lossy)
        self.truth = truth
        self.prompt_len = len(spec.prompt.token_ids)
        self.computed = 0
        self.n_out = 0
        self.drafts: list[int] = []
        self.n_drafts = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.trim_chars = 0
        self.listener: Callable[[], None] | None = None
        self.aborted = False
        self.proposer = proposer
        self.rng = rng
        self.rates = rates
        self.last_emit = 0.0
        self._text_tail = ""
        self.block_hashes: list[int] = []
        # Tokens to (re)compute before decoding: the prompt, or prompt + output after a preemption.
        self.prefill_len = self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        return self.target.ids[start : self.n_out if end is None else end]

    def output_text(self, start: int = 0, end: int | None = None) -> str:
        end = self.n_out if end is None else end
        text = "".join(self.target.pieces[start:end])
        if self.trim_chars and end >= self.n_out:
            text = text[: len(text) - self.trim_chars] if self.trim_chars < len(text) else ""
        return text

    def emit(self, count: int) -> None:
        """Add up to ``count`` tokens to the output, cut at EOS, ``max_tokens`` or a stop string (which
        set ``finish_reason``)."""
        spec = self.spec
        start = self.n_out
        end = min(start + count, spec.max_tokens)
        target = self.target
        target.ensure(end)
        ids = target.ids
        reason: str | None = None
        for pos in range(start, end):
            if ids[pos] == EOS_ID and not spec.ignore_eos and pos + 1 > spec.min_tokens:
                end = pos + 1
                reason = "stop"
                break
        self.n_out = end
        if spec.stop and self.n_out > start:
            self._check_stop(start)
            if self.finish_reason is not None:
                return
        if reason is None and self.n_out >= spec.max_tokens:
            reason = "length"
        if reason is not None:
            self.finish_reason = reason

    def _check_stop(self, start: int) -> None:
        spec = self.spec
        pieces = self.target.pieces
        if self.n_out <= spec.min_tokens:
            self._text_tail = (self._text_tail + "".join(pieces[start : self.n_out]))[-256:]
            return
        tail = self._text_tail
        for pos in range(start, self.n_out):
            tail += pieces[pos]
            for stop in spec.stop:
                at = tail.find(stop)
                if at >= 0:
                    # Output ends with the token that completed the stop string; text is cut before it.
                    self.n_out = pos + 1
                    keep_to = at + (len(stop) if spec.include_stop_str_in_output else 0)
                    self.trim_chars = len(tail) - keep_to
                    self.finish_reason = "stop"
                    self.stop_reason = stop
                    return
            tail = tail[-256:]
        self._text_tail = tail


@dataclass
class StepPlan:
    """One engine step: who runs, with how many tokens, and what it costs."""

    items: list[tuple[Sequence, int, bool]]  # (sequence, tokens scheduled, is prefill)
    batched_tokens: int
    kv_tokens: int
    prefill_tokens: int
    drafting: int
    duration_s: float


class EngineCore:
    """The scheduler and the model: synchronous, driven by whoever owns the clock."""

    def __init__(self, config: SimConfig, profile: CostProfile) -> None:
        self.config = config
        self.profile = profile
        self.spec: SpeculativeConfig | None = config.speculative
        self.method = self.spec.method if self.spec else None
        self.k = self.spec.num_speculative_tokens if self.spec else 0
        self.max_num_seqs = config.max_num_seqs or profile.max_num_seqs
        self.max_batched = config.max_num_batched_tokens or profile.max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.metrics = EngineMetrics(config.served_name, self.k if self.spec else None)
        self.truths: OrderedDict[str, SeqTruth] = OrderedDict()
        self.suffix_cache = SuffixCache()
        self.kv_capacity = config.kv_cache_tokens or profile.kv_cache_tokens
        self.prefix_cache = PrefixCache(self.kv_capacity) if config.enable_prefix_caching else None
        self.steps = 0
        self.busy_time_s = 0.0

    def add(self, spec: RequestSpec, now: float) -> Sequence:
        truth = SeqTruth(
            request_id=spec.request_id,
            category=spec.category,
            method=self.method,
            num_speculative_tokens=self.k,
            prompt_tokens=len(spec.prompt.token_ids),
            accepted_per_pos=[0] * self.k,
            acceptance_histogram=[0] * (self.k + 1),
            lossy=spec.lossy,
            arrival=now,
        )
        proposer: NgramIndex | SuffixProposer | None = None
        rates: tuple[float, ...] = ()
        if self.spec is not None:
            if self.method == "ngram":
                proposer = NgramIndex(
                    list(spec.prompt.token_ids), self.spec.prompt_lookup_min, self.spec.prompt_lookup_max
                )
            elif self.method == "suffix":
                proposer = SuffixProposer(list(spec.prompt.token_ids), self.suffix_cache, self.spec)
            else:
                rates = acceptance_rates(self.spec, spec.category)
        # Acceptance draws are seeded per request, so a request's speculation is the same at any load.
        rng = random.Random(spec.key ^ (self.config.seed * 0x9E3779B97F4A7C15))
        seq = Sequence(spec, truth, proposer, rates, rng)
        if spec.lossy:
            truth.divergence_position = seq.target.tie_at
        self.waiting.append(seq)
        self._remember(truth)
        self.metrics.waiting = len(self.waiting)
        return seq

    def _remember(self, truth: SeqTruth) -> None:
        self.truths[truth.request_id] = truth
        while len(self.truths) > self.config.keep_finished:
            self.truths.popitem(last=False)

    def abort(self, seq: Sequence) -> None:
        """The client went away: stop generating for it at the next step (vLLM aborts the same way)."""
        if not seq.finished:
            seq.aborted = True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def plan_step(self, now: float) -> StepPlan | None:
        budget = self.max_batched
        items: list[tuple[Sequence, int, bool]] = []  # (sequence, tokens this step, prefilling)
        lookup = self.method in LOOKUP_METHODS
        if any(s.aborted for s in self.running):
            for s in self.running:
                if s.aborted:
                    self._finish(s, "abort", now)
            self.running = [s for s in self.running if not s.aborted]
        used = self._preempt_to_fit(1 + self.k if self.spec is not None else 1)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.computed < seq.prefill_len:
                chunk = min(seq.prefill_len - seq.computed, budget)
                items.append((seq, chunk, True))
                budget -= chunk
            else:
                n_drafts = len(seq.drafts) if lookup else self.k
                if 1 + n_drafts > budget:
                    n_drafts = budget - 1
                    if lookup:
                        seq.drafts = seq.drafts[:n_drafts]
                seq.n_drafts = n_drafts
                items.append((seq, 1 + n_drafts, False))
                budget -= 1 + n_drafts
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.aborted:
                self.waiting.popleft()
                self._finish(seq, "abort", now)
                continue
            if self.running and used + seq.prefill_len > self.kv_capacity:
                break  # no KV blocks free for it yet (first come, first served, as vLLM)
            self.waiting.popleft()
            used += seq.prefill_len
            self.running.append(seq)
            first_time = seq.truth.scheduled is None
            if first_time:
                seq.truth.scheduled = now
                self.metrics.queue.observe(now - seq.truth.arrival)
                self.metrics.prompt_tokens += seq.prompt_len  # cached or computed, as vLLM counts them
            if self.prefix_cache is not None:
                if not seq.block_hashes:
                    seq.block_hashes = PrefixCache.block_hashes(seq.spec.prompt.token_ids)
                seq.computed = self.prefix_cache.cached_tokens(seq.block_hashes, seq.prompt_len)
                self.metrics.prefix_cache_queries += seq.prompt_len
                self.metrics.prefix_cache_hits += seq.computed
                if first_time:
                    seq.truth.cached_prompt_tokens = seq.computed
            chunk = min(seq.prefill_len - seq.computed, budget)
            items.append((seq, chunk, True))
            budget -= chunk
        self.metrics.waiting = len(self.waiting)
        self.metrics.running = len(self.running)
        if not items:
            return None
        batched = self.max_batched - budget
        prefill = kv = drafting = 0
        for s, n, prefilling in items:
            if prefilling:
                prefill += n
                kv += s.computed + n  # the chunk and the prefix before it
            else:
                kv += s.prompt_len + s.n_out + n - 1  # the context and the drafts
                if s.n_drafts:
                    drafting += 1
        duration = self.profile.step_time(
            batched, kv, prefill_tokens=prefill, method=self.method, drafting_requests=drafting, k=self.k
        )
        return StepPlan(items, batched, kv, prefill, drafting, duration)

    def _preempt_to_fit(self, growth: int) -> int:
        """Preempt the newest running requests until this step's KV fits; returns the KV tokens in use.

        As vLLM's scheduler does (recompute mode): a preempted request goes back to the front of the
        queue and later recomputes its prompt and output as a prefill before decoding on.
        """
        used = 0
        for seq in self.running:
            used += seq.prompt_len + seq.n_out + (growth if seq.computed >= seq.prefill_len else 0)
        while used > self.kv_capacity and len(self.running) > 1:
            victim = self.running.pop()
            used -= (
                victim.prompt_len + victim.n_out + (growth if victim.computed >= victim.prefill_len else 0)
            )
            victim.computed = 0
            victim.prefill_len = victim.prompt_len + victim.n_out
            victim.drafts = []
            victim.truth.preemptions += 1
            self.metrics.preemptions += 1
            self.waiting.appendleft(victim)
        return used

    def finish_step(self, plan: StepPlan, now: float, stamp: float | None = None) -> list[Sequence]:
        """Apply a step's outcome at time `now`; returns the sequences that got new output or finished.

        ``stamp``: when the step landed on a fine clock, for the step timeline (the event loop's clock
        can be as coarse as a millisecond); `now` when not given."""
        self.steps += 1
        self.busy_time_s += plan.duration_s
        m = self.metrics
        m.iteration_tokens.observe(plan.batched_tokens)
        touched: list[Sequence] = []
        lookup = self.method in LOOKUP_METHODS
        spec_on = self.spec is not None
        any_finished = False
        for seq, tokens, is_prefill in plan.items:
            if seq.aborted or seq.finish_reason is not None:
                continue
            truth = seq.truth
            truth.steps += 1
            if is_prefill:
                seq.computed += tokens
                if seq.computed < seq.prefill_len:
                    continue
                if self.prefix_cache is not None:
                    self.prefix_cache.insert(seq.block_hashes)
                emitted = 1  # the step that completes prefill samples the first token
            else:
                truth.decode_steps += 1
                emitted = self._verify(seq, lookup) + 1
            before = seq.n_out
            seq.emit(emitted)
            new = seq.n_out - before
            m.generation_tokens += new
            if new:
                truth.emit_times.append(now if stamp is None else stamp)
                truth.emit_tokens.append(new)
            if before == 0:
                truth.first_token = now
                m.ttft.observe(now - truth.arrival)
            else:
                m.itl.observe(now - seq.last_emit)
            seq.last_emit = now
            finished = seq.finish_reason is not None
            if spec_on and not finished:
                if lookup:
                    proposer = seq.proposer
                    assert proposer is not None
                    proposer.append(seq.target.ids[before : seq.n_out])
                    seq.drafts = (
                        proposer.propose(self.k) if isinstance(proposer, NgramIndex) else proposer.propose()
                    )
            if finished:
                self._finish(seq, seq.finish_reason or "stop", now)
                any_finished = True
            touched.append(seq)
        if any_finished:
            self.running = [s for s in self.running if s.finish_reason is None]
        m.running = len(self.running)
        m.kv_usage = min(1.0, sum(s.prompt_len + s.n_out for s in self.running) / self.kv_capacity)
        return touched

    def _verify(self, seq: Sequence, lookup: bool) -> int:
        """Verify a decode step's drafts: how many the target accepted (counted in the metrics)."""
        truth = seq.truth
        m = self.metrics
        n_drafts = seq.n_drafts
        accepted = 0
        if n_drafts:
            if lookup:
                target = seq.target
                target.ensure(seq.n_out + n_drafts)
                ids = target.ids
                base = seq.n_out
                for i, tok in enumerate(seq.drafts[:n_drafts]):
                    if ids[base + i] != tok:
                        break
                    accepted += 1
            else:
                accepted = draw_accepted(seq.rng, seq.rates, n_drafts)
            # Counted before the EOS/stop/max_tokens trim, as vLLM counts them.
            truth.num_drafts += 1
            truth.draft_tokens += n_drafts
            truth.accepted_tokens += accepted
            truth.acceptance_histogram[accepted] += 1
            if self.config.per_request_spec_decode_metrics == "detailed":
                truth.per_step_accepted.append(accepted)
                truth.per_step_drafted.append(n_drafts)
            m.spec_drafts += 1
            m.spec_draft_tokens += n_drafts
            m.spec_accepted += accepted
            per_pos = m.spec_accepted_per_pos
            truth_pos = truth.accepted_per_pos
            for i in range(accepted):
                per_pos[i] += 1
                truth_pos[i] += 1
        return accepted

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
        truth = seq.truth
        truth.finish_reason = seq.finish_reason
        truth.completion_tokens = seq.n_out
        truth.finished = now
        m = self.metrics
        key = seq.finish_reason if seq.finish_reason in m.success else "stop"
        m.success[key] += 1
        m.e2e.observe(now - truth.arrival)
        m.request_prompt_tokens.observe(seq.prompt_len)
        m.request_generation_tokens.observe(seq.n_out)
        if truth.first_token is not None:
            if truth.scheduled is not None:
                m.prefill_time.observe(truth.first_token - truth.scheduled)
            m.decode_time.observe(now - truth.first_token)
            if seq.n_out > 1:
                m.tpot.observe((now - truth.first_token) / (seq.n_out - 1))
        if self.method == "suffix" and seq.n_out:
            self.suffix_cache.add(seq.output_ids())
        if seq.listener is not None:
            seq.listener()


class DelayHistogram:
    """Cumulative counts of delays per bucket (``counts[i]``: at most ``bounds_s[i]`` and above the
    bound before; the last count: above every bound). A reader takes two snapshots and subtracts them
    for the delays in between."""

    def __init__(self, bounds_s: tuple[float, ...]) -> None:
        self.bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)

    def add(self, delay_s: float) -> None:
        self.counts[bisect.bisect_left(self.bounds_s, delay_s)] += 1


class SimEngine:
    """`EngineCore` on the asyncio clock: each step sleeps its (scaled) duration, then lands.

    The engine keeps an ideal clock (the sum of its step times since it last went idle) and sleeps
    to it, so a late wake-up (the OS scheduling another process) is absorbed by the following steps,
    which then run back to back until the clock is caught up; lateness beyond `CATCH_UP_S` is booked
    as lag. `clock_lag_ratio` says how far the real clock fell behind the ideal one while busy (the
    512-stream target is <= 5 %).
    """

    CATCH_UP_S = 0.25

    def __init__(self, config: SimConfig, profile: CostProfile) -> None:
        self.core = EngineCore(config, profile)
        self.time_scale = config.time_scale
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.ideal_busy_s = 0.0
        self.lag_s = 0.0
        self.max_lag_s = 0.0
        self.write_delays = DelayHistogram(WRITE_DELAY_BOUNDS_S)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="specproxy-sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def submit(self, spec: RequestSpec) -> Sequence:
        seq = self.core.add(spec, asyncio.get_running_loop().time())
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        self.core.abort(seq)
        self._wake.set()

    @property
    def clock_lag_ratio(self) -> float:
        return self.lag_s / self.ideal_busy_s if self.ideal_busy_s else 0.0

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        ideal = loop.time()
        while True:
            if not core.has_work():
                # Book any lateness still outstanding before the ideal clock restarts at wake-up.
                self.lag_s += max(0.0, loop.time() - ideal)
                self._wake.clear()
                await self._wake.wait()
                ideal = loop.time()
            now = loop.time()
            if now - ideal > self.CATCH_UP_S:
                # Fell too far behind to catch up by running steps back to back: book it as lag, resync.
                self.lag_s += now - ideal
                ideal = now
            plan = core.plan_step(now)
            if plan is None:
                await asyncio.sleep(0.001)  # nothing schedulable right now (e.g. only aborted requests)
                continue
            wall = plan.duration_s / self.time_scale
            ideal += wall
            self.ideal_busy_s += wall
            delay = ideal - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            end = loop.time()
            self.max_lag_s = max(self.max_lag_s, end - ideal)
            touched = core.finish_step(plan, end, time.monotonic())
            for seq in touched:
                if seq.listener is not None:
                    seq.listener()
            # Let the woken handlers write their chunks before the next step is planned: a server's
            # delivery does not wait on its scheduler (vLLM's engine core runs in its own process), and
            # planning a large batch takes long enough to delay every stream's chunk by a varying amount.
            await asyncio.sleep(0)

    def stats(self) -> dict[str, Any]:
        core = self.core
        delays = self.write_delays
        return {
            "steps": core.steps,
            "running": len(core.running),
            "waiting": len(core.waiting),
            "engine_busy_s": core.busy_time_s,
            "ideal_busy_wall_s": self.ideal_busy_s,
            "lag_s": self.lag_s,
            "max_lag_s": self.max_lag_s,
            "clock_lag_ratio": self.clock_lag_ratio,
            "time_scale": self.time_scale,
            "write_delay_bounds_s": list(delays.bounds_s),
            "write_delay_counts": list(delays.counts),
        }
