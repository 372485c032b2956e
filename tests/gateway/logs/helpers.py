"""Shared test wiring for the Elasticsearch sink: fast configs and a metrics recorder."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kvscope.gateway.logs.elasticsearch import ElasticsearchSinkConfig
from kvscope.gateway.logs.es_client import EsConnectionConfig
from kvscope.gateway.logs.es_setup import EsIndexConfig
from kvscope.gateway.logs.es_shipper import ShipperConfig
from kvscope.gateway.logs.spool import SpoolConfig


class RecordingMetrics:
    """Implements kvscope.gateway.logs.elasticsearch.SinkMetrics; keeps totals and every spool-bytes
    report."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.spool_bytes: list[int] = []

    def on_outcome(self, outcome: str, n: int) -> None:
        self.outcomes[outcome] += n

    def on_spool_bytes(self, n: int) -> None:
        self.spool_bytes.append(n)


def fast_config(
    spool_dir: Path,
    url: str,
    *,
    timeout_s: float = 2.0,
    spool_max_bytes: int = 1 << 30,
    queue_size: int = 10_000,
    batch_size: int = 500,
    compat: int = 8,
    setup: bool = True,
) -> ElasticsearchSinkConfig:
    """Millisecond-scale intervals and backoffs; the double's strict mapping catches unmapped fields."""
    return ElasticsearchSinkConfig(
        spool=SpoolConfig(
            spool_dir,
            max_bytes=spool_max_bytes,
            segment_bytes=256 << 10,
            fsync="interval",
            fsync_interval_s=0.05,
        ),
        connection=EsConnectionConfig(hosts=(url,), request_timeout_s=timeout_s, compat_major=compat),
        index=EsIndexConfig(dynamic="strict"),
        shipper=ShipperConfig(
            queue_size=queue_size,
            batch_size=batch_size,
            flush_interval_s=0.02,
            max_retries=3,
            initial_backoff_s=0.01,
            max_backoff_s=0.1,
            close_timeout_s=3.0,
        ),
        setup_on_start=setup,
    )


def segment_files(spool_dir: Path) -> list[str]:
    return sorted(p.name for p in spool_dir.glob("seg-*.jsonl"))
