"""sample_from_metrics: each kind's /metrics text (tests/fixtures/upstreams/<kind>/metrics.txt, written from
the servers' sources; kvscope's made live by the engine's own collectors) reduced to exact EngineSamples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvscope.common.upstream_metrics import METRIC_PREFIXES, UPSTREAM_METRIC_NAMES, sampled_names
from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.gateway.engines.samples import (
    MAX_SAMPLED_LINES,
    METRIC_NAMES,
    EngineSample,
    sample_from_metrics,
    sample_from_slots,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "upstreams"


def fixture(kind: str) -> str:
    return (FIXTURES / kind / "metrics.txt").read_text()


def test_every_kind_but_openai_has_its_series() -> None:
    assert set(METRIC_NAMES) == set(UpstreamKind) - {UpstreamKind.OPENAI}
    assert set(UPSTREAM_METRIC_NAMES) == {k.value for k in METRIC_NAMES}
    assert set(METRIC_PREFIXES) == set(UPSTREAM_METRIC_NAMES)
    for kind, names in UPSTREAM_METRIC_NAMES.items():  # every sampled series carries its kind's prefix
        sampled = (*names.requests_running, *names.requests_waiting, *names.kv_cache_usage)
        assert all(n.startswith(METRIC_PREFIXES[kind]) for n in sampled), kind
    assert "vllm:kv_cache_usage_perc" in sampled_names() and "vllm:cache_config_info" in sampled_names()


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # two data-parallel engines: running 3 + 2, waiting 1 + 0, usage max(0.4125, 0.25),
        # capacity 2 x 101712
        ("vllm", EngineSample(7.0, 5.0, 1.0, 0.4125, 203424, UpstreamKind.VLLM)),
        # TP ranks 0 and 1 report copies of one scheduler: counted once
        ("sglang", EngineSample(7.0, 4.0, 2.0, 0.37, 287186, UpstreamKind.SGLANG)),
        # no KV usage series; the capacity is the batch token budget
        ("tgi", EngineSample(7.0, 6.0, 3.0, None, 163840, UpstreamKind.TGI)),
    ],
)
def test_fixture_samples(kind: str, expected: EngineSample) -> None:
    assert sample_from_metrics(fixture(kind), at=7.0) == expected


def test_kvscope_engine_collectors() -> None:
    """The text our own engine serves (its collectors, rendered by prometheus_client) reads back exactly."""
    from kvscope.engine.server.metrics import EngineMetrics

    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    metrics.requests_running.labels(model="m").set(7)
    metrics.requests_waiting.labels(model="m").set(2)
    metrics.kv_cache_usage_ratio.labels(model="m").set(0.625)
    text = generate_latest(registry).decode()
    assert sample_from_metrics(text, at=1.5) == EngineSample(1.5, 7.0, 2.0, 0.625, None, UpstreamKind.KVSCOPE)


LLAMACPP_CURRENT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1530
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode counter
llamacpp:n_busy_slots_per_decode 1.84
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""
"""The shape of tools/server/server-context.cpp's /metrics handler (``llamacpp:`` + name, no labels, the
value as a C++ stream writes a double)."""


def test_llamacpp_current_build_has_no_kv_usage() -> None:
    assert sample_from_metrics(LLAMACPP_CURRENT, at=0.0) == EngineSample(
        0.0, 2.0, 1.0, None, None, UpstreamKind.LLAMACPP
    )


def test_llamacpp_older_build_kv_usage_ratio() -> None:
    """Older llama-server builds also wrote ``kv_cache_usage_ratio`` (used KV cells / n_ctx)."""
    text = LLAMACPP_CURRENT + (
        "# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE llamacpp:kv_cache_usage_ratio gauge\n"
        "llamacpp:kv_cache_usage_ratio 0.1875\n"
    )
    assert sample_from_metrics(text, at=0.0).kv_cache_usage == 0.1875


def test_llamacpp_recorded_fixture() -> None:
    """llama.cpp's /metrics as recorded from the llama-server this repo builds (tests/fixtures/upstreams/
    llamacpp/, during a 200-token stream): busy slots, deferred tasks and the kind; no KV usage."""
    text = (FIXTURES / "llamacpp" / "metrics_busy.txt").read_text()
    assert sample_from_metrics(text, at=0.0) == EngineSample(0.0, 1.0, 0.0, None, None, UpstreamKind.LLAMACPP)


def slots_fixture(name: str) -> object:
    return json.loads((FIXTURES / "llamacpp" / f"{name}.json").read_text())


def test_llamacpp_recorded_slots() -> None:
    """/slots as recorded (-np 2 -c 1024: two slots of n_ctx 512). Idle, never used: nothing held. During a
    stream: slot 1 runs (n_prompt_tokens 72 = 37 prompt + 35 decoded: it already counts n_decoded), slot 0 is
    idle and keeps the 12 tokens of its last task; (72 + 12) / (512 + 512)."""
    assert sample_from_slots(slots_fixture("slots"), at=1.0) == EngineSample(1.0, 0.0, None, 0.0, 1024)
    assert sample_from_slots(slots_fixture("slots_busy"), at=2.0) == EngineSample(
        2.0, 1.0, None, 84 / 1024, 1024
    )


@pytest.mark.parametrize(
    "body",
    [[], {"slots": []}, [{"id": 0}], [{"id": 0, "n_ctx": 0}], [{"id": 0, "n_ctx": True}], ["x"]],
)
def test_llamacpp_slots_not_a_slot_array_raises(body: object) -> None:
    with pytest.raises(ValueError):
        sample_from_slots(body)


def test_metrics_filled_by_slots() -> None:
    """/metrics first (its busy slots and deferred tasks), /slots fills the KV usage and capacity; the older
    stamp counts."""
    metrics = EngineSample(5.0, 2.0, 1.0, None, None, UpstreamKind.LLAMACPP)
    slots = EngineSample(4.0, 1.0, None, 0.25, 2048)
    assert metrics.filled(slots) == EngineSample(4.0, 2.0, 1.0, 0.25, 2048, UpstreamKind.LLAMACPP)
    assert slots.filled(metrics) == EngineSample(4.0, 1.0, 1.0, 0.25, 2048, UpstreamKind.LLAMACPP)


def test_vllm_older_names_and_block_count_capacity() -> None:
    """Releases before 0.9: ``vllm:gpu_cache_usage_perc``; before ``kv_cache_size_tokens``: blocks x size."""
    text = """\
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="6000"} 1.0
"""
    assert sample_from_metrics(text, at=0.0) == EngineSample(0.0, 1.0, 0.0, 0.5, 96000, UpstreamKind.VLLM)


def test_vllm_new_usage_name_wins_and_unprofiled_capacity_is_unknown() -> None:
    text = """\
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.75
vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="None",num_gpu_blocks="None"} 1.0
"""
    sample = sample_from_metrics(text, at=0.0)
    assert (sample.kv_cache_usage, sample.kv_capacity_tokens) == (0.25, None)


def test_sglang_data_parallel_ranks_add_up() -> None:
    """dp_rank 0 and 1 are two schedulers (summed); their TP ranks are copies (counted once)."""
    lines = []
    for dp, (running, queued, usage, pool) in enumerate([(3, 1, 0.2, 1000), (5, 0, 0.6, 1000)]):
        for tp in (2 * dp, 2 * dp + 1):
            labels = f'dp_rank="{dp}",engine_type="unified",model_name="m",tp_rank="{tp}"'
            lines += [
                f"sglang:num_running_reqs{{{labels}}} {running}",
                f"sglang:num_queue_reqs{{{labels}}} {queued}",
                f"sglang:token_usage{{{labels}}} {usage}",
                f"sglang:max_total_num_tokens{{{labels}}} {pool}",
            ]
    sample = sample_from_metrics("\n".join(lines) + "\n", at=0.0)
    assert sample == EngineSample(0.0, 8.0, 1.0, 0.6, 2000, UpstreamKind.SGLANG)


def test_configured_kind_reads_its_own_series() -> None:
    """``kind`` (config or card) picks the series even where the names' majority says another kind."""
    text = fixture("tgi") + 'vllm:num_requests_running{engine="0",model_name="m"} 9.0\n'
    sample = sample_from_metrics(text, UpstreamKind.VLLM, at=0.0)
    assert (sample.requests_running, sample.requests_waiting, sample.kind_hint) == (
        9.0,
        None,
        UpstreamKind.TGI,
    )


def test_unknown_text_is_empty() -> None:
    sample = sample_from_metrics(
        "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n", at=2.0
    )
    assert sample == EngineSample(2.0) and sample.empty
    assert sample_from_metrics('{"echo": "/metrics"}', at=0.0).empty  # a JSON answer: nothing
    assert not sample_from_metrics(fixture("tgi"), at=0.0).empty


def test_malformed_sampled_line_raises_other_lines_do_not_matter() -> None:
    with pytest.raises(ValueError):
        sample_from_metrics('vllm:num_requests_running{engine="0" 3.0\n')
    text = 'weird{a=unquoted} 1\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    assert sample_from_metrics(text, at=0.0).requests_running == 3.0


def test_non_finite_values_are_ignored() -> None:
    text = 'vllm:kv_cache_usage_perc{engine="0"} NaN\nvllm:kv_cache_usage_perc{engine="1"} 0.5\n'
    assert sample_from_metrics(text, at=0.0).kv_cache_usage == 0.5


def test_age() -> None:
    assert EngineSample(10.0).age_s(10.5) == 0.5
    assert EngineSample(10.0).age_s(9.0) == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # negative gauges and a KV usage below 0: no server's state
        (
            'vllm:num_requests_running{engine="0"} -3\nvllm:num_requests_waiting{engine="0"} -1\n'
            'vllm:kv_cache_usage_perc{engine="0"} -0.5\n',
            EngineSample(0.0, kind_hint=UpstreamKind.VLLM),
        ),
        # a percentage where vLLM sends a fraction, and 1e300 requests: dropped, the sane series kept
        (
            'vllm:num_requests_running{engine="0"} 1e300\nvllm:num_requests_waiting{engine="0"} 4\n'
            'vllm:kv_cache_usage_perc{engine="0"} 85\n',
            EngineSample(0.0, requests_waiting=4.0, kind_hint=UpstreamKind.VLLM),
        ),
        # one engine's absurd value is dropped, the others still add up
        (
            'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 2e9\n'
            'vllm:kv_cache_usage_perc{engine="0"} 1.0\nvllm:kv_cache_usage_perc{engine="1"} 1.5\n',
            EngineSample(0.0, requests_running=2.0, kv_cache_usage=1.0, kind_hint=UpstreamKind.VLLM),
        ),
        # a capacity no cache holds (num_gpu_blocks x block_size = 1.6e21 tokens), and +Inf for SGLang's
        (
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="99999999999999999999"} 1\n',
            EngineSample(0.0, kind_hint=UpstreamKind.VLLM),
        ),
        (
            "sglang:max_total_num_tokens +Inf\nsglang:num_running_reqs 1\n",
            EngineSample(0.0, requests_running=1.0, kind_hint=UpstreamKind.SGLANG),
        ),
    ],
)
def test_values_no_server_reports_are_dropped(text: str, expected: EngineSample) -> None:
    """A buggy or hostile /metrics put -3 running, a KV usage of 85 and a 301-digit integer (ES `long`
    fields refuse the whole record) into the request log before."""
    assert sample_from_metrics(text, at=0.0) == expected


def test_too_many_sampled_lines_raise() -> None:
    """160,000 lines of a sampled series (8 MB) took 4 s of the event loop per scrape before."""
    line = 'vllm:num_requests_running{engine="%d"} 1\n'
    fits = "".join(line % i for i in range(MAX_SAMPLED_LINES))
    assert sample_from_metrics(fits, at=0.0).requests_running == float(MAX_SAMPLED_LINES)
    with pytest.raises(ValueError, match=f"more than {MAX_SAMPLED_LINES} lines of sampled series"):
        sample_from_metrics(fits + line % MAX_SAMPLED_LINES, at=0.0)
    # lines of series the gateway does not read are not counted
    other = "".join(f'vllm:e2e_request_latency_seconds_bucket{{le="{i}"}} 1\n' for i in range(5000))
    assert sample_from_metrics(other + fits, at=0.0).requests_running == float(MAX_SAMPLED_LINES)


def test_slots_capacity_no_cache_holds_is_dropped() -> None:
    body = [{"id": 0, "n_ctx": 2**41, "is_processing": True, "n_prompt_tokens": 2**40}]
    assert sample_from_slots(body, at=0.0) == EngineSample(0.0, requests_running=1.0, kv_cache_usage=0.5)
