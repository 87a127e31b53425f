"""Where a level's figures came from, and what that allows: token counts and acceptance figures.

Token counts (``tokens_source`` of each call): ``usage`` (the backend's own count), ``tokenizer`` (the
output re-encoded with the model's tokenizer: exact but for rare texts whose re-encoding differs) and
``chunks`` (one token per chunk, which the proxy uses only for an arm whose chunks were seen to hold one
token each) are measurements. ``text_estimate`` is an estimate with a stated error
(:data:`TEXT_ESTIMATE_ERROR`, which nine outputs in ten stay within, not a bound): decode speeds,
throughputs and speedups built on it are marked estimated, and a level whose arm or baseline has any
estimated count gets no WIN or LOSS from them (:func:`specproxy.analysis.verdicts.rules.level_verdict`).
Calls without a source (stores from before the column) count as measured, as they were then.

Acceptance figures (``spec_source``): the engine's per-request report (:data:`REPORTED_SPEC_SOURCES`)
and the stream-shape estimate whose conditions held (``stream_shape``) are figures, labelled by where
they came from. ``stream_shape_unreliable`` (the estimate's conditions failed: merged chunks, a method
that does not draft every step) and ``unknown`` (no report and no per-chunk token counts) are not
measured: the level's figure leaves them out, and shows "—" with the reason when nothing else is left.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specproxy.record import REPORTED_SPEC_SOURCES
from specproxy.record import TEXT_ESTIMATE_ERROR as TEXT_ESTIMATE_ERROR

ESTIMATED_TOKENS = "text_estimate"
NOT_RECORDED = "not recorded"
STREAM_SHAPE = "stream_shape"
MEASURED_SPEC_SOURCES: tuple[str, ...] = (*REPORTED_SPEC_SOURCES, STREAM_SHAPE)
NOT_MEASURED_REASON = {
    "stream_shape_unreliable": "stream-shape estimate unreliable (merged chunks or a method that does not "
    "draft every step)",
    "unknown": "unknown (no engine report, no per-chunk token counts)",
}


@dataclass(frozen=True)
class TokenCounts:
    """Where an arm's token counts at one level came from: ok calls with a count, per source."""

    by_source: Mapping[str, int]

    @property
    def estimated(self) -> int:
        return self.by_source.get(ESTIMATED_TOKENS, 0)

    def describe(self) -> str:
        """ "usage", or "text_estimate 12/20, usage 8/20" when the sources are mixed; "" without calls."""
        total = sum(self.by_source.values())
        items = sorted(self.by_source.items(), key=lambda kv: (-kv[1], kv[0]))
        if len(items) == 1:
            return items[0][0]
        return ", ".join(f"{source} {n}/{total}" for source, n in items)


def estimate_note(own: TokenCounts, baseline: TokenCounts | None) -> str:
    """Why a row's speed figures are estimates ("" when they are not): whose counts, from what."""
    whose = [
        name
        for name, counts in (("the arm's", own), ("the baseline's", baseline))
        if counts is not None and counts.estimated
    ]
    if not whose:
        return ""
    return (
        f"token counts estimated from the text for {' and '.join(whose)} calls (text_estimate, stated error "
        f"±{TEXT_ESTIMATE_ERROR:.0%})"
    )


@dataclass(frozen=True)
class SpecCounts:
    """An arm's speculation figures at one level: ok calls per ``spec_source``, and the request
    acceptance sums over the calls whose source is a measurement."""

    by_source: Mapping[str, int]
    accepted_tokens: float | None
    draft_tokens: float | None
    num_drafts: float | None
    mean_acceptance_length: float | None

    @property
    def acceptance_rate(self) -> float | None:
        if self.accepted_tokens is None or not self.draft_tokens:
            return None
        return self.accepted_tokens / self.draft_tokens

    @property
    def acceptance_length(self) -> float | None:
        """vLLM's definition (1 + accepted / drafts) where drafts were counted, else the calls' mean."""
        if self.accepted_tokens is not None and self.num_drafts:
            return 1.0 + self.accepted_tokens / self.num_drafts
        return self.mean_acceptance_length

    def source(self) -> str:
        """Where the figure came from: "reported (vllm_request_metrics)", "estimated (stream shape)",
        or both with their call counts; "" when no call has a measured figure."""
        reported = sorted(s for s in self.by_source if s in REPORTED_SPEC_SOURCES)
        shape = self.by_source.get(STREAM_SHAPE, 0)
        parts = []
        if reported:
            parts.append(f"reported ({', '.join(reported)})")
        if shape:
            parts.append("estimated (stream shape)")
        if len(parts) == 2:
            n_rep = sum(self.by_source[s] for s in reported)
            parts = [f"{parts[0]} {n_rep} calls", f"{parts[1]} {shape} calls"]
        return " + ".join(parts)

    def not_measured(self) -> str:
        """The calls whose figure is not a measurement, and why ("" when none)."""
        parts = [
            f"{n} calls: {NOT_MEASURED_REASON[s]}"
            for s, n in sorted(self.by_source.items())
            if s in NOT_MEASURED_REASON and n
        ]
        return "; ".join(parts)
