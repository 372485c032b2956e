"""Fairness between client requests in the scheduler (engine/core/fairness.py, issue 35 case N3): one
request's many sequences cannot starve a one-sequence request. Exact steps and slot counts, scheduler
factories only."""

from __future__ import annotations

from collections import Counter

from kvscope.engine.core.request import Request
from kvscope.engine.core.scheduler import Scheduler
from tests.engine.core.factories import make_request, make_scheduler, prompt, step


def _fan_out(
    sched: Scheduler, group: str, count: int, *, num_prompts: int = 1, length: int = 8, max_tokens: int = 8
) -> list[Request]:
    """``count`` sequences of one client request: ``num_prompts`` prompts with ``count // num_prompts``
    choices each (``parent_id`` per prompt, ``fairness_group`` = the client request, as the server sets
    them)."""
    requests = []
    for i in range(count):
        k = i % num_prompts
        request = make_request(
            f"{group}-{i}",
            prompt(1000 * (k + 1), length),
            max_tokens=max_tokens,
            eos_token_id=None,
            parent_id=f"{group}-p{k}",
        )
        request.fairness_group = group
        sched.add_request(request)
        requests.append(request)
    return requests


def _first_step_with(sched: Scheduler, request_id: str, max_steps: int = 200) -> int:
    for index in range(max_steps):
        out, _ = step(sched)
        if any(s.request_id == request_id for s in out.scheduled):
            return index
    raise AssertionError(f"{request_id} not scheduled in {max_steps} steps")


def _running_per_group(sched: Scheduler) -> Counter[str]:
    return Counter(r.fairness_key for r in sched.running)


def test_a_one_sequence_request_queued_behind_a_fan_out_runs_in_the_first_step() -> None:
    sched = make_scheduler(max_num_seqs=4)
    _fan_out(sched, "fan", 16, num_prompts=4)
    sched.add_request(make_request("solo", prompt(5000, 8), max_tokens=4, eos_token_id=None))
    out, _ = step(sched)
    # rule 1: the group running the fewest sequences goes next (FCFS on ties): fan, solo, then fan again
    assert [s.request_id for s in out.scheduled] == ["fan-0", "solo", "fan-1", "fan-2"]
    assert [r.request_id for r in sched.waiting][:2] == ["fan-3", "fan-4"]


def test_a_one_sequence_request_arriving_while_a_fan_out_holds_every_slot_runs_in_the_next_step() -> None:
    sched = make_scheduler(max_num_seqs=4)
    _fan_out(sched, "fan", 16, num_prompts=4)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["fan-0", "fan-1", "fan-2", "fan-3"]
    solo = make_request("solo", prompt(5000, 8), max_tokens=4, eos_token_id=None)
    sched.add_request(solo)
    out, _ = step(sched)
    # rule 2: two groups, share 4 // 2 = 2; the fan-out (4 running) gives up its newest sequence
    assert [s.request_id for s in out.scheduled] == ["fan-0", "fan-1", "fan-2", "solo"]
    assert out.preempted_req_ids == {"fan-3"}
    assert [r.request_id for r in sched.waiting][0] == "fan-3"  # back at the front of its group
    assert _running_per_group(sched) == {"fan": 3, "solo": 1}
    assert solo.stats.attribution.summary(None, None).queue_blocked_steps == 0
    out, _ = step(sched)
    assert out.preempted_req_ids == set() and len(out.scheduled) == 4  # stable: solo asks for no more
    assert _first_step_with(sched, "fan-3") == 2  # fan-3 returns once solo's 4 tokens are done
    assert solo.is_finished and solo.stats.num_preemptions == 0


def test_two_fan_outs_split_the_slots_by_share_and_a_third_request_takes_one() -> None:
    sched = make_scheduler(max_num_seqs=8)
    _fan_out(sched, "A", 12, num_prompts=2)
    step(sched)
    assert _running_per_group(sched) == {"A": 8}
    _fan_out(sched, "B", 12, num_prompts=3)
    out, _ = step(sched)
    # share 8 // 2 = 4: A gives up its 4 newest, B takes 4; A admits nobody else in that step
    assert out.preempted_req_ids == {"A-4", "A-5", "A-6", "A-7"}
    assert [s.request_id for s in out.scheduled] == ["A-0", "A-1", "A-2", "A-3", "B-0", "B-1", "B-2", "B-3"]
    assert _running_per_group(sched) == {"A": 4, "B": 4}
    out, _ = step(sched)
    assert out.preempted_req_ids == set() and _running_per_group(sched) == {"A": 4, "B": 4}
    sched.add_request(make_request("C", prompt(7000, 8), max_tokens=4, eos_token_id=None))
    out, _ = step(sched)
    # share 8 // 3 = 2: A and B are both 2 over; the newest such sequence (B-3) goes, C takes its slot
    assert out.preempted_req_ids == {"B-3"}
    assert _running_per_group(sched) == {"A": 4, "B": 3, "C": 1}
    assert [s.request_id for s in out.scheduled][-1] == "C"


def test_running_sequences_share_the_token_budget_round_robin_across_groups() -> None:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=10, long_prefill_token_threshold=4)
    _fan_out(sched, "fan", 2, length=16)
    out, _ = step(sched)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("fan-0", 4), ("fan-1", 4)]
    sched.add_request(make_request("solo", prompt(5000, 16), max_tokens=4, eos_token_id=None))
    out, _ = step(sched)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("fan-0", 4),
        ("fan-1", 4),
        ("solo", 2),
    ]
    out, _ = step(sched)
    # rule 3: every group's first running sequence, then the second: solo's chunk before fan-1's
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("fan-0", 4),
        ("solo", 4),
        ("fan-1", 2),
    ]


def test_out_of_blocks_preempts_the_group_over_its_share_not_the_newest_request() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16, max_num_seqs=4, enable_caching=False)
    _fan_out(sched, "big", 3, length=3)
    step(sched)
    small = make_request("small", prompt(5000, 4), max_tokens=4, eos_token_id=None)
    sched.add_request(small)
    out, _ = step(sched)  # one block each, one left; every sequence needs a second one next
    assert [s.request_id for s in out.scheduled] == ["big-0", "big-1", "big-2", "small"]
    out, _ = step(sched)
    # rule 4, share 4 // 2 = 2: small (the newest request) needs a block; big runs 3, over its share, so its
    # newest unscheduled sequence gives it up; then big-1 finds none and, nobody being over the share any
    # more, preempts itself as before
    assert [s.request_id for s in out.scheduled] == ["big-0", "small"]
    assert out.preempted_req_ids == {"big-1", "big-2"}
    assert small.stats.num_preemptions == 0


def test_one_sequence_requests_keep_fcfs_and_are_never_preempted_for_fairness() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", prompt(100 * i, 8), max_tokens=2, eos_token_id=None))
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert out.preempted_req_ids == set()
        order += [s.request_id for s in out.scheduled if s.is_new]
    assert order == ["r0", "r1", "r2", "r3", "r4"]
