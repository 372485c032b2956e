"""Elasticsearch resources for the request log: ILM policy, component templates, index template (data stream).

All calls are ``PUT``s of the full resource, so :func:`ensure_setup` is idempotent: run it at every start
and from ``kvscope logs setup-es``. Mappings change only for backing indices created afterwards; pass
``rollover=True`` (``setup-es --rollover``) to start one now.

Names (data stream ``kvscope-requests`` by default, deliberately outside the built-in ``logs-*-*``
template, whose priority-100 ``logs`` template would otherwise apply ECS dynamic templates and its own ILM):

- ILM policy ``{stream}-ilm``: hot rollover at ``rollover_max_age`` or ``rollover_max_primary_shard_size``,
  delete ``delete_after`` after rollover.
- component templates ``{stream}@settings`` (ILM, 1 shard, ``auto_expand_replicas 0-1``,
  ``index.mapping.ignore_malformed``) and ``{stream}@mappings`` (every field of docs/gateway.md "Request log",
  explicit).
- index template ``{stream}`` at priority 500 with ``data_stream: {}``.

``dynamic: false`` (default) keeps an unknown field in ``_source`` but unindexed, so a new field in the
record builder never makes Elasticsearch reject records; ``strict`` rejects them (the tests run the double
in strict mode so that a field missing here fails a test instead of production).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from elasticsearch import AsyncElasticsearch

from kvscope.gateway.context import GATEWAY_PHASES
from kvscope.gateway.engines.section import SOURCE_KEYS

logger = logging.getLogger(__name__)

TEMPLATE_VERSION = 2
_META = {"managed_by": "kvscope", "description": "kvscope gateway request log (docs/gateway.md, Request log)"}


@dataclass(frozen=True, slots=True)
class EsIndexConfig:
    data_stream: str = "kvscope-requests"
    """Data stream name; must not match ``logs-*-*``, ``metrics-*-*`` or ``traces-*-*``."""
    delete_after: str = "30d"
    """ILM delete phase ``min_age`` (time after rollover until a backing index is deleted)."""
    rollover_max_age: str = "1d"
    """ILM hot-phase rollover ``max_age``."""
    rollover_max_primary_shard_size: str = "50gb"
    """ILM hot-phase rollover ``max_primary_shard_size``."""
    dynamic: Literal["false", "strict"] = "false"
    """Mapping ``dynamic`` for fields not listed here."""
    priority: int = 500
    """Index template priority (≥ 500 beats Elastic's built-in templates)."""

    def __post_init__(self) -> None:
        name = self.data_stream
        if not name or name != name.lower() or name.startswith(("-", "_", "+", ".")) or "*" in name:
            raise ValueError(f"invalid data stream name {name!r}")
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] in ("logs", "metrics", "traces", "synthetics"):
            raise ValueError(f"data stream {name!r} falls under a built-in {parts[0]}-*-* template")
        if self.dynamic not in ("false", "strict"):
            raise ValueError("dynamic must be 'false' or 'strict'")
        if self.priority < 500:
            raise ValueError("index template priority must be >= 500")

    @property
    def ilm_policy(self) -> str:
        return f"{self.data_stream}-ilm"

    @property
    def settings_template(self) -> str:
        return f"{self.data_stream}@settings"

    @property
    def mappings_template(self) -> str:
        return f"{self.data_stream}@mappings"


def _kw() -> dict[str, Any]:
    return {"type": "keyword", "ignore_above": 1024}


def _obj(**props: dict[str, Any]) -> dict[str, Any]:
    return {"properties": props}


_LONG = {"type": "long"}
_DOUBLE = {"type": "double"}
_DATE = {"type": "date"}
_BOOL = {"type": "boolean"}
_TEXT = {"type": "match_only_text"}
_UNINDEXED = {"type": "object", "enabled": False}


def attribution_properties() -> dict[str, Any]:
    """Mapping of the latency-attribution fields of ``kvscope.engine`` (docs/logs.md, "Why was this request
    slow?"; the engine's KvscopeStats, which tests/gateway/logs/test_why.py keeps in step with this)."""
    longs = [
        "prompt_tokens",
        "cached_tokens",
        "queue_ahead",
        "running_on_arrival",
        "queue_blocked_steps",
        "recomputed_tokens",
    ]
    doubles: list[str] = [
        "attributed_queue_s",
        "structured_mask_s",
        "structured_wait_s",
        "structured_compile_s",
    ]
    for phase in ("prefill", "decode"):
        longs += [
            f"{phase}_{f}"
            for f in ("steps", "tokens", "other_prefill_tokens", "other_decode_tokens", "other_requests_max")
        ]
        doubles += [
            f"{phase}_{f}"
            for f in (
                "step_s_mean",
                "step_s_max",
                "own_s",
                "interference_s",
                "interference_prefill_s",
                "preempted_s",
                "other_s",
            )
        ]
    return {"queue_limit": _kw()} | dict.fromkeys(longs, _LONG) | dict.fromkeys(doubles, _DOUBLE)


def record_properties() -> dict[str, Any]:
    """Explicit mapping of every field of the request log record (docs/gateway.md, "Request log"), nested
    ECS objects."""
    engine = {
        f: _DOUBLE
        for f in ("queue_s", "ttft_s", "prefill_s", "decode_s", "tpot_s", "batch_size_mean", "kv_cache_usage")
    }
    engine |= {f: _LONG for f in ("batch_size_max", "kv_blocks", "num_preemptions")}
    engine |= attribution_properties()
    # speculative decoding (docs/logs.md): counts, and the mean acceptance length
    engine |= dict.fromkeys(("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"), _LONG)
    engine |= {"spec_mean_accepted_length": _DOUBLE}
    # admission (issue 42): the TTFT predicted when the request was queued (or refused), its tier
    engine |= {"predicted_ttft_s": _DOUBLE, "service_tier": _kw()}
    return {
        # explicit false: ES < 8.11 refuses a data stream whose @timestamp inherits the index-level
        # ignore_malformed (elastic/elasticsearch#71755, #99346)
        "@timestamp": {"type": "date", "ignore_malformed": False},
        "ecs": _obj(version=_kw()),
        "log": _obj(level=_kw(), logger=_kw()),
        "message": _TEXT,
        "event": _obj(
            id=_kw(),
            kind=_kw(),
            category=_kw(),
            type=_kw(),
            outcome=_kw(),
            dataset=_kw(),
            duration=_LONG,
            start=_DATE,
            end=_DATE,
        ),
        "http": _obj(
            version=_kw(),
            request=_obj(id=_kw(), method=_kw(), body=_obj(bytes=_LONG)),
            response=_obj(status_code=_LONG, body=_obj(bytes=_LONG)),
        ),
        "url": _obj(path=_kw()),
        "client": _obj(ip={"type": "ip"}),
        "user_agent": _obj(original=_kw()),
        "user": _obj(id=_kw()),
        "server": _obj(address=_kw()),
        "service": _obj(name=_kw(), version=_kw(), node=_obj(name=_kw())),
        "process": _obj(pid=_LONG),
        "trace": _obj(id=_kw()),
        "span": _obj(id=_kw()),
        "error": _obj(type=_kw(), message=_TEXT),
        "gen_ai": _obj(
            operation=_obj(name=_kw()),
            request=_obj(model=_kw(), max_tokens=_LONG, temperature=_DOUBLE, stream=_BOOL),
            response=_obj(id=_kw(), model=_kw(), finish_reasons=_kw()),
            usage=_obj(input_tokens=_LONG, output_tokens=_LONG, cache_read=_obj(input_tokens=_LONG)),
            input=_UNINDEXED,
            output=_UNINDEXED,  # message content, only with log_content
        ),
        "kvscope": _obj(
            route=_kw(),
            ttft_s=_DOUBLE,
            tpot_s=_DOUBLE,
            e2e_s=_DOUBLE,
            gateway_overhead_s=_DOUBLE,
            upstream_s=_DOUBLE,
            gateway=_obj(**dict.fromkeys(GATEWAY_PHASES, _DOUBLE)),
            attempts=_LONG,
            client_disconnected=_BOOL,
            disconnect_phase=_kw(),
            rate_limited=_BOOL,
            rate_limit_reason=_kw(),
            stream_error=_kw(),
            prompt_tokens_counted=_LONG,
            routing=_obj(
                policy=_kw(),
                reason=_kw(),
                replica=_kw(),
                predicted_cached_tokens=_LONG,
                cached_tokens=_LONG,
                prefix_unit=_kw(),
            ),
            engine=_obj(**engine),
            upstream=upstream_properties(),
        ),
    }


def upstream_properties() -> dict[str, Any]:
    """Mapping of ``kvscope.upstream`` (docs/gateway.md, "Request log"; gateway/engines/section.py): the
    replica's kind, where each quantity came from, the engine samples at arrival and finish."""
    sample = _obj(requests_running=_DOUBLE, requests_waiting=_DOUBLE, kv_cache_usage=_DOUBLE, age_s=_DOUBLE)
    return _obj(
        kind=_kw(),
        kind_source=_kw(),
        sources=_obj(**{key: _kw() for key in SOURCE_KEYS}),
        sampled=_obj(arrival=sample, finish=sample),
    )


def ilm_policy_body(config: EsIndexConfig) -> dict[str, Any]:
    """Body of ``PUT _ilm/policy/{name}``."""
    rollover = {
        "max_age": config.rollover_max_age,
        "max_primary_shard_size": config.rollover_max_primary_shard_size,
    }
    phases = {
        "hot": {"min_age": "0ms", "actions": {"rollover": rollover}},
        "delete": {"min_age": config.delete_after, "actions": {"delete": {}}},
    }
    return {"policy": {"_meta": _META, "phases": phases}}


def settings_template_body(config: EsIndexConfig) -> dict[str, Any]:
    """Body of ``PUT _component_template/{stream}@settings``."""
    settings = {
        "index.lifecycle.name": config.ilm_policy,
        "index.number_of_shards": 1,
        "index.auto_expand_replicas": "0-1",
        "index.mapping.ignore_malformed": True,
        "index.codec": "best_compression",
    }
    return {"template": {"settings": settings}, "version": TEMPLATE_VERSION, "_meta": _META}


def mappings_template_body(config: EsIndexConfig) -> dict[str, Any]:
    """Body of ``PUT _component_template/{stream}@mappings``."""
    mappings = {"dynamic": config.dynamic, "date_detection": False, "properties": record_properties()}
    return {"template": {"mappings": mappings}, "version": TEMPLATE_VERSION, "_meta": _META}


def index_template_body(config: EsIndexConfig) -> dict[str, Any]:
    """Body of ``PUT _index_template/{stream}``: a data stream composed of the two component templates."""
    return {
        "index_patterns": [f"{config.data_stream}*"],
        "data_stream": {},
        "priority": config.priority,
        "composed_of": [config.settings_template, config.mappings_template],
        "version": TEMPLATE_VERSION,
        "_meta": _META,
    }


async def ensure_setup(
    client: AsyncElasticsearch, config: EsIndexConfig, *, rollover: bool = False
) -> list[str]:
    """Create or update the ILM policy, component templates and index template; return what was put.

    Idempotent (every call ``PUT``s the whole resource). Raises ``elasticsearch.ApiError`` when the
    cluster refuses (e.g. 403: the API key lacks ``manage_ilm``/``manage_index_templates``) and
    ``elasticsearch.TransportError`` when it cannot be reached.
    """
    done: list[str] = []
    await client.ilm.put_lifecycle(name=config.ilm_policy, body=ilm_policy_body(config))
    done.append(f"ilm policy {config.ilm_policy}")
    for name, body in (
        (config.settings_template, settings_template_body(config)),
        (config.mappings_template, mappings_template_body(config)),
    ):
        await client.cluster.put_component_template(name=name, body=body)
        done.append(f"component template {name}")
    await client.indices.put_index_template(name=config.data_stream, body=index_template_body(config))
    done.append(f"index template {config.data_stream} (priority {config.priority})")
    if rollover:
        await client.indices.rollover(alias=config.data_stream)
        done.append(f"rollover of {config.data_stream}")
    logger.info("elasticsearch setup: %s", ", ".join(done))
    return done
