"""Index setup (ILM, component/index templates), compatibility mode, and the double's fidelity."""

from __future__ import annotations

import asyncio
import json

import pytest
from elasticsearch import ApiError, UnsupportedProductError

from kvscope.gateway.analytics.cli import logs_main
from kvscope.gateway.logs.es_client import EsConnectionConfig, make_client
from kvscope.gateway.logs.es_setup import EsIndexConfig, ensure_setup, record_properties
from kvscope.testing.es_double import EsDouble
from kvscope.testing.records import engine_stats, make_record


def client_for(url: str, compat: int = 8):
    return make_client(EsConnectionConfig(hosts=(url,), compat_major=compat, request_timeout_s=5))


async def test_setup_puts_policy_templates_and_is_idempotent(es):
    client = client_for(es.url)
    try:
        first = await ensure_setup(client, EsIndexConfig())
        stored = json.dumps([es.ilm_policies, es.component_templates, es.index_templates], sort_keys=True)
        second = await ensure_setup(client, EsIndexConfig())
    finally:
        await client.close()
    assert (
        first
        == second
        == [
            "ilm policy kvscope-requests-ilm",
            "component template kvscope-requests@settings",
            "component template kvscope-requests@mappings",
            "index template kvscope-requests (priority 500)",
        ]
    )
    assert json.dumps([es.ilm_policies, es.component_templates, es.index_templates], sort_keys=True) == stored
    phases = es.ilm_policies["kvscope-requests-ilm"]["policy"]["phases"]
    assert phases["hot"]["actions"]["rollover"] == {"max_age": "1d", "max_primary_shard_size": "50gb"}
    assert phases["delete"] == {"min_age": "30d", "actions": {"delete": {}}}
    template = es.index_templates["kvscope-requests"]
    assert (template["index_patterns"], template["data_stream"], template["priority"]) == (
        ["kvscope-requests*"],
        {},
        500,
    )
    assert template["composed_of"] == ["kvscope-requests@settings", "kvscope-requests@mappings"]
    settings = es.component_templates["kvscope-requests@settings"]["template"]["settings"]
    assert settings["index.lifecycle.name"] == "kvscope-requests-ilm"
    assert settings["index.mapping.ignore_malformed"] is True
    mappings = es.component_templates["kvscope-requests@mappings"]["template"]["mappings"]
    assert (mappings["dynamic"], mappings["date_detection"]) == ("false", False)


def test_mapping_types_of_the_fields_the_report_reads():
    props = record_properties()

    def leaf(path: str) -> dict:
        node = {"properties": props}
        for part in path.split("."):
            node = node["properties"][part]
        return node

    assert leaf("@timestamp") == {"type": "date", "ignore_malformed": False}
    assert leaf("event.duration") == leaf("http.response.status_code") == {"type": "long"}
    assert leaf("user.id") == {"type": "keyword", "ignore_above": 1024}
    assert leaf("gen_ai.response.finish_reasons")["type"] == "keyword"
    assert leaf("gen_ai.response.id") == {"type": "keyword", "ignore_above": 1024}
    assert leaf("message") == leaf("error.message") == {"type": "match_only_text"}
    assert leaf("client.ip") == {"type": "ip"}
    for name in ("ttft_s", "tpot_s", "e2e_s"):
        assert leaf(f"kvscope.{name}") == {"type": "double"}
    assert leaf("kvscope.engine.kv_cache_usage") == {"type": "double"}
    assert leaf("kvscope.engine.num_preemptions") == {"type": "long"}
    assert leaf("gen_ai.input") == {"type": "object", "enabled": False}


def test_every_field_of_a_full_record_is_mapped():
    record = make_record(1, status=503, engine=engine_stats(0.1, 0.2, 0.3))

    def unmapped(doc: dict, props: dict, path: str = "") -> list[str]:
        out = []
        for key, value in doc.items():
            if key not in props:
                out.append(path + key)
            elif isinstance(value, dict) and "properties" in props[key]:
                out += unmapped(value, props[key]["properties"], f"{path}{key}.")
        return out

    assert unmapped(record, record_properties()) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"data_stream": "logs-kvscope-default"},
        {"data_stream": "Kvscope"},
        {"priority": 100},
        {"dynamic": "true"},
    ],
)
def test_invalid_index_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        EsIndexConfig(**kwargs)


async def test_rollover_starts_a_new_backing_index(es):
    client = client_for(es.url)
    try:
        await ensure_setup(client, EsIndexConfig())
        await client.bulk(operations=[{"create": {"_index": "kvscope-requests", "_id": "a"}}, make_record(0)])
        await ensure_setup(client, EsIndexConfig(), rollover=True)
    finally:
        await client.close()
    indices = [i.name for i in es.data_streams["kvscope-requests"].indices]
    assert indices == [".ds-kvscope-requests-2025.01.01-000001", ".ds-kvscope-requests-2025.01.01-000002"]


async def test_compatibility_mode_8_talks_to_es8_and_native_9_is_refused_by_it():
    async with EsDouble(major=8) as es8:
        native = client_for(es8.url, compat=9)
        with pytest.raises(ApiError) as refused:
            await ensure_setup(native, EsIndexConfig())
        await native.close()
        assert refused.value.status_code == 400 and refused.value.message == "media_type_header_exception"
        compat = client_for(es8.url, compat=8)
        await ensure_setup(compat, EsIndexConfig())
        await compat.close()
        sent = es8.requests[-1].headers
        assert sent["accept"] == "application/vnd.elasticsearch+json; compatible-with=8"
        assert sent["content-type"] == "application/vnd.elasticsearch+json; compatible-with=8"


async def test_client_refuses_a_server_without_the_product_header():
    async with EsDouble(product_header=False) as fake:
        client = client_for(fake.url)
        with pytest.raises(UnsupportedProductError):
            await client.info()
        await client.close()


async def test_bulk_answers_per_item_with_the_errors_flag(es):
    client = client_for(es.url)
    await ensure_setup(client, EsIndexConfig(dynamic="strict"))
    no_ts = make_record(2)
    del no_ts["@timestamp"]
    ops = [
        {"create": {"_index": "kvscope-requests", "_id": "a"}},
        make_record(0),
        {"create": {"_index": "kvscope-requests", "_id": "a"}},
        make_record(0),
        {"index": {"_index": "kvscope-requests", "_id": "b"}},
        make_record(1),
        {"create": {"_index": "kvscope-requests", "_id": "c"}},
        no_ts,
    ]
    response = await client.bulk(operations=ops)
    await client.close()
    assert response.body["errors"] is True
    got = [
        (op, item["status"], item.get("error", {}).get("type"))
        for entry in response.body["items"]
        for op, item in entry.items()
    ]
    assert got == [
        ("create", 201, None),
        ("create", 409, "version_conflict_engine_exception"),
        ("index", 400, "illegal_argument_exception"),
        ("create", 400, "document_parsing_exception"),
    ]


def test_cli_setup_es_against_the_double_and_print(capsys):
    async def run() -> tuple[int, dict]:
        async with EsDouble(major=8) as es8:
            code = await asyncio.to_thread(logs_main, ["setup-es", "--url", es8.url, "--delete-after", "7d"])
            return code, es8.ilm_policies

    code, policies = asyncio.run(run())
    assert code == 0
    assert capsys.readouterr().out.splitlines()[0] == "ok  ilm policy kvscope-requests-ilm"
    assert policies["kvscope-requests-ilm"]["policy"]["phases"]["delete"]["min_age"] == "7d"
    assert logs_main(["setup-es", "--print", "--dynamic", "strict"]) == 0
    bodies = json.loads(capsys.readouterr().out)
    assert list(bodies) == [
        "PUT _ilm/policy/kvscope-requests-ilm",
        "PUT _component_template/kvscope-requests@settings",
        "PUT _component_template/kvscope-requests@mappings",
        "PUT _index_template/kvscope-requests",
    ]
    assert (
        bodies["PUT _component_template/kvscope-requests@mappings"]["template"]["mappings"]["dynamic"]
        == "strict"
    )


def test_gateway_config_struct_builds_the_sink_config(tmp_path):
    import msgspec

    from kvscope.gateway.logs.es_settings import EsLogSettings, cli_env

    raw = {
        "hosts": ["https://es:9200"],
        "username": "u",
        "password": "p",
        "spool_dir": str(tmp_path),
        "compat_major": 9,
        "data_stream": "kvscope-x",
        "spool_fsync": "always",
    }
    cfg = msgspec.convert(raw, EsLogSettings).sink_config()
    assert (cfg.connection.hosts, cfg.connection.basic_auth, cfg.connection.compat_major) == (
        ("https://es:9200",),
        ("u", "p"),
        9,
    )
    assert (cfg.index.data_stream, cfg.spool.directory, cfg.spool.fsync) == ("kvscope-x", tmp_path, "always")
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"hostz": ["x"]}, EsLogSettings)
    with pytest.raises(ValueError):
        msgspec.convert({"spool_fsync": "sometimes"}, EsLogSettings).sink_config()
    env = cli_env(
        {"KVSCOPE_GATEWAY_LOG_FILE": "/var/log/kvscope/requests.jsonl", "ELASTICSEARCH_API_KEY": "k"}
    )
    assert (env.source, env.api_key, env.es_url) == ("/var/log/kvscope/requests.jsonl", "k", None)
