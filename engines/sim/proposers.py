"""Draft proposers: what each speculative method proposes, and how much of it the target accepts.

Model-free methods really search: `NgramProposer` looks the last n tokens up in prompt + output
(n from prompt_lookup_max down to prompt_lookup_min, earliest occurrence, as vLLM's proposer does)
and proposes what followed; `SuffixProposer` also searches the outputs of earlier requests, so it
learns across requests. A proposal is accepted up to the first token that differs from the target's.

Model-based methods (draft_model, eagle, eagle3, mtp) draft k tokens every step; the number the target
accepts is drawn position by position from the method's acceptance profile for the request's
category: conditional rates alpha_i = P(position i accepted | positions < i accepted).
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict

from specproxy.engines.sim.config import SpeculativeConfig

# Conditional per-position acceptance, chain drafting, temperature 0, Llama-3.1-8B-Instruct targets.
# Calibrated so EAGLE-3 chain 3 on MT-bench-like chat gives a mean acceptance length of ~2.22
# (1 + .66 + .66*.56 + .66*.56*.52), which with the H100 cost fit reproduces EAGLE-3 Table 3's
# throughput ratios by batch size; categories are ordered as in EAGLE-3 Table 1 (code highest,
# summarization lowest). Positions past a list's end reuse its last rate times 0.95 per extra position.
ACCEPTANCE: dict[str, dict[str, tuple[float, ...]]] = {
    "eagle3": {
        "chat": (0.66, 0.56, 0.52, 0.48, 0.44, 0.41),
        "summarization": (0.62, 0.52, 0.47, 0.43, 0.40, 0.37),
        "code_edit": (0.80, 0.72, 0.66, 0.61, 0.57, 0.53),
        "extraction": (0.75, 0.66, 0.60, 0.55, 0.50, 0.46),
        "rag_qa": (0.68, 0.58, 0.52, 0.48, 0.44, 0.41),
    },
    "eagle": {
        "chat": (0.62, 0.52, 0.47, 0.42, 0.38, 0.35),
        "summarization": (0.55, 0.45, 0.40, 0.36, 0.33, 0.30),
        "code_edit": (0.72, 0.63, 0.57, 0.52, 0.48, 0.44),
        "extraction": (0.67, 0.57, 0.51, 0.46, 0.42, 0.39),
        "rag_qa": (0.60, 0.50, 0.45, 0.41, 0.37, 0.34),
    },
    # MTP heads trained with the model: high first-token acceptance (DeepSeek-V3 reports 85-90 %).
    "mtp": {
        "chat": (0.86, 0.72, 0.62, 0.55),
        "summarization": (0.82, 0.66, 0.56, 0.49),
        "code_edit": (0.90, 0.79, 0.70, 0.63),
        "extraction": (0.88, 0.75, 0.66, 0.58),
        "rag_qa": (0.85, 0.70, 0.60, 0.53),
    },
    # A same-family small model (e.g. Llama-3.2-1B for 8B): flatter, since it conditions on its own drafts.
    "draft_model": {
        "chat": (0.78, 0.74, 0.71, 0.69, 0.67, 0.65),
        "summarization": (0.74, 0.70, 0.67, 0.65, 0.63, 0.61),
        "code_edit": (0.85, 0.82, 0.80, 0.78, 0.76, 0.74),
        "extraction": (0.80, 0.76, 0.73, 0.71, 0.69, 0.67),
        "rag_qa": (0.77, 0.73, 0.70, 0.68, 0.66, 0.64),
    },
}


def acceptance_rates(spec: SpeculativeConfig, category: str) -> tuple[float, ...]:
    """The k conditional acceptance rates a model-based method uses for one category."""
    k = spec.num_speculative_tokens
    if spec.synthetic_acceptance_rates:
        base = spec.synthetic_acceptance_rates
    elif spec.synthetic_acceptance_rate is not None:
        return (spec.synthetic_acceptance_rate,) * k
    else:
        table = ACCEPTANCE.get(spec.method, ACCEPTANCE["eagle3"])
        base = table.get(category, table["chat"])
    rates = list(base[:k])
    while len(rates) < k:
        rates.append(rates[-1] * 0.95)
    return tuple(rates)


def draw_accepted(rng: random.Random, rates: tuple[float, ...], k: int) -> int:
    """Accepted draft count for one verification: leading successes over the chain."""
    accepted = 0
    for i in range(k):
        if rng.random() >= rates[i]:
            break
        accepted += 1
    return accepted


class NgramIndex:
    """The tokens so far, searched for the earliest earlier occurrence of their last n tokens.

    The tokens are also kept packed (4 bytes each) so that a lookup is one ``bytes.find`` in C: no
    index to build when a request arrives (a per-prompt-token Python loop was the n-gram simulator's
    largest cost inside its event loop, enough to put it behind its clock at high concurrency)."""

    __slots__ = ("tokens", "_lo", "_hi", "_packed")

    def __init__(self, tokens: list[int], lo: int, hi: int) -> None:
        self.tokens = tokens
        self._lo = lo
        self._hi = hi
        self._packed = bytearray(array("I", tokens))

    def append(self, new: list[int]) -> None:
        self.tokens.extend(new)
        self._packed += array("I", new)

    def longest_match(self) -> tuple[int, int] | None:
        """(n, position after the earliest occurrence) of the longest n-gram (hi..lo) ending the tokens,
        among occurrences followed by a token."""
        size = len(self.tokens)
        packed = self._packed
        end = (size - 1) * 4  # an occurrence must end before the last token
        for n in range(self._hi, self._lo - 1, -1):
            if size <= n:
                continue
            pattern = bytes(packed[(size - n) * 4 :])
            at = packed.find(pattern, 0, end)
            while at >= 0 and at % 4:  # a match across token boundaries
                at = packed.find(pattern, at + 1, end)
            if at >= 0:
                return n, at // 4 + n
        return None

    def propose(self, k: int) -> list[int]:
        """The up-to-k tokens that followed the longest matching n-gram's earliest occurrence."""
        match = self.longest_match()
        if match is None:
            return []
        return self.tokens[match[1] : match[1] + k]


class SuffixCache:
    """Outputs of finished requests, indexed by their 4-grams, shared by every request of a server."""

    NGRAM = 4

    def __init__(self, max_entries: int = 400_000) -> None:
        self._map: OrderedDict[tuple[int, ...], tuple[list[int], int]] = OrderedDict()
        self._max = max_entries

    def add(self, output: list[int]) -> None:
        n = self.NGRAM
        for m in range(n, len(output)):
            key = tuple(output[m - n : m])
            self._map[key] = (output, m)
            self._map.move_to_end(key)
        while len(self._map) > self._max:
            self._map.popitem(last=False)

    def propose(self, suffix: list[int], k: int) -> list[int]:
        if len(suffix) < self.NGRAM:
            return []
        hit = self._map.get(tuple(suffix[-self.NGRAM :]))
        if hit is None:
            return []
        output, m = hit
        return output[m : m + k]


class SuffixProposer:
    """Suffix decoding: the request's own prompt + output first, then earlier requests' outputs.

    Speculation length adapts to the evidence, as suffix trees do: a longer matched context earns a
    longer proposal, up to num_speculative_tokens and the tree depth.
    """

    __slots__ = ("_index", "_cache", "_k")

    def __init__(self, tokens: list[int], cache: SuffixCache, spec: SpeculativeConfig) -> None:
        self._index = NgramIndex(tokens, 2, 8)
        self._cache = cache
        self._k = min(spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth)

    @property
    def tokens(self) -> list[int]:
        return self._index.tokens

    def append(self, new: list[int]) -> None:
        self._index.append(new)

    def propose(self) -> list[int]:
        tokens = self._index.tokens
        own = self._index.longest_match()
        # A match in earlier outputs is at least SuffixCache.NGRAM long; prefer whichever is longer.
        if own is None or own[0] < SuffixCache.NGRAM:
            shared = self._cache.propose(tokens, self._k)
            if shared:
                return shared
        if own is None:
            return []
        n, follow = own
        return tokens[follow : follow + min(self._k, 2 * n)]
