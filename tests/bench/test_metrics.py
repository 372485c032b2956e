"""Statistics against hand-computed values: percentiles, latency summaries and a whole run over a fake stream
with known timings (benchmark clock = the scripted stream's clock)."""

from __future__ import annotations

import asyncio
import contextlib
import math

import httpx
import pytest

from kvscope.bench.client import EndpointConfig, RequestOutput
from kvscope.bench.dataset import SampleRequest
from kvscope.bench.metrics import LatencyStats, calculate_metrics, percentile
from kvscope.bench.runner import LoadConfig, run_benchmark
from tests.bench.fakes import FakeClock, ScriptedServer, token_stream


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (50, 2.5), (90, 3.7), (99, 3.97), (100, 4.0)])
def test_percentile_interpolates_linearly_like_numpy(q, expected):
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected, abs=1e-12)


def test_percentile_edges():
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_stats_in_ms_with_population_std():
    stats = LatencyStats.of([0.1, 0.2, 0.3, 0.4], [50, 90, 99])
    assert stats.mean == pytest.approx(250.0)
    assert stats.median == pytest.approx(250.0)
    assert stats.std == pytest.approx(math.sqrt(12500.0))  # deviations ±150, ±50 → (2·150² + 2·50²)/4
    assert stats.percentiles == pytest.approx({50.0: 250.0, 90.0: 370.0, 99.0: 397.0})
    assert stats.count == 4
    assert LatencyStats.of([], [99]) == LatencyStats(0.0, 0.0, 0.0, {99.0: 0.0}, 0)


def test_counts_mismatches_errors_and_prompt_fallback():
    good = RequestOutput(
        success=True,
        prompt_len=0,
        expected_output_len=3,
        ttft=0.5,
        latency=1.0,
        stream_tokens=2,
        usage_output_tokens=3,
        usage_prompt_tokens=9,
        cached_tokens=4,
    )
    no_usage = RequestOutput(
        success=True, prompt_len=5, expected_output_len=3, ttft=0.5, latency=1.5, stream_tokens=3
    )
    failed = [
        RequestOutput(error_type="http_429"),
        RequestOutput(error_type="http_429"),
        RequestOutput(error_type="timeout"),
    ]
    m = calculate_metrics([good, no_usage, *failed], duration=2.0)
    assert (m.completed, m.failed) == (2, 3)
    assert m.error_counts == {"http_429": 2, "timeout": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (9 + 5, 3 + 3)
    assert (m.stream_usage_mismatches, m.missing_usage, m.output_len_mismatches) == (1, 1, 0)
    assert (m.server_input_tokens, m.cached_tokens) == (9, 4)
    assert m.latencies["tpot"].mean == pytest.approx(((1.0 - 0.5) / 2 + (1.5 - 0.5) / 2) / 2 * 1000)
    with pytest.raises(ValueError):
        calculate_metrics([good], duration=0.0)


STREAMS = {
    # prompt → (events, prompt_len): tokens at the given gaps, [DONE] after the last
    "p1": (token_stream([0.5, 0.125, 0.25], done_after=0.125), 10),  # TTFT .5  e2e 1.0  3 tokens
    "p2": (token_stream([0.25, 0.25, 0.25, 0.25], done_after=0.5), 20),  # TTFT .25 e2e 1.5  4 tokens
    "p3": (token_stream([1.0], done_after=0.0), 30),  # TTFT 1.0 e2e 1.0  1 token
    "p4": ((500, {"error": {"message": "engine died", "type": "server_error"}}), 40),
}


async def test_run_over_fake_streams_matches_hand_computed_figures():
    clock = FakeClock(100.0)
    server = ScriptedServer(clock, lambda body: STREAMS[body["prompt"]][0])
    samples = [SampleRequest(p, STREAMS[p][1], 3) for p in STREAMS]
    load = LoadConfig(max_concurrency=1, num_warmups=0)
    async with server.client() as client:
        result = await run_benchmark(
            EndpointConfig("http://fake", "m"), samples, load, client=client, clock=clock, progress=False
        )
    m = result.metrics.as_dict()
    duration = 1.0 + 1.5 + 1.0
    assert m["duration"] == pytest.approx(duration)
    assert (m["completed"], m["failed"], m["error_counts"]) == (3, 1, {"http_500": 1})
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 8)
    assert m["request_throughput"] == pytest.approx(3 / duration)
    assert m["input_throughput"] == pytest.approx(60 / duration)
    assert m["output_throughput"] == pytest.approx(8 / duration)
    assert m["total_token_throughput"] == pytest.approx(68 / duration)
    expected_ms = {
        # TTFT [500, 250, 1000]
        "mean_ttft_ms": 1750 / 3,
        "median_ttft_ms": 500,
        "p90_ttft_ms": 900,
        "p99_ttft_ms": 990,
        "std_ttft_ms": math.sqrt(
            ((500 - 1750 / 3) ** 2 + (250 - 1750 / 3) ** 2 + (1000 - 1750 / 3) ** 2) / 3
        ),
        # TPOT: p1 (1.0 − .5)/2 = 250, p2 (1.5 − .25)/3 = 416.67, p3 has one token → none
        "mean_tpot_ms": (250 + 1250 / 3) / 2,
        "median_tpot_ms": (250 + 1250 / 3) / 2,
        "p99_tpot_ms": 250 + 0.99 * (1250 / 3 - 250),
        # ITL pooled [125, 250, 250, 250, 250]
        "mean_itl_ms": 225,
        "median_itl_ms": 250,
        "p90_itl_ms": 250,
        # E2EL [1000, 1500, 1000]
        "mean_e2el_ms": 3500 / 3,
        "median_e2el_ms": 1000,
        "p90_e2el_ms": 1400,
        "p99_e2el_ms": 1490,
    }
    assert {k: m[k] for k in expected_ms} == pytest.approx(expected_ms)
    assert m["output_len_mismatches"] == 2  # p2 made 4 tokens and p3 1, 3 were expected
    assert [o.error for o in result.outputs] == ["", "", "", "engine died"]
    assert server.bodies[0]["max_tokens"] == 3


async def test_max_concurrency_caps_requests_in_flight():
    """Each answer is held until ``expected_peak`` requests are in flight at once (30 s deadline, so a cap
    that is too tight ends with a lower peak instead of hanging); no clock decides the overlap."""
    in_flight, peak, target = 0, 0, 0
    crowded = asyncio.Event()

    async def body():
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight >= target:
            crowded.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(crowded.wait(), 30)
        in_flight -= 1  # before the last bytes: the client closes the stream at [DONE]
        yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\ndata: [DONE]\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    samples = [SampleRequest(f"p{i}", 1, 1) for i in range(9)]
    for cap, expected_peak in ((3, 3), (None, 9)):
        peak, target = 0, expected_peak
        crowded.clear()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            result = await run_benchmark(
                EndpointConfig("http://fake", "m"),
                samples,
                LoadConfig(max_concurrency=cap, num_warmups=0),
                client=client,
                progress=False,
            )
        assert result.metrics.completed == 9
        assert peak == expected_peak
