"""A finished call's span figures: timing, tokens and their source, speculation, latency.

Pure stages over the call's :class:`CompletionTap`, run once when the call ends, however it ended.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from specproxy.config import Arm
from specproxy.proxy.upstream.acceptance import speculation_for
from specproxy.proxy.upstream.engines import engine_report
from specproxy.proxy.upstream.latency import chunk_latency, tpot_s
from specproxy.proxy.upstream.sse import CompletionTap
from specproxy.proxy.upstream.tokens import count_completion_tokens, load_tokenizer
from specproxy.record import SpanRecord, decode_tok_s

if TYPE_CHECKING:
    from specproxy.proxy.upstream.calls import UpstreamState


def finish_record(
    record: SpanRecord, arm: Arm, tap: CompletionTap, t_send: float, t_end: float | None, capture: bool
) -> None:
    end = t_end if t_end is not None else time.perf_counter()
    record.t_start = datetime.fromtimestamp((record.t_start_ns or 0) / 1e9, UTC)
    record.e2e_s = end - t_send
    streamed = record.stream
    if streamed and tap.t_first is not None:
        record.ttft_s = tap.t_first - t_send
        record.chunks = tap.chunks
    record.completion_tokens = tap.completion_tokens
    if tap.prompt_tokens is not None:
        record.prompt_tokens = tap.prompt_tokens
    if streamed:
        record.decode_tok_s = decode_tok_s(record.completion_tokens, tap.t_first, tap.t_last)
    record.finish_reason = tap.finish_reason
    text = tap.text()
    if text or tap.t_first is not None:
        record.output_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if capture:
        record.output_text = text


def learn_engine(arm: Arm, tap: CompletionTap, state: UpstreamState) -> None:
    """Remember the engine the arm's URL answered as (its first response that shows one)."""
    if tap.engine_hint is not None and arm.url not in state.engines:
        state.engines[arm.url] = tap.engine_hint


def record_engine_facts(record: SpanRecord, arm: Arm, tap: CompletionTap, state: UpstreamState) -> None:
    """What the engine told about the call (its name, queueing, speculation) and the completion tokens
    with their source: the parts of a span that depend on which engine answered."""
    engine = arm.engine_kind if arm.engine_kind != "auto" else tap.engine_hint or state.engine_of(arm)
    record.engine = engine
    report = engine_report(tap, engine)
    if report is not None:
        record.queue_s = report.queue_s
    tokenizer = load_tokenizer(arm.tokenizer) if arm.tokenizer else None
    count = count_completion_tokens(
        tap,
        arm,
        state.chunk_evidence,
        tokenizer=tokenizer,
        reported=report.completion_tokens if report is not None else None,
        complete=record.status == "ok",
        engine=engine,
    )
    record.completion_tokens, record.tokens_source = count.tokens, count.source
    if record.stream:
        record.decode_tok_s = decode_tok_s(record.completion_tokens, tap.t_first, tap.t_last)
    spec, record.spec_source = speculation_for(tap, arm, report, state.merging)
    if spec is not None:
        record.num_drafts = spec.num_drafts
        record.draft_tokens = spec.draft_tokens
        record.accepted_tokens = spec.accepted_tokens
        record.acceptance_length = spec.acceptance_length


def record_latency(record: SpanRecord, tap: CompletionTap) -> None:
    """TPOT, inter-token latency and the chunk gaps and sizes of a streamed call (see .latency); after
    :func:`record_engine_facts`, which settles ``completion_tokens``."""
    if not record.stream:
        return
    if len(tap.chunk_times) >= 2:
        # One chunk (or a whole JSON body to a stream request) shows no time between tokens.
        record.tpot_s = tpot_s(record.e2e_s, record.ttft_s, record.completion_tokens)
    lat = chunk_latency(
        tap.chunk_times, tap.tokens_per_chunk, tokens_exact=tap.count_source in _EXACT_CHUNK_COUNTS
    )
    record.chunk_gaps_us, record.chunk_tokens = lat.gaps_us, lat.tokens
    record.itl_p50_s, record.itl_p95_s, record.itl_p99_s, record.itl_max_s = (
        lat.p50_s,
        lat.p95_s,
        lat.p99_s,
        lat.max_s,
    )


# How the tap counted tokens per chunk when each chunk's count is the engine's own (exact).
_EXACT_CHUNK_COUNTS = ("token_ids", "continuous_usage")
