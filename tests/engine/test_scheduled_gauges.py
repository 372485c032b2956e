"""Running/waiting gauges do not lag a long first prefill (issue 15, point 8): the step listener hears the
scheduler's state as soon as a step is scheduled, before the model runs."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvscope.engine.engine_core import StepResult
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.stat_logger import ServerMetrics

pytestmark = pytest.mark.slow


def test_a_request_in_its_first_prefill_is_running_before_the_step_ends(llm) -> None:
    core = llm.engine
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, "m")
    seen: list[tuple[bool, float | None, float | None, int]] = []

    def listener(result: StepResult) -> None:
        metrics.on_step(result)
        if result.scheduled_only:  # the model has not run yet: no token sampled
            assert core.scheduler.requests["gauges-1"].output_token_ids == []
        # what a scrape during the model's forward pass would read
        seen.append(
            (
                result.scheduled_only,
                registry.get_sample_value("kvscope_engine_requests_running", {"model": "m"}),
                registry.get_sample_value("kvscope_engine_requests_waiting", {"model": "m"}),
                len(result.outputs),
            )
        )

    prompt = llm.tokenizer.encode("A long prompt about caches. " * 20)
    core.add_request("gauges-1", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    result = core.step(on_scheduled=listener)
    listener(result)
    assert seen[0] == (True, 1.0, 0.0, 0)  # scheduled: running 1, waiting 0, nothing computed yet
    assert seen[1][0] is False and seen[1][1] == 1.0 and seen[1][3] == 1
    while core.has_unfinished_requests():
        core.step()
