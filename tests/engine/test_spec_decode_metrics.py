"""The speculative-decoding metrics (issue 16; docs/metrics.md): exact counter, per-position and histogram
values after a known sequence of StepResult.spec_decoding, and what is exported with speculation off."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvscope.engine.engine_core import StepResult
from kvscope.engine.server.metrics import EngineMetrics, acceptance_length_buckets
from kvscope.engine.server.stat_logger import ServerMetrics
from kvscope.engine.spec_decode.stats import SpecDecodingStats

SD = "kvscope_engine_spec_decode_"


def _spec(*drafts: tuple[int, int]) -> SpecDecodingStats:
    return SpecDecodingStats(
        num_drafts=len(drafts),
        num_draft_tokens=sum(k for k, _ in drafts),
        num_accepted_tokens=sum(a for _, a in drafts),
        accepted_per_draft=tuple(a for _, a in drafts),
    )


def test_counters_positions_and_lengths_after_known_steps() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, "m", num_speculative_tokens=3)
    metrics.on_step(StepResult(batch_size=2, spec_decoding=_spec((3, 3), (3, 0))))
    metrics.on_step(StepResult(batch_size=1))  # a step without drafts counts nothing
    metrics.on_step(StepResult(batch_size=3, spec_decoding=_spec((2, 1), (3, 2), (1, 1))))
    value = registry.get_sample_value
    m = {"model": "m"}
    assert [
        value(f"{SD}{n}_total", m) for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    ] == [5.0, 12.0, 7.0]
    # accepted runs 3, 0, 1, 2, 1: position 0 accepted in 4 drafts, position 1 in 2, position 2 in 1
    assert [value(f"{SD}num_accepted_tokens_per_pos_total", {**m, "position": str(p)}) for p in range(3)] == [
        4.0,
        2.0,
        1.0,
    ]
    # lengths 1 + a = 4, 1, 2, 3, 2 into buckets 1, 2, 3, 4 (cumulative)
    assert [
        value(f"{SD}acceptance_length_bucket", {**m, "le": le}) for le in ("1.0", "2.0", "3.0", "4.0", "+Inf")
    ] == [1.0, 3.0, 4.0, 5.0, 5.0]
    assert (value(f"{SD}acceptance_length_sum", m), value(f"{SD}acceptance_length_count", m)) == (12.0, 5.0)
    # the histogram mean is vLLM's mean acceptance length 1 + accepted / drafts
    assert value(f"{SD}acceptance_length_sum", m) / value(f"{SD}acceptance_length_count", m) == 1 + 7 / 5


def test_speculation_off_exports_the_counters_at_zero_and_no_positions() -> None:
    registry = CollectorRegistry()
    ServerMetrics(registry, "m").on_step(StepResult(batch_size=4, num_scheduled_tokens=4))
    text = generate_latest(registry).decode()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'{SD}{name}_total{{model="m"}} 0.0' in text.splitlines()
    assert f'{SD}acceptance_length_bucket{{le="1.0",model="m"}} 0.0' in text.splitlines()
    assert f'{SD}acceptance_length_count{{model="m"}} 0.0' in text.splitlines()
    assert [
        line for line in text.splitlines() if line.startswith(f"{SD}num_accepted_tokens_per_pos_total")
    ] == []


def test_per_position_series_start_at_zero_for_each_draft_slot() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, num_speculative_tokens=4).initialize("m", "cpu")
    lines = [
        line
        for line in generate_latest(registry).decode().splitlines()
        if line.startswith(f"{SD}num_accepted_tokens_per_pos_total")
    ]
    assert lines == [
        f'{SD}num_accepted_tokens_per_pos_total{{model="m",position="{p}"}} 0.0' for p in range(4)
    ]


def test_acceptance_length_buckets_are_one_to_k_plus_one() -> None:
    assert acceptance_length_buckets(5) == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    assert acceptance_length_buckets(0) == (1.0,)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        EngineMetrics(CollectorRegistry(), num_speculative_tokens=-1)
