"""Kibana saved objects and the Grafana Elasticsearch datasource: well-formed and consistent with the
mapping."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kvscope.gateway.logs.es_setup import EsIndexConfig, record_properties

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def mapped(path: str) -> bool:
    node = {"properties": record_properties()}
    for part in path.split("."):
        node = node.get("properties", {}).get(part)
        if node is None:
            return False
    return "type" in node


def test_kibana_ndjson_data_view_and_slow_failed_search():
    objects = [
        json.loads(line) for line in (DEPLOY / "kibana" / "saved_objects.ndjson").read_text().splitlines()
    ]
    by_type = {o["type"]: o for o in objects if o["id"] != "kvscope-latency-attribution"}
    assert sorted(by_type) == ["index-pattern", "search"]
    view = by_type["index-pattern"]
    assert view["id"] == "kvscope-requests"
    assert view["attributes"]["title"] == EsIndexConfig().data_stream + "*"
    assert view["attributes"]["timeFieldName"] == "@timestamp"
    for field in json.loads(view["attributes"]["fieldFormatMap"]):
        assert mapped(field), field
    search = by_type["search"]
    attrs = search["attributes"]
    source = json.loads(attrs["kibanaSavedObjectMeta"]["searchSourceJSON"])
    assert source["query"] == {
        "query": "kvscope.e2e_s >= 10 or http.response.status_code >= 500 or "
        "kvscope.engine.num_preemptions > 0",
        "language": "kuery",
    }
    ref = {r["name"]: r for r in search["references"]}[source["indexRefName"]]
    assert (ref["type"], ref["id"]) == ("index-pattern", view["id"])
    assert attrs["sort"] == [["kvscope.e2e_s", "desc"]]
    assert [c for c in attrs["columns"] if not mapped(c)] == []
    assert "trace.id" in attrs["columns"]


def test_kibana_latency_attribution_search_shows_mapped_cause_fields():
    objects = {
        json.loads(line)["id"]: json.loads(line)
        for line in (DEPLOY / "kibana" / "saved_objects.ndjson").read_text().splitlines()
    }
    attrs = objects["kvscope-latency-attribution"]["attributes"]
    source = json.loads(attrs["kibanaSavedObjectMeta"]["searchSourceJSON"])
    assert source["query"] == {"query": "kvscope.engine.prefill_steps >= 1", "language": "kuery"}
    assert [c for c in attrs["columns"] if not mapped(c)] == []
    assert {
        "kvscope.engine.queue_ahead",
        "kvscope.engine.prefill_interference_s",
        "kvscope.engine.decode_preempted_s",
    } <= set(attrs["columns"])
    assert [c for c in attrs["columns"] if c.startswith("kvscope.gateway.")] == [
        "kvscope.gateway.retry_s",
        "kvscope.gateway.rate_limit_s",
        "kvscope.gateway.tokenize_s",
        "kvscope.gateway.auth_s",
        "kvscope.gateway.other_s",
    ]
    assert attrs["sort"] == [["kvscope.e2e_s", "desc"]]


def test_grafana_datasource_points_at_the_data_stream():
    doc = yaml.safe_load((DEPLOY / "grafana-es-datasource.yaml").read_text())
    (ds,) = doc["datasources"]
    assert doc["apiVersion"] == 1
    assert (ds["type"], ds["uid"], ds["access"]) == ("elasticsearch", "kvscope-elasticsearch", "proxy")
    assert ds["jsonData"]["index"] == EsIndexConfig().data_stream
    assert ds["jsonData"]["timeField"] == "@timestamp"
    assert mapped(ds["jsonData"]["logMessageField"]) and mapped(ds["jsonData"]["logLevelField"])
