"""Evaluate dashboard queries against a Prometheus HTTP API (stdlib only; used by render.py and the tests).

Grafana variables are substituted the way Grafana would for "All": ``$job``, ``$instance``, ``$model`` →
``.*``; ``$__rate_interval``, ``$__range``, ``$__interval`` → durations given by the caller.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

ALL = ".*"
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


class PromQLError(RuntimeError):
    """Prometheus answered a query with ``status: error`` (``error_type`` e.g. ``bad_data``)."""

    def __init__(self, expr: str, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message} in {expr!r}")
        self.expr, self.error_type, self.message = expr, error_type, message


@dataclass(frozen=True, slots=True)
class Variables:
    """Values substituted for Grafana variables; durations are PromQL durations (``1m``)."""

    rate_interval: str = "1m"
    range: str = "1h"
    interval: str = "15s"
    values: dict[str, str] = field(default_factory=lambda: {"job": ALL, "instance": ALL, "model": ALL})

    def substitute(self, expr: str) -> str:
        """``expr`` with every ``$name``/``${name}`` replaced; raises KeyError on an unknown variable."""
        builtins = {"__rate_interval": self.rate_interval, "__range": self.range, "__interval": self.interval}

        def replace(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            if name in builtins:
                return builtins[name]
            if name not in self.values:
                raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
            return self.values[name]

        return _VARIABLE.sub(replace, expr)


@dataclass(frozen=True, slots=True)
class PrometheusAPI:
    """Minimal client of Prometheus' HTTP API v1 (``url`` like ``http://127.0.0.1:9090``)."""

    url: str
    timeout_s: float = 10.0

    def _call(self, path: str, params: dict[str, Any], expr: str = "") -> Any:
        data = urllib.parse.urlencode(params, doseq=True).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            if "errorType" not in body:
                raise
        if body.get("status") != "success":
            raise PromQLError(expr, body.get("errorType", "unknown"), body.get("error", ""))
        return body["data"]

    def query(self, expr: str, time: float | None = None) -> list[dict[str, Any]]:
        """Instant query → ``[{"metric": {...}, "value": [t, "v"]}]`` (scalars as one unlabeled sample);
        raises PromQLError."""
        params: dict[str, Any] = {"query": expr}
        if time is not None:
            params["time"] = time
        data = self._call("/api/v1/query", params, expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """Range query (unix seconds) → ``[{"metric": {...}, "values": [[t, "v"], ...]}]``."""
        params = {"query": expr, "start": start, "end": end, "step": step}
        return self._call("/api/v1/query_range", params, expr)["result"]

    def series(self, match: str) -> list[dict[str, str]]:
        """Label sets of the series matching selector ``match`` (validates the selector's syntax)."""
        return self._call("/api/v1/series", {"match[]": match}, match)

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing) as Prometheus sees them."""
        request = urllib.request.Request(f"{self.url}/api/v1/alerts")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.load(response)["data"]["alerts"]

    def rules(self) -> list[dict[str, Any]]:
        """Rule groups with each rule's health and last evaluation error."""
        request = urllib.request.Request(f"{self.url}/api/v1/rules")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.load(response)["data"]["groups"]


def legend(fmt: str, labels: dict[str, str], fallback: str) -> str:
    """Grafana legend: ``{{label}}`` placeholders filled from ``labels``; ``__auto``/empty → ``fallback``."""
    if not fmt or fmt == "__auto":
        return fallback
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or fallback
