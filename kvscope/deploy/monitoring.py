"""prometheus-operator objects and Grafana dashboards: what the compose stack's Prometheus and Grafana load
from files, as the objects a cluster's monitoring stack reads.

- engine: a PodMonitor, so every engine pod is scraped, not-ready ones too (a starting or draining engine
  is not in its Service's endpoints, and its ``up`` and gauges still matter);
- gateway: a ServiceMonitor on its Service;
- both relabel ``job`` to the compose stack's job names (deploy/prometheus.yml), which the alert rules and the
  dashboards' ``job`` variable select, and scrape at its interval (the dashboards' rate windows assume it);
- the PrometheusRule holds alerts/kvscope.rules.yaml's groups as they are;
- one ConfigMap per dashboard of dashboards/json/, labelled ``grafana_dashboard: "1"`` for the Grafana
  sidecar (kube-prometheus-stack, the grafana chart), folder ``kvscope`` by the ``grafana_folder``
  annotation where the sidecar's ``folderAnnotation`` names it.

The objects name their namespace themselves (a component's resources get none from the base). Prometheus
picks them up when its ``podMonitorSelector``/``serviceMonitorSelector``/``ruleSelector`` match their labels
(kube-prometheus-stack's default selects its release's label): docs/deploy.md.
"""

from __future__ import annotations

from typing import Any

from kvscope.deploy.names import ENGINE, GATEWAY, HTTP, NAMESPACE, labels, meta, selector
from kvscope.deploy.sources import Sources

Obj = dict[str, Any]
DASHBOARD_LABEL = "grafana_dashboard"
DASHBOARD_FOLDER = "kvscope"


def _endpoint(sources: Sources, job: str) -> Obj:
    return {
        "port": HTTP,
        "path": "/metrics",
        "interval": sources.scrape_interval,
        "scrapeTimeout": sources.scrape_timeout,
        "relabelings": [{"action": "replace", "targetLabel": "job", "replacement": job}],
    }


def engine_pod_monitor(sources: Sources) -> Obj:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta(ENGINE, "engine", namespace=NAMESPACE),
        "spec": {
            "selector": {"matchLabels": selector("engine")},
            "podMetricsEndpoints": [_endpoint(sources, sources.engine_job)],
        },
    }


def gateway_service_monitor(sources: Sources) -> Obj:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta(GATEWAY, "gateway", namespace=NAMESPACE),
        "spec": {
            "selector": {"matchLabels": selector("gateway")},
            "endpoints": [_endpoint(sources, sources.gateway_job)],
        },
    }


def prometheus_rule(sources: Sources) -> Obj:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": meta("kvscope", "monitoring", namespace=NAMESPACE),
        "spec": {"groups": sources.rules["groups"]},
    }


def dashboard_configmaps(sources: Sources) -> list[Obj]:
    """One ConfigMap per dashboard (each stays far below the 1 MiB object limit). Plain names, no content
    hash: the sidecar writes a dashboard file per data key, and deleting an old hashed ConfigMap would
    delete the file the new one wrote."""
    out = []
    for filename, text in sources.dashboards.items():
        name = "kvscope-dashboard-" + filename.removesuffix(".json").removeprefix("kvscope-")
        metadata = {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {**labels("monitoring"), DASHBOARD_LABEL: "1"},
            "annotations": {"grafana_folder": DASHBOARD_FOLDER},
        }
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {filename: text}})
    return out
