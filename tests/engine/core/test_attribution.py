"""Latency attribution from the scheduler's step records (engine/core/attribution.py, issue 18): on scripted
scenarios run through the real scheduler with a fake clock, each request's attribution adds up to the TTFT and
e2e the harness measured itself, and the cause the scenario built in comes first."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvscope.engine.core.request import Request
from kvscope.engine.core.scheduler import Scheduler
from kvscope.gateway.logs.why import rank_causes
from tests.engine.core.factories import FakeClock, make_request, make_scheduler, prompt

STEP_BASE_S = 0.010
"""Fixed cost of one step (s); each scheduled token adds TOKEN_S."""
TOKEN_S = 0.0001


@dataclass
class Run:
    """Drives the scheduler like engine_core.step, advancing the fake clock by a step cost model, and measures
    TTFT / e2e of each request from its own observation of the outputs."""

    scheduler: Scheduler
    clock: FakeClock
    arrivals: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    preempted: dict[str, float] = field(default_factory=dict)
    """Request id → start of the step that preempted it."""

    def add(self, request_id: str, num_prompt: int, max_tokens: int, start: int = 0) -> None:
        request = make_request(
            request_id,
            prompt(1000 + start, num_prompt),
            max_tokens=max_tokens,
            eos_token_id=None,
            arrival_time=self.clock.now,
        )
        self.arrivals[request_id] = self.clock.now
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.preempted.update(dict.fromkeys(out.preempted_req_ids, self.clock.now))
        self.clock.now += STEP_BASE_S + TOKEN_S * out.total_num_scheduled_tokens
        sampled = {s.request_id: [7] for s in out.scheduled if s.sample}
        finished = self.scheduler.update_from_output(out, sampled)
        for s in out.scheduled:
            if s.sample and s.request_id not in self.first_token:
                self.first_token[s.request_id] = self.clock.now
        for request in finished:
            self.finished[request.request_id] = self.clock.now

    def until_done(self) -> None:
        for _ in range(10_000):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("the scheduler did not drain")

    def stats(self, request_id: str) -> dict:
        request = self.requests[request_id]
        return request.stats.summary(request.num_output_tokens).to_dict()

    def check_adds_up(self, request_id: str) -> dict:
        """The named parts explain the measured TTFT and e2e within 5 %; returns the stats."""
        s = self.stats(request_id)
        ttft = self.first_token[request_id] - self.arrivals[request_id]
        e2e = self.finished[request_id] - self.arrivals[request_id]
        ttft_parts = (
            s["queue_s"] + s["prefill_own_s"] + s["prefill_interference_s"] + s["prefill_preempted_s"]
        )
        e2e_parts = ttft_parts + s["decode_own_s"] + s["decode_interference_s"] + s["decode_preempted_s"]
        assert ttft_parts == pytest.approx(ttft, rel=0.05)
        assert e2e_parts == pytest.approx(e2e, rel=0.05)
        assert s["ttft_s"] == pytest.approx(ttft, abs=1e-9)
        return s


def test_long_prompt_arriving_while_8_streams_decode() -> None:
    clock = FakeClock()
    run = Run(
        make_scheduler(num_blocks=256, max_num_batched_tokens=256, max_model_len=2048, clock=clock), clock
    )
    for i in range(8):
        run.add(f"short{i}", 16, max_tokens=40, start=100 * i)
    for _ in range(3):
        run.step()
    run.add("long", 1000, max_tokens=4, start=5000)
    run.until_done()
    long = run.check_adds_up("long")
    # 8 decodes take 8 of each step's 256 tokens: the prompt goes in chunks of 248 (4 steps) + 8
    assert (long["queue_ahead"], long["running_on_arrival"], long["queue_limit"]) == (0, 8, None)
    assert (long["prefill_steps"], long["prefill_tokens"]) == (5, 1000)
    assert (long["prefill_other_prefill_tokens"], long["prefill_other_decode_tokens"]) == (0, 40)
    assert long["prefill_other_requests_max"] == 8
    assert rank_causes(long)[0][0] == "own prefill"
    for i in range(8):
        short = run.check_adds_up(f"short{i}")
        assert (short["decode_steps"], short["decode_tokens"], short["decode_other_prefill_tokens"]) == (
            39,
            39,
            1000,
        )
        # the long prompt's share of the decode steps it shared with this stream: 4 chunks of 248 of 256
        # tokens (10 ms + 25.6 ms each), then 8 of 16 tokens (10 ms + 1.6 ms) ...
        joined = 4 * (STEP_BASE_S + 256 * TOKEN_S) * 248 / 256 + (STEP_BASE_S + 16 * TOKEN_S) * 8 / 16
        assert short["decode_interference_prefill_s"] == pytest.approx(joined, abs=1e-9)
        # ... plus the 7 other short prompts in its own prefill step (112 of 128 tokens, 10 ms + 12.8 ms)
        causes = dict(rank_causes(short))
        assert causes["other prefills"] == pytest.approx(
            joined + (STEP_BASE_S + 128 * TOKEN_S) * 112 / 128, abs=1e-9
        )
        assert [c for c, _ in rank_causes(short)][:2] == ["batched decodes", "other prefills"]


def test_32_arrivals_at_once_wait_on_max_num_seqs() -> None:
    clock = FakeClock()
    run = Run(make_scheduler(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096, clock=clock), clock)
    for i in range(32):
        run.add(f"r{i}", 64, max_tokens=8, start=100 * i)
    run.until_done()
    for i in range(32):
        s = run.check_adds_up(f"r{i}")
        assert (s["queue_ahead"], s["running_on_arrival"]) == (i, 0)
    last = run.stats("r31")
    # 3 waves of 8 requests ahead, 8 steps each (1 prefill + 7 decodes): 24 blocked steps
    assert (last["queue_limit"], last["queue_blocked_steps"]) == ("max_num_seqs", 24)
    assert rank_causes(last)[0][0] == "queue"
    assert run.stats("r0")["queue_limit"] is None


def test_kv_budget_forces_preemption() -> None:
    clock = FakeClock()
    # 6 blocks of 16 tokens: at 48 tokens each the two requests hold all 6; a's 49th token preempts b (the
    # newest, 48 tokens computed), which comes back once a (92 tokens = 6 blocks) has finished
    run = Run(make_scheduler(num_blocks=6, block_size=16, max_model_len=96, clock=clock), clock)
    run.add("a", 32, max_tokens=60)
    run.add("b", 32, max_tokens=20, start=500)
    run.until_done()
    a, b = run.check_adds_up("a"), run.check_adds_up("b")
    assert (a["num_preemptions"], b["num_preemptions"], b["recomputed_tokens"]) == (0, 1, 48)
    assert (b["prefill_preempted_s"], a["decode_preempted_s"]) == (0.0, 0.0)
    assert b["decode_preempted_s"] == pytest.approx(run.finished["a"] - run.preempted["b"], abs=1e-9)
    assert b["decode_tokens"] == 16 + 49 + 2  # 16 decodes, one chunk of 48 recomputed + 1 pending, 2 decodes
    assert rank_causes(b)[0][0] == "preemption"


def test_the_choices_of_one_request_are_not_each_others_interference() -> None:
    """n > 1: siblings (Request.parent_id) share every step; each counts the group's tokens as its own, and
    the merged kvscope object takes one choice's attribution (the last to finish) instead of adding them
    up."""
    from kvscope.engine.core.stats import KvscopeStats

    clock = FakeClock()
    run = Run(make_scheduler(num_blocks=64, enable_caching=False, clock=clock), clock)
    for i in range(2):
        request = make_request(
            f"req-{i}",
            prompt(1000, 40),
            max_tokens=3,
            eos_token_id=None,
            parent_id="req",
            arrival_time=clock.now,
        )
        run.arrivals[request.request_id], run.requests[request.request_id] = clock.now, request
        run.scheduler.add_request(request)
    run.add("stranger", 24, max_tokens=3, start=500)
    run.until_done()
    first = run.check_adds_up("req-0")
    assert (
        first["prefill_tokens"],
        first["prefill_other_prefill_tokens"],
        first["prefill_other_requests_max"],
        first["decode_tokens"],
        first["decode_other_decode_tokens"],
    ) == (80, 24, 1, 4, 2)
    stranger = run.stats("stranger")
    assert (
        stranger["prefill_tokens"],
        stranger["prefill_other_prefill_tokens"],
        stranger["prefill_other_requests_max"],
    ) == (24, 80, 2)
    summaries = [run.requests[f"req-{i}"].stats.summary(3) for i in range(2)]
    merged = KvscopeStats.merge(summaries)
    assert (merged.prefill_tokens, merged.decode_tokens, merged.prefill_own_s) == (
        80,
        4,
        summaries[1].prefill_own_s,
    )
