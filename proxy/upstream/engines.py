"""What each serving engine reports about one request, read into one engine-neutral record.

An adapter per engine knows where that engine puts its per-request figures; nothing outside this
module branches on an engine's wire format. The record (:class:`EngineReport`) holds the speculation
counts (drafts, draft tokens, accepted draft tokens, the per-step histogram where given) and the
server-side timings an engine reports. Each format, with its source:

- **vLLM** (``vllm/entrypoints/generate/base/protocol.py`` in the vLLM 0.33 wheel,
  ``PerRequestMetrics`` / ``SpeculativeDecodingMetrics``): a top-level ``metrics`` object. With
  ``--per-request-spec-decode-metrics summary|detailed``, ``metrics.speculative_decoding`` =
  ``{mean_acceptance_length, draft_acceptance_rate, acceptance_histogram (dense, index = accepted
  drafts in a step), num_spec_steps, num_accepted_draft_tokens, num_draft_tokens, num_spec_tokens}``;
  streaming: on the final usage chunk. With ``--enable-per-request-metrics``: ``queue_time_ms``,
  ``time_to_first_token_ms``, ``generation_time_ms``, ``mean_itl_ms``, ``tokens_per_second``.
- **SGLang** (``python/sglang/srt/entrypoints/openai/utils.py``, ``spec_tokens_details_from_meta_info``;
  SGLang ≥ 0.5.19, asked per request with ``return_spec_tokens_details: true``):
  ``sglext.spec_tokens_details = {spec_verify_ct, spec_num_proposed_drafts, spec_num_correct_drafts,
  spec_accept_length, spec_accept_rate, spec_correct_drafts_histogram, ...}``.
- **TensorRT-LLM** (PyTorch backend with ``per_request_spec_decode_stats`` in its
  ``--extra_llm_api_options``; documented by AIPerf 0.14's "Per-Request Speculative-Decoding
  Acceptance" reference, ``src/aiperf/spec_decode/trtllm_adapter.py``): a per-choice
  ``speculative_decoding = {num_spec_steps, total_draft_tokens, total_accepted_draft_tokens,
  acceptance_rate, acceptance_histogram, num_spec_tokens}`` on the choice carrying ``finish_reason``.
- **llama.cpp** ``llama-server`` (``tools/server/server-common.cpp``, ``server_slot_stats::to_json``;
  checked against a real server, recordings in ``tests/fixtures/llama_server/``): a top-level
  ``timings`` object on a response, on a chat stream's last chunk (the usage-only chunk when
  ``include_usage`` was asked for) and on a completions stream's last chunk, with ``predicted_n``
  (output tokens), ``prompt_ms``/``predicted_ms`` and, when the request drafted anything, ``draft_n``
  (draft tokens) and ``draft_n_accepted``; a response with ``timings`` but no ``draft_n`` drafted
  nothing (0 draft tokens). It does not report the number of drafting steps: ``num_drafts`` stays None
  and the acceptance length is derived as ``1 + draft_n_accepted / (predicted_n − draft_n_accepted − 1)``,
  every decoding step after the first token counted as a drafting step. Measured against the
  ``llamacpp:spec_decode_num_drafts_total`` delta of single requests (draft model, k = 4, with and
  without synthetic rejections): 9 of 12 exact, the other three one step off (a last step that could
  not draft, one token before ``max_tokens``; an end token); over a 48-response run, 313 steps against
  the counter's 280 (length 4.55 against 4.97). Methods that draft only on a match (n-gram) have steps
  without a draft, which this counts: a lower bound for them.

Engine detection: an arm's ``engine`` setting wins; otherwise the server's ``/v1/models`` listing names
it before the first call (:func:`engine_of_models`), or the response's own shape does (see
``_engine_signal`` in :mod:`.sse`); the first engine seen for an arm URL is remembered.

The Prometheus names of each engine's load gauges and speculation counters are in
:data:`METRIC_NAMES` (read by :mod:`.scrape`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from specproxy.proxy.upstream.sse import CompletionTap
from specproxy.record import SpecSource

Engine = Literal["vllm", "sglang", "trtllm", "llamacpp", "unknown"]
ENGINES: tuple[str, ...] = ("vllm", "sglang", "trtllm", "llamacpp")


@dataclass(frozen=True, slots=True)
class EngineReport:
    """What one engine said about one request; None where it said nothing."""

    engine: str
    spec_source: SpecSource | None = None  # the value for the span's spec_source when speculation is reported
    num_drafts: int | None = None  # drafting (verify) steps
    draft_tokens: int | None = None
    accepted_tokens: int | None = None  # accepted draft tokens, the bonus token excluded
    acceptance_length: float | None = None  # mean tokens per drafting step, bonus included
    histogram: tuple[int, ...] | None = None  # [j] = steps that accepted exactly j drafts
    completion_tokens: int | None = None  # the engine's count outside the usage object
    queue_s: float | None = None
    server_ttft_s: float | None = None
    server_generation_s: float | None = None

    @property
    def has_speculation(self) -> bool:
        return self.spec_source is not None


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return int(v)


def _float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _ms(v: Any) -> float | None:
    f = _float(v)
    return f / 1000.0 if f is not None else None


def _hist(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return tuple(v)
    return None


def _length(accepted: int | None, steps: int | None) -> float | None:
    if accepted is None or not steps:
        return None
    return 1.0 + accepted / steps


def _with_step_counts(
    report: EngineReport,
    spec_source: SpecSource,
    counts: dict[str, Any],
    keys: tuple[str, str, str, str],
    reported_length: float | None = None,
) -> EngineReport:
    """``report`` with the speculation counts an engine gives per drafting step; ``keys`` name its
    steps, draft tokens, accepted draft tokens and histogram. A length it does not report is derived."""
    steps_key, drafted_key, accepted_key, histogram_key = keys
    steps = _int(counts.get(steps_key))
    accepted = _int(counts.get(accepted_key))
    return dataclasses.replace(
        report,
        spec_source=spec_source,
        num_drafts=steps,
        draft_tokens=_int(counts.get(drafted_key)),
        accepted_tokens=accepted,
        acceptance_length=reported_length if reported_length is not None else _length(accepted, steps),
        histogram=_hist(counts.get(histogram_key)),
    )


def read_vllm(extras: dict[str, Any]) -> EngineReport | None:
    metrics = extras.get("metrics")
    if not isinstance(metrics, dict):
        return None
    sd = metrics.get("speculative_decoding")
    timing = EngineReport(
        "vllm",
        queue_s=_ms(metrics.get("queue_time_ms")),
        server_ttft_s=_ms(metrics.get("time_to_first_token_ms")),
        server_generation_s=_ms(metrics.get("generation_time_ms")),
    )
    if not isinstance(sd, dict):
        return timing
    keys = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "acceptance_histogram")
    return _with_step_counts(
        timing, "vllm_request_metrics", sd, keys, _float(sd.get("mean_acceptance_length"))
    )


def read_sglang(extras: dict[str, Any]) -> EngineReport | None:
    sglext = extras.get("sglext")
    details = sglext.get("spec_tokens_details") if isinstance(sglext, dict) else None
    if not isinstance(details, dict):
        return None
    keys = (
        "spec_verify_ct",
        "spec_num_proposed_drafts",
        "spec_num_correct_drafts",
        "spec_correct_drafts_histogram",
    )
    # A length of 0 counts as none reported: derived instead.
    length = _float(details.get("spec_accept_length")) or None
    return _with_step_counts(EngineReport("sglang"), "sglang_request_metrics", details, keys, length)


def read_trtllm(extras: dict[str, Any]) -> EngineReport | None:
    sd = extras.get("choice_speculative_decoding")
    if not isinstance(sd, dict) or "total_draft_tokens" not in sd:
        return None
    keys = ("num_spec_steps", "total_draft_tokens", "total_accepted_draft_tokens", "acceptance_histogram")
    # Derived length, as TensorRT-LLM reports no mean acceptance length of its own.
    return _with_step_counts(EngineReport("trtllm"), "trtllm_request_metrics", sd, keys)


def read_llamacpp(extras: dict[str, Any]) -> EngineReport | None:
    timings = extras.get("timings")
    if not isinstance(timings, dict):
        return None
    predicted = _int(timings.get("predicted_n"))
    drafted = _int(timings.get("draft_n"))
    accepted = _int(timings.get("draft_n_accepted"))
    timing = EngineReport(
        "llamacpp",
        completion_tokens=predicted if predicted is not None and predicted >= 0 else None,
        server_generation_s=_ms(timings.get("predicted_ms")),
    )
    if drafted is None and accepted is None and predicted is not None:
        # llama-server leaves draft_n out of the timings of a request that drafted nothing.
        return dataclasses.replace(timing, spec_source="llamacpp_timings", draft_tokens=0, accepted_tokens=0)
    if drafted is None or accepted is None:
        return timing
    # Decoding steps after the first token (which prefill produced); see the module docstring.
    steps = predicted - accepted - 1 if predicted is not None else None
    return dataclasses.replace(
        timing,
        spec_source="llamacpp_timings",
        draft_tokens=drafted,
        accepted_tokens=accepted,
        acceptance_length=1.0 + accepted / steps if steps is not None and steps > 0 else None,
    )


_READERS = {"vllm": read_vllm, "trtllm": read_trtllm, "sglang": read_sglang, "llamacpp": read_llamacpp}


def engine_report(tap: CompletionTap, engine: str) -> EngineReport | None:
    """The engine's own figures for this response: its adapter first, then any whose payload is there
    (a misnamed or undetected engine still has its payload read)."""
    first = _READERS.get(engine)
    report = first(tap.extras) if first is not None else None
    if report is not None:
        return report
    for name, reader in _READERS.items():
        if name != engine:
            report = reader(tap.extras)
            if report is not None:
                return report
    return None


@dataclass(frozen=True, slots=True)
class MetricNames:
    """One engine's Prometheus names: load gauges and speculation counters (None: it has none)."""

    prefix: str
    running: str | None = None
    waiting: str | None = None
    drafts: str | None = None
    draft_tokens: str | None = None
    accepted: str | None = None
    accepted_per_pos: str | None = None


# Sources: vLLM 0.33 (vllm/v1/metrics/loggers.py); llama.cpp llama-server --metrics
# (tools/server/server-task.cpp, server_task_result_metrics::to_metrics: llamacpp:requests_processing /
# requests_deferred, the spec_decode_* counters and the per-position counter, labelled position="i");
# SGLang (python/sglang/srt/metrics/collector.py: sglang:num_running_reqs, sglang:num_queue_reqs;
# acceptance is a gauge there, sglang:spec_accept_length, not a counter);
# TensorRT-LLM's trtllm-serve exposes no per-request queue gauges under a stable name.
METRIC_NAMES: dict[str, MetricNames] = {
    "vllm": MetricNames(
        "vllm:",
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        drafts="vllm:spec_decode_num_drafts_total",
        draft_tokens="vllm:spec_decode_num_draft_tokens_total",
        accepted="vllm:spec_decode_num_accepted_tokens_total",
        accepted_per_pos="vllm:spec_decode_num_accepted_tokens_per_pos_total",
    ),
    "llamacpp": MetricNames(
        "llamacpp:",
        running="llamacpp:requests_processing",
        waiting="llamacpp:requests_deferred",
        drafts="llamacpp:spec_decode_num_drafts_total",
        draft_tokens="llamacpp:spec_decode_num_draft_tokens_total",
        accepted="llamacpp:spec_decode_num_accepted_tokens_total",
        accepted_per_pos="llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
    ),
    "sglang": MetricNames("sglang:", running="sglang:num_running_reqs", waiting="sglang:num_queue_reqs"),
    "trtllm": MetricNames("trtllm_"),
}
KNOWN_PREFIXES: tuple[str, ...] = tuple(m.prefix for m in METRIC_NAMES.values())


def engine_of_metrics(names: set[str] | frozenset[str]) -> str | None:
    """The engine whose prefix the scraped metric names carry (the most samples wins)."""
    counts = {e: sum(1 for n in names if n.startswith(m.prefix)) for e, m in METRIC_NAMES.items()}
    best = max(counts, key=lambda e: counts[e])
    return best if counts[best] else None


# /v1/models' ``owned_by``: each server's own word about itself. vLLM: ``ModelCard.owned_by = "vllm"``
# (vllm/entrypoints/openai/engine/protocol.py); SGLang: ``"sglang"`` (sglang/srt/entrypoints/openai/
# protocol.py); llama-server: ``"llamacpp"`` (tools/server/server-context.cpp); llama-cpp-python's
# server: ``"me"``, next to a ``permissions`` list (llama_cpp/server/app.py, get_models), which it
# needs: its responses carry nothing of their own and echo the requested model name.
_OWNERS = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}


def engine_of_models(listing: Any) -> str | None:
    """The engine a ``GET /v1/models`` body names through its models' ``owned_by``; None if none does."""
    data = listing.get("data") if isinstance(listing, dict) else None
    for model in data if isinstance(data, list) else ():
        if not isinstance(model, dict):
            continue
        owner = model.get("owned_by")
        if owner == "me" and isinstance(model.get("permissions"), list):
            return "llamacpp"
        if isinstance(owner, str) and owner in _OWNERS:
            return _OWNERS[owner]
    return None
