"""The span record: one row per upstream call, the contract between proxy, replay and analysis.

A shadowed request gives one record per arm, all sharing ``request_id``. The proxy and replay build
records with :class:`SpanRecord`; the sink turns them into OpenTelemetry spans (attribute names in
:data:`OTEL_ATTRIBUTE`) and DuckDB rows (table ``requests``, columns in :data:`COLUMNS`, in order).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

Status = Literal["ok", "http_error", "upstream_error", "timeout", "client_cancelled", "dropped"]
# Where a span's speculation figures came from: reported by the engine for the request (one value per
# engine format), estimated from the stream's shape (reliable or not), unknown for an arm that
# speculates without either, none for an arm that does not speculate. See proxy/upstream/acceptance.py.
SpecSource = Literal[
    "vllm_request_metrics",
    "sglang_request_metrics",
    "trtllm_request_metrics",
    "llamacpp_timings",
    "stream_shape",
    "stream_shape_unreliable",
    "unknown",
    "none",
]
REPORTED_SPEC_SOURCES: tuple[str, ...] = (
    "vllm_request_metrics",
    "sglang_request_metrics",
    "trtllm_request_metrics",
    "llamacpp_timings",
)
# Where completion_tokens came from; text_estimate is an estimate (see proxy/upstream/tokens.py).
TokensSource = Literal["usage", "tokenizer", "chunks", "text_estimate"]

# The stated error of a `text_estimate` count (proxy.upstream.tokens.estimate_tokens): on windows of
# 150 words of Markdown and Python, measured against SmolLM2's tokenizer by tests/bench/bench_tokens.py,
# the mean absolute error is 6-9 % and nine windows in ten are within this bound. Other languages,
# other vocabularies and very short outputs can be off by more: a figure built on an estimated count
# is not a measurement.
TEXT_ESTIMATE_ERROR = 0.25

RoutedAs = Literal["primary", "shadow", "split", "verify", "replay"]
Source = Literal["live", "replay"]
STATUSES: tuple[str, ...] = ("ok", "http_error", "upstream_error", "timeout", "client_cancelled", "dropped")


@dataclass(slots=True)
class SpanRecord:
    # identity
    run_id: str
    request_id: str
    arm: str
    arm_role: str
    backend_url: str
    trace_id: str = ""
    span_id: str = ""
    spec_method: str = "none"
    num_speculative_tokens: int | None = None
    # how it came
    source: str = "live"
    routed_as: str = "primary"
    category: str | None = None
    concurrency_level: int | None = None
    inflight_at_start: int | None = None
    # request
    endpoint: str = "chat"  # chat | completions
    model: str | None = None
    stream: bool = False
    temperature: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    prompt_sha256: str | None = None
    prompt_tokens: int | None = None
    # timing; t_start is UTC (tz-aware datetime, microseconds) and t_start_ns the exact epoch ns
    t_start: datetime | None = None
    t_start_ns: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    decode_tok_s: float | None = None
    chunks: int | None = None
    # output
    completion_tokens: int | None = None
    finish_reason: str | None = None
    output_sha256: str | None = None
    output_text: str | None = None
    # speculation
    num_drafts: int | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    acceptance_length: float | None = None
    spec_source: str = "none"
    # verification
    identical: bool | None = None
    first_divergence: int | None = None
    divergence_margin: float | None = None
    # outcome
    status: str = "ok"
    http_status: int | None = None
    error: str | None = None
    # added in schema 7 (appended, so older files migrate by ALTER TABLE ADD COLUMN)
    round: int | None = None  # replay's round of this level (1-based); None for live traffic
    engine: str | None = None  # the engine that answered: vllm | sglang | trtllm | llamacpp | unknown
    tokens_source: str | None = None  # completion_tokens from: usage | tokenizer | text_estimate | chunks
    queue_s: float | None = None  # engine-reported time queued before scheduling, where reported
    engine_running: float | None = None  # the arm's running-requests gauge at call start (last scrape)
    engine_waiting: float | None = None  # the arm's waiting-requests gauge at call start (last scrape)
    notes: str | None = None  # what had to change to store the record (a value out of range, bad UTF-8)

    def as_row(self) -> tuple[Any, ...]:
        """Values in :data:`COLUMNS` order, for DuckDB inserts."""
        return tuple(getattr(self, name) for name in COLUMNS)


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SpanRecord))

# OpenTelemetry attribute name for each record field: GenAI semantic conventions where one exists,
# `specproxy.*` otherwise.
OTEL_ATTRIBUTE: dict[str, str] = {name: f"specproxy.{name}" for name in COLUMNS} | {
    "model": "gen_ai.request.model",
    "temperature": "gen_ai.request.temperature",
    "max_tokens": "gen_ai.request.max_tokens",
    "seed": "gen_ai.request.seed",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "completion_tokens": "gen_ai.usage.output_tokens",
    "finish_reason": "gen_ai.response.finish_reasons",
    "backend_url": "server.address",
    "http_status": "http.response.status_code",
    "error": "error.type",
}


def decode_tok_s(
    completion_tokens: int | None, t_first_token: float | None, t_last_token: float | None
) -> float | None:
    """The per-request decode speed: (completion_tokens − 1) / (t_last − t_first).

    None when it is not defined (fewer than two tokens, or all tokens arrived in one chunk).
    """
    if completion_tokens is None or completion_tokens < 2 or t_first_token is None or t_last_token is None:
        return None
    dt = t_last_token - t_first_token
    if dt <= 0:
        return None
    return (completion_tokens - 1) / dt
