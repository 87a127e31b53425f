"""The latency a streaming client feels, per call: inter-token latency (ITL) and time per output token.

The tap (:class:`~.sse.CompletionTap`) only appends the arrival time of each content chunk (a chunk
that carries output text or tokens; a role-only or usage-only chunk is not one) to a list; everything
here runs once, when the call's span is finished, so the relay's per-chunk work stays one
``list.append``.

- **ITL**: the gaps between consecutive content chunks' arrivals at the proxy (the first gap starts at
  the first content chunk, so the TTFT is not one of them). Chunks that arrive in one network read
  share its arrival time: their gap is 0, as a client reading that socket would see it. A call with
  fewer than two content chunks has no gaps, and its ITL figures are None.
- **Percentiles** of a call's gaps use linear interpolation between the two nearest ranks (NumPy's
  default ``linear`` method, DuckDB's ``quantile_cont``, what ``vllm bench serve`` reports): for gaps
  sorted as g[0] ≤ … ≤ g[n−1], the q-quantile is g[i] + (g[i+1] − g[i]) · f with i + f = q · (n − 1).
  ``itl_max_s`` is the largest gap: the longest stall after the first token.
- **TPOT** is vLLM's: (e2e − ttft) / (completion_tokens − 1), with the span's completion tokens
  whatever their source. None for fewer than two tokens, and where the time between tokens was not
  seen: a non-streamed call, or a stream whose whole answer came in one content chunk (vLLM's
  benchmark would report a TPOT near 0 there).
- ``chunk_gaps_us`` keeps each gap, in whole microseconds, comma-separated (``"8123,10044,0,9987"``),
  so any distribution can be recomputed in SQL; ``chunk_tokens`` keeps the tokens of each content
  chunk where they are known exactly (the chunk's ``token_ids``, or vLLM's continuous usage), else None.

Example::

    lat = chunk_latency([0.100, 0.110, 0.130], [1, 2, 1], tokens_exact=True)
    lat.gaps_us, lat.tokens, lat.p50_s     # '10000,20000', '1,2,1', 0.015 (seconds, ± float error)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ITL_QUANTILES = (0.50, 0.95, 0.99)


@dataclass(frozen=True, slots=True)
class ChunkLatency:
    """One call's gaps between content chunks and what follows from them (None: fewer than 2 chunks)."""

    gaps_us: str | None
    tokens: str | None
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    max_s: float | None


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile of values sorted ascending, by linear interpolation between the nearest ranks.

    >>> quantile([1.0, 2.0, 3.0, 4.0], 0.5)
    2.5
    >>> quantile([1.0, 2.0, 3.0, 4.0], 0.25)
    1.75
    """
    pos = q * (len(sorted_values) - 1)
    i = int(pos)
    if i + 1 >= len(sorted_values):
        return sorted_values[-1]
    lo, hi = sorted_values[i], sorted_values[i + 1]
    return lo + (hi - lo) * (pos - i)


def chunk_latency(times: Sequence[float], tokens: Sequence[int], *, tokens_exact: bool) -> ChunkLatency:
    """The ITL figures of one call from its content chunks' arrival times (seconds, any clock) and
    tokens per chunk (kept only when ``tokens_exact``)."""
    token_text = ",".join(map(str, tokens)) if tokens_exact and tokens else None
    if len(times) < 2:
        return ChunkLatency(None, token_text, None, None, None, None)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    gaps_us = ",".join([str(round(g * 1e6)) for g in gaps])
    gaps.sort()
    p50, p95, p99 = (quantile(gaps, q) for q in ITL_QUANTILES)
    return ChunkLatency(gaps_us, token_text, p50, p95, p99, gaps[-1])


def tpot_s(e2e_s: float | None, ttft_s: float | None, completion_tokens: int | None) -> float | None:
    """vLLM's time per output token, (e2e − ttft) / (tokens − 1); None when it is not defined.

    >>> tpot_s(1.0, 0.1, 10)
    0.1
    >>> tpot_s(1.0, 0.1, 1) is None
    True
    """
    if e2e_s is None or ttft_s is None or completion_tokens is None or completion_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (completion_tokens - 1)
