"""Physical KV blocks: ref counts, an O(1) LRU free list and the prefix-cache map. Pure Python.

Algorithm from vLLM v1 (``vllm/v1/core/block_pool.py``, ``vllm/v1/core/kv_cache_utils.py``): every block is
either in use (``ref_cnt > 0``) or in the free queue. A free block may still hold a cached prefix
(``block_hash`` set): it stays findable through :meth:`BlockPool.get_cached_block` until
:meth:`BlockPool.get_new_blocks` pops it from the head of the free queue and evicts its hash. Callers free a
request's blocks tail-first, so the tail of a prefix is evicted before its head.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of ``block_size`` token slots in every layer's KV tensor."""

    block_id: int
    ref_cnt: int = 0
    """Requests holding the block; 0 means it sits in the free queue."""
    block_hash: int | None = None
    """Hash-chain value of the full block's tokens when it is in the prefix cache, else None."""
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, least recently freed first; every operation is O(1).

    Sentinel head and tail nodes (block_id -1) keep the link updates branch-free, as in vLLM v1.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block. Raises ValueError when the queue is empty."""
        first = self._head.next_free_block
        if first is None or first is self._tail:
            raise ValueError("no free blocks available")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue. Raises ValueError if it is not in the queue."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last). Raises ValueError if it is already queued."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in eviction order (O(n); for tests and stats)."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Owns blocks ``0 … num_blocks - 1`` (all free at start, handed out in id order) and the prefix cache.

    The cache maps a block hash to the blocks holding it (block_id → block); two requests that computed the
    same block before either was cached both register it, as vLLM v1's ``BlockHashToBlockMap`` does.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[int, dict[int, KVCacheBlock]] = {}

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the free queue (LRU first), evicting their cached hashes.

        Each returned block has ``ref_cnt == 1``. Raises ValueError if fewer blocks are free.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks, only {self.get_num_free_blocks()} are free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue tail in the order given.

        Pass a request's blocks in reverse so its tail blocks are evicted first (vLLM v1 ``free``).
        Raises ValueError on a block that is already free.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (prefix-cache hit); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int]) -> None:
        """Register full blocks under their hash-chain values (``blocks[i]`` ↔ ``block_hashes[i]``).

        Blocks already cached (a prefix hit) are left alone. No-op when caching is disabled.
        """
        if not self.enable_caching:
            return
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """A block holding ``block_hash`` (the first registered), or None on a miss."""
        holders = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(holders.values())) if holders else None

    def get_num_free_blocks(self) -> int:
        """Free blocks, including free blocks that still hold a cached prefix."""
        return self.free_block_queue.num_free_blocks

    def get_num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (O(cached blocks))."""
        return sum(
            1
            for holders in self.cached_block_hash_to_block.values()
            for block in holders.values()
            if block.ref_cnt == 0
        )

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, ``1 - free / num_blocks`` in [0, 1] (cached-but-free count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        holders = self.cached_block_hash_to_block.get(block.block_hash)
        if holders is not None:
            holders.pop(block.block_id, None)
            if not holders:
                del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
