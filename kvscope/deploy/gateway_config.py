"""The gateway's config in the cluster: deploy/gateway.yaml (the compose stack's) where they overlap, the
cluster's own settings where they differ.

Shared with compose: ``host``, ``port``, ``service_name`` and the served models. Different in a cluster:
- ``discovery.dns`` instead of a static ``upstreams`` list: the engines' headless Service, whose A/AAAA
  records are the ready engine pods, re-resolved every ``interval_s`` (a pod that joins gets traffic, one
  that leaves stops getting new requests);
- ``routing.policy: auto``: cache-aware whenever a model has more than one replica;
- ``redis_url``: the gateway replicas share their rate limits through the Redis of the base;
- ``metrics_public``: with API keys configured the gateway's ``/metrics`` would need a key; Prometheus
  scrapes it inside the cluster without one (docs/deploy.md says how to scrape with a key instead);
- the request log on stdout (the cluster's log collector picks it up) instead of a file on a volume; no
  OTLP endpoint (compose's Jaeger is not there: set ``tracing.otlp_endpoint`` in an overlay).
API keys are not in this file: they come from the Secret as ``KVSCOPE_GATEWAY_API_KEY_HASHES``.
"""

from __future__ import annotations

from typing import Any

from kvscope.deploy.names import engine_dns, redis_url
from kvscope.deploy.sources import Sources

DISCOVERY_INTERVAL_S = 5
"""Seconds between two resolutions of the engines' DNS name (CoreDNS answers for headless Services with a
5 s TTL by default, so a new or gone pod is seen within about 10 s)."""


def gateway_config(sources: Sources) -> dict[str, Any]:
    """The config file the gateway pods read (the ConfigMap's ``gateway.yaml``)."""
    compose = sources.gateway_config
    models = [m for upstream in compose["upstreams"] for m in upstream.get("models", [])]
    return {
        "host": compose["host"],
        "port": compose["port"],
        "discovery": {
            "interval_s": DISCOVERY_INTERVAL_S,
            "dns": [{"name": engine_dns(), "port": sources.cpu_engine.port, "models": models}],
        },
        "routing": {"policy": "auto"},
        "redis_url": redis_url(),
        "metrics_public": True,
        "logs": {"stdout": True},
        "service_name": compose["service_name"],
    }
