"""Names and labels the generated objects share (Kubernetes' recommended ``app.kubernetes.io/*`` labels)."""

from __future__ import annotations

NAMESPACE = "kvscope"
"""Every object of the base lives here; the gateway's DNS discovery names it (changing it means changing
the discovery name too: docs/deploy.md)."""
ENGINE = "kvscope-engine"
"""The engine StatefulSet, its headless Service (the StatefulSet's ``serviceName``), PDB and HPA."""
GATEWAY = "kvscope-gateway"
REDIS = "kvscope-redis"
GATEWAY_CONFIG = "kvscope-gateway-config"
"""The ConfigMap (kustomize configMapGenerator: the name gets a content hash, so a change rolls the
gateways)."""
API_KEYS = "kvscope-gateway-api-keys"
"""The Secret holding ``KVSCOPE_GATEWAY_API_KEY_HASHES`` (kustomize secretGenerator, hashed name)."""
MODEL_CACHE = "model-cache"
"""The engine's volumeClaimTemplate: ``$KVSCOPE_CACHE`` (the model and its conversion, the CPU kernels)."""
HTTP = "http"
"""The port name of every kvscope container and Service."""
ADAPTER_NAMESPACE = "monitoring"
"""Where prometheus-adapter usually runs (kube-prometheus, the prometheus-community chart's examples)."""


def labels(component: str) -> dict[str, str]:
    """The labels of one component's objects and pods."""
    return {
        "app.kubernetes.io/name": "kvscope",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "kvscope",
    }


def selector(component: str) -> dict[str, str]:
    """The immutable subset that selectors match (no ``part-of``: a selector cannot change later)."""
    return {k: v for k, v in labels(component).items() if k != "app.kubernetes.io/part-of"}


def meta(name: str, component: str, namespace: str | None = None) -> dict[str, object]:
    """``metadata`` of a namespaced object of ``component``; ``namespace`` only where no kustomization sets it
    (the components' objects)."""
    return {"name": name, **({"namespace": namespace} if namespace else {}), "labels": labels(component)}


def engine_dns(namespace: str = NAMESPACE) -> str:
    """The headless Service's cluster DNS name, whose A/AAAA records are the ready engine pods."""
    return f"{ENGINE}.{namespace}.svc.cluster.local"


def redis_url(namespace: str = NAMESPACE) -> str:
    return f"redis://{REDIS}.{namespace}.svc.cluster.local:6379/0"
