"""The console's sampler (gateway/console/sampler.py) reads only the registry families it draws: the same
values a whole collect gives, without collecting the others."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvscope.gateway.console.alerts import AlertBoard
from kvscope.gateway.console.records import RecordRing
from kvscope.gateway.console.sampler import SAMPLE_NAMES, ConsoleSampler, read_registry
from kvscope.gateway.console.series import ConsoleSeries
from kvscope.gateway.metrics import GatewayMetrics


class CountingCollector(Collector):
    """A family the console does not draw, counting how often it is collected."""

    def __init__(self) -> None:
        self.collected = 0

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("other_gauge", "not the console's")

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.collected += 1
        yield GaugeMetricFamily("other_gauge", "not the console's", value=7.0)


def test_a_tick_collects_only_the_console_families_and_reads_what_a_whole_collect_reads() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    other = CountingCollector()
    registry.register(other)
    metrics.requests.labels("m", "/v1/chat/completions", "200").inc(3)
    metrics.ttft.labels("m").observe(0.2)
    metrics.tokens.labels("m", "output").inc(40)
    sampler = ConsoleSampler(
        registry, lambda: (), RecordRing(10), ConsoleSeries(), AlertBoard(()), ("/v1/chat/completions",)
    )
    assert read_registry(sampler.view) == read_registry(registry)
    assert other.collected == 1  # the whole collect above; the view did not call it
    tick = sampler.tick(now=10.0, wall=1000.0)
    assert other.collected == 1
    assert (tick.counters.requests, tick.counters.generation, tick.counters.output_tokens) == (
        3.0,
        {"m": 3.0},
        40.0,
    )
    assert tick.histograms.ttft["m"][1][-1] == 1.0
    assert "other_gauge" not in SAMPLE_NAMES
