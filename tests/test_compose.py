"""compose.yaml, Dockerfile and deploy/: schema-valid, pinned images, health checks, depends_on conditions,
memory limits, existing mounts, and configs that agree with each other (ports, jobs, scrape interval)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import require_tool

REPO = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
ONE_SHOT = {"es-setup", "kibana-setup"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)


def check_jsonschema() -> list[str]:
    """The venv's check-jsonschema (run as a module: `make test` does not put .venv/bin on PATH)."""
    schema = ["--builtin-schema", "vendor.compose-spec"]
    if importlib.util.find_spec("check_jsonschema") is None:
        return [require_tool("check-jsonschema"), *schema]  # skips on a laptop, fails under CI=true
    return [sys.executable, "-m", "check_jsonschema", *schema]


@pytest.mark.parametrize("path", ["compose.yaml", "compose.gpu.yaml"])
def test_compose_matches_the_compose_spec_schema(path: str) -> None:
    result = run(*check_jsonschema(), path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_bad_condition(tmp_path: Path) -> None:
    bad = (REPO / "compose.yaml").read_text().replace("condition: service_healthy", "condition: healthy", 1)
    (tmp_path / "compose.yaml").write_text(bad)
    result = run(*check_jsonschema(), str(tmp_path / "compose.yaml"))
    assert result.returncode == 1


def test_the_stack_has_every_service() -> None:
    assert set(SERVICES) == {
        "engine",
        "gateway",
        "prometheus",
        "alertmanager",
        "grafana",
        "elasticsearch",
        "kibana",
        "es-setup",
        "kibana-setup",
        "jaeger",
    }


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_image_is_pinned(name: str) -> None:
    image = SERVICES[name]["image"]
    repo, _, tag = image.rpartition(":")
    assert repo and "/" not in tag and tag != "latest" and re.search(r"\d+\.\d+", tag), image


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_service_has_a_memory_limit(name: str) -> None:
    assert re.fullmatch(r"\d+[mg]", SERVICES[name]["deploy"]["resources"]["limits"]["memory"])


@pytest.mark.parametrize("name", sorted(set(SERVICES) - ONE_SHOT))
def test_long_running_service_has_a_health_check(name: str) -> None:
    check = SERVICES[name]["healthcheck"]
    assert check["test"][0] in ("CMD", "CMD-SHELL") and {"interval", "timeout", "retries"} <= set(check)
    assert SERVICES[name]["restart"] == "unless-stopped"


@pytest.mark.parametrize("name", sorted(ONE_SHOT))
def test_one_shot_services_do_not_restart(name: str) -> None:
    assert SERVICES[name]["restart"] == "no"


def test_depends_on_uses_conditions_on_known_services() -> None:
    for name, service in SERVICES.items():
        for dep, spec in service.get("depends_on", {}).items():
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
            expected = (
                "service_completed_successfully"
                if dep in ONE_SHOT
                else ("service_healthy", "service_started")
            )
            assert spec["condition"] in expected, f"{name} → {dep}"
    assert SERVICES["gateway"]["depends_on"]["engine"]["condition"] == "service_healthy"
    assert SERVICES["gateway"]["depends_on"]["es-setup"]["condition"] == "service_completed_successfully"


def test_engine_gateway_and_setup_commands() -> None:
    assert SERVICES["engine"]["command"] == [
        "kvscope",
        "engine",
        "--model",
        "smollm2-135m",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]
    assert SERVICES["gateway"]["command"] == ["kvscope", "gateway", "--config", "/etc/kvscope/gateway.yaml"]
    assert SERVICES["es-setup"]["command"] == [
        "kvscope",
        "logs",
        "setup-es",
        "--url",
        "http://elasticsearch:9200",
    ]
    assert "file=@/etc/kvscope/kibana/saved_objects.ndjson" in SERVICES["kibana-setup"]["command"]
    assert {SERVICES[n]["image"] for n in ("engine", "gateway", "es-setup", "kibana-setup")} == {
        "kvscope:0.1.0"
    }


def bind_mounts() -> list[tuple[str, str, str]]:
    mounts = []
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                mounts.append((name, source[2:], target))
    return mounts


@pytest.mark.parametrize(("service", "source", "target"), bind_mounts())
def test_bind_mount_sources_exist(service: str, source: str, target: str) -> None:
    assert (REPO / source).exists(), f"{service} mounts missing ./{source}"


def test_prometheus_scrapes_the_compose_services() -> None:
    config = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in config["scrape_configs"]}
    assert targets["kvscope-engine"] == ["engine:8000"] and targets["kvscope-gateway"] == ["gateway:4000"]
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    assert config["rule_files"] == ["../alerts/kvscope.rules.yaml"]
    assert ("./alerts", "/etc/kvscope/alerts") in {(f"./{s}", t) for _, s, t in bind_mounts()}


def test_promtool_check_config() -> None:
    result = run(require_tool("promtool"), "check", "config", "deploy/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 49 rules found" in result.stdout


def test_grafana_mounts_the_generated_dashboards_where_provisioning_looks() -> None:
    provider = yaml.safe_load((REPO / "dashboards/provisioning/dashboards/kvscope.yaml").read_text())
    mounts = {s: t for _, s, t in bind_mounts()}
    assert mounts["dashboards/json"] == provider["providers"][0]["options"]["path"]
    assert mounts["dashboards/provisioning"] == "/etc/grafana/provisioning"


def test_gateway_config_loads_with_the_gateway_schema() -> None:
    from kvscope.gateway import settings

    loaded = settings.load_settings(REPO / "deploy" / "gateway.yaml", env={})
    assert (loaded.host, loaded.port) == ("0.0.0.0", 4000)
    assert [u.url for u in loaded.upstreams] == ["http://engine:8000"]
    assert loaded.tracing.otlp_endpoint == "http://jaeger:4318"


def test_dockerfile_is_one_cpu_image_with_a_gpu_variant() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11\.\d+-slim-bookworm$", text, re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "ARG TORCH_VERSION=2.13.0" in text  # the version the Makefile installs
    assert "USER kvscope" in text and 'CMD ["kvscope", "engine"' in text
    gpu = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())["services"]["engine"]
    assert gpu["build"]["args"]["TORCH_INDEX_URL"].endswith("/cu128")
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", "test-artifacts"} <= ignored
    copied = re.findall(r"^COPY (\S+)", (REPO / "Dockerfile").read_text(), re.M)
    assert not set(copied) & ignored
