"""Engine autoscaling: an autoscaling/v2 HPA on the engines' own gauges, and the prometheus-adapter rules that
serve those gauges to it as Pods metrics (custom.metrics.k8s.io), both built from one table.

Why an HPA with prometheus-adapter rather than a KEDA ScaledObject: the HPA is a core API object (no operator
to install; ``kubectl describe hpa`` shows the metric values it acted on), and prometheus-adapter is what
kube-prometheus and the prometheus-community charts already run next to Prometheus. KEDA's advantages,
scaling to zero and its many event sources, do not help engines that take minutes to start; a KEDA
ScaledObject would create this same HPA underneath.

Why these gauges: an engine's waiting queue (requests queued or preempted) grows only once its batch
(``--max-num-seqs``) or its KV cache is full, so it is the direct signal of demand beyond capacity, read
from the engine itself rather than inferred from CPU; KV-cache usage rising towards 1 means preemptions are
next (long prompts or long conversations fill the cache before the batch is full). The HPA scales on the
larger of the two proposals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscope.deploy.names import ENGINE, meta

MIN_REPLICAS = 2
"""Two engines at least: one may be drained (PDB) while the other serves, and cache-aware routing has a
choice."""
MAX_REPLICAS = 8
ADAPTER_WINDOW = "1m"
"""The adapter averages each gauge over this window (a queue that blips for one scrape scales nothing)."""


@dataclass(frozen=True, slots=True)
class ScalingMetric:
    """One engine gauge the HPA scales on, served per pod by prometheus-adapter under its own name."""

    series: str
    """The engine's gauge (engine/server/metrics.py), also the custom metric's name."""
    aggregate: str
    """How the adapter folds the gauge's ``model`` series of one pod into one value (``sum`` of requests,
    ``max`` of a ratio)."""
    target: str
    """The HPA's per-pod average target, a Kubernetes quantity (``800m`` = 0.8)."""


SCALING_METRICS = (
    ScalingMetric("kvscope_engine_requests_waiting", "sum", "2"),
    ScalingMetric("kvscope_engine_kv_cache_usage_ratio", "max", "800m"),
)


def adapter_rules(engine_job: str) -> list[dict[str, Any]]:
    """prometheus-adapter ``rules`` (its config format): each gauge of ``engine_job``'s targets, per pod,
    averaged over :data:`ADAPTER_WINDOW`. ``namespace`` and ``pod`` are the target labels the
    prometheus-operator adds to PodMonitor targets."""
    return [
        {
            "seriesQuery": f'{m.series}{{job="{engine_job}",namespace!="",pod!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": {"matches": f"^{m.series}$", "as": m.series},
            "metricsQuery": (
                f"{m.aggregate} by (<<.GroupBy>>) "
                f"(avg_over_time(<<.Series>>{{<<.LabelMatchers>>}}[{ADAPTER_WINDOW}]))"
            ),
        }
        for m in SCALING_METRICS
    ]


def engine_hpa() -> dict[str, Any]:
    """The engines' HPA. Scale-up: two pods a minute, at once; scale-down: one pod per five minutes after ten
    minutes of lower load (an engine takes minutes to start and its prefix cache is lost when it goes)."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta(ENGINE, "engine"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": ENGINE},
            "minReplicas": MIN_REPLICAS,
            "maxReplicas": MAX_REPLICAS,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": m.series},
                        "target": {"type": "AverageValue", "averageValue": m.target},
                    },
                }
                for m in SCALING_METRICS
            ],
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": 600,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}],
                },
            },
        },
    }
