"""What the Kubernetes manifests take from the files the compose stack runs from, read once.

Each field names the file it comes from, so the cluster runs the same image, command, ports, limits, gateway
settings, scrape jobs, alert rules and dashboards as ``docker compose up``. Raises ValueError naming the file
when one of them lacks what is read from it (the generator then exits 2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
"""The checkout (kvscope/deploy/ → kvscope/ → the root; src/kvscope links to kvscope/)."""


@dataclass(frozen=True, slots=True)
class EngineSource:
    """One variant of the compose ``engine`` service (compose.yaml, or compose.gpu.yaml over it)."""

    image: str
    """``kvscope:0.1.0`` (CPU) or ``kvscope:0.1.0-cuda``."""
    command: tuple[str, ...]
    """``kvscope engine --model … --host 0.0.0.0 --port 8000 [--device cuda]``."""
    memory: str
    """The compose memory limit as a Kubernetes quantity (``4g`` → ``4Gi``)."""

    def flag(self, name: str) -> str:
        """The value after ``name`` in the command; raises ValueError when the flag is absent."""
        if name not in self.command[:-1]:
            raise ValueError(f"compose engine command has no {name}: {list(self.command)}")
        return self.command[self.command.index(name) + 1]

    @property
    def model(self) -> str:
        return self.flag("--model")

    @property
    def port(self) -> int:
        return int(self.flag("--port"))


@dataclass(frozen=True, slots=True)
class Sources:
    """Everything the manifests take from the repository's other files."""

    cpu_engine: EngineSource
    """compose.yaml's ``engine``."""
    gpu_engine: EngineSource
    """compose.gpu.yaml's ``engine`` over compose.yaml's."""
    engine_env: dict[str, str]
    """compose.yaml's engine environment that holds in a cluster too (``KVSCOPE_CACHE``,
    ``OTEL_SERVICE_NAME``); the OTLP endpoint names compose's Jaeger and is left out."""
    gateway_image: str
    gateway_command: tuple[str, ...]
    """``kvscope gateway --config /etc/kvscope/gateway.yaml``."""
    gateway_memory: str
    gateway_config: dict[str, Any]
    """deploy/gateway.yaml, the compose gateway's config (its host, port and service name carry over)."""
    image_uid: int
    """The image's ``kvscope`` user (Dockerfile ``useradd --uid``): runAsUser/fsGroup of the pods."""
    scrape_interval: str
    scrape_timeout: str
    """deploy/prometheus.yml's global ``scrape_interval``/``scrape_timeout`` (the dashboards' rate windows
    assume them)."""
    engine_job: str
    gateway_job: str
    """deploy/prometheus.yml's job names of the engine and gateway targets: alerts and dashboards select
    ``job``, so the cluster's monitors relabel to the same names."""
    rules: dict[str, Any]
    """alerts/kvscope.rules.yaml, parsed."""
    dashboards: dict[str, str]
    """dashboards/json/*.json: file name → text."""

    @property
    def gateway_port(self) -> int:
        return int(self.gateway_config["port"])

    @property
    def gateway_config_path(self) -> str:
        """Where the gateway's command reads its config (``--config PATH``)."""
        return self.gateway_command[self.gateway_command.index("--config") + 1]


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def quantity(compose_size: str) -> str:
    """A compose byte size as a Kubernetes quantity: ``4g`` → ``4Gi``, ``512m`` → ``512Mi`` (compose's
    suffixes are binary). Raises ValueError for other forms."""
    match = re.fullmatch(r"(\d+)([kmg])", compose_size)
    if match is None:
        raise ValueError(f"compose memory limit {compose_size!r}: expected digits and k, m or g")
    return match.group(1) + {"k": "Ki", "m": "Mi", "g": "Gi"}[match.group(2)]


def _memory(service: dict[str, Any]) -> str:
    return quantity(service["deploy"]["resources"]["limits"]["memory"])


def _job_of(prometheus: dict[str, Any], host: str) -> str:
    for job in prometheus["scrape_configs"]:
        targets = [t for c in job.get("static_configs", []) for t in c["targets"]]
        if any(t.split(":")[0] == host for t in targets):
            return job["job_name"]
    raise ValueError(f"deploy/prometheus.yml: no scrape job targets {host!r}")


def _image_uid(dockerfile: str) -> int:
    match = re.search(r"useradd\b[^\n]*--uid (\d+) kvscope\b", dockerfile)
    if match is None:
        raise ValueError("Dockerfile: no `useradd ... --uid N kvscope`")
    return int(match.group(1))


def read_sources(repo: Path = REPO) -> Sources:
    """Read the compose files, the Dockerfile, deploy/, alerts/ and dashboards/json/ of ``repo``."""
    services = _yaml(repo / "compose.yaml")["services"]
    gpu = _yaml(repo / "compose.gpu.yaml")["services"]["engine"]
    engine, gateway = services["engine"], services["gateway"]
    cpu_engine = EngineSource(engine["image"], tuple(engine["command"]), _memory(engine))
    gpu_engine = EngineSource(gpu["image"], tuple(gpu["command"]), _memory(gpu))
    prometheus = _yaml(repo / "deploy" / "prometheus.yml")
    return Sources(
        cpu_engine=cpu_engine,
        gpu_engine=gpu_engine,
        engine_env={k: v for k, v in engine["environment"].items() if not k.startswith("OTEL_EXPORTER")},
        gateway_image=gateway["image"],
        gateway_command=tuple(gateway["command"]),
        gateway_memory=_memory(gateway),
        gateway_config=_yaml(repo / "deploy" / "gateway.yaml"),
        image_uid=_image_uid((repo / "Dockerfile").read_text(encoding="utf-8")),
        scrape_interval=prometheus["global"]["scrape_interval"],
        scrape_timeout=prometheus["global"]["scrape_timeout"],
        engine_job=_job_of(prometheus, "engine"),
        gateway_job=_job_of(prometheus, "gateway"),
        rules=_yaml(repo / "alerts" / "kvscope.rules.yaml"),
        dashboards={
            p.name: p.read_text(encoding="utf-8") for p in sorted((repo / "dashboards/json").glob("*.json"))
        },
    )
