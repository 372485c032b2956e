"""Fairness between tenants (API keys) above the fairness between requests (engine/core/fairness.py, issue
35): a tenant's share is max(1, max_num_seqs // tenants), its requests split it, so one key's many requests
cannot starve another key's one. Exact steps and slot counts, scheduler factories only."""

from __future__ import annotations

from collections import Counter

import pytest

from kvscope.engine.core.request import Request
from kvscope.engine.core.scheduler import Scheduler
from tests.engine.core.factories import make_request, make_scheduler, prompt, step


def _send(
    sched: Scheduler, tenant: str | None, group: str, count: int, *, max_tokens: int = 8, length: int = 8
) -> list[Request]:
    """One client request of ``tenant`` asking for ``count`` sequences (its choices: ``{group}-{i}``), with
    ``fairness_group`` and ``fairness_tenant`` as the engine server sets them."""
    requests = []
    for i in range(count):
        request = make_request(
            f"{group}-{i}",
            prompt(100 * len(sched.requests), length),
            max_tokens=max_tokens,
            eos_token_id=None,
            parent_id=group if count > 1 else None,
        )
        request.fairness_group = group
        request.fairness_tenant = tenant
        sched.add_request(request)
        requests.append(request)
    return requests


def _per_group(sched: Scheduler) -> Counter[str]:
    return Counter(r.fairness_key for r in sched.running)


def _per_tenant(sched: Scheduler) -> Counter[str | None]:
    return Counter(r.fairness_tenant for r in sched.running)


def test_one_tenants_fan_outs_split_its_share_and_another_tenants_request_runs_in_the_first_step() -> None:
    sched = make_scheduler(max_num_seqs=8)
    for k in range(4):
        _send(sched, "key-a", f"a{k}", 8)
    _send(sched, "key-b", "b1", 1, max_tokens=2)
    out, _ = step(sched)
    # rule 1: tenant key-b runs fewer than key-a once a0-0 is in, so b1 is second, not fifth (after every
    # a-group)
    assert [s.request_id for s in out.scheduled] == [
        "a0-0",
        "b1-0",
        "a1-0",
        "a2-0",
        "a3-0",
        "a0-1",
        "a1-1",
        "a2-1",
    ]
    assert _per_group(sched) == {"a0": 2, "a1": 2, "a2": 2, "a3": 1, "b1": 1}
    _send(sched, "key-b", "b2", 8)
    out, _ = step(sched)
    # tenant share 8 // 2 = 4; key-b's groups get 4 // 2 = 2 each: b2 claims 2, key-a (7, 3 over) gives up its
    # newest sequences of the groups over their share 4 // 4 = 1
    assert out.preempted_req_ids == {"a2-1", "a1-1"}
    assert Counter(s.request.fairness_key for s in out.scheduled) == {
        "a0": 2,
        "a1": 1,
        "a2": 1,
        "a3": 1,
        "b1": 1,
        "b2": 2,
    }
    assert "b1-0" not in sched.requests  # b1's 2 tokens are done: key-b has one group left, b2 now claims 4
    out, _ = step(sched)
    assert out.preempted_req_ids == {"a0-1"}
    assert _per_group(sched) == {"a0": 1, "a1": 1, "a2": 1, "a3": 1, "b2": 4}
    out, _ = step(sched)
    assert out.preempted_req_ids == set() and _per_tenant(sched) == {"key-a": 4, "key-b": 4}


def _ten_requests_and_one(tenant: str | None, other: str | None) -> tuple[Scheduler, Request]:
    """``tenant`` sends 10 one-sequence requests of 50 tokens (8 run), then ``other`` one of 4 tokens."""
    sched = make_scheduler(max_num_seqs=8)
    for i in range(10):
        _send(sched, tenant, f"a{i}", 1, max_tokens=50)
    step(sched)
    assert _per_tenant(sched) == {tenant: 8}
    return sched, _send(sched, other, "b", 1, max_tokens=4)[0]


def test_one_tenants_many_requests_do_not_starve_another_tenants_one() -> None:
    sched, solo = _ten_requests_and_one(None, None)
    out, _ = step(sched)
    # per request alone (no tenants, today's engine without the header): 11 groups, share max(1, 8 // 11) = 1,
    # nobody over it: b waits for one of the 50-token requests to end
    assert out.preempted_req_ids == set() and [s.request_id for s in out.scheduled if s.is_new] == []
    sched, solo = _ten_requests_and_one("key-a", "key-b")
    out, _ = step(sched)
    # 2 tenants, share 4: key-a (8 running; its 10 requests' share 4 // 10 -> 1 each) gives up its newest
    # request and key-b's one runs now
    assert out.preempted_req_ids == {"a7-0"}
    assert [s.request_id for s in out.scheduled if s.is_new] == ["b-0"]
    assert _per_tenant(sched) == {"key-a": 7, "key-b": 1}
    while not solo.is_finished:
        out, _ = step(sched)
        assert out.preempted_req_ids == set()
    assert solo.stats.num_preemptions == 0 and solo.num_output_tokens == 4


def test_two_tenants_with_several_requests_each_split_the_slots_four_and_four() -> None:
    sched = make_scheduler(max_num_seqs=8)
    for k in range(4):
        _send(sched, "key-a", f"a{k}", 8, max_tokens=50)
    step(sched)
    assert _per_group(sched) == {"a0": 2, "a1": 2, "a2": 2, "a3": 2}  # alone: one tenant, 8 // 4 per request
    for k in range(2):
        _send(sched, "key-b", f"b{k}", 8, max_tokens=50)
    out, _ = step(sched)
    # shares: 8 // 2 = 4 per tenant; key-a's 4 requests 1 each, key-b's 2 requests 2 each (per request alone
    # it would be 8 // 6 = 1 each: key-a 6 slots, key-b 2)
    assert out.preempted_req_ids == {"a0-1", "a1-1", "a2-1", "a3-1"}
    assert _per_group(sched) == {"a0": 1, "a1": 1, "a2": 1, "a3": 1, "b0": 2, "b1": 2}
    for _ in range(3):
        out, _ = step(sched)
        assert out.preempted_req_ids == set() and _per_tenant(sched) == {"key-a": 4, "key-b": 4}


def test_running_sequences_share_the_token_budget_round_robin_across_tenants_first() -> None:
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=10, long_prefill_token_threshold=4)
    for k in range(2):
        _send(sched, "key-a", f"a{k}", 1, length=16)
    out, _ = step(sched)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a0-0", 4), ("a1-0", 4)]
    _send(sched, "key-b", "b0", 1, length=16)
    out, _ = step(sched)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("a0-0", 4),
        ("a1-0", 4),
        ("b0-0", 2),
    ]
    out, _ = step(sched)
    # rule 3: every tenant's first running sequence (a0-0, b0-0), then key-a's second (a1-0, a request of its
    # own: per request alone it would come before b0-0)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("a0-0", 4),
        ("b0-0", 4),
        ("a1-0", 2),
    ]


def test_a_group_belongs_to_one_tenant() -> None:
    sched = make_scheduler()
    _send(sched, "key-a", "g", 1)
    other = make_request("g-other", prompt(0, 8))
    other.fairness_group, other.fairness_tenant = "g", "key-b"
    with pytest.raises(
        ValueError, match="fairness group 'g' belongs to tenant 'tenant:key-a', not 'tenant:key-b'"
    ):
        sched.add_request(other)
    assert len(sched.requests) == 1 and len(sched.waiting) == 1
