"""What one replica most likely still holds in its prefix cache: an approximate, bounded LRU of block hashes.

The gateway never sees the replica's cache; it remembers the blocks of the prompts it sent there, up to the
replica's KV capacity in blocks, and forgets the least recently used first, as the engine's free-block queue
evicts. Within one prompt the later blocks are remembered as older than the earlier ones (the engine frees a
finished request's blocks tail first, vLLM ``KVCacheManager.free``), so eviction cuts prefixes from their end
and a match is always a prefix. The index resets when the replica restarts (its cache is empty then).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """A bounded LRU set of chained block hashes (gateway/routing/prefix.py) for one replica."""

    def __init__(self, capacity_blocks: int) -> None:
        """``capacity_blocks``: blocks remembered at most (the replica's KV capacity). Raises ValueError below
        1."""
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` this replica most likely holds (stops at the first miss)."""
        matched = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            matched += 1
        return matched

    def insert(self, hashes: Sequence[int]) -> None:
        """Remember ``hashes`` (one prompt's blocks) as just used: the first block most recent, the last block
        the first of them to go; then evict least recently used blocks down to ``capacity_blocks``."""
        blocks = self._blocks
        for block_hash in reversed(hashes):
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
