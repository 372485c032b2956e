"""The workloads: engine StatefulSet + headless Service + PDB, gateway Deployment + Service + PDB, Redis,
the Namespace, and the cpu/gpu overlays' engine patches. Kubernetes objects as plain dicts, in the order
``kubectl`` prints their fields.

Why a StatefulSet for the engine: each replica keeps its own model cache on a PersistentVolumeClaim
(volumeClaimTemplates), so a restarted or rescheduled engine skips the download, the GGUF conversion and the
CPU kernel build (``$KVSCOPE_CACHE`` holds all three); a Deployment would either share one ReadWriteMany
volume (rare, slow) or start from an emptyDir every time. Pods are started in parallel (the HPA adds
several at once; nothing depends on ordinals) and have stable names (``kvscope-engine-0`` in logs).
"""

from __future__ import annotations

from posixpath import dirname
from typing import Any

from kvscope.deploy.names import (
    API_KEYS,
    ENGINE,
    GATEWAY,
    GATEWAY_CONFIG,
    HTTP,
    MODEL_CACHE,
    NAMESPACE,
    REDIS,
    labels,
    meta,
    selector,
)
from kvscope.deploy.sources import EngineSource, Sources

Obj = dict[str, Any]

GATEWAY_REPLICAS = 2
"""Two gateways at least: one can be drained or rolled while the other serves (their PDB allows one down)."""
ENGINE_CPUS = 4
"""cpu overlay: CPUs per engine (requests = limits: Guaranteed QoS, and the static CPU manager can pin them);
the engine runs that many torch threads (``--num-threads`` from the limit). Size replicas, not this, for
more throughput: docs/deploy.md "How many engines"."""
GPU_ENGINE_CPUS = 2
"""gpu overlay: host CPUs per engine (the step loop, tokenizer and server; the model runs on the GPU)."""
MODEL_CACHE_SIZE = "10Gi"
"""Per engine: the default model's GGUF (94 MiB) and its one-time conversion, CPU kernels; larger models
need more (an overlay patches the volumeClaimTemplate)."""
ENGINE_DRAIN_S = 30
"""preStop sleep of an engine: the pod has left the headless Service's DNS answer when it starts, so the
gateways (re-resolving every few seconds) stop sending new requests while running ones finish. The engine
fails what is still running when SIGTERM comes after it (engine/server/cli.py): raise this with
``terminationGracePeriodSeconds`` for long generations."""
ENGINE_START_S = 900
"""The startup probe's window: the first start converts the model and builds the CPU kernels."""
GATEWAY_START_S = 900
"""The gateway's startup probe waits (``/readyz``) until it has found a ready engine for each model, at most
this long: a new gateway joins the Service only once it can serve, so a rollout never swaps working
gateways for ones with no engines. After start-up, readiness is ``/healthz``: an engine outage then leaves
the gateways in the Service, answering an OpenAI-shaped 503 (and KvscopeNoHealthyUpstream fires), instead
of taking every gateway out at once."""
REDIS_IMAGE = "redis:7.2.7"
"""The last BSD-licensed Redis line; rate-limit state only, in memory, no persistence (the gateway's limiter
fails open while Redis is away: gateway/ratelimit.py)."""
REDIS_UID = 999
"""The ``redis`` user of the official image."""


def namespace() -> Obj:
    """The namespace, with Pod Security Admission's ``restricted`` profile enforced (every pod here meets
    it: non-root, no privilege escalation, no capabilities, RuntimeDefault seccomp)."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": NAMESPACE,
            "labels": {
                "app.kubernetes.io/part-of": "kvscope",
                "pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/warn": "restricted",
            },
        },
    }


def _pod_security(uid: int) -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security(read_only_root: bool) -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
    }


def _http_probe(path: str, period_s: int, timeout_s: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": path, "port": HTTP},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failures,
    }


def _spread(component: str) -> list[Obj]:
    """Replicas on different nodes where the cluster has them (a node drain then takes one, which the PDB
    allows), on one node where it has not."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector(component)},
        }
    ]


def _pdb(name: str, component: str) -> Obj:
    """At most one pod of ``component`` down for voluntary disruptions (drains, cluster upgrades);
    pods that are not running anyway may always be evicted (a crash-looping pod never blocks a drain)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(name, component),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector(component)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _env(values: dict[str, str]) -> list[Obj]:
    return [{"name": k, "value": v} for k, v in values.items()]


def _cache_mount(sources: Sources) -> Obj:
    return {"name": MODEL_CACHE, "mountPath": sources.engine_env["KVSCOPE_CACHE"]}


def engine_statefulset(sources: Sources) -> Obj:
    """The engines. No ``replicas``: the HPA owns the count (a replicas field here would reset it on every
    apply); it starts at the HPA's minimum."""
    engine = sources.cpu_engine
    pull = {
        "name": "pull-model",
        "image": engine.image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["kvscope", "pull", engine.model],
        "env": _env({"KVSCOPE_CACHE": sources.engine_env["KVSCOPE_CACHE"]}),
        "volumeMounts": [_cache_mount(sources)],
        "securityContext": _container_security(read_only_root=False),
    }
    container = {
        "name": "engine",
        "image": engine.image,
        "imagePullPolicy": "IfNotPresent",
        "args": list(engine.command),
        "env": _env(sources.engine_env),
        "ports": [{"name": HTTP, "containerPort": engine.port, "protocol": "TCP"}],
        "startupProbe": _http_probe("/health", 10, 5, ENGINE_START_S // 10),
        "readinessProbe": _http_probe("/health", 5, 3, 2),
        "livenessProbe": _http_probe("/health", 10, 5, 6),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(ENGINE_DRAIN_S)]}}},
        "volumeMounts": [_cache_mount(sources)],
        "securityContext": _container_security(read_only_root=False),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(ENGINE, "engine"),
        "spec": {
            "serviceName": ENGINE,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector("engine")},
            "updateStrategy": {"type": "RollingUpdate"},
            "minReadySeconds": 10,
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
            "template": {
                "metadata": {"labels": labels("engine")},
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(sources.image_uid),
                    "terminationGracePeriodSeconds": ENGINE_DRAIN_S + 30,
                    "topologySpreadConstraints": _spread("engine"),
                    "initContainers": [pull],
                    "containers": [container],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": MODEL_CACHE, "labels": labels("engine")},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": MODEL_CACHE_SIZE}},
                    },
                }
            ],
        },
    }


def engine_service(sources: Sources) -> Obj:
    """The headless Service: no cluster IP, its DNS name answers with one A/AAAA record per ready engine
    (never a not-ready one), which the gateways resolve to find their replicas."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(ENGINE, "engine"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector("engine"),
            "ports": [{"name": HTTP, "port": sources.cpu_engine.port, "targetPort": HTTP, "protocol": "TCP"}],
        },
    }


def engine_objects(sources: Sources) -> list[Obj]:
    return [engine_statefulset(sources), engine_service(sources), _pdb(ENGINE, "engine")]


def gateway_deployment(sources: Sources) -> Obj:
    """The gateways: config from the ConfigMap, API key hashes from the Secret, a shared Redis."""
    config_dir = dirname(sources.gateway_config_path)
    container = {
        "name": "gateway",
        "image": sources.gateway_image,
        "imagePullPolicy": "IfNotPresent",
        "args": list(sources.gateway_command),
        "envFrom": [{"secretRef": {"name": API_KEYS}}],
        "ports": [{"name": HTTP, "containerPort": sources.gateway_port, "protocol": "TCP"}],
        "startupProbe": _http_probe("/readyz", 5, 3, GATEWAY_START_S // 5),
        "readinessProbe": _http_probe("/healthz", 5, 3, 2),
        "livenessProbe": _http_probe("/healthz", 10, 5, 3),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "resources": {
            "requests": {"cpu": "500m", "memory": sources.gateway_memory},
            "limits": {"memory": sources.gateway_memory},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": config_dir, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": _container_security(read_only_root=True),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(GATEWAY, "gateway"),
        "spec": {
            "replicas": GATEWAY_REPLICAS,
            "selector": {"matchLabels": selector("gateway")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels("gateway")},
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(sources.image_uid),
                    "terminationGracePeriodSeconds": 60,
                    "topologySpreadConstraints": _spread("gateway"),
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": GATEWAY_CONFIG}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def gateway_service(sources: Sources) -> Obj:
    """The API's address inside the cluster (put an Ingress or a Gateway API route in front of it)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(GATEWAY, "gateway"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector("gateway"),
            "ports": [{"name": HTTP, "port": sources.gateway_port, "targetPort": HTTP, "protocol": "TCP"}],
        },
    }


def gateway_objects(sources: Sources) -> list[Obj]:
    return [gateway_deployment(sources), gateway_service(sources), _pdb(GATEWAY, "gateway")]


def redis_objects() -> list[Obj]:
    """One Redis for the gateways' shared rate limits (no PDB: a single pod, and the limiter fails open while
    it restarts). Use a managed Redis instead by changing ``redis_url`` in an overlay."""
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            "96mb",
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        "ports": [{"name": "redis", "containerPort": 6379, "protocol": "TCP"}],
        "readinessProbe": {
            "exec": {"command": ["redis-cli", "ping"]},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
        },
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "timeoutSeconds": 3},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "128Mi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "securityContext": _container_security(read_only_root=True),
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(REDIS, "redis"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector("redis")},
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": labels("redis")},
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(REDIS_UID),
                    "containers": [container],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(REDIS, "redis"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector("redis"),
            "ports": [{"name": "redis", "port": 6379, "targetPort": "redis", "protocol": "TCP"}],
        },
    }
    return [deployment, service]


def _engine_patch(engine: EngineSource, container: Obj, pod: Obj | None = None) -> Obj:
    """A strategic-merge patch of the engine StatefulSet: containers and init containers merge by name. The
    model-pull init container gets the engine's CPU and memory (requests = limits) so that the pod is in the
    Guaranteed QoS class (Kubernetes counts every container, init ones too: the static CPU manager pins only
    such pods' cores, and a namespace's LimitRange cannot default it into something else)."""
    limits = container["resources"]["limits"]
    own = {name: limits[name] for name in ("cpu", "memory")}
    pull = {"name": "pull-model", "image": engine.image, "resources": {"requests": own, "limits": own}}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": ENGINE},
        "spec": {
            "template": {
                "spec": {
                    **(pod or {}),
                    "initContainers": [pull],
                    "containers": [{"name": "engine", **container}],
                }
            }
        },
    }


def cpu_engine_patch(sources: Sources) -> Obj:
    """cpu overlay: ``ENGINE_CPUS`` CPUs (requests = limits) and the compose memory limit, and as many torch
    threads as CPUs (the engine's default, usable CPUs − 1, would count the node's CPUs, not the quota)."""
    engine = sources.cpu_engine
    cpus = str(ENGINE_CPUS)
    threads = {
        "name": "KVSCOPE_NUM_THREADS",
        "valueFrom": {
            "resourceFieldRef": {"containerName": "engine", "resource": "limits.cpu", "divisor": "1"}
        },
    }
    container = {
        "image": engine.image,
        "args": [*engine.command, "--num-threads", "$(KVSCOPE_NUM_THREADS)"],
        "env": [threads],
        "resources": {
            "requests": {"cpu": cpus, "memory": engine.memory},
            "limits": {"cpu": cpus, "memory": engine.memory},
        },
    }
    return _engine_patch(engine, container)


GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
"""The label NVIDIA's GPU feature discovery (GPU operator) puts on GPU nodes."""
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
"""The taint GPU node pools commonly carry (GKE, AKS, the GPU operator's docs)."""


def gpu_engine_patch(sources: Sources) -> Obj:
    """gpu overlay: compose.gpu.yaml's CUDA image and command (``--device cuda``), one ``nvidia.com/gpu`` (the
    NVIDIA device plugin's resource; compose reserves one GPU), its memory limit, GPU nodes only."""
    engine = sources.gpu_engine
    resources = {"cpu": str(GPU_ENGINE_CPUS), "memory": engine.memory, "nvidia.com/gpu": "1"}
    container = {
        "image": engine.image,
        "args": list(engine.command),
        "resources": {"requests": resources, "limits": resources},
    }
    pod = {"nodeSelector": GPU_NODE_SELECTOR, "tolerations": GPU_TOLERATIONS}
    return _engine_patch(engine, container, pod)
