"""The n-gram proposer, the per-request acceptance tracker, the step-cost model and SpeculativeConfig."""

from __future__ import annotations

import logging

import pytest

from kvscope.engine.config import SpeculativeConfig
from kvscope.engine.spec_decode.adaptive import (
    FIRST_BACKOFF,
    PROBE_EVERY,
    AcceptanceTracker,
    StepCostModel,
    rows_bucket,
)
from kvscope.engine.spec_decode.ngram import NgramProposer
from kvscope.engine.spec_decode.stats import SpecDecodingStats


def test_proposer_matches_the_longest_suffix_at_its_last_occurrence():
    p = NgramProposer(4, 2, 4)
    assert p.propose([1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5, 6, 1]  # suffix 1 2 3 seen at 0
    assert p.propose([1, 2, 3, 4, 5, 6, 1, 2, 3], max_draft=2) == [4, 5]
    assert p.propose([1, 2, 9, 1, 2, 8, 1, 2]) == [8, 1, 2]  # the latest of two occurrences of 1 2
    assert p.propose([5, 6, 7, 9, 9, 6, 7]) == [9, 9, 6, 7]  # 3-gram 9 6 7 unseen: the 2-gram 6 7 matches
    assert p.propose([1, 2, 3, 4, 5]) == []  # no repeated suffix
    assert p.propose([1, 2, 3, 1, 2], max_draft=0) == []
    assert p.propose([3, 3]) == []  # too short: the suffix itself is not a match
    assert NgramProposer(2, 1, 1).propose([4, 7, 4]) == [7, 4]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(4, 3, 2)


def test_a_request_with_low_acceptance_pauses_then_retries_with_a_growing_backoff():
    t = AcceptanceTracker()
    t.on_verified(4, 4)
    t.on_verified(4, 0)
    assert t.should_propose()
    t.on_verified(4, 0)
    t.on_verified(4, 0)
    assert t.paused_steps == 0
    t.on_verified(4, 0)  # ema .5 -> .65 -> .455 -> .32 -> .22 -> .16 < .2: paused
    assert t.paused_steps == FIRST_BACKOFF
    assert [t.should_propose() for _ in range(FIRST_BACKOFF + 1)] == [False] * FIRST_BACKOFF + [True]
    t.on_verified(4, 0)  # the one retry draft fails too (ema .25 -> .175): twice as long
    assert t.paused_steps == 2 * FIRST_BACKOFF
    t.paused_steps = 0
    t.on_verified(4, 1)  # a quarter accepted: .25 stays .25, the request keeps proposing
    assert t.paused_steps == 0 and t.should_propose()
    t.paused_steps = 0
    t.on_verified(4, 4)
    assert t.backoff == FIRST_BACKOFF and t.should_propose()


def test_step_cost_model_turns_drafts_off_where_they_do_not_pay_and_logs_it(caplog):
    model = StepCostModel()
    assert model.allows(1, 4, 2.0)  # nothing measured: explore
    model.record(1, 0, 0.040)
    model.record(1, 4, 0.044)  # +1 ms per draft token at batch 1
    assert model.allows(1, 4, 1.0)  # 1 ms * 4 * 1 row < 40 ms * 1 expected
    for _ in range(20):
        model.record(32, 0, 0.150)
        model.record(32, 128, 0.470)  # +2.5 ms per draft token at batch 32
    with caplog.at_level(logging.INFO, logger="kvscope.engine.spec_decode.adaptive"):
        assert not model.allows(32, 128, 40.0)  # 2.5 ms * 128 * 32 > 150 ms * 40
    assert model.decision(32) is False and model.decision(1) is True
    assert "speculative decoding off at batch size 32" in caplog.text
    decisions = [model.allows(32, 128, 40.0) for _ in range(PROBE_EVERY)]
    assert decisions.count(True) == 1  # one probe per PROBE_EVERY steps re-measures the cost
    assert [rows_bucket(n) for n in (1, 4, 5, 8, 9, 33)] == [1, 4, 8, 8, 16, 64]
    costs = model.costs()  # what bench/spec_decode.py reports
    assert list(costs) == [1, 32] and costs[1] == (0.040, pytest.approx(0.001), True)
    t0, per_token, pays = costs[32]
    assert t0 == pytest.approx(0.150) and per_token == pytest.approx(0.0025) and pays is False
    model.allows(2, 2, 1.0)
    assert model.costs()[2] == (None, None, None)  # a bucket seen, nothing measured yet


def test_speculative_config_validation_and_stats():
    with pytest.raises(ValueError, match="speculative method must be one of ngram"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min must be at least 1"):
        SpeculativeConfig(prompt_lookup_min=0, prompt_lookup_max=0)
    assert SpecDecodingStats.from_drafts([]) is None
    assert SpecDecodingStats.from_drafts([(4, 2), (3, 3)]) == SpecDecodingStats(2, 7, 5, (2, 3))


def test_engine_flags_build_the_speculative_config():
    from kvscope.engine.llm import build_engine_config
    from kvscope.engine.server.cli import build_parser, engine_config_kwargs

    args = build_parser().parse_args(
        ["--speculative", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-max", "5"]
    )
    config = build_engine_config("smollm2-135m", **engine_config_kwargs(args))
    assert config.speculative == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=5
    )
    assert (
        build_engine_config("smollm2-135m", **engine_config_kwargs(build_parser().parse_args([]))).speculative
        is None
    )
    with pytest.raises(ValueError, match=r"prompt_lookup_max \(1\) must be at least prompt_lookup_min \(2\)"):
        build_engine_config("smollm2-135m", speculative="ngram", prompt_lookup_max=1)
