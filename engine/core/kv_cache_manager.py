"""Per-request block tables on top of :class:`BlockPool`, with hash-chain prefix caching. Pure Python.

Follows vLLM v1's ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``): a request's block table grows as
it is scheduled; blocks that become full are registered in the prefix cache under a hash chain
``h_i = H(h_{i-1}, tokens of block i)`` so an identical prefix maps to the same physical blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvscope.engine.core.block_pool import BlockPool, KVCacheBlock
from kvscope.engine.core.request import Request


def hash_block_tokens(parent_block_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash-chain value of one full block: SHA-256 of the parent hash and the block's token ids.

    Encoding: the parent as 32 big-endian bytes (32 zero bytes for the first block), then each token id as a
    little-endian uint32. SHA-256 instead of Python's ``hash()`` because the latter is salted per process
    (PYTHONHASHSEED) and weak against crafted collisions (vLLM's ``sha256`` prefix-caching hash for the same
    reasons). Returns the full 256-bit digest as an int. Raises struct.error for ids outside [0, 2**32).
    """
    parent = (parent_block_hash or 0).to_bytes(32, "big")
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return int.from_bytes(hashlib.sha256(parent + payload).digest(), "big")


class KVCacheManager:
    """Allocates and frees block tables; ``block_size`` tokens per block."""

    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        """request_id → how many of its leading blocks are registered in the prefix cache."""

    @property
    def usage(self) -> float:
        """KV cache usage in [0, 1]: blocks in use / total blocks."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, including evictable ones holding a cached prefix."""
        return self.block_pool.get_num_free_blocks()

    def update_block_hashes(self, request: Request) -> list[int]:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens; returns it."""
        hashes, size = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // size):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tokens[i * size : (i + 1) * size]))
        return hashes

    def reads_prefix_cache(self, request: Request) -> bool:
        """Whether ``request`` looks its prompt up in the prefix cache: caching is on and it asks for no
        prompt logprobs (a cached position has no logits to score; vLLM v1's
        ``Request.skip_reading_prefix_cache``). Its blocks are cached either way."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix-cache hit for a request with no blocks: (hit blocks, hit tokens).

        Only full blocks match, and never the request's last known token, so at least one token is computed
        and yields logits: at most ``(num_tokens - 1) // block_size`` blocks. Nothing is touched here;
        pass the blocks to :meth:`allocate_slots`. Returns ``([], 0)`` unless :meth:`reads_prefix_cache`.
        """
        if not self.reads_prefix_cache(request):
            return [], 0
        hashes = self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[int] | None:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens after its computed ones.

        ``new_computed_blocks`` are prefix-cache hits from :meth:`get_computed_blocks` (they count as computed
        on top of ``request.num_computed_tokens``); they are touched and prepended. Full blocks after this
        step are registered in the prefix cache. Returns the ids of the freshly allocated blocks (possibly
        empty), or None — with nothing allocated or touched — when the pool cannot supply them (free hit
        blocks count against the free blocks because touching takes them out of the free queue).
        """
        hits = new_computed_blocks or []
        if hits and not self.enable_caching:
            raise ValueError("new_computed_blocks given while prefix caching is disabled")
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(hits)
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(hits)
        req_blocks.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(
                request, req_blocks, min(num_computed + num_new_tokens, request.num_tokens)
            )
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix head is evicted last. Idempotent."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks that lie wholly past its first ``num_tokens`` positions (rejected draft
        tokens of speculative decoding; never registered in the prefix cache, which only holds blocks full of
        known tokens)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (physical block ids, in token order); [] for an unknown request."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        hashes = self.update_block_hashes(request)
        self.block_pool.cache_full_blocks(req_blocks[num_cached:num_full], hashes[num_cached:num_full])
        self.num_cached_block[request.request_id] = num_full
