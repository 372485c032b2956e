"""Scheduler: stop checks, external finishes/aborts in every state, request and scheduler stats."""

from __future__ import annotations

import pytest

from kvscope.engine.core.request import Request, RequestStatus
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.core.stats import SchedulerStats
from tests.engine.core.factories import FakeClock, make_request, make_scheduler, prompt, step


def run_tokens(sched: Scheduler, req: Request, tokens: list[int]) -> list[tuple[int, RequestStatus]]:
    """Feed ``tokens`` one step at a time; (num_output_tokens, status) after each step."""
    sched.add_request(req)
    trace = []
    for token in tokens:
        step(sched, {req.request_id: token})
        trace.append((req.num_output_tokens, req.status))
        if req.is_finished:
            break
    return trace


def assert_pool_empty(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    assert kv.req_to_blocks == {} and sched.running == [] and not sched.waiting


def test_eos_is_ignored_before_min_tokens() -> None:
    req = make_request("a", prompt(10, 4), eos_token_id=2, min_tokens=3)
    trace = run_tokens(make_scheduler(), req, [2, 2, 2, 2])
    assert trace == [
        (1, RequestStatus.RUNNING),
        (2, RequestStatus.RUNNING),
        (3, RequestStatus.FINISHED_STOPPED),
    ]
    assert req.stop_reason is None and req.output_token_ids == [2, 2, 2]


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = make_request("a", prompt(10, 4), eos_token_id=2, ignore_eos=True, max_tokens=3)
    trace = run_tokens(make_scheduler(), req, [2, 2, 2, 2])
    assert trace[-1] == (3, RequestStatus.FINISHED_LENGTH) and len(trace) == 3


def test_stop_token_ids_respect_min_tokens_and_set_stop_reason() -> None:
    req = make_request("a", prompt(10, 4), stop_token_ids=[7], min_tokens=2)
    trace = run_tokens(make_scheduler(), req, [7, 7, 7])
    assert trace == [(1, RequestStatus.RUNNING), (2, RequestStatus.FINISHED_STOPPED)]
    assert req.stop_reason == 7


def test_stop_token_wins_over_length_on_the_last_allowed_token() -> None:
    req = make_request("a", prompt(10, 4), stop_token_ids=[7], max_tokens=2)
    assert run_tokens(make_scheduler(), req, [5, 7])[-1] == (2, RequestStatus.FINISHED_STOPPED)
    assert req.stop_reason == 7
    other = make_request("b", prompt(10, 4), max_tokens=2)
    assert run_tokens(make_scheduler(), other, [5, 5])[-1] == (2, RequestStatus.FINISHED_LENGTH)
    assert other.stop_reason is None


def test_max_model_len_ends_generation_and_is_never_exceeded() -> None:
    sched = make_scheduler(max_model_len=16, block_size=4, num_blocks=8)
    req = make_request("a", prompt(10, 14), max_tokens=100)
    sched.add_request(req)
    ends = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        ends += [s.num_computed_tokens + s.num_scheduled_tokens for s in out.scheduled]
    assert ends == [14, 15] and req.num_tokens == 16
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 2
    full = make_request("b", prompt(10, 16), max_tokens=100)
    assert run_tokens(sched, full, [5, 5]) == [(1, RequestStatus.FINISHED_LENGTH)]


def test_abort_waiting_request() -> None:
    sched = make_scheduler()
    req = make_request("a", prompt(0, 20))
    sched.add_request(req)
    assert [r.request_id for r in sched.abort_requests(["a", "unknown"])] == ["a"]
    assert req.status == RequestStatus.FINISHED_ABORTED and sched.get_request("a") is None
    assert_pool_empty(sched)
    assert sched.abort_requests(["a"]) == []
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


def test_abort_mid_chunked_prefill_frees_every_block() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("a", prompt(0, 100)))
    out, _ = step(sched)
    assert out.scheduled[0].block_ids == [0, 1]
    sched.abort_requests(["a"])
    assert_pool_empty(sched)


def test_abort_during_decode_with_shared_prefix_frees_every_block() -> None:
    sched = make_scheduler(num_blocks=8, max_model_len=128)
    a, b = make_request("a", prompt(0, 40)), make_request("b", prompt(0, 40))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    sched.abort_requests(["b", "a"])
    assert_pool_empty(sched)
    assert sched.get_stats().num_cached_blocks == 2
    assert not sched.has_unfinished_requests()


def test_abort_preempted_request_and_abort_during_the_step() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, enable_caching=False)
    a, b = make_request("a", prompt(0, 6), max_tokens=8), make_request("b", prompt(100, 6), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        step(sched)
    assert b.status == RequestStatus.PREEMPTED
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is b
    assert list(sched.waiting) == []
    out = sched.schedule()
    assert sched.abort_requests(["a"]) == [a]  # client went away while the step ran
    assert sched.update_from_output(out, {"a": [9]}) == []
    assert a.output_token_ids == [5, 5, 5, 5]
    assert_pool_empty(sched)


def test_finish_request_with_stop_string_status_and_invalid_status() -> None:
    sched = make_scheduler()
    req = make_request("a", prompt(0, 4))
    sched.add_request(req)
    step(sched)
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED) is req
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED) is None
    assert req.status.finish_reason == "stop"
    with pytest.raises(ValueError, match="RUNNING is not a finished status"):
        sched.finish_request("x", RequestStatus.RUNNING)


def test_request_stats_follow_the_clock() -> None:
    clock = FakeClock(now=10.0)
    sched = make_scheduler(clock=clock, num_blocks=8, max_model_len=128)
    req = make_request("a", prompt(0, 20), max_tokens=2, arrival_time=9.0)
    other = make_request("b", prompt(100, 4), max_tokens=1)
    sched.add_request(req)
    sched.add_request(other)
    step(sched)
    clock.now = 12.5
    _, finished = step(sched)
    assert finished == [req]
    stats = req.stats
    assert (stats.first_scheduled_time, stats.first_token_time, stats.last_token_time) == (10.0, 10.0, 12.5)
    assert (stats.finished_time, stats.num_steps, stats.batch_size_sum, stats.batch_size_max) == (
        12.5,
        2,
        3,
        2,
    )
    assert (stats.kv_blocks_peak, stats.kv_cache_usage) == (2, 0.25)
    assert stats.to_dict(req.num_output_tokens)["queue_s"] == 1.0


def test_scheduler_stats_partition_the_pool_and_count_prefix_hits() -> None:
    sched = make_scheduler(num_blocks=8, max_model_len=128, max_num_batched_tokens=64)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, prompt(0, 40), max_tokens=2))
    out, _ = step(sched)  # a computes 40; b and c hit a's 2 full blocks and compute 8 each
    assert [(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("a", 0, 40),
        ("b", 32, 8),
        ("c", 32, 8),
    ]
    assert sched.get_stats() == SchedulerStats(
        num_running=3,
        num_waiting=0,
        kv_cache_usage=0.625,
        num_used_blocks=5,
        num_cached_blocks=0,
        num_free_blocks=3,
        num_preemptions_total=0,
        prefix_cache_queries=120,
        prefix_cache_hits=64,
    )
    while sched.has_unfinished_requests():
        step(sched)
    stats = sched.get_stats()
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks) == (0, 2, 6)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
