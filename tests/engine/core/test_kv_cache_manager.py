"""KVCacheManager: block tables, hash chain, prefix sharing, all-or-nothing allocation."""

from __future__ import annotations

import hashlib

from kvscope.engine.core.block_pool import BlockPool
from kvscope.engine.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from tests.engine.core.factories import make_request, prompt


def make_manager(num_blocks: int = 8, block_size: int = 16, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, enable_caching), block_size, enable_caching)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def test_hash_chain_is_sha256_of_parent_and_uint32_tokens() -> None:
    root = hash_block_tokens(None, [1, 2, 3])
    assert root == 0x3DB346A400AB6B8DB792FCF156443A8885B27DB208362DCF77084F8C7648E645
    encoded = bytes(32) + b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00"
    assert root == int.from_bytes(hashlib.sha256(encoded).digest(), "big")
    child = hash_block_tokens(root, [4, 5, 6])
    assert child == 0x687B49FFCD9B34AE3999CA282DA7DC547D1C9C54FCE3720607B8D863257AE9A0
    assert hash_block_tokens(None, [4, 5, 6]) != child


def test_allocate_prompt_caches_only_full_blocks() -> None:
    kv = make_manager()
    req = make_request("a", prompt(100, 40))
    assert kv.allocate_slots(req, 40) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert req.block_hashes == [
        hash_block_tokens(None, prompt(100, 16)),
        hash_block_tokens(req.block_hashes[0], prompt(116, 16)),
    ]
    blocks = kv.req_to_blocks["a"]
    assert [b.block_hash for b in blocks] == [*req.block_hashes, None]
    assert kv.usage == 0.375 and kv.num_free_blocks == 5


def test_identical_prompts_share_full_blocks() -> None:
    kv = make_manager()
    a, b = make_request("a", prompt(100, 40)), make_request("b", prompt(100, 40))
    kv.allocate_slots(a, 40)
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit_tokens == 32
    assert kv.allocate_slots(b, 8, hits) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[:4]] == [2, 2, 1, 1]
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[:4]] == [1, 1, 0, 1]
    assert free_ids(kv) == [4, 5, 6, 7, 2]


def test_hit_never_covers_the_last_prompt_token() -> None:
    kv = make_manager()
    a, b = make_request("a", prompt(0, 32)), make_request("b", prompt(0, 32))
    kv.allocate_slots(a, 32)
    assert len(a.block_hashes) == 2
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0] and num_hit_tokens == 16


def test_hit_on_freed_blocks_removes_them_from_the_free_queue() -> None:
    kv = make_manager()
    a = make_request("a", prompt(100, 40))
    kv.allocate_slots(a, 40)
    kv.free(a)
    assert free_ids(kv) == [3, 4, 5, 6, 7, 2, 1, 0]
    b = make_request("b", prompt(100, 40) + [7])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 32
    assert kv.allocate_slots(b, 9, hits) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert free_ids(kv) == [4, 5, 6, 7, 2]


def test_allocation_failure_allocates_and_touches_nothing() -> None:
    kv = make_manager(num_blocks=4)
    a = make_request("a", prompt(100, 40))
    kv.allocate_slots(a, 40)
    kv.free(a)  # queue: 3, 2, 1(cached), 0(cached)
    b = make_request("b", prompt(100, 32) + prompt(500, 48))  # 80 tokens: 2 hit + 3 new blocks > 4 - 2
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 32
    assert kv.allocate_slots(b, 48, hits) is None
    assert kv.get_block_ids("b") == [] and "b" not in kv.req_to_blocks
    assert free_ids(kv) == [3, 2, 1, 0]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [0, 0, 0, 0]
    c = make_request("c", prompt(100, 32) + prompt(500, 32))  # 64 tokens: 2 hit + 2 new blocks fit exactly
    hits, _ = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 32, hits) == [3, 2]
    assert kv.get_block_ids("c") == [0, 1, 3, 2] and kv.num_free_blocks == 0


def test_decode_grows_the_table_and_caches_blocks_as_they_fill() -> None:
    kv = make_manager(block_size=4)
    req = make_request("a", prompt(10, 3))
    assert kv.allocate_slots(req, 3) == [0]
    req.num_computed_tokens = 3
    req.append_output_token_ids([50])
    assert kv.allocate_slots(req, 1) == []
    assert kv.req_to_blocks["a"][0].block_hash == hash_block_tokens(None, [10, 11, 12, 50])
    req.num_computed_tokens = 4
    req.append_output_token_ids([51])
    assert kv.allocate_slots(req, 1) == [1]
    assert kv.get_block_ids("a") == [0, 1] and len(req.block_hashes) == 1


def test_chunked_prefill_hashes_known_tokens_but_caches_only_computed_blocks() -> None:
    kv = make_manager(block_size=4)
    req = make_request("a", prompt(0, 10))
    assert kv.allocate_slots(req, 6) == [0, 1]
    assert len(req.block_hashes) == 2
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, False]
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 4) == [2]
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, True, False]


def test_caching_disabled_has_no_hits_and_no_hashes() -> None:
    kv = make_manager(enable_caching=False)
    a, b = make_request("a", prompt(0, 40)), make_request("b", prompt(0, 40))
    kv.allocate_slots(a, 40)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert a.block_hashes == [] and kv.block_pool.cached_block_hash_to_block == {}
    assert kv.allocate_slots(b, 40) == [3, 4, 5]


def test_free_is_idempotent_and_releases_tail_first() -> None:
    kv = make_manager(num_blocks=4)
    req = make_request("a", prompt(0, 40))
    kv.allocate_slots(req, 40)
    kv.free(req)
    kv.free(req)
    assert free_ids(kv) == [3, 2, 1, 0] and kv.usage == 0.0
    assert kv.get_block_ids("a") == []
