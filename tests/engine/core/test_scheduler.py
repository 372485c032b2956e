"""Scheduler: token budget, chunked prefill, mixed steps, max_num_seqs, preemption, prefix hits."""

from __future__ import annotations

import pytest

from kvscope.engine.core.block_pool import BlockPool
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.request import RequestStatus
from kvscope.engine.core.scheduler_output import SchedulerOutput
from kvscope.engine.errors import PromptTooLongError
from tests.engine.core.factories import make_request, make_scheduler, prompt, step


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, bool, bool]]:
    """(request_id, num_computed_tokens, num_scheduled_tokens, sample, is_new) per scheduled request."""
    return [
        (s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.sample, s.is_new)
        for s in out.scheduled
    ]


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    req = make_request("a", prompt(1000, 100))
    sched.add_request(req)
    chunks, tables = [], []
    for _ in range(4):
        out, finished = step(sched)
        assert finished == []
        chunks += summary(out)
        tables.append(out.scheduled[0].block_ids)
        assert (
            out.scheduled[0].token_ids == req.prompt_token_ids[chunks[-1][1] : chunks[-1][1] + chunks[-1][2]]
        )
    assert chunks == [
        ("a", 0, 32, False, True),
        ("a", 32, 32, False, False),
        ("a", 64, 32, False, False),
        ("a", 96, 4, True, False),
    ]
    assert tables == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]]
    assert req.output_token_ids == [5] and req.num_computed_tokens == 100
    out, _ = step(sched)
    assert summary(out) == [("a", 100, 1, True, False)] and out.scheduled[0].token_ids == [5]


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    sched = make_scheduler(long_prefill_token_threshold=8)
    sched.add_request(make_request("a", prompt(0, 20)))
    sizes = [summary(step(sched)[0])[0][2] for _ in range(4)]
    assert sizes == [8, 8, 4, 1]


def test_one_step_mixes_decodes_and_a_new_prefill_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("a", prompt(0, 20)))
    step(sched)
    sched.add_request(make_request("b", prompt(100, 50)))
    out, _ = step(sched)
    assert summary(out) == [("a", 20, 1, True, False), ("b", 0, 31, False, True)]
    assert out.scheduled[1].token_ids == prompt(100, 31)
    assert (out.total_num_scheduled_tokens, out.num_decode_tokens, out.num_prefill_tokens) == (32, 1, 31)
    assert (out.num_running, out.num_waiting) == (2, 0)
    assert out.scheduled[0].block_ids == [0, 1] and out.scheduled[1].block_ids == [2, 3]
    out, _ = step(sched)
    assert summary(out) == [("a", 21, 1, True, False), ("b", 31, 19, True, False)]


def test_budget_exhausted_by_running_requests_leaves_new_ones_waiting() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", prompt(0, 40)))
    sched.add_request(make_request("b", prompt(100, 4)))
    out, _ = step(sched)
    assert summary(out) == [("a", 0, 16, False, True)]
    assert (out.num_running, out.num_waiting) == (1, 1)


def test_max_num_seqs_caps_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, prompt(10 * i, 4), max_tokens=1 if rid == "a" else 4))
    out, finished = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert (out.num_running, out.num_waiting) == (2, 1)
    assert [r.request_id for r in finished] == ["a"]
    out, _ = step(sched)
    assert summary(out) == [("b", 4, 1, True, False), ("c", 0, 4, True, True)]
    assert out.finished_req_ids == {"a"}


def test_waiting_queue_is_fcfs_without_overtaking() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    sched.add_request(make_request("a", prompt(0, 12)))
    sched.add_request(make_request("big", prompt(100, 8)))
    sched.add_request(make_request("small", prompt(200, 2)))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]


def _preemption_scheduler(enable_caching: bool):
    sched = make_scheduler(
        num_blocks=4, block_size=4, max_model_len=16, max_num_seqs=2, enable_caching=enable_caching
    )
    reqs = [
        make_request("a", prompt(0, 6), max_tokens=5),
        make_request("b", prompt(100, 6), max_tokens=5),
        make_request("c", prompt(200, 4), max_tokens=1),
    ]
    for req in reqs:
        sched.add_request(req)
    return sched, reqs


def test_out_of_blocks_preempts_the_newest_running_request() -> None:
    sched, (a, b, c) = _preemption_scheduler(enable_caching=False)
    out, _ = step(sched)
    assert summary(out) == [("a", 0, 6, True, True), ("b", 0, 6, True, True)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1], [2, 3]]
    step(sched)
    step(sched)  # a and b now hold 9 tokens each, 8 computed, all 4 blocks in use
    out, _ = step(sched)  # a needs a 3rd block: b is preempted, its blocks freed (3 first, then 2)
    assert summary(out) == [("a", 8, 1, True, False)]
    assert out.scheduled[0].block_ids == [0, 1, 3]
    assert out.preempted_req_ids == {"b"}
    assert (b.status, b.num_computed_tokens, b.stats.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert sched.kv_cache_manager.get_block_ids("b") == []
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # c not admitted in a preempting step
    assert sched.get_stats().num_preemptions_total == 1
    out, finished = step(sched)  # b (9 tokens, 3 blocks) does not fit in 1 free block; c may not overtake
    assert summary(out) == [("a", 9, 1, True, False)]
    assert finished == [a] and a.status == RequestStatus.FINISHED_LENGTH
    out, _ = step(sched)
    assert summary(out) == [("b", 0, 9, True, True), ("c", 0, 4, True, True)]
    assert out.scheduled[0].token_ids == prompt(100, 6) + [5, 5, 5]
    assert [s.block_ids for s in out.scheduled] == [[2, 3, 1], [0]]
    assert out.finished_req_ids == {"a"}
    assert (b.status, b.num_cached_tokens, b.output_token_ids) == (RequestStatus.RUNNING, 0, [5, 5, 5, 5])


def test_preempted_request_resumes_from_its_surviving_cached_blocks() -> None:
    sched, (a, b, c) = _preemption_scheduler(enable_caching=True)
    for _ in range(4):
        step(sched)  # step 4 preempts b; a takes b's block 3 and evicts its hash; b's block 2 stays cached
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]
    out, _ = step(sched)
    assert summary(out) == [("b", 4, 5, True, True), ("c", 0, 4, True, True)]
    assert out.scheduled[0].token_ids == [104, 105, 5, 5, 5]
    assert [s.block_ids for s in out.scheduled] == [[2, 3, 1], [0]]
    assert b.num_cached_tokens == 0
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (16, 0)


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    sched = make_scheduler(
        num_blocks=4, block_size=4, max_model_len=16, long_prefill_token_threshold=4, enable_caching=False
    )
    for rid, start in (("a", 0), ("b", 100)):
        sched.add_request(make_request(rid, prompt(start, 6), max_tokens=8))
    for _ in range(4):
        step(sched)  # chunks 4+2, then 2 decodes: 9 tokens each, blocks a [0, 2], b [1, 3]
    out, _ = step(sched)  # b's 4-token resume chunk would fit in the free block, but not in this step
    assert summary(out) == [("a", 8, 1, True, False)] and out.preempted_req_ids == {"b"}
    assert out.scheduled[0].block_ids == [0, 2, 3] and list(sched.waiting) == [sched.requests["b"]]
    out, _ = step(sched)
    assert summary(out) == [("a", 9, 1, True, False), ("b", 0, 4, False, True)]
    assert out.scheduled[1].block_ids == [1]


def test_a_request_that_preempts_itself_stops_the_running_pass() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, enable_caching=False)
    a = make_request("a", prompt(0, 12), max_tokens=8)
    sched.add_request(a)
    step(sched)  # 12 tokens in blocks 0-2; position 12 needs a 4th block
    pool = sched.kv_cache_manager.block_pool
    stolen = pool.get_new_blocks(1)
    out, _ = step(sched)
    assert out.scheduled == [] and out.preempted_req_ids == {"a"}
    assert a.status == RequestStatus.PREEMPTED and list(sched.waiting) == [a] and sched.running == []
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks(stolen)
    out, _ = step(sched)
    assert summary(out) == [("a", 0, 13, True, True)]
    assert out.scheduled[0].block_ids == [2, 1, 0, 3]


def test_identical_prompts_in_one_step_share_blocks() -> None:
    sched = make_scheduler(num_blocks=8, max_model_len=128)
    a, b = make_request("a", prompt(0, 40)), make_request("b", prompt(0, 40))
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert summary(out) == [("a", 0, 40, True, True), ("b", 32, 8, True, True)]
    assert [s.block_ids for s in out.scheduled] == [[0, 1, 2], [0, 1, 3]]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 32)
    assert [blk.ref_cnt for blk in sched.kv_cache_manager.block_pool.blocks[:4]] == [2, 2, 1, 1]
    assert out.kv_cache_usage == 0.5


def test_prompt_that_is_a_multiple_of_block_size_recomputes_its_last_block() -> None:
    sched = make_scheduler()
    a, b = make_request("a", prompt(0, 32)), make_request("b", prompt(0, 32))
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert summary(out) == [("a", 0, 32, True, True), ("b", 16, 16, True, True)]
    assert b.num_cached_tokens == 16


def test_add_request_validates_prompt() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(PromptTooLongError, match="maximum context length is 16"):
        sched.add_request(make_request("a", prompt(0, 17)))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("e", []))
    sched.add_request(make_request("b", prompt(0, 16)))
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add_request(make_request("b", prompt(0, 4)))


def test_kv_cache_must_hold_max_model_len() -> None:
    kv = KVCacheManager(BlockPool(4), 4)
    from kvscope.engine.config import CacheConfig, SchedulerConfig
    from kvscope.engine.core.scheduler import Scheduler

    with pytest.raises(ValueError, match="holds 16 tokens, fewer than max_model_len=17"):
        Scheduler(SchedulerConfig(), CacheConfig(block_size=4), kv, 17)


def test_empty_scheduler_returns_an_empty_output() -> None:
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.total_num_scheduled_tokens == 0 and not sched.has_unfinished_requests()
