"""Span records with every column set (a round trip through the span store checks every column)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from specproxy.record import SpanRecord

T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
T0_NS = 1_772_366_400_123_456_789  # 2026-03-01T12:00:00.123456789Z


def full_record(i: int = 0, **overrides: Any) -> SpanRecord:
    """A record with every column set (so a round trip checks every column)."""
    fields: dict[str, Any] = dict(
        run_id="run-1",
        request_id=f"req-{i}",
        arm="eagle3",
        arm_role="candidate",
        backend_url="http://127.0.0.1:8002",
        spec_method="eagle3",
        num_speculative_tokens=3,
        source="replay",
        routed_as="shadow",
        category="code",
        concurrency_level=16,
        inflight_at_start=5,
        endpoint="chat",
        model="meta-llama/Llama-3.1-8B-Instruct",
        stream=True,
        temperature=0.0,
        max_tokens=256,
        seed=1234567890123,
        prompt_sha256="a" * 64,
        prompt_tokens=321,
        t_start=T0,
        t_start_ns=T0_NS + i,
        ttft_s=0.0213,
        e2e_s=1.875,
        decode_tok_s=97.25,
        chunks=70,
        completion_tokens=256,
        finish_reason="length",
        output_sha256="b" * 64,
        output_text="héllo ✓",
        num_drafts=60,
        draft_tokens=180,
        accepted_tokens=130,
        acceptance_length=3.1666,
        spec_source="vllm_request_metrics",
        identical=False,
        first_divergence=17,
        divergence_margin=0.03125,
        status="ok",
        http_status=200,
        error=None,
    )
    fields.update(overrides)
    return SpanRecord(**fields)
