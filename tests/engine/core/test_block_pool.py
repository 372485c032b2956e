"""BlockPool and its O(1) LRU free queue: exact block ids, eviction order, ref counts, cache map."""

from __future__ import annotations

import pytest

from kvscope.engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_queue_popleft_remove_append_are_linked_list_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft().block_id == 0
    queue.remove(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 0]
    assert queue.num_free_blocks == 4
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[2])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[3])
    for expected in (1, 3, 4, 0):
        assert queue.popleft().block_id == expected
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    assert queue.num_free_blocks == 0


def test_new_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(8)
    assert free_ids(pool) == list(range(8))
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 5
    assert pool.usage == 0.375


def test_blocks_freed_in_reverse_come_back_tail_first_after_older_free_blocks() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert ids(pool.get_new_blocks(6)) == [3, 4, 5, 6, 7, 2]
    assert ids(pool.get_new_blocks(2)) == [1, 0]
    assert pool.usage == 1.0


def test_shared_block_returns_to_queue_only_at_ref_cnt_zero() -> None:
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [1, 2, 3]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool) == [1, 2, 3, 0]
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([block])


def test_get_new_blocks_refuses_more_than_free() -> None:
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1


def test_cached_block_stays_findable_while_free_and_touch_takes_it_out_of_the_queue() -> None:
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b0, b1], [111, 222])
    pool.free_blocks([b1, b0])
    assert free_ids(pool) == [2, 3, 1, 0]
    assert pool.get_num_cached_free_blocks() == 2
    hit = pool.get_cached_block(111)
    assert hit is b0
    pool.touch([hit])
    assert b0.ref_cnt == 1 and b0.block_hash == 111
    assert free_ids(pool) == [2, 3, 1]
    assert pool.get_num_free_blocks() == 3
    assert pool.get_num_cached_free_blocks() == 1


def test_eviction_follows_lru_order_and_drops_the_hash() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [10, 20, 30])
    pool.free_blocks(reversed(blocks))  # queue: 3, 2(30), 1(20), 0(10)
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert pool.get_cached_block(30) is None and blocks[2].block_hash is None
    assert pool.get_cached_block(20) is blocks[1] and pool.get_cached_block(10) is blocks[0]
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(20) is None
    assert sorted(pool.cached_block_hash_to_block) == [10]


def test_duplicate_hash_keeps_both_holders_until_each_is_evicted() -> None:
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [7])
    pool.cache_full_blocks([second], [7])
    assert pool.get_cached_block(7) is first
    pool.free_blocks([first])
    assert ids(pool.get_new_blocks(2)) == [2, 0]  # block 0 evicted
    assert pool.get_cached_block(7) is second
    assert first.block_hash is None and second.block_hash == 7


def test_cache_full_blocks_skips_already_cached_and_is_a_no_op_without_caching() -> None:
    pool = BlockPool(2)
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([block], [1])
    pool.cache_full_blocks([block], [2])
    assert block.block_hash == 1 and list(pool.cached_block_hash_to_block) == [1]

    plain = BlockPool(2, enable_caching=False)
    block = plain.get_new_blocks(1)[0]
    plain.cache_full_blocks([block], [1])
    assert block.block_hash is None and plain.get_cached_block(1) is None


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BlockPool(0)
