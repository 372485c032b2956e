"""Upstream replicas: served models, health, least-outstanding-requests selection, passive ejection.

Active health check: ``GET {url}/v1/models`` every ``health_interval_s`` (universal across OpenAI-compatible
servers, and it refreshes each replica's model cards, including ``max_model_len``). Passive ejection: a
connection error or timeout ejects a replica at once, ``failure_threshold`` consecutive 5xx answers eject it;
an ejected replica returns at its next good health check. A health probe that gets no answer within
``health_timeout_s`` ejects only as the ``failure_threshold``-th in a row (a replica whose event loop is slow
in a long step is busy, not dead: Kubernetes' readiness ``failureThreshold``, Envoy's
``unhealthy_threshold``); a refused or timed-out connection, an error status or a malformed answer ejects at
once. Selection: among healthy replicas serving the model, the one with the fewest requests in flight; ties go
round-robin.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvscope.gateway.metrics import GatewayMetrics
from kvscope.gateway.settings import ModelConfig, RoutingConfig, UpstreamConfig

_log = logging.getLogger("kvscope.gateway")


@dataclass(slots=True)
class Replica:
    """One upstream server and what the gateway knows about it."""

    config: UpstreamConfig
    healthy: bool = False
    outstanding: int = 0
    consecutive_failures: int = 0
    probe_timeouts: int = 0
    """Consecutive health probes that got no answer within ``health_timeout_s``."""
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Model id → the upstream's ``/v1/models`` entry."""

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def url(self) -> str:
        return self.config.url.rstrip("/")

    def serves(self, model: str) -> bool:
        return model in self.config.models if self.config.models else model in self.cards

    @property
    def models(self) -> tuple[str, ...]:
        """The models it serves: configured, else as its ``/v1/models`` last listed them (empty: not
        known)."""
        return self.config.models or tuple(self.cards)

    def serves_only(self, allowed: frozenset[str]) -> bool:
        """Whether every model it serves is in ``allowed`` (False while its models are not known): a request
        that names no model gets the upstream's own default model, which must be one the caller may use."""
        models = self.models
        return bool(models) and allowed.issuperset(models)

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}


class UpstreamPool:
    """All replicas; chooses one per attempt and keeps health and metrics up to date."""

    def __init__(
        self,
        upstreams: Iterable[UpstreamConfig],
        models: Iterable[ModelConfig],
        routing: RoutingConfig,
        metrics: GatewayMetrics,
    ) -> None:
        self.replicas = [Replica(u) for u in upstreams]
        self._model_configs = {m.name: m for m in models}
        self._routing = routing
        self._metrics = metrics
        self._turn = itertools.count()
        for replica in self.replicas:
            metrics.upstream_up.labels(replica.label).set(0)
            metrics.upstream_outstanding.labels(replica.label).set(0)

    # --- models -------------------------------------------------------------------------------------------
    def served_models(self) -> list[str]:
        """Every model name some replica is configured for or has listed, plus configured models."""
        names: dict[str, None] = dict.fromkeys(self._model_configs)
        for replica in self.replicas:
            names.update(dict.fromkeys(replica.config.models or replica.cards))
        return list(names)

    def is_served(self, model: str) -> bool:
        return model in self._model_configs or any(r.serves(model) for r in self.replicas)

    def has_unknown_models(self) -> bool:
        """Whether some replica has never told us its models (no ``models`` configured, never reached): a
        model it may serve cannot be refused as unknown yet."""
        return any(not r.config.models and not r.cards and not r.healthy for r in self.replicas)

    def model_card(self, model: str) -> dict[str, Any]:
        """The ``/v1/models`` entry: the upstream's (from a healthy replica first) with configured
        overrides."""
        card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "kvscope"}
        for replica in sorted(self.replicas, key=lambda r: not r.healthy):
            if model in replica.cards:
                card = dict(replica.cards[model])
                break
        config = self._model_configs.get(model)
        if config is not None and config.max_model_len is not None:
            card["max_model_len"] = config.max_model_len
        return card

    def max_model_len(self, model: str) -> int | None:
        value = self.model_card(model).get("max_model_len")
        return value if isinstance(value, int) and value > 0 else None

    def ready(self) -> dict[str, bool]:
        """Model → whether a healthy replica serves it, for every configured or ever-discovered model (a
        replica keeps its last model list while it is down)."""
        return {m: any(r.healthy and r.serves(m) for r in self.replicas) for m in self.served_models()}

    def retry_after(self) -> str:
        """``Retry-After`` seconds for "no healthy replica": the health-check period (a replica can return
        only at a health check), at least 1."""
        return str(max(1, math.ceil(self._routing.health_interval_s)))

    # --- selection ----------------------------------------------------------------------------------------
    def candidates(
        self, model: str | None, exclude: Iterable[Replica] = (), only: frozenset[str] | None = None
    ) -> list[Replica]:
        """Healthy replicas serving ``model`` (any healthy replica for ``None``), minus ``exclude``; with
        ``only``, just those serving nothing but models in ``only`` (:meth:`Replica.serves_only`)."""
        skip = set(map(id, exclude))
        return [
            r
            for r in self.replicas
            if r.healthy
            and (model is None or r.serves(model))
            and id(r) not in skip
            and (only is None or r.serves_only(only))
        ]

    def serving_only(self, only: frozenset[str]) -> list[Replica]:
        """Replicas, healthy or not, that serve nothing but models in ``only``."""
        return [r for r in self.replicas if r.serves_only(only)]

    def pick(
        self, model: str | None, exclude: Iterable[Replica] = (), only: frozenset[str] | None = None
    ) -> Replica | None:
        """The healthy replica serving ``model`` (and, with ``only``, nothing but those models) with the
        fewest outstanding requests (ties round-robin)."""
        replicas = self.candidates(model, exclude, only)
        if not replicas:
            return None
        fewest = min(r.outstanding for r in replicas)
        tied = [r for r in replicas if r.outstanding == fewest]
        return tied[next(self._turn) % len(tied)]

    def acquire(self, replica: Replica) -> None:
        replica.outstanding += 1
        self._metrics.upstream_outstanding.labels(replica.label).set(replica.outstanding)

    def release(self, replica: Replica) -> None:
        replica.outstanding -= 1
        self._metrics.upstream_outstanding.labels(replica.label).set(replica.outstanding)

    # --- passive health -----------------------------------------------------------------------------------
    def report_success(self, replica: Replica) -> None:
        replica.consecutive_failures = 0

    def report_failure(
        self, replica: Replica, reason: str, eject: bool = False, passive: bool = True
    ) -> None:
        """Count a failed attempt (``reason``: connect, timeout, status_5xx, stream_broken …) in
        ``kvscope_gateway_upstream_errors_total``; eject when ``eject`` or after ``failure_threshold``
        consecutive ``passive`` failures. Timeouts are not passive failures: a slow replica is busy, not
        dead."""
        self._metrics.upstream_errors.labels(replica.label, reason).inc()
        if not passive:
            return
        replica.consecutive_failures += 1
        if eject or replica.consecutive_failures >= self._routing.failure_threshold:
            if replica.healthy:
                _log.warning("upstream %s ejected (%s)", replica.label, reason)
            self._set_health(replica, False)

    def _set_health(self, replica: Replica, healthy: bool) -> None:
        replica.healthy = healthy
        self._metrics.upstream_up.labels(replica.label).set(1 if healthy else 0)

    # --- active health ------------------------------------------------------------------------------------
    async def check(self, replica: Replica, client: httpx.AsyncClient) -> bool:
        """One health probe: ``GET /v1/models`` (once more on a fresh connection when a reused keep-alive
        connection turns out closed, :meth:`_probe`); updates the replica's cards and health and returns
        whether the replica stays in rotation (a healthy replica keeps it through ``failure_threshold`` - 1
        probes in a row without an answer, see the module docstring)."""
        try:
            resp = await self._probe(replica, client)
            if resp.status_code != 200:
                raise ValueError(f"GET /v1/models answered {resp.status_code}")
            data = resp.json()["data"]
            cards = {c["id"]: c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if isinstance(
                exc, httpx.ReadTimeout
            ):  # connected, no answer yet: busy until failure_threshold in a row
                replica.probe_timeouts += 1
                if replica.healthy and replica.probe_timeouts < self._routing.failure_threshold:
                    _log.warning(
                        "upstream %s did not answer its health check within %gs (%d of %d before ejection)",
                        replica.label,
                        self._routing.health_timeout_s,
                        replica.probe_timeouts,
                        self._routing.failure_threshold,
                    )
                    return True
            if replica.healthy:
                _log.warning("upstream %s failed its health check: %r", replica.label, exc)
            self._set_health(replica, False)
            return False
        if not replica.healthy:
            _log.info("upstream %s is healthy (%s)", replica.label, ", ".join(cards) or "no models")
        replica.cards = cards
        replica.consecutive_failures = replica.probe_timeouts = 0
        self._set_health(replica, True)
        return True

    async def _probe(self, replica: Replica, client: httpx.AsyncClient) -> httpx.Response:
        """``GET /v1/models``, retried once when the connection failed under it: an upstream that closes
        idle keep-alive connections (uvicorn after 5 s, as long as httpx keeps them) can close the pooled
        one just as the probe reuses it ("Server disconnected without sending a response"), which says
        nothing about the upstream's health; the pool drops that connection and the second attempt opens a
        new one."""
        url, headers, timeout = (
            replica.url + "/v1/models",
            replica.auth_headers(),
            self._routing.health_timeout_s,
        )
        try:
            return await client.get(url, headers=headers, timeout=timeout)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            return await client.get(url, headers=headers, timeout=timeout)

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(r, client) for r in self.replicas))

    async def run_health_checks(self, client: httpx.AsyncClient) -> None:
        """Probe every replica every ``health_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self._routing.health_interval_s)
            await self.check_all(client)
