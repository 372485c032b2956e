"""The upstream kind on the gateway's per-upstream series (gateway/metrics.py, issue 38): a ``kind`` label on
``…_upstream_up``, ``…_upstream_outstanding_requests`` and ``…_upstream_errors_total``, and
``kvscope_gateway_upstream_info{upstream, kind, kind_source}``; a changed kind moves the series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.gateway.metrics import UPSTREAM_ERROR_REASONS, GatewayMetrics

UP, OUT = "kvscope_gateway_upstream_up", "kvscope_gateway_upstream_outstanding_requests"
ERRORS, INFO = "kvscope_gateway_upstream_errors_total", "kvscope_gateway_upstream_info"


def series(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of every sample labelled ``upstream``."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if "upstream" in s.labels and not s.name.endswith("_created")
    }


def expected(
    upstream: str, kind: str, source: str, up: float = 0.0, outstanding: float = 0.0, **errors: float
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The series of one upstream: ``errors`` maps reason → count (others 0)."""
    labels = (("kind", kind), ("upstream", upstream))
    return {
        (UP, labels): up,
        (OUT, labels): outstanding,
        **{(ERRORS, (("kind", kind), ("reason", r), ("upstream", upstream))): errors.get(r, 0.0) for r in
           UPSTREAM_ERROR_REASONS},
        (INFO, (("kind", kind), ("kind_source", source), ("upstream", upstream))): 1.0,
    }  # fmt: skip


def test_a_joining_upstream_is_of_unknown_kind_until_told() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.initialize_upstream("a")
    metrics.initialize_upstream("b", UpstreamKind.TGI, "config")  # a kind set in the config is known at once
    assert series(registry) == {**expected("a", "unknown", "unknown"), **expected("b", "tgi", "config")}


def test_a_detected_kind_moves_the_series_keeping_the_gauges() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.initialize_upstream("a")
    metrics.set_upstream_up("a", True)
    metrics.set_upstream_outstanding("a", 3)
    metrics.count_upstream_error("a", "connect")
    metrics.set_upstream_kind("a", UpstreamKind.VLLM, "models")
    # the gauges keep their values; the counters are new series of the new kind, from 0
    assert series(registry) == expected("a", "vllm", "models", up=1.0, outstanding=3.0)
    metrics.count_upstream_error("a", "timeout")
    metrics.set_upstream_outstanding("a", 2)
    metrics.set_upstream_up("a", False)
    assert series(registry) == expected("a", "vllm", "models", up=0.0, outstanding=2.0, timeout=1.0)


def test_a_new_source_of_the_same_kind_moves_only_the_info_series() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.initialize_upstream("a", "sglang", "models")
    metrics.count_upstream_error("a", "status_5xx")
    metrics.set_upstream_kind("a", "sglang", "models")  # unchanged: nothing moves
    assert series(registry) == expected("a", "sglang", "models", status_5xx=1.0)
    metrics.set_upstream_kind("a", "sglang", "metrics")
    assert series(registry) == expected("a", "sglang", "metrics", status_5xx=1.0)
    metrics.set_upstream_kind("a", None, None)  # not known any more
    assert series(registry) == expected("a", "unknown", "unknown")


def test_a_leaving_upstream_takes_every_series_and_rejoins_afresh() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.initialize(("a", "b"))
    metrics.set_upstream_kind("a", "llamacpp", "props")
    metrics.set_upstream_up("a", True)
    metrics.remove_upstream("a")
    metrics.remove_upstream("a")  # already gone: nothing to do
    assert series(registry) == expected("b", "unknown", "unknown")
    metrics.initialize_upstream("b", "openai", "default")  # a replica that joins again starts afresh
    assert series(registry) == expected("b", "openai", "default")


def test_an_upstream_first_seen_by_a_setter_gets_series_of_unknown_kind() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.count_upstream_error("c", "disconnect")
    assert series(registry) == expected("c", "unknown", "unknown", disconnect=1.0)
