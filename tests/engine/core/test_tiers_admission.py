"""Tiers, priorities, admission and deadlines in the scheduler (issue 42; engine/core/admission.py,
engine/core/scheduler.py): exact admission orders, preemptions and refusals on scripted states."""

from __future__ import annotations

import pytest

from kvscope.engine.core.admission import AdmissionConfig, Refusal, parse_slos
from kvscope.engine.core.request import Request, RequestStatus
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.core.ttft import TtftPrediction
from tests.engine.core.factories import FakeClock, make_request, make_scheduler, prompt, step


def _add(
    sched: Scheduler,
    request_id: str,
    *,
    tier: str = "default",
    priority: int = 0,
    tenant: str | None = None,
    max_tokens: int = 1,
    deadline: float | None = None,
    group: str | None = None,
) -> Request:
    request = make_request(
        request_id, prompt(100 * len(sched.requests), 8), max_tokens=max_tokens, eos_token_id=None
    )
    request.service_tier, request.priority, request.deadline = tier, priority, deadline
    request.fairness_tenant, request.fairness_group = tenant, group
    request.arrival_time = sched.clock()
    sched.add_request(request)
    return request


def _admission_order(sched: Scheduler) -> list[list[str]]:
    """The requests each step scheduled, step by step, until nothing is left."""
    steps = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        steps.append([s.request_id for s in out.scheduled])
    return steps


def test_tiers_first_then_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for request_id, tier, priority in (
        ("flex-1", "flex", 0),
        ("default-1", "default", 0),
        ("priority-1", "priority", 5),
        ("default-urgent", "default", -1),
        ("default-2", "default", 0),
        ("priority-2", "priority", 0),
    ):
        _add(sched, request_id, tier=tier, priority=priority)
    assert _admission_order(sched) == [
        ["priority-2"],  # the best tier; inside it the lower priority value
        ["priority-1"],
        ["default-urgent"],
        ["default-1"],  # same tier and priority: arrival order
        ["default-2"],
        ["flex-1"],  # batch work waits for every better tier, although it came first
    ]


def test_within_a_tier_a_key_with_one_request_is_not_queued_behind_anothers_many() -> None:
    sched = make_scheduler(max_num_seqs=2)
    _add(sched, "c0", tier="flex", tenant="batch-key")
    for i in range(4):
        _add(sched, f"a{i}", tenant="key-a")
    _add(sched, "b0", tenant="key-b")
    # rule 1 inside the default tier: key-b runs fewer than key-a once a0 is in, so b0 is second, not fifth;
    # the flex request, first to arrive, goes last
    assert _admission_order(sched) == [["a0", "b0"], ["a1", "a2"], ["a3", "c0"]]


def test_two_keys_sending_alike_alternate_within_their_tier() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        _add(sched, f"a{i}", tenant="key-a")
    for i in range(3):
        _add(sched, f"b{i}", tenant="key-b")
    assert _admission_order(sched) == [["a0", "b0"], ["a1", "b1"], ["a2", "b2"]]


def test_batch_work_is_preempted_for_interactive_work_that_finds_no_slot() -> None:
    sched = make_scheduler(max_num_seqs=2)
    _add(sched, "f0", tier="flex", max_tokens=8)
    _add(sched, "f1", tier="flex", max_tokens=8)
    step(sched)
    assert [r.request_id for r in sched.running] == ["f0", "f1"]
    _add(sched, "d0", max_tokens=8)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["f0", "d0"]
    assert out.preempted_req_ids == {"f1"}
    assert sched.requests["f1"].status == RequestStatus.PREEMPTED
    # a default request waiting behind a running default one preempts nothing
    _add(sched, "d1", max_tokens=8)
    out, _ = step(sched)
    assert out.preempted_req_ids == {"f0"}  # the last flex request goes for d1
    assert [s.request_id for s in out.scheduled] == ["d0", "d1"]
    _add(sched, "d2", max_tokens=8)
    out, _ = step(sched)
    assert out.preempted_req_ids == set()
    assert [s.request_id for s in out.scheduled] == ["d0", "d1"]


def test_an_unknown_tier_is_an_invariant_error() -> None:
    sched = make_scheduler()
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        _add(sched, "x", tier="gold")


def test_slo_parsing() -> None:
    assert parse_slos("") == {}
    assert parse_slos("2") == {"priority": 2.0, "default": 2.0, "flex": 2.0}
    assert parse_slos("priority=0.5, default=2") == {"priority": 0.5, "default": 2.0}
    for bad, message in (
        ("gold=1", "TIER=SECONDS"),
        ("default=x", "number"),
        ("0", "positive"),
        ("priority=1,priority=30", "tier priority is named twice"),  # was: the last one, silently
    ):
        with pytest.raises(ValueError, match=message):
            parse_slos(bad)
    with pytest.raises(ValueError, match="unknown tier"):
        AdmissionConfig({"gold": 1.0})


def test_admission_decisions_are_exact() -> None:
    config = AdmissionConfig({"default": 2.0, "priority": 0.5})
    assert config.enabled and not AdmissionConfig().enabled
    refusal = config.decide("default", 7.8, 41)
    assert refusal == Refusal("default", 7.8, 2.0, 41)
    assert refusal.message == (
        "predicted time to first token 7.8 s exceeds the 2 s objective of tier default; 41 requests ahead"
    )
    assert refusal.retry_after_s == 6
    assert config.decide("default", 2.0, 41) is None  # at the objective: admitted
    assert config.decide("default", None, 41) is None  # no prediction yet: admitted
    assert config.decide("flex", 100.0, 41) is None  # a tier without an objective
    one = config.decide("priority", 0.6, 1)
    assert one is not None and one.retry_after_s == 1
    assert one.message.endswith("objective of tier priority; 1 request ahead")


def test_admission_holds_the_prediction_scaled_by_the_tiers_error_quantile() -> None:
    config = AdmissionConfig({"flex": 60.0}, quantile=0.9)
    assert config.decide("flex", 50.0, 12, error_ratio=1.25) == Refusal("flex", 50.0, 60.0, 12, 62.5, 0.9)
    refusal = config.decide("flex", 50.0, 12, error_ratio=1.25)
    assert refusal is not None and refusal.decided_on_s == 62.5 and refusal.retry_after_s == 3
    assert refusal.message == (
        "predicted time to first token 50.0 s (62.5 s at the 90th percentile of recent errors) exceeds "
        "the 60 s objective of tier flex; 12 requests ahead"
    )
    assert config.decide("flex", 50.0, 12, error_ratio=1.2) is None  # 60.0: at the objective
    close = AdmissionConfig({"default": 0.5}).decide("default", 0.5004, 0)
    assert close is not None and close.message.startswith(
        "predicted time to first token 0.5004 s exceeds the 0.5 s objective"
    )  # never "0.5 s exceeds the 0.5 s"
    near = AdmissionConfig({"default": 0.5}).decide("default", 0.53, 0)
    assert near is not None and near.message.startswith("predicted time to first token 0.53 s exceeds")
    assert config.decide("flex", 70.0, 12, error_ratio=0.8) is None  # over-predicting tier: 56 s
    assert config.decide("flex", 50.0, 12) is None  # no ratio yet: the prediction itself
    # nothing running, nothing ahead: its own prefill, which no retry shortens; admitted
    assert config.decide("flex", 90.0, 0, error_ratio=1.25, running=0) is None
    assert config.decide("flex", 90.0, 0, error_ratio=1.25, running=1) is not None  # waiting can help
    assert config.decide("flex", 90.0, 1, error_ratio=1.25, running=0) is not None
    assert config.decide("flex", None, 12, error_ratio=2.0) is None
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="quantile"):
            AdmissionConfig({"flex": 60.0}, quantile=bad)


def test_the_scheduler_keeps_each_tiers_actual_over_predicted_ttft() -> None:
    clock = FakeClock()
    sched = make_scheduler(clock=clock, max_num_seqs=8)
    predicted = {"a": 2.0, "b": 4.0, "c": 1.0}
    for request_id, tier in (("a", "flex"), ("b", "flex"), ("c", "priority")):
        request = make_request(request_id, prompt(100 * len(sched.requests), 8), max_tokens=2)
        request.service_tier, request.arrival_time = tier, clock.now
        sched.add_request(request, TtftPrediction(predicted[request_id], 0, 0, 0, 0))
    for index in range(2):  # choices of one n = 2 request share a prediction: counted once
        choice = make_request(f"e-{index}", prompt(700, 8), max_tokens=2)
        choice.service_tier, choice.arrival_time, choice.parent_id = "flex", clock.now, "e"
        sched.add_request(choice, TtftPrediction(6.0, 0, 0, 0, 0))
    unpredicted = make_request("d", prompt(900, 8), max_tokens=2)
    unpredicted.service_tier, unpredicted.arrival_time = "flex", clock.now
    sched.add_request(unpredicted, TtftPrediction(None, 0, 0, 0, 0))
    clock.now += 3.0
    step(sched)  # every first token, 3 s after arrival
    clock.now += 5.0
    step(sched)  # second tokens: not first tokens, not observed
    calibration = sched.ttft_calibration
    assert calibration.samples(2) == 3 and calibration.samples(0) == 1 and calibration.samples(1) == 0
    first_token_at = clock.now - 5.0  # the scheduler's clock stamps each ratio (they age out)
    assert list(calibration._ratios[2]) == [(first_token_at, r) for r in (1.5, 0.75, 0.5)]
    assert list(calibration._ratios[0]) == [(first_token_at, 3.0)]


def test_a_queued_request_past_its_deadline_is_dropped_before_any_prefill() -> None:
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=1, clock=clock)
    _add(sched, "r0", max_tokens=4)
    step(sched)
    late = _add(sched, "late", deadline=clock.now + 5.0)
    patient = _add(sched, "patient", deadline=clock.now + 50.0)
    clock.now += 6.0
    assert sched.expire_waiting() == [late]
    assert late.status == RequestStatus.FINISHED_ABORTED and late.stats.first_scheduled_time is None
    assert "late" not in sched.requests
    assert sched.expire_waiting() == []
    scheduled = [request_id for steps in _admission_order(sched) for request_id in steps]
    assert "late" not in scheduled and "patient" in scheduled
    assert patient.num_cached_tokens == 0  # it was admitted: its deadline no longer applies
    clock.now += 100.0
    assert sched.expire_waiting() == []


def test_a_disconnected_clients_queued_request_never_reaches_prefill() -> None:
    sched = make_scheduler(max_num_seqs=1)
    _add(sched, "r0", max_tokens=3)
    step(sched)
    _add(sched, "gone")
    _add(sched, "stays")
    assert [r.request_id for r in sched.abort_requests(["gone"])] == ["gone"]  # the server's abort
    scheduled = [request_id for steps in _admission_order(sched) for request_id in steps]
    assert scheduled == ["r0", "r0", "stays"]


class HalfSecondPlus:
    """Scripted step time: 0.5 s plus 10 ms per prefill token."""

    def observe(self, prefill_tokens: int, decode_rows: int, context_tokens: int, seconds: float) -> None:
        pass

    def predict(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float | None:
        return 0.5 + 0.01 * prefill_tokens


def _overdue_scheduler(clock: FakeClock, objectives: dict[str, float]) -> Scheduler:
    """One running slot held by a long default-tier request, admission's objectives set, scripted steps."""
    sched = make_scheduler(max_num_seqs=1, clock=clock, long_prefill_token_threshold=4)
    sched.step_time = HalfSecondPlus()
    sched.ttft_objectives = objectives
    _add(sched, "holder", max_tokens=100)
    step(sched)
    return sched


def test_a_queued_request_whose_first_token_can_no_longer_be_on_time_is_dropped() -> None:
    """Each 8-token prompt needs two 4-token chunks: 2 x (0.5 + 0.04) = 1.08 s of its own steps. With a 10 s
    objective the request arriving at 100 is kept while now + 1.08 <= 110 and dropped after."""
    clock = FakeClock()
    sched = _overdue_scheduler(clock, {"flex": 10.0})
    first = _add(sched, "first", tier="flex")
    clock.now = 101.0
    second = _add(sched, "second", tier="flex")
    _add(sched, "untimed", tier="default")  # no objective for its tier: never dropped
    clock.now = 108.92
    assert sched.shed_overdue() == []
    clock.now = 108.93
    [dropped] = sched.shed_overdue()
    assert dropped.request is first and first.status == RequestStatus.FINISHED_ABORTED
    assert (dropped.waited_s, dropped.predicted_ttft_s, dropped.requests_ahead) == pytest.approx(
        (8.93, 10.01, 1)
    )  # "untimed" (tier default) is admitted before flex
    assert "first" not in sched.requests and sched.shed_overdue() == []
    clock.now = 109.93
    assert [d.request for d in sched.shed_overdue()] == [second]
    clock.now = 500.0
    assert sched.shed_overdue() == []
    assert "untimed" in sched.requests


def test_requests_dropped_in_one_sweep_count_the_queue_as_it_stood() -> None:
    """Three flex requests queued together go overdue together: each one's requests ahead are those
    admitted before it in the queue before the sweep (the default-tier one first, then the earlier flex
    ones), not what is left after the others were dropped."""
    clock = FakeClock()
    sched = _overdue_scheduler(clock, {"flex": 10.0})
    flex = [_add(sched, f"flex-{i}", tier="flex") for i in range(3)]
    _add(sched, "untimed", tier="default")
    clock.now = 200.0
    dropped = sched.shed_overdue()
    assert [(d.request, d.requests_ahead) for d in dropped] == [(flex[0], 1), (flex[1], 2), (flex[2], 3)]


def test_a_request_admitted_once_or_late_even_when_idle_is_never_dropped() -> None:
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=1, clock=clock, long_prefill_token_threshold=4)
    sched.step_time = HalfSecondPlus()
    sched.ttft_objectives = {"flex": 10.0, "default": 1.0}
    admitted = _add(sched, "admitted", tier="flex", max_tokens=100)
    step(sched)  # its first chunk: admitted once
    hopeless = _add(sched, "hopeless")  # its own 1.08 s of prefill exceed its tier's 1 s
    clock.now += 1000.0
    assert sched.shed_overdue() == []
    step(sched)  # the flex request is preempted for the better tier's: back to waiting, admitted once
    assert admitted.status == RequestStatus.PREEMPTED and admitted.num_cached_tokens >= 0
    assert hopeless.status == RequestStatus.RUNNING
    clock.now += 1000.0
    assert sched.shed_overdue() == []
    assert admitted.request_id in sched.requests


def test_a_prompt_of_a_client_request_already_started_is_never_dropped() -> None:
    """Two slots: the holder and the first prompt of a two-prompt client request (one fairness group, as the
    server sends a /v1/completions prompt list or ``n`` > 1). Its second prompt waits for a slot past the
    objective and is kept: the client request's first token came on time (its 200 may be on the wire); a
    request of its own arriving with it is dropped."""
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=2, clock=clock, long_prefill_token_threshold=4)
    sched.step_time = HalfSecondPlus()
    sched.ttft_objectives = {"flex": 10.0}
    _add(sched, "holder", max_tokens=100)
    step(sched)
    first = _add(sched, "cmpl-0", tier="flex", max_tokens=100, group="cmpl")
    second = _add(sched, "cmpl-1", tier="flex", max_tokens=100, group="cmpl")
    alone = _add(sched, "alone", tier="flex", max_tokens=100)
    step(sched)
    step(sched)  # the first prompt's two chunks: it runs, the other two wait for a slot
    assert first.status == RequestStatus.RUNNING and first.num_cached_tokens >= 0
    assert second.status == alone.status == RequestStatus.WAITING
    clock.now += 1000.0
    assert [d.request for d in sched.shed_overdue()] == [alone]
    assert second.status == RequestStatus.WAITING and "cmpl-1" in sched.requests


def test_without_a_step_time_fit_a_request_is_dropped_once_its_objective_passed() -> None:
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=1, clock=clock)
    sched.ttft_objectives = {"flex": 5.0}
    _add(sched, "holder", max_tokens=100)
    step(sched)
    late = _add(sched, "late", tier="flex")
    clock.now += 5.0
    assert sched.shed_overdue() == []
    clock.now += 0.001
    assert [d.request for d in sched.shed_overdue()] == [late]
