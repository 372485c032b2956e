"""The TTFT predictor of issue 42 (engine/core/ttft.py): the online step-time fit and the replay of the
scheduler's rules on scripted engine states, priced by a scripted step model. Exact values, no clocks."""

from __future__ import annotations

import pytest

from kvscope.engine.core.request import Request
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.core.ttft import (
    ArrivalStream,
    OutputLengths,
    RecentArrivals,
    SimSequence,
    StepLimits,
    StepTimeModel,
    TtftCalibration,
    injected_arrivals,
    replay_ttft,
    running_sequence,
    waiting_sequence,
)
from tests.engine.core.factories import FakeClock, make_request, make_scheduler, prompt, step


class LinearSteps:
    """A scripted step model: 10 ms + 1 ms per prefill token + 2 ms per decode row; records what it saw."""

    def __init__(self) -> None:
        self.observed: list[tuple[int, int, int, float]] = []

    def observe(self, prefill_tokens: int, decode_rows: int, context_tokens: int, seconds: float) -> None:
        self.observed.append((prefill_tokens, decode_rows, context_tokens, seconds))

    def predict(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float | None:
        return 0.010 + 0.001 * prefill_tokens + 0.002 * decode_rows


def test_the_step_model_recovers_a_linear_machine_and_waits_for_enough_steps() -> None:
    model = StepTimeModel(forgetting=1.0, min_steps=4)
    shapes = [(512, 0, 512), (0, 8, 800), (128, 4, 900), (0, 32, 4000), (256, 16, 2500), (0, 1, 100)]
    for i, (prefill, decode, context) in enumerate(shapes):
        if i < 4:
            assert (i, model.predict(1, 1, 1)) == (i, None)
        model.observe(prefill, decode, context, 0.005 + 0.0002 * prefill + 0.003 * decode + 1e-6 * context)
    assert model.steps == 6
    assert model.predict(1000, 10, 5000) == pytest.approx(0.005 + 0.2 + 0.03 + 0.005, rel=1e-4)


def test_the_step_model_never_prices_a_feature_negatively() -> None:
    model = StepTimeModel(forgetting=1.0, min_steps=1)
    # more decode rows, less time: a plain fit would give decode rows a negative price
    for decode, seconds in ((1, 0.05), (2, 0.04), (4, 0.03), (8, 0.02)):
        model.observe(0, decode, 0, seconds)
    coefficients = model.coefficients()
    assert coefficients is not None and min(coefficients) >= 0.0
    assert model.predict(0, 3, 0) == pytest.approx(0.035)  # the mean: decode rows dropped from the fit


def test_step_model_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="forgetting"):
        StepTimeModel(forgetting=0.0)
    with pytest.raises(ValueError, match="min_steps"):
        StepTimeModel(min_steps=0)


def test_replay_waits_for_a_slot_then_prices_the_prefill_step() -> None:
    # two decoding requests hold both slots: 3 and 5 tokens left; the new prompt needs 50 tokens
    running = [SimSequence(0, 3, 100), SimSequence(0, 5, 200)]
    seconds = replay_ttft(
        running, [], 50, StepLimits(max_num_seqs=2, max_num_batched_tokens=100), LinearSteps()
    )
    # 3 decode steps of 2 rows (14 ms each), then one step: the second request's decode + the 50-token prefill
    assert seconds == pytest.approx(3 * 0.014 + (0.010 + 0.050 + 0.002))
    assert [(s.prefill_left, s.decode_left) for s in running] == [(0, 3), (0, 5)]  # inputs untouched


def test_replay_admits_the_queue_ahead_first_and_chunks_long_prompts() -> None:
    limits = StepLimits(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=48)
    ahead = [SimSequence(100, 2, 0)]
    seconds = replay_ttft([], ahead, 10, limits, LinearSteps())
    # step 1: 48 of the 100 tokens ahead (threshold) + the new prompt's 10 (it fits the budget left): sampled
    assert seconds == pytest.approx(0.010 + 0.058)
    seconds = replay_ttft([], ahead, 40, limits, LinearSteps())
    # step 1: 48 ahead (threshold) + 16 of ours (budget); step 2: 48 ahead + 16 of ours; step 3: the last 4
    # ahead + our last 8
    assert seconds == pytest.approx((0.010 + 0.064) + (0.010 + 0.064) + (0.010 + 0.012 + 0.001 * 0))


def test_replay_without_a_fit_predicts_nothing() -> None:
    class Unfitted(LinearSteps):
        def predict(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float | None:
            return None

    assert replay_ttft([], [], 10, StepLimits(4, 64), Unfitted()) is None


def test_expected_output_lengths_follow_the_finished_requests() -> None:
    lengths = OutputLengths(initial=256, window=4)
    assert (lengths.expected(16), lengths.expected(1000)) == (16, 256)
    lengths.observe(100, False)  # ended by EOS after 100 tokens
    lengths.observe(50, False)
    assert (lengths.expected(1000), lengths.expected(10)) == (75, 10)
    lengths.observe(40, True)  # ran to its max_tokens
    lengths.observe(40, True)
    # half run to their limit, the others stop after 75: 0.5 * 200 + 0.5 * 75
    assert (lengths.expected(200), lengths.expected(40)) == (138, 40)
    for _ in range(4):  # the window keeps the last 4: all ran to their limit (ignore_eos traffic)
        lengths.observe(8, True)
    assert (lengths.expected(200), lengths.expected(3)) == (200, 3)


def _running(sched, request_id: str, length: int, max_tokens: int) -> Request:
    request = make_request(request_id, prompt(1000 * len(sched.requests), length), max_tokens=max_tokens)
    request.arrival_time = sched.clock()
    sched.add_request(request)
    return request


def test_the_scheduler_predicts_from_its_queues_on_a_scripted_state() -> None:
    clock = FakeClock()
    steps = LinearSteps()
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, clock=clock)
    sched.step_time = steps
    r0 = _running(sched, "r0", 32, 4)
    _running(sched, "r1", 32, 4)
    step(sched)  # both prefilled in one step, one token each
    assert steps.observed == [(64, 0, 64, 0.0)]  # the step's record reached the model (fake clock: 0 s)
    _running(sched, "r2", 32, 4)  # waits: both slots are taken
    new = make_request("r3", prompt(7000, 16), max_tokens=4, arrival_time=clock.now - 0.5)
    prediction = sched.predict_ttft(new)
    # running: 3 tokens left each (4 expected, 1 out); r2: 32 prompt tokens, then 3 more tokens
    # 3 decode steps (the 3rd ends both) at 14 ms, then r2's 32 and our 16 prefill tokens in one step
    assert prediction.seconds == pytest.approx(0.5 + 3 * 0.014 + (0.010 + 0.048))
    assert (prediction.requests_ahead, prediction.tokens_ahead, prediction.running) == (1, 32, 2)
    assert prediction.cached_tokens == 0
    sched.add_request(new, prediction)
    assert new.stats.predicted_ttft_s == prediction.seconds
    assert new.stats.summary(0).predicted_ttft_s == prediction.seconds
    assert new.stats.summary(0).service_tier == "default"
    # a prompt whose first block the cache holds (r0's): those 16 tokens are not priced
    same = make_request("r4", list(r0.prompt_token_ids), max_tokens=4, arrival_time=clock.now)
    assert sched.predict_ttft(same).cached_tokens == 16
    assert same.foreseen_cached_tokens == 16


def test_a_better_tier_does_not_queue_behind_a_worse_one_in_the_prediction() -> None:
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, clock=clock)
    sched.step_time = LinearSteps()
    for i in range(3):
        batch = make_request(f"f{i}", prompt(100 * i, 32), max_tokens=4, arrival_time=clock.now)
        batch.service_tier = "flex"
        sched.add_request(batch)
    urgent = make_request("p0", prompt(900, 16), max_tokens=4, arrival_time=clock.now)
    urgent.service_tier = "priority"
    flex = make_request("f9", prompt(950, 16), max_tokens=4, arrival_time=clock.now)
    flex.service_tier = "flex"
    assert sched.predict_ttft(urgent).requests_ahead == 0
    assert sched.predict_ttft(urgent).seconds == pytest.approx(0.010 + 0.016)
    assert sched.predict_ttft(flex).requests_ahead == 3


def test_running_and_waiting_sequences_as_the_replay_sees_them() -> None:
    sched = make_scheduler()
    decoding = _running(sched, "d", 20, 10)
    step(sched)
    assert (decoding.num_output_tokens, running_sequence(decoding, 6)) == (1, SimSequence(0, 5, 20))
    assert running_sequence(decoding, 1) == SimSequence(0, 1, 20)  # past its expected length: one more
    fresh = make_request("w", prompt(500, 40), max_tokens=10)
    assert waiting_sequence(fresh, 6, 16) == SimSequence(24, 5, 16)


def test_step_records_include_the_host_time_between_busy_steps() -> None:
    clock = FakeClock()
    steps = LinearSteps()
    sched = make_scheduler(clock=clock)
    sched.step_time = steps
    _running(sched, "r0", 20, 2)
    for host_s in (0.0, 0.05):  # the host work between the two steps (outputs delivered, arrivals queued)
        clock.now += host_s
        out = sched.schedule()
        clock.now += 0.2
        sched.update_from_output(out, {"r0": [5]})
    assert [record[:3] for record in steps.observed] == [(20, 0, 20), (0, 1, 21)]
    assert [record[3] for record in steps.observed] == pytest.approx([0.2, 0.25])
    assert not sched.has_unfinished_requests()  # r0 ended: the next arrival's step starts afresh
    clock.now += 30.0
    _running(sched, "r1", 20, 2)
    out = sched.schedule()
    clock.now += 0.2
    sched.update_from_output(out, {"r1": [5]})
    assert steps.observed[-1][3] == pytest.approx(0.2)  # the idle 30 s are no step's


def test_a_long_queue_is_replayed_in_part_and_extrapolated() -> None:
    clock = FakeClock()
    sched = make_scheduler(num_blocks=1024, max_num_seqs=1, max_num_batched_tokens=8, clock=clock)
    sched.step_time = LinearSteps()
    for i in range(300):  # one step each (8 prompt tokens, one output token)
        sched.add_request(make_request(f"w{i}", prompt(10 * i, 8), max_tokens=1, arrival_time=clock.now))
    prediction = sched.predict_ttft(
        make_request("new", prompt(5000, 8), max_tokens=1, arrival_time=clock.now)
    )
    # 256 of the 300 replayed: 257 steps of 18 ms, scaled by 301 / 257: the 301 steps a full replay counts
    assert (prediction.requests_ahead, prediction.seconds) == (300, pytest.approx(301 * 0.018))


def test_nothing_is_replayed_before_the_step_model_has_a_fit() -> None:
    sched = make_scheduler()
    assert isinstance(sched.step_time, StepTimeModel) and sched.step_time.steps == 0
    request = _running(sched, "r0", 20, 2)
    prediction = sched.predict_ttft(make_request("r1", prompt(900, 20), max_tokens=2))
    assert (prediction.seconds, prediction.requests_ahead, request.stats.predicted_ttft_s) == (None, 1, None)
    assert request.stats.summary(0).predicted_ttft_s is None


def test_interactive_work_is_predicted_to_take_the_slots_of_batch_work() -> None:
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, clock=clock)
    sched.step_time = LinearSteps()
    for i in range(2):
        batch = make_request(f"f{i}", prompt(100 * i, 16), max_tokens=100, arrival_time=clock.now)
        batch.service_tier = "flex"
        sched.add_request(batch)
    step(sched)  # both flex requests run, 99 tokens to go each
    urgent = make_request("p0", prompt(900, 16), max_tokens=4, arrival_time=clock.now)
    urgent.service_tier = "priority"
    # the scheduler preempts the newest flex request for it: one step, beside the other one's decode
    assert sched.predict_ttft(urgent).seconds == pytest.approx(0.010 + 0.016 + 0.002)
    late = make_request("f9", prompt(950, 16), max_tokens=4, arrival_time=clock.now)
    late.service_tier = "flex"
    # a flex request waits for a slot: both end after 99 more steps of 2 decode rows, then its prefill
    assert sched.predict_ttft(late).seconds == pytest.approx(99 * 0.014 + 0.010 + 0.016)
    out, _ = step(sched, {})
    sched.add_request(urgent)
    out, _ = step(sched)
    assert ([s.request_id for s in out.scheduled], out.preempted_req_ids) == (["f0", "p0"], {"f1"})


def test_expected_arrivals_of_a_better_tier_overtake_the_queue_in_the_replay() -> None:
    limits = StepLimits(max_num_seqs=1, max_num_batched_tokens=64)
    running = [SimSequence(0, 4, 100)]  # holds the one slot for 4 more decode steps of 12 ms
    ahead = [SimSequence(16, 0, 0, tier=2)]  # a flex request queued ahead: one 16-token prefill, then done
    # today: 4 decode steps (48 ms), the flex request's prefill (26 ms), ours (26 ms)
    assert replay_ttft(running, ahead, 16, limits, LinearSteps()) == pytest.approx(0.100)
    # a priority request (8 prompt tokens, nothing after its first token) every 30 ms from now: at 48 ms the
    # one of 30 ms goes first (18 ms), at 66 ms the one of 60 ms (18 ms), at 84 ms the flex one (26 ms),
    # at 110 ms the one of 90 ms, at 128 ms the one of 120 ms, at 146 ms ours (26 ms)
    priority = ArrivalStream(tier=0, interval_s=0.030, prefill=8, decode=0)
    seconds = replay_ttft(running, ahead, 16, limits, LinearSteps(), [priority])
    assert seconds == pytest.approx(0.048 + 4 * 0.018 + 2 * 0.026)
    # a stream whose first request comes after our first token changes nothing
    late = ArrivalStream(tier=0, interval_s=1.0, prefill=8, decode=0)
    assert replay_ttft(running, ahead, 16, limits, LinearSteps(), [late]) == pytest.approx(0.100)
    # a queued request of the arrivals' own tier keeps its place: it goes before them
    same = [SimSequence(16, 0, 0, tier=0)]
    seconds = replay_ttft(running, same, 16, limits, LinearSteps(), [priority])
    # 48 ms: the queued one (26 ms); 74 ms: the one of 30 ms; 92 ms: the one of 60 ms; 110 ms: the one of
    # 90 ms; 128 ms: the one of 120 ms; 146 ms: ours
    assert seconds == pytest.approx(0.048 + 0.026 + 4 * 0.018 + 0.026)


def test_injected_arrivals_come_in_time_order_better_tier_first_and_are_capped() -> None:
    streams = [ArrivalStream(1, 0.75, 4, 2), ArrivalStream(0, 0.5, 8, 0)]
    arrivals = list(injected_arrivals(streams, limit=5))
    assert [(at, seq.tier) for at, seq in arrivals] == [(0.5, 0), (0.75, 1), (1.0, 0), (1.5, 0), (1.5, 1)]
    assert arrivals[1][1] == SimSequence(4, 2, 0, 1)
    assert list(injected_arrivals([], limit=5)) == []


def test_recent_arrivals_count_a_window_per_tier() -> None:
    arrivals = RecentArrivals(window_s=10.0, max_kept=4)
    assert arrivals.rate(0, 100.0) is None
    for at, prompt_tokens, max_tokens in ((91.0, 10, 4), (95.0, 20, 8), (99.0, 30, 12)):
        arrivals.observe(0, at, prompt_tokens, max_tokens)
    assert arrivals.rate(0, 100.0) == (0.3, 20.0, 8.0)  # 3 in the last 10 s
    assert arrivals.rate(0, 102.0) == (0.2, 25.0, 10.0)  # the one of 91 s left the window
    assert arrivals.rate(1, 102.0) is None
    for at in (102.0, 103.0, 104.0):  # 4 kept (99 to 104 s): the rate over their 5 s, not the window's 10
        arrivals.observe(0, at, 8, 1)
    assert arrivals.rate(0, 104.0) == (4 / 5.0, 13.5, 3.75)
    assert arrivals.rate(0, 120.0) is None
    with pytest.raises(ValueError, match="window_s"):
        RecentArrivals(window_s=0.0)
    with pytest.raises(ValueError, match="max_kept"):
        RecentArrivals(max_kept=0)


def _overtaken_state(history_tier: str | None) -> tuple[Scheduler, FakeClock]:
    """One slot, held by a default-tier request with 200 tokens to go (12 ms each), after 60 s in which a
    request of ``history_tier`` (8 prompt tokens, 1 output token) was queued, and finished, every 0.5 s."""
    clock = FakeClock()
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=512, clock=clock)
    sched.step_time = LinearSteps()
    for i in range(120 if history_tier else 0):
        clock.now += 0.5
        earlier = make_request(f"h{i}", prompt(10_000 + 8 * i, 8), max_tokens=1, arrival_time=clock.now)
        earlier.service_tier = history_tier
        sched.add_request(earlier)
        step(sched)
    assert not sched.has_unfinished_requests()
    holder = make_request("d0", prompt(500, 16), max_tokens=201, arrival_time=clock.now)
    sched.add_request(holder)
    step(sched)
    return sched, clock


def _predict(sched: Scheduler, clock: FakeClock, tier: str) -> float | None:
    request = make_request(f"new-{tier}", prompt(900, 16), max_tokens=4, arrival_time=clock.now)
    request.service_tier = tier
    return sched.predict_ttft(request).seconds


def test_a_flex_prediction_expects_the_priority_requests_arriving_meanwhile() -> None:
    today = 200 * 0.012 + (0.010 + 0.016)  # the holder's 200 decode steps, then our prefill
    sched, clock = _overtaken_state("priority")
    # 120 priority requests in the last 60 s: one every 0.5 s, 8 prompt tokens, 1 token (all ran to their
    # max_tokens). Those of 0.5, 1, 1.5 and 2 s arrive before the slot frees at 2.4 s and go first, 18 ms
    # each; the next one (2.5 s) comes after ours is admitted (2.472 s)
    assert _predict(sched, clock, "flex") == pytest.approx(2.4 + 4 * 0.018 + 0.026)
    assert _predict(sched, clock, "default") == pytest.approx(2.4 + 4 * 0.018 + 0.026)
    assert _predict(sched, clock, "priority") == pytest.approx(today)  # nothing overtakes the best tier
    # the same stream of flex requests, or none: today's prediction for every tier (the holder's own
    # default-tier arrival, one in 60 s, is expected back after 60 s: beyond these predictions)
    for history in ("flex", None):
        sched, clock = _overtaken_state(history)
        assert [_predict(sched, clock, tier) for tier in ("flex", "default", "priority")] == pytest.approx(
            [today] * 3
        ), history
    # the window forgets: 60 s after the last priority arrival, a flex request expects none
    sched, clock = _overtaken_state("priority")
    clock.now += 60.0
    assert _predict(sched, clock, "flex") == pytest.approx(today)


def test_calibration_takes_the_conformal_rank_of_each_tiers_recent_ratios() -> None:
    calibration = TtftCalibration(window=10, min_samples=4)
    for ratio in (1.0, 3.0, 2.0):
        calibration.observe(2, predicted_s=10.0, actual_s=10.0 * ratio)
    assert calibration.ratio(2, 0.9) is None  # 3 < min_samples
    calibration.observe(2, predicted_s=10.0, actual_s=5.0)
    calibration.observe(2, predicted_s=0.0, actual_s=5.0)  # no usable prediction: ignored
    calibration.observe(2, predicted_s=10.0, actual_s=-1.0)  # ignored
    assert calibration.samples(2) == 4 and calibration.ratio(0, 0.9) is None  # per tier
    # sorted 0.5, 1.0, 2.0, 3.0: rank ceil(5 x q), at most 4
    assert calibration.ratio(2, 0.9) == 3.0
    assert calibration.ratio(2, 0.5) == 2.0
    assert calibration.ratio(2, 0.3) == 1.0
    assert calibration.ratio(2, 0.1) == 0.5
    for index in range(10):  # the window keeps the last 10
        calibration.observe(2, predicted_s=1.0, actual_s=1.0 + index / 10)
    assert calibration.samples(2) == 10
    assert calibration.ratio(2, 1.0) == pytest.approx(1.9)
    assert calibration.ratio(2, 0.5) == pytest.approx(1.5)  # rank ceil(5.5) = 6 of 1.0 .. 1.9
    with pytest.raises(ValueError, match="quantile"):
        calibration.ratio(2, 0.0)
    with pytest.raises(ValueError, match="min_samples"):
        TtftCalibration(window=3, min_samples=4)
    with pytest.raises(ValueError, match="min_samples"):
        TtftCalibration(min_samples=0)


def test_calibration_starts_afresh_after_max_age_without_a_first_token() -> None:
    """Only admitted requests add ratios: a tier whose ratios make every request refused would stay refused
    forever (an idle engine, nothing ahead) unless a tier silent for ``max_age_s`` drops them."""
    calibration = TtftCalibration(window=10, min_samples=2, max_age_s=60.0)
    calibration.observe(1, predicted_s=1.0, actual_s=3.0, now=100.0)
    calibration.observe(1, predicted_s=1.0, actual_s=4.0, now=130.0)
    assert calibration.ratio(1, 0.9, now=189.0) == 4.0  # the newest is 59 s old: all kept
    assert calibration.samples(1) == 2
    assert calibration.ratio(1, 0.9, now=191.0) is None  # 61 s without a first token: dropped
    assert calibration.samples(1) == 0
    calibration.observe(1, predicted_s=1.0, actual_s=0.5, now=200.0)
    assert calibration.ratio(1, 0.9, now=200.0) is None and calibration.samples(1) == 1  # 1 < min_samples
    with pytest.raises(ValueError, match="max_age_s"):
        TtftCalibration(max_age_s=0.0)
