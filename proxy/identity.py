"""Greedy-output identity: does a candidate arm produce exactly the baseline's output?

Only temperature-0, n=1 requests are comparable (:func:`is_comparable`). :func:`compare` takes the
baseline's and the candidate's :class:`~specproxy.proxy.upstream.sse.CompletionTap` (or anything with the same
``text()``, ``token_ids``, ``has_token_ids``, ``margins``, ``token_texts``) for one ``request_id`` and
returns an :class:`Identity`: token ids are compared when both sides returned them, text otherwise;
``first_divergence`` is a token index (token ids) or a character index (text); ``divergence_margin`` is
the baseline's top-1 minus top-2 logprob at the diverging token, when logprobs were returned. A small
margin means a near-tie that numerics can flip (vLLM promises losslessness only up to numerics); a
large one is a real mismatch.

Example::

    if is_comparable(body):
        ident = compare(baseline_tap, candidate_tap)
        record.identical, record.first_divergence, record.divergence_margin = ident
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol


class Output(Protocol):
    @property
    def token_ids(self) -> list[int]: ...

    @property
    def has_token_ids(self) -> bool: ...

    @property
    def margins(self) -> list[float | None]: ...

    @property
    def token_texts(self) -> list[str]: ...

    def text(self) -> str: ...


class Identity(NamedTuple):
    identical: bool | None
    first_divergence: int | None
    divergence_margin: float | None


NOT_COMPARABLE = Identity(None, None, None)


def is_comparable(body: dict[str, Any]) -> bool:
    """Greedy and single-choice: temperature explicitly 0, n absent or 1 (best_of/beam search off)."""
    temperature = body.get("temperature")
    if temperature is None or isinstance(temperature, bool) or not isinstance(temperature, int | float):
        return False
    if temperature != 0:
        return False
    n = body.get("n", 1)
    return n in (1, None) and body.get("best_of", 1) in (1, None) and not body.get("use_beam_search")


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first position where the sequences differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _token_at_char(token_texts: Sequence[str], char_index: int) -> int | None:
    pos = 0
    for i, t in enumerate(token_texts):
        pos += len(t)
        if char_index < pos:
            return i
    return None


def _margin_at(out: Output, token_index: int | None) -> float | None:
    if token_index is None or token_index >= len(out.margins):
        return None
    return out.margins[token_index]


def compare(baseline: Output, candidate: Output) -> Identity:
    """Compare two outputs of the same greedy request (see the module docstring)."""
    if baseline.has_token_ids and candidate.has_token_ids:
        idx = first_difference(baseline.token_ids, candidate.token_ids)
        if idx is None:
            return Identity(True, None, None)
        margin = _margin_at(baseline, idx)
        if margin is None:
            margin = _margin_at(candidate, idx)
        return Identity(False, idx, margin)
    a, b = baseline.text(), candidate.text()
    idx = first_difference(a, b)
    if idx is None:
        return Identity(True, None, None)
    margin = _margin_at(baseline, _token_at_char(baseline.token_texts, idx))
    if margin is None:
        margin = _margin_at(candidate, _token_at_char(candidate.token_texts, idx))
    return Identity(False, idx, margin)
