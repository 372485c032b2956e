"""A replica's kind: the configured one, else its card's owned_by, else its /metrics names, else its /info or
/props answer, else openai; set when the replica is made and again at every health check and scrape. Its KV
capacity: the card's, else the last sample's. The settings that name kinds and metric paths."""

from __future__ import annotations

from typing import get_args

import httpx
import msgspec
import pytest
from prometheus_client import CollectorRegistry

from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.gateway.engines.samples import EngineSample
from kvscope.gateway.metrics import GatewayMetrics
from kvscope.gateway.proxy.upstreams import Replica, UpstreamPool
from kvscope.gateway.routing.prefix_index import PrefixIndex
from kvscope.gateway.settings import (
    DnsDiscoveryConfig,
    RoutingConfig,
    UpstreamConfig,
    UpstreamKindSetting,
    UpstreamMetricsConfig,
    load_settings,
)

URL = "http://10.0.0.1:8000"


def replica(**config: object) -> Replica:
    return Replica(msgspec.convert({"url": URL, **config}, UpstreamConfig))


def test_the_setting_names_every_kind() -> None:
    assert set(get_args(UpstreamKindSetting)) == {"auto"} | {k.value for k in UpstreamKind}


def test_nothing_known_is_openai_by_default() -> None:
    r = replica()
    assert (r.kind, r.kind_source) == (UpstreamKind.OPENAI, "default")


def test_each_stronger_signal_overrides_the_weaker() -> None:
    r = replica()
    r.observe_probe(UpstreamKind.TGI, "info")
    assert (r.kind, r.kind_source) == (UpstreamKind.TGI, "info")
    r.observe_sample(EngineSample(1.0, kind_hint=UpstreamKind.SGLANG))
    assert (r.kind, r.kind_source) == (UpstreamKind.SGLANG, "metrics")
    r.cards = {"m": {"id": "m", "owned_by": "vllm"}}
    r.evaluate_kind()
    assert (r.kind, r.kind_source) == (UpstreamKind.VLLM, "models")
    r.observe_sample(EngineSample(2.0))  # a later scrape without names: the card still decides
    assert (r.kind, r.kind_source) == (UpstreamKind.VLLM, "models")


def test_the_configured_kind_wins_from_the_start() -> None:
    r = replica(kind="llamacpp")
    assert (r.kind, r.kind_source) == (UpstreamKind.LLAMACPP, "config")
    r.cards = {"m": {"id": "m", "owned_by": "vllm"}}
    r.observe_sample(EngineSample(1.0, kind_hint=UpstreamKind.SGLANG))
    assert (r.kind, r.kind_source) == (UpstreamKind.LLAMACPP, "config")


def test_a_card_that_names_no_server_says_nothing() -> None:
    r = replica()
    r.cards = {"m": {"id": "m", "owned_by": "meta-llama/Llama-3.1-8B"}}  # TGI writes the model id there
    r.observe_sample(EngineSample(1.0, kind_hint=UpstreamKind.TGI))
    assert (r.kind, r.kind_source) == (UpstreamKind.TGI, "metrics")


async def test_every_health_check_re_evaluates_the_kind() -> None:
    owned_by = {"value": "fake"}

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"data": [{"id": "m", "owned_by": owned_by["value"]}]})

    registry = CollectorRegistry()
    pool = UpstreamPool([UpstreamConfig(url=URL)], [], RoutingConfig(), GatewayMetrics(registry))
    r = pool.replicas[0]
    assert info_labels(registry) == [("10.0.0.1:8000", "unknown", "unknown")]  # never reached yet
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        assert await pool.check(r, client)
        assert (r.kind, r.kind_source, r.health_epoch) == (UpstreamKind.OPENAI, "default", 1)
        assert info_labels(registry) == [("10.0.0.1:8000", "openai", "default")]
        owned_by["value"] = "sglang"
        assert await pool.check(r, client)
        assert (r.kind, r.kind_source, r.health_epoch) == (UpstreamKind.SGLANG, "models", 1)
        assert info_labels(registry) == [("10.0.0.1:8000", "sglang", "models")]
    r.cards = {}
    r.observe_sample(EngineSample(3.0, kind_hint=UpstreamKind.TGI))  # a scrape moves the series at once
    assert info_labels(registry) == [("10.0.0.1:8000", "tgi", "metrics")]
    assert (
        registry.get_sample_value("kvscope_gateway_upstream_up", {"upstream": "10.0.0.1:8000", "kind": "tgi"})
        == 1
    )


def info_labels(registry: CollectorRegistry) -> list[tuple[str, str, str]]:
    """(upstream, kind, kind_source) of every kvscope_gateway_upstream_info series."""
    return [
        (s.labels["upstream"], s.labels["kind"], s.labels["kind_source"])
        for family in registry.collect()
        for s in family.samples
        if s.name == "kvscope_gateway_upstream_info"
    ]


def test_a_reconfigured_replica_takes_its_new_kind() -> None:
    pool = UpstreamPool([UpstreamConfig(url=URL)], [], RoutingConfig(), GatewayMetrics(CollectorRegistry()))
    r = pool.replicas[0]
    pool.set_upstreams("config", [UpstreamConfig(url=URL, kind="tgi")])
    assert (r.kind, r.kind_source) == (UpstreamKind.TGI, "config")


def test_health_transitions_count() -> None:
    pool = UpstreamPool([UpstreamConfig(url=URL)], [], RoutingConfig(), GatewayMetrics(CollectorRegistry()))
    r = pool.replicas[0]
    pool.report_failure(r, "connect", eject=True)  # already down: no transition
    assert r.health_epoch == 0
    pool._set_health(r, True)
    pool._set_health(r, True)
    pool.report_failure(r, "connect", eject=True)
    r.restarted()  # down: coming back up is the transition
    assert r.health_epoch == 2
    pool._set_health(r, True)
    r.restarted()  # a new instance while up
    assert r.health_epoch == 4


def test_kv_capacity_card_first_then_sample() -> None:
    r = replica()
    assert r.kv_cache_capacity("m") == (None, None)
    r.observe_sample(EngineSample(1.0, kv_capacity_tokens=203424))
    assert r.kv_cache_capacity("m") == (None, 203424)
    r.cards = {"m": {"id": "m", "kvscope": {"block_size": 16, "num_gpu_blocks": 100}}}
    assert r.kv_cache_capacity("m") == (16, 1600)


def test_a_capacity_first_learned_from_metrics_resizes_the_prefix_index() -> None:
    r = replica()
    r.prefix_index = index = PrefixIndex(8)
    r.observe_sample(EngineSample(1.0))  # no capacity: the index stays
    assert r.prefix_index is index
    r.observe_sample(EngineSample(2.0, kv_capacity_tokens=4096))
    assert r.prefix_index is None  # made again at the next cache_aware request, 4096 tokens large
    r.prefix_index = index
    r.observe_sample(EngineSample(3.0, kv_capacity_tokens=8192))  # known before: the index keeps its prefixes
    assert r.prefix_index is index


def test_upstream_and_dns_settings() -> None:
    settings = load_settings(
        None,
        {
            "upstreams": [
                {"url": URL, "kind": "vllm"},
                {"url": "http://10.0.0.2:8000", "metrics_path": None},
            ],
            "upstream_metrics": {"interval_s": 0.5, "idle_interval_s": 30, "timeout_s": 0.25},
        },
        env={},
    )
    assert [(u.kind, u.metrics_path) for u in settings.upstreams] == [("vllm", "/metrics"), ("auto", None)]
    assert settings.upstream_metrics == UpstreamMetricsConfig(
        interval_s=0.5, idle_interval_s=30, timeout_s=0.25
    )
    dns = DnsDiscoveryConfig(name="vllm-headless", port=8000, kind="vllm", metrics_path="/prom")
    assert dns.upstream("10.0.0.3") == UpstreamConfig(
        url="http://10.0.0.3:8000", kind="vllm", metrics_path="/prom"
    )


@pytest.mark.parametrize(
    "raw",
    [
        {"upstreams": [{"url": URL, "kind": "ollama"}]},
        {"upstreams": [{"url": URL, "metrics_path": "metrics"}]},
        {"upstreams": [{"url": URL, "metrics_path": "http://x/metrics"}]},
        {"upstreams": [{"url": URL}], "upstream_metrics": {"interval_s": 0}},
        {"upstreams": [{"url": URL}], "upstream_metrics": {"idle_interval_s": 0.5}},
        {"upstreams": [{"url": URL}], "upstream_metrics": {"timeout_s": 2}},
        {"upstreams": [{"url": URL}], "upstream_metrics": {"timeout_s": float("nan")}},
    ],
)
def test_invalid_settings_are_refused(raw: dict) -> None:
    with pytest.raises(ValueError) as exc:
        load_settings(None, raw, env={})
    assert "invalid gateway config" in str(exc.value)
