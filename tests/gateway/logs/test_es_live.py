"""Against a real Elasticsearch: runs when ELASTICSEARCH_URL is set (e.g. the compose stack's
http://127.0.0.1:9200), skipped otherwise. Uses its own data stream and removes everything it created."""

from __future__ import annotations

import os
import uuid

import pytest

from kvscope.gateway.analytics.es_logs import EsLogs
from kvscope.gateway.logs.elasticsearch import ElasticsearchSink, ElasticsearchSinkConfig
from kvscope.gateway.logs.es_client import EsConnectionConfig, make_client
from kvscope.gateway.logs.es_setup import EsIndexConfig
from kvscope.gateway.logs.es_shipper import ShipperConfig
from kvscope.gateway.logs.spool import SpoolConfig
from kvscope.testing.records import engine_stats, make_record

URL = os.environ.get("ELASTICSEARCH_URL")
pytestmark = pytest.mark.skipif(not URL, reason="set ELASTICSEARCH_URL to run against a real Elasticsearch")


async def test_ship_report_and_clean_up(tmp_path):
    run = uuid.uuid4().hex[:8]
    index = EsIndexConfig(data_stream=f"kvscope-livetest-{run}", dynamic="strict")
    conn = EsConnectionConfig(
        hosts=(URL,),
        api_key=os.environ.get("ELASTICSEARCH_API_KEY"),
        ca_certs=os.environ.get("ELASTICSEARCH_CA_CERTS"),
        compat_major=int(os.environ.get("ELASTICSEARCH_COMPAT", "8")),
    )
    sink = ElasticsearchSink(
        ElasticsearchSinkConfig(
            spool=SpoolConfig(tmp_path),
            connection=conn,
            index=index,
            shipper=ShipperConfig(flush_interval_s=0.05, initial_backoff_s=0.1),
        )
    )
    await sink.start()
    for i in range(200):
        record = make_record(i, e2e_s=(i + 1) / 100, engine=engine_stats(0.01, 0.02, 0.03))
        record["http"]["request"]["id"] = f"{run}-{i}"
        sink.emit(record)
    sink.emit(record)  # a retried record: must not become a second document
    assert await sink.wait_idle(60)
    await sink.aclose()
    client = make_client(conn)
    try:
        await client.indices.refresh(index=index.data_stream)
        count = await client.count(index=index.data_stream)
        assert count["count"] == 200 and sink.stats.shipped == 201 and sink.stats.duplicates == 1
        report = await EsLogs(client, index.data_stream, URL, None).report(top=3)
        assert report.total.requests == 200 and report.total.errors == 0
        # ES >= 8.9 sorts the 200 values (fewer than 2,000): type-7 interpolation between 1.00 and 1.01, to
        # rounding (tests/gateway/logs/test_es_agreement.py derives the tolerance)
        assert report.total.latency["e2e"][50] == pytest.approx(1.005, rel=1e-12)
        assert [s.e2e_s for s in report.slowest] == [2.0, 1.99, 1.98]
    finally:
        await client.indices.delete_data_stream(name=index.data_stream)
        await client.indices.delete_index_template(name=index.data_stream)
        for name in (index.settings_template, index.mappings_template):
            await client.cluster.delete_component_template(name=name)
        await client.ilm.delete_lifecycle(name=index.ilm_policy)
        await client.close()
