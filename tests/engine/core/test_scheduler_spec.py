"""Scheduler side of speculative decoding with a scripted drafter: budgeting, rollback, block trimming, stop
checks inside an accepted run, no preemption for drafts."""

from __future__ import annotations

from kvscope.engine.config import CacheConfig, SchedulerConfig
from kvscope.engine.core.block_pool import BlockPool
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.request import RequestStatus
from kvscope.engine.core.scheduler import Scheduler
from tests.engine.core.factories import FakeClock, make_request


class ScriptedDrafter:
    """Proposes ``draft`` (cut to max_draft) for every decode step; records verifications."""

    def __init__(self, draft: list[int], allow: bool = True) -> None:
        self.draft = draft
        self.allow = allow
        self.verified: list[tuple[str, int, int]] = []
        self.max_drafts: list[int] = []
        self.dropped: list[str] = []

    def propose(self, request, max_draft):
        self.max_drafts.append(max_draft)
        return self.draft[:max_draft]

    def allows(self, num_decode_rows, drafts):
        return self.allow

    def on_verified(self, request, num_draft_tokens, num_accepted_tokens):
        self.verified.append((request.request_id, num_draft_tokens, num_accepted_tokens))

    def drop(self, request_id):
        self.dropped.append(request_id)


def scheduler(drafter, *, num_blocks=64, block_size=4, budget=2048, max_model_len=64) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=True), block_size, enable_caching=True)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget),
        CacheConfig(block_size=block_size),
        kv,
        max_model_len,
        clock=FakeClock(),
        drafter=drafter,
    )


def prefill(sched, request, first_token=50):
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, {request.request_id: [first_token]})


def test_a_decode_with_a_draft_is_scheduled_with_its_draft_and_rolled_back_past_rejections():
    drafter = ScriptedDrafter([60, 61, 62])
    sched = scheduler(drafter)
    a = make_request("a", list(range(10, 16)), max_tokens=20)  # 6 prompt tokens, blocks of 4
    prefill(sched, a)
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.token_ids == [50, 60, 61, 62] and item.spec_token_ids == [60, 61, 62]
    assert (
        item.num_computed_tokens == 6 and out.total_num_scheduled_tokens == 4 and out.num_decode_tokens == 4
    )
    assert a.num_computed_tokens == 10 and len(sched.kv_cache_manager.get_block_ids("a")) == 3
    sampled = {"a": [60, 77]}  # first draft token accepted, then the target's own token
    sched.update_from_output(out, sampled)
    assert a.output_token_ids == [50, 60, 77] and sampled == {"a": [60, 77]}
    assert a.num_computed_tokens == 8  # positions 8, 9 held rejected drafts: recomputed next step
    assert len(sched.kv_cache_manager.get_block_ids("a")) == 3  # 9 tokens need 3 blocks of 4
    assert drafter.verified == [("a", 3, 1)]
    assert (a.stats.spec_num_drafts, a.stats.spec_num_draft_tokens, a.stats.spec_num_accepted_tokens) == (
        1,
        3,
        1,
    )
    out = sched.schedule()
    assert out.scheduled[0].token_ids == [77, 60, 61, 62] and out.scheduled[0].num_computed_tokens == 8


def test_blocks_wholly_past_the_tokens_are_freed_after_a_rejection():
    drafter = ScriptedDrafter([60, 61, 62, 63, 64, 65])
    sched = scheduler(drafter, block_size=2)
    a = make_request("a", [10, 11, 12], max_tokens=20)
    prefill(sched, a)
    out = sched.schedule()  # 4 tokens known, computes positions 3..9: 5 blocks of 2
    assert len(sched.kv_cache_manager.get_block_ids("a")) == 5
    free_before = sched.kv_cache_manager.num_free_blocks
    sched.update_from_output(out, {"a": [99]})  # all rejected
    assert a.num_computed_tokens == 4 and a.num_tokens == 5
    assert len(sched.kv_cache_manager.get_block_ids("a")) == 3
    assert sched.kv_cache_manager.num_free_blocks == free_before + 2
    cached = sched.kv_cache_manager.num_cached_block["a"]
    assert cached == 2  # only blocks full of known tokens were ever hashed: tokens 0..3


def test_drafts_are_capped_by_max_tokens_max_model_len_and_the_budget():
    drafter = ScriptedDrafter([60, 61, 62, 63, 64, 65, 66, 67])
    sched = scheduler(drafter, max_model_len=12)
    a = make_request("a", list(range(10, 16)), max_tokens=4)
    prefill(sched, a)
    assert sched.schedule().scheduled[0].spec_token_ids == [60, 61]  # 1 output + 1 + 2 drafts = max_tokens 4
    assert drafter.max_drafts == [2]
    sched2 = scheduler(ScriptedDrafter([60, 61, 62, 63, 64, 65, 66, 67]), max_model_len=10)
    b = make_request("b", list(range(10, 16)), max_tokens=40)
    prefill(sched2, b)
    assert sched2.schedule().scheduled[0].spec_token_ids == [
        60,
        61,
    ]  # 7 tokens known + 1 + 2 = max_model_len 10
    sched3 = scheduler(ScriptedDrafter([60, 61, 62, 63]), budget=5)
    c, d = make_request("c", [10, 11], max_tokens=40), make_request("d", [12, 13], max_tokens=40)
    sched3.add_request(c)
    sched3.add_request(d)
    sched3.update_from_output(sched3.schedule(), {"c": [50], "d": [51]})
    out = sched3.schedule()
    # c leaves one token of the budget for d: 1 + 3 drafts, then d plain
    assert [(s.request_id, s.spec_token_ids) for s in out.scheduled] == [("c", [60, 61, 62]), ("d", [])]


def test_a_stop_inside_an_accepted_run_ends_at_that_token_and_drops_the_rest():
    drafter = ScriptedDrafter([60, 2, 61])  # 2 = EOS
    sched = scheduler(drafter)
    a = make_request("a", list(range(10, 16)), max_tokens=20)
    prefill(sched, a)
    out = sched.schedule()
    sampled = {"a": [60, 2, 61, 70]}
    finished = sched.update_from_output(out, sampled)
    assert finished == [a] and a.status == RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids == [50, 60, 2] and sampled == {"a": [60, 2]}
    assert drafter.verified == [("a", 3, 3)] and drafter.dropped == ["a"]
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_a_stop_string_inside_a_run_keeps_only_the_tokens_up_to_it():
    sched = scheduler(ScriptedDrafter([60, 61, 62]))
    a = make_request("a", list(range(10, 16)), max_tokens=20)
    prefill(sched, a)
    sched.update_from_output(sched.schedule(), {"a": [60, 61, 62, 63]})
    assert a.num_output_tokens == 5
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED, num_output_tokens=3) is a
    assert a.output_token_ids == [50, 60, 61] and a.all_token_ids == list(range(10, 16)) + [50, 60, 61]


def test_a_request_that_cannot_get_blocks_for_its_draft_runs_plain_without_preempting():
    drafter = ScriptedDrafter([60, 61, 62, 63, 64, 65, 66, 67])
    sched = scheduler(drafter, num_blocks=16, block_size=4, max_model_len=64)
    a = make_request("a", list(range(10, 25)), max_tokens=40)  # 15 tokens: 4 blocks
    b = make_request("b", list(range(30, 74)), max_tokens=40)  # 44 tokens: 11 blocks
    sched.add_request(a)
    sched.add_request(b)
    sched.update_from_output(sched.schedule(), {"a": [50], "b": [51]})
    assert sched.kv_cache_manager.num_free_blocks == 1
    out = sched.schedule()
    # a (16 tokens, a full table) would need 3 more blocks for 1 + 8; only the one for its own token is free
    assert [(s.request_id, s.spec_token_ids) for s in out.scheduled] == [("a", []), ("b", [])]
    assert out.preempted_req_ids == set()


def test_no_drafts_for_prefill_chunks_or_when_the_drafter_declines():
    drafter = ScriptedDrafter([60, 61], allow=False)
    sched = scheduler(drafter, budget=4)
    a = make_request("a", list(range(10, 20)), max_tokens=20)
    sched.add_request(a)
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == [] and drafter.max_drafts == []
    sched.update_from_output(out, {})
    sched.update_from_output(sched.schedule(), {})
    sched.update_from_output(sched.schedule(), {"a": [50]})
    out = sched.schedule()
    assert out.scheduled[0].token_ids == [50] and out.scheduled[0].spec_token_ids == []
    assert drafter.max_drafts == [18]  # proposed once the request decoded, then declined for the step


def test_an_abort_during_a_step_with_a_draft_frees_everything():
    drafter = ScriptedDrafter([60, 61, 62])
    sched = scheduler(drafter)
    a = make_request("a", list(range(10, 16)), max_tokens=20)
    prefill(sched, a)
    out = sched.schedule()
    assert sched.abort_requests(["a"]) == [a]  # the client went away while the draft was verified
    assert sched.update_from_output(out, {"a": [60, 61, 70]}) == []
    assert a.output_token_ids == [50] and drafter.verified == [] and drafter.dropped == ["a"]
    assert sched.kv_cache_manager.num_free_blocks == 64
