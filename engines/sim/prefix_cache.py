"""Automatic prefix caching, as vLLM V1 does it by default: full 16-token blocks, chained hashes, LRU.

A request whose prompt starts with blocks an earlier request computed skips their prefill (vLLM
always recomputes at least the last prompt token). Only prompt blocks are cached here.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_SIZE = 16


class PrefixCache:
    def __init__(self, capacity_tokens: int) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._capacity = max(1, capacity_tokens // BLOCK_SIZE)

    @staticmethod
    def block_hashes(token_ids: list[int]) -> list[int]:
        hashes = []
        parent = 0
        for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
            parent = hash((parent, tuple(token_ids[start : start + BLOCK_SIZE])))
            hashes.append(parent)
        return hashes

    def cached_tokens(self, hashes: list[int], prompt_len: int) -> int:
        """Tokens of the prompt already in the cache (leading full blocks), at most prompt_len - 1."""
        hits = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hits += 1
        return min(hits * BLOCK_SIZE, prompt_len - 1)

    def insert(self, hashes: list[int]) -> None:
        blocks = self._blocks
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self._capacity:
            blocks.popitem(last=False)
