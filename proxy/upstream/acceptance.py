"""A span's speculation figures: the engine's own report when there is one, else an honest estimate.

``spec_source`` says which:

- ``vllm_request_metrics``, ``sglang_request_metrics``, ``trtllm_request_metrics``,
  ``llamacpp_timings``: reported by the engine for this request (:mod:`.engines`). Exact.
- ``stream_shape``: estimated from tokens per chunk (:func:`shape_estimate`), and the
  conditions under which that estimate holds were all met (below).
- ``stream_shape_unreliable``: the same estimate where a condition failed; its figures are kept for
  inspection and must not be read as measured.
- ``unknown``: the arm speculates, and neither a report nor an estimate was possible (no per-chunk
  token counts).
- ``none``: the arm does not speculate.

When the estimate holds. One chunk is one engine step, and each step after the first proposed a draft:

1. Tokens per chunk are exact (token ids or continuous usage), so a chunk's size is a step's yield.
2. The method drafts at every step. EAGLE/EAGLE3, MTP and draft models do; n-gram and suffix
   decoding propose only where the text matched, so their steps without a draft would count as
   rejected drafts (too many drafts, acceptance too low). For n-gram prompt lookup with token ids
   (``return_token_ids``), the lookup is replayed on the prompt's and output's ids, so a draft is
   counted only at a step where the proposer found a match (:func:`ngram_estimate`); a step that
   yielded more tokens than were drafted then proves merged steps.
3. No step was merged into another chunk. Two checks: no chunk of this stream exceeds k + 1 tokens,
   and the plain (non-speculative) arms' streams under the current load carry one token per chunk
   (:class:`MergeCalibration`): a server that merges queued steps into one chunk under load does so
   for every arm, and a merged step looks exactly like an accepted draft.
"""

from __future__ import annotations

from dataclasses import dataclass

from specproxy.config import Arm
from specproxy.proxy.upstream.engines import EngineReport
from specproxy.proxy.upstream.sse import CompletionTap, SpecStats
from specproxy.record import SpecSource

# Methods that propose a draft at every decoding step (vLLM 0.33's `method` values).
DRAFTS_EVERY_STEP = frozenset({"eagle", "eagle3", "mtp", "draft_model", "dflash", "dspark"})

# Share of recent plain-stream tokens that may arrive merged before the shape is not trusted.
_MERGE_TOLERANCE = 0.05
_EWMA_WEIGHT = 0.2  # ~ the last 10 plain streams


def shape_estimate(tap: CompletionTap, k: int | None) -> SpecStats | None:
    """Acceptance estimated from tokens per chunk (one chunk ≈ one engine step).

    Only when tokens were counted exactly (token ids or continuous usage). The first token chunk
    comes from prefill, not from a verified draft, so it is left out. Each later chunk of n tokens
    counts as one step with n − 1 accepted drafts; drafts = steps × k when k is known. A chunk of
    more than k + 1 tokens holds several steps (``--stream-interval``, or a server whose HTTP side
    lagged behind its engine): it counts as ceil(n / (k + 1)) steps, the fewest that could give it.
    Approximate: merged steps still overestimate acceptance, and the last step can be cut by
    max_tokens or a stop string (underestimates).
    """
    if tap.count_source == "chunks":
        return None
    per_step = k + 1 if k else None
    steps = 0
    accepted = 0
    for n in tap.tokens_per_chunk[1:]:
        if n <= 0:
            continue
        s = -(-n // per_step) if per_step else 1
        steps += s
        accepted += n - s
    if not steps:
        return None
    return SpecStats(
        num_drafts=steps,
        draft_tokens=steps * k if k else None,
        accepted_tokens=accepted,
        acceptance_length=1.0 + accepted / steps,
    )


@dataclass(slots=True)
class MergeCalibration:
    """The share of plain arms' streamed tokens that arrived merged with another in one chunk, lately
    (an exponentially weighted mean over ~10 streams)."""

    merged_share: float | None = None

    def observe(self, arm: Arm, tap: CompletionTap) -> None:
        """A finished plain stream with usage: how many of its tokens shared a chunk?"""
        used = tap.usage_tokens
        if arm.spec_method != "none" or not used or not tap.done or not tap.content_chunks:
            return
        # An engine may count the end token that no text chunk carries: one token of slack.
        merged = max(0, used - tap.content_chunks - 1) / used
        prev = self.merged_share
        self.merged_share = merged if prev is None else prev + _EWMA_WEIGHT * (merged - prev)

    def unmerged(self) -> bool | None:
        """True: plain streams carry one token per chunk now (within the tolerance); None: no plain
        stream seen yet."""
        if self.merged_share is None:
            return None
        return self.merged_share <= _MERGE_TOLERANCE


def _from_report(report: EngineReport) -> SpecStats:
    return SpecStats(
        num_drafts=report.num_drafts,
        draft_tokens=report.draft_tokens,
        accepted_tokens=report.accepted_tokens,
        acceptance_length=report.acceptance_length,
    )


def shape_is_reliable(tap: CompletionTap, arm: Arm, calibration: MergeCalibration) -> bool:
    """Conditions 2 and 3 of the module docstring (condition 1 is shape_estimate's own)."""
    if arm.spec_method not in DRAFTS_EVERY_STEP:
        return False
    k = arm.num_speculative_tokens
    if k is None or any(n > k + 1 for n in tap.tokens_per_chunk):
        return False
    return calibration.unmerged() is True


def speculation_for(
    tap: CompletionTap, arm: Arm, report: EngineReport | None, calibration: MergeCalibration
) -> tuple[SpecStats | None, SpecSource]:
    """The figures for a span's speculation columns and the ``spec_source`` that names them."""
    calibration.observe(arm, tap)
    if report is not None and report.has_speculation and report.spec_source is not None:
        if arm.spec_method == "none" and not report.draft_tokens:
            return None, "none"  # the engine drafted nothing, as the arm's config says
        return _from_report(report), report.spec_source
    if arm.spec_method == "none":
        return None, "none"
    if arm.spec_method in NGRAM_METHODS:
        replayed, consistent = ngram_estimate(tap, arm)
        # A replay that found no draft at all in a stream with multi-token steps is not the server's
        # lookup: the plain shape estimate (flagged) is used instead. Any other contradiction (a step
        # yielding more than was drafted) is merged steps: the replay stands, flagged.
        if replayed is not None and (replayed.num_drafts or max(tap.tokens_per_chunk[1:], default=0) <= 1):
            reliable = consistent and calibration.unmerged() is True
            return replayed, "stream_shape" if reliable else "stream_shape_unreliable"
    estimate = shape_estimate(tap, arm.num_speculative_tokens)
    if estimate is None:
        return None, "unknown"
    reliable = shape_is_reliable(tap, arm, calibration)
    return estimate, "stream_shape" if reliable else "stream_shape_unreliable"


# n-gram methods whose proposals can be replayed from the token ids (vLLM's prompt lookup).
NGRAM_METHODS = frozenset({"ngram", "ngram_gpu"})


class _NgramLookup:
    """Prompt lookup as vLLM's n-gram proposer does it: the longest n-gram (max..min tokens) ending the
    context that occurred earlier, and the up-to-k tokens that followed its earliest occurrence."""

    def __init__(self, tokens: list[int], lo: int, hi: int) -> None:
        self.tokens: list[int] = []
        self.lo, self.hi = lo, hi
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> position after its earliest occurrence
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        tokens = self.tokens
        for token in new:
            tokens.append(token)
            end = len(tokens) - 1  # n-grams ending just before the new token now have a follower
            for n in range(self.lo, self.hi + 1):
                if end >= n:
                    self.first.setdefault(tuple(tokens[end - n : end]), end)

    def proposal(self, k: int) -> int:
        """How many tokens the proposer would draft now (0: no match, no draft)."""
        tokens = self.tokens
        for n in range(self.hi, self.lo - 1, -1):
            if len(tokens) >= n:
                follow = self.first.get(tuple(tokens[len(tokens) - n :]))
                if follow is not None:
                    return min(k, len(tokens) - follow)
        return 0


def ngram_estimate(tap: CompletionTap, arm: Arm) -> tuple[SpecStats | None, bool]:
    """Drafts counted only at the steps where prompt lookup found a match, replayed from the prompt's
    and the output's token ids (vLLM ``return_token_ids``). Returns the estimate and whether it is
    consistent: a step that yielded more tokens than were drafted means merged steps."""
    k = arm.num_speculative_tokens
    prompt, output = tap.prompt_token_ids, tap.token_ids
    if not k or not prompt or not tap.has_token_ids or sum(tap.tokens_per_chunk) != len(output):
        return None, False
    lo = int(arm.speculative.get("prompt_lookup_min") or arm.speculative.get("prompt_lookup_max") or 5)
    hi = int(arm.speculative.get("prompt_lookup_max") or lo)
    sizes = tap.tokens_per_chunk
    lookup = _NgramLookup([*prompt, *output[: sizes[0]]] if sizes else list(prompt), lo, hi)
    at = sizes[0] if sizes else 0
    drafts = drafted = accepted = 0
    consistent = True
    for n in sizes[1:]:
        if n <= 0:
            continue
        proposed = lookup.proposal(k)
        if proposed:
            drafts += 1
            drafted += proposed
            accepted += n - 1
        consistent = consistent and n <= proposed + 1
        lookup.extend(output[at : at + n])
        at += n
    if not drafts:
        return SpecStats(0, 0, 0, None), consistent
    return SpecStats(drafts, drafted, accepted, 1.0 + accepted / drafts), consistent
