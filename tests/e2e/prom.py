"""Real Prometheus and Alertmanager processes for tests, on random local ports, plus a webhook receiver.

The binaries are Debian's (``apt-get install prometheus prometheus-alertmanager``): ``prometheus``,
``promtool`` and ``/usr/bin/prometheus-alertmanager``. No init system runs them; the tests start and stop
them here. Configs are generated from the project's files (alerts/, deploy/) with test-only changes:
short ``for:`` and Alertmanager timers, webhook URLs pointing at :class:`WebhookReceiver`.
"""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from kvscope.dashboards.overview import MIN_SLO_REQUESTS
from kvscope.dashboards.query import PrometheusAPI
from kvscope.testing.ports import free_port
from kvscope.testing.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "kvscope.rules.yaml"
ALERTMANAGER_CONFIG = REPO / "alerts" / "alertmanager.yml"
EXAMPLE_RECEIVER = "http://127.0.0.1:5001"
"""Receiver base URL in alerts/alertmanager.yml, replaced by the test receiver's URL."""


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200; raises RuntimeError if ``proc`` exits first, AssertionError (with
    the last error) after ``timeout_s``."""

    def ok() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} was ready")
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200

    wait_until(ok, timeout_s, f"{url} answering 200", interval_s=0.05, retry_on=(OSError,))


def wait_for_series(api: PrometheusAPI, expr: str, timeout_s: float) -> list[dict[str, Any]]:
    """Poll instant query ``expr`` until it returns a series (e.g. the first scrape of a target landed);
    raises AssertionError after ``timeout_s``."""
    return wait_until(lambda: api.query(expr), timeout_s, f"a series for {expr!r}", interval_s=0.2)


def fast_rules(dest: Path, for_duration: str = "1s", src: Path = RULES, min_slo_requests: int = 10) -> Path:
    """Copy the project's rules with every ``for:`` set to ``for_duration`` (15 s for the absent() rules,
    which would fire before the first scrape) and the error-budget alerts' minimum-traffic guard
    (``MIN_SLO_REQUESTS`` requests in the long window) lowered to ``min_slo_requests`` (the e2e test's
    "test copy": seconds of traffic instead of hours)."""
    doc = yaml.safe_load(src.read_text())
    guard = f">= {MIN_SLO_REQUESTS}"
    for group in doc["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if "for" in rule:  # absent(): no series before the first scrape, so it keeps a longer wait
                rule["for"] = "15s" if "absent(" in rule["expr"] else for_duration
            if "alert" in rule and guard in rule["expr"]:
                rule["expr"] = rule["expr"].replace(guard, f">= {min_slo_requests}")
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


def alertmanager_config(receiver_url: str, src: Path = ALERTMANAGER_CONFIG) -> str:
    """The project's Alertmanager config with receivers at ``receiver_url`` and 1 s grouping timers."""
    doc = yaml.safe_load(src.read_text().replace(EXAMPLE_RECEIVER, receiver_url))
    for route in [doc["route"], *doc["route"].get("routes", [])]:
        route["group_wait"], route["group_interval"] = "1s", "1s"
    return yaml.safe_dump(doc, sort_keys=False)


@dataclass
class ManagedProcess:
    """A child process whose output goes to ``log_path``; ``stop()`` terminates (then kills) it."""

    args: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> ManagedProcess:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would (no graceful shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class _ServerProcess:
    """Start/stop/context-manager plumbing shared by the Prometheus and Alertmanager wrappers."""

    _process: ManagedProcess

    def _await_ready(self, ready_url: str, timeout_s: float):
        self._process.start()
        try:
            wait_http_ok(ready_url, timeout_s, self._process.proc)
        except (RuntimeError, AssertionError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}\n{self._process.log()}") from exc
        return self

    def stop(self) -> None:
        if hasattr(self, "_process"):
            self._process.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class PrometheusServer(_ServerProcess):
    """``prometheus`` on a random port; ``targets`` maps job name → ["host:port", ...]."""

    workdir: Path
    targets: dict[str, list[str]] = field(default_factory=dict)
    rule_files: list[Path] = field(default_factory=list)
    alertmanager: str | None = None
    """``host:port`` of an Alertmanager to send alerts to."""
    scrape_interval: str = "1s"
    binary: str = "prometheus"
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> PrometheusAPI:
        return PrometheusAPI(self.url)

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "global": {
                "scrape_interval": self.scrape_interval,
                "scrape_timeout": self.scrape_interval,
                "evaluation_interval": "1s",
            },
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}]}
                for job, hosts in self.targets.items()
            ],
        }
        if self.alertmanager:
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [self.alertmanager]}]}]}
        return cfg

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self._process = ManagedProcess(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--rules.alert.resend-delay=1s",
                "--log.level=warn",
            ],
            self.workdir / "prometheus.log",
        )
        return self._await_ready(f"{self.url}/-/ready", timeout_s)


@dataclass
class AlertmanagerServer(_ServerProcess):
    """``prometheus-alertmanager`` on a random port, clustering off, with ``config_text``."""

    workdir: Path
    config_text: str
    binary: str = "/usr/bin/prometheus-alertmanager"
    port: int = field(default_factory=free_port)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> AlertmanagerServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "alertmanager.yml"
        config.write_text(self.config_text)
        self._process = ManagedProcess(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.path={self.workdir / 'data'}",
                f"--web.listen-address={self.address}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            self.workdir / "alertmanager.log",
        )
        return self._await_ready(f"http://{self.address}/-/ready", timeout_s)

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts Alertmanager holds now (``GET /api/v2/alerts``): each with ``labels`` and ``status``
        (``state``: ``active``, ``suppressed`` or ``unprocessed``; ``inhibitedBy``: the fingerprints of the
        alerts inhibiting it)."""
        with urllib.request.urlopen(f"http://{self.address}/api/v2/alerts", timeout=5) as response:
            return json.loads(response.read())

    def state(self, **labels: str) -> set[tuple[str, bool]]:
        """``(status.state, inhibited)`` of every alert whose labels include ``labels``."""
        return {
            (a["status"]["state"], bool(a["status"]["inhibitedBy"]))
            for a in self.alerts()
            if labels.items() <= a["labels"].items()
        }


@dataclass(frozen=True, slots=True)
class Notification:
    """One webhook POST from Alertmanager (payload: version 4 webhook JSON)."""

    path: str
    payload: dict[str, Any]

    def alerts(self, status: str = "firing") -> list[dict[str, Any]]:
        return [a for a in self.payload["alerts"] if a["status"] == status]


class WebhookReceiver:
    """Collects Alertmanager webhook notifications on a random local port (a thread serves them)."""

    def __init__(self) -> None:
        self.notifications: list[Notification] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.notifications.append(Notification(self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def firing(self, path: str | None = None) -> list[dict[str, str]]:
        """Labels of every alert received as firing (optionally only on receiver ``path``), in order."""
        with self._lock:
            notes = [n for n in self.notifications if path is None or n.path == path]
        return [a["labels"] for n in notes for a in n.alerts("firing")]

    def wait_for(self, predicate: Callable[[WebhookReceiver], bool], timeout_s: float) -> bool:
        """Poll ``predicate(self)`` until true or ``timeout_s`` passes; returns whether it became true."""
        try:
            wait_until(lambda: predicate(self), timeout_s, "webhook notifications", interval_s=0.1)
        except AssertionError:
            return False
        return True

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
