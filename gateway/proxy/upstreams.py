"""Upstream replicas: served models, health, least-outstanding-requests selection, passive ejection.

Active health check: ``GET {url}/v1/models`` every ``health_interval_s`` (universal across OpenAI-compatible
servers, and it refreshes each replica's model cards, including ``max_model_len``). Passive ejection: a
connection error or timeout ejects a replica at once, ``failure_threshold`` consecutive 5xx answers eject it;
an ejected replica returns at its next good health check. A health probe that gets no answer within
``health_timeout_s`` ejects only as the ``failure_threshold``-th in a row (a replica whose event loop is slow
in a long step is busy, not dead: Kubernetes' readiness ``failureThreshold``, Envoy's
``unhealthy_threshold``); a refused or timed-out connection, an error status or a malformed answer ejects at
once. Selection: among healthy replicas serving the model, by the model's routing policy (gateway/routing/:
cache_aware, least_outstanding, round_robin). A replica that comes back healthy, or whose card names a new
server instance, has an empty KV cache: the router forgets the prefixes it held. Membership: each discovery
source (the settings' ``upstreams``, a DNS name: gateway/proxy/discovery.py) sets its replicas with
:meth:`UpstreamPool.set_upstreams`; one it drops drains (no new requests) and leaves with its last request.
Kind (gateway/engines/kinds.py): which server a replica is, from its config, else its card's ``owned_by``,
else the names in its ``/metrics``, else its ``/info`` or ``/props``, else ``openai``; set when it is made and
again at every health check and scrape (:meth:`Replica.evaluate_kind`). Its engine state (requests running and
waiting, KV usage and capacity) is the last scrape of its ``/metrics`` (llama.cpp: and ``/slots``;
gateway/engines/scraper.py), kept on the replica: a request reads it and never waits for a scrape.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvscope.gateway.engines.kinds import KindSource, UpstreamKind, decide_kind, kind_from_cards, parse_kind
from kvscope.gateway.engines.samples import EngineSample
from kvscope.gateway.metrics import GatewayMetrics
from kvscope.gateway.routing.prefix import PromptPrefix
from kvscope.gateway.routing.prefix_index import PrefixIndex
from kvscope.gateway.routing.router import Policy, RouteDecision, Router
from kvscope.gateway.settings import ModelConfig, RoutingConfig, UpstreamConfig

_log = logging.getLogger("kvscope.gateway")

CONFIG_SOURCE = "config"
"""The discovery source of the settings' ``upstreams`` (the config file, ``--upstream``, the environment)."""


@dataclass(slots=True)
class Replica:
    """One upstream server and what the gateway knows about it."""

    config: UpstreamConfig
    healthy: bool = False
    outstanding: int = 0
    consecutive_failures: int = 0
    probe_timeouts: int = 0
    """Consecutive health probes that got no answer within ``health_timeout_s``."""
    probe_error: str | None = None
    """Why its last health probe failed (``connection refused``, ``GET /v1/models answered 404`` …); None
    after a good one. Logged whenever it changes, so an upstream that never answers says why."""
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Model id → the upstream's ``/v1/models`` entry."""
    prefix_index: PrefixIndex | None = None
    """The prompt prefixes it most likely holds in its KV cache (gateway/routing/); reset when it restarts."""
    instance_id: str | None = None
    """The server instance its card names (kvscope's ``kvscope.instance_id``): a new one is a restart."""
    draining: bool = False
    """Its discovery sources no longer list it: it gets no new requests (:meth:`UpstreamPool.candidates`),
    those in flight finish, and it leaves the pool when the last one ends."""
    sources: dict[str, UpstreamConfig] = field(default_factory=dict)
    """Discovery source (``config``, ``dns:<name>``) → the config it gives this URL; ``config`` is the first
    source's (:meth:`UpstreamPool.set_upstreams`)."""
    kind: UpstreamKind = UpstreamKind.OPENAI
    """Which server it is (gateway/engines/kinds.py); :meth:`evaluate_kind` sets it."""
    kind_source: KindSource = "default"
    """What decided :attr:`kind` (gateway/engines/kinds.py ``KindSource``: config, models, metrics, info,
    props, default)."""
    engine_sample: EngineSample | None = None
    """The last good scrape of its ``/metrics`` (gateway/engines/scraper.py); None before the first. A failed
    scrape keeps it (its ``at`` says how old it is)."""
    probed_kind: tuple[UpstreamKind, KindSource] | None = None
    """The kind its ``/info`` or ``/props`` answer said (the scraper asks when nothing stronger says one)."""
    contradicted_by: UpstreamKind | None = None
    """The kind its ``/metrics`` names say when that is not the configured or card-given kind (warned once
    per contradicting kind: its sampled fields stay null, since the series of the kind it is said to be are
    read)."""
    health_epoch: int = 0
    """Counts its health transitions (down → up, up → down, a new server instance); the scraper gives up on a
    missing or failing ``/metrics`` until this changes."""
    last_active_at: float | None = None
    """``time.monotonic()`` when a request to it last started or ended (the scraper samples a busy replica
    every ``upstream_metrics.interval_s``)."""
    on_kind: Callable[[Replica], None] | None = field(default=None, repr=False, compare=False)
    """Called when :meth:`evaluate_kind` changes its kind or kind source (the pool moves its metric
    series)."""

    def __post_init__(self) -> None:
        self.evaluate_kind()

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def metrics_path(self) -> str | None:
        """The path of its Prometheus endpoint (None: not scraped)."""
        return self.config.metrics_path

    @property
    def kind_known(self) -> bool:
        """Whether :attr:`kind` is more than the default of a replica never reached: something named it, or
        it has answered a health check (then ``openai`` is what it is until a signal says more)."""
        return self.kind_source != "default" or self.health_epoch > 0

    def evaluate_kind(self) -> bool:
        """Set :attr:`kind` and :attr:`kind_source` from the strongest signal it has now (gateway/engines/
        kinds.py ``decide_kind``'s order); returns whether the kind changed. Tells :attr:`on_kind` when the
        kind or its source changed."""
        kind, source = self._detected_kind()
        changed = kind != self.kind
        moved = changed or source != self.kind_source
        if changed and (self.kind_source != "default" or source != "default"):
            _log.info("upstream %s is %s (from %s)", self.label, kind.value, source)
        self.kind, self.kind_source = kind, source
        if moved and self.on_kind is not None:
            self.on_kind(self)
        return changed

    def _detected_kind(self) -> tuple[UpstreamKind, KindSource]:
        """(kind, source) by gateway/engines/kinds.py :func:`decide_kind`'s order over what it knows now."""
        return decide_kind(
            parse_kind(self.config.kind),  # "auto": None
            models=kind_from_cards(self.cards.values()),
            metrics=self.engine_sample.kind_hint if self.engine_sample is not None else None,
            probe=self.probed_kind,
        )

    def observe_sample(self, sample: EngineSample) -> None:
        """A good scrape of its ``/metrics``: keep it, and re-evaluate the kind. When it is the first to tell
        a KV capacity the card does not, the prefix index (sized before from ``capacity_tokens``) starts over
        at that size. When its metric names say another kind than the configured or card-given one (a
        ``kind: tgi`` in front of a vLLM), a warning says so, once per contradicting kind."""
        learned = (
            sample.kv_capacity_tokens is not None
            and (self.engine_sample is None or self.engine_sample.kv_capacity_tokens is None)
            and not any(self._card_capacity(card)[1] for card in self.cards.values())
        )
        self.engine_sample = sample
        if learned:
            self.prefix_index = None
        self.evaluate_kind()
        hint = sample.kind_hint
        contradicted = hint if hint is not None and hint != self.kind else None
        if contradicted is not None and contradicted != self.contradicted_by:
            _log.warning(
                "upstream %s is %s (from %s) but its %s names are %s's: its engine state is not read "
                "(is its kind: right?)",
                self.label,
                self.kind.value,
                self.kind_source,
                self.metrics_path,
                contradicted.value,
            )
        self.contradicted_by = contradicted

    def observe_probe(self, kind: UpstreamKind, source: KindSource) -> None:
        """Its ``/info`` or ``/props`` answer said ``kind``: re-evaluate the kind."""
        self.probed_kind = (kind, source)
        self.evaluate_kind()

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

    def kv_cache_capacity(self, model: str) -> tuple[int | None, int | None]:
        """(tokens per KV block, KV capacity in tokens) from its ``/v1/models`` card for ``model``
        (kvscope's ``kvscope.block_size`` and ``kvscope.num_gpu_blocks``), the capacity else from its last
        ``/metrics`` sample (vLLM's ``vllm:cache_config_info``, SGLang's ``sglang:max_total_num_tokens``,
        TGI's ``tgi_batch_max_total_tokens``, llama.cpp's ``/slots`` Σ ``n_ctx``: gateway/engines/samples.py);
        None where neither says."""
        size, capacity = self._card_capacity(self.cards.get(model))
        if capacity is None and self.engine_sample is not None:
            capacity = self.engine_sample.kv_capacity_tokens
        return size, capacity

    @staticmethod
    def _card_capacity(card: dict[str, Any] | None) -> tuple[int | None, int | None]:
        """(block size, capacity in tokens) from a card's ``kvscope`` object; (None, None) without one."""
        info = (card or {}).get("kvscope")
        if not isinstance(info, dict):
            return None, None
        size, blocks = info.get("block_size"), info.get("num_gpu_blocks")
        size = size if isinstance(size, int) and size > 0 else None
        blocks = blocks if isinstance(blocks, int) and blocks > 0 else None
        return size, (size * blocks if size and blocks else None)

    def restarted(self) -> None:
        """Its KV cache is empty now (it came back after being down, or its instance changed): forget the
        prefixes it held, so their requests go where they are cached now. A new instance of a replica that
        stays up is a health transition too (the scraper tries its ``/metrics`` again); one that comes back
        counts once, in :meth:`UpstreamPool._set_health`."""
        self.prefix_index = None
        if self.healthy:
            self.health_epoch += 1

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
        self.replicas: list[Replica] = []
        self._by_url: dict[str, Replica] = {}
        """Replicas in the pool by URL (one Replica per URL, whatever sources list it)."""
        self._model_configs = {m.name: m for m in models}
        self._routing = routing
        self._metrics = metrics
        self.router = Router(routing, self._model_configs)
        self.set_upstreams(CONFIG_SOURCE, tuple(upstreams))

    # --- membership (gateway/proxy/discovery.py) -----------------------------------------------------------
    def set_upstreams(self, source: str, configs: Sequence[UpstreamConfig]) -> list[Replica]:
        """Make ``configs`` the replicas that ``source`` (``config``, ``dns:<name>``) lists, and return those
        that joined or returned (new replicas, draining ones listed again): probe them now (:meth:`check`),
        they take no traffic before a good health check.

        One Replica per URL: a URL still listed keeps its Replica (requests in flight, health, cards, prefix
        index); a new one joins unhealthy; one that no source lists any more drains: no new requests, those
        in flight finish, and it leaves the pool (and its metric series go) when the last one ends
        (:meth:`release`), at once when idle. A URL listed by several sources stays until the last drops it
        and takes the first source's config (its label, models and key)."""
        wanted: dict[str, UpstreamConfig] = {}
        for config in configs:
            wanted.setdefault(config.url.rstrip("/"), config)
        joined: list[Replica] = []
        for url, config in wanted.items():
            replica = self._by_url.get(url)
            if replica is None:
                replica = Replica(config, sources={source: config})
                self._by_url[url] = replica
                self.replicas = [*self.replicas, replica]  # a new list: a loop over the old one is unaffected
                self._metrics.initialize_upstream(replica.label, *self._kind_labels(replica))
                replica.on_kind = self._sync_kind
                _log.info("upstream %s joined (%s)", replica.label, source)
                joined.append(replica)
                continue
            replica.sources[source] = config
            self._reconfigure(replica)
            if replica.draining:
                replica.draining = False
                _log.info(
                    "upstream %s returned (%s) while draining %d requests",
                    replica.label,
                    source,
                    replica.outstanding,
                )
                joined.append(replica)
        for replica in self.replicas:
            if source not in replica.sources or replica.url in wanted:
                continue
            del replica.sources[source]
            if replica.sources:
                self._reconfigure(replica)
            elif not replica.draining:
                replica.draining = True
                if replica.outstanding == 0:
                    self._leave(replica)
                else:
                    _log.info(
                        "upstream %s draining (%s no longer lists it): %d requests in flight",
                        replica.label,
                        source,
                        replica.outstanding,
                    )
        return joined

    def present(self, replica: Replica) -> bool:
        """Whether ``replica`` is in the pool (not yet left; it may be draining)."""
        return self._by_url.get(replica.url) is replica

    def _reconfigure(self, replica: Replica) -> None:
        """Give ``replica`` its first source's config; a new label moves its series."""
        config = next(iter(replica.sources.values()))
        if config == replica.config:
            return
        old = replica.label
        replica.config = config
        replica.evaluate_kind()  # its kind may be configured now, or no longer
        if replica.label != old:
            self._metrics.remove_upstream(old)
            self._metrics.initialize_upstream(replica.label, *self._kind_labels(replica))
            self._metrics.set_upstream_up(replica.label, replica.healthy)
            self._metrics.set_upstream_outstanding(replica.label, replica.outstanding)
        _log.info("upstream %s reconfigured (was %s)", replica.label, old)

    def _leave(self, replica: Replica) -> None:
        """Take a draining replica out of the pool and drop its metric series."""
        if not self.present(replica):
            return
        replica.on_kind = None
        del self._by_url[replica.url]
        self.replicas = [r for r in self.replicas if r is not replica]
        self._metrics.remove_upstream(replica.label)
        _log.info("upstream %s left", replica.label)

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
        return any(
            not r.config.models and not r.cards and not r.healthy and not r.draining for r in self.replicas
        )

    def unreached(self) -> list[str]:
        """``label: why`` of each replica :meth:`has_unknown_models` waits for whose probe failed (the 503's
        message names them), in pool order."""
        return [
            f"{r.label}: {r.probe_error}"
            for r in self.replicas
            if not r.config.models and not r.cards and not r.healthy and not r.draining and r.probe_error
        ]

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
        return {
            m: any(r.healthy and not r.draining and r.serves(m) for r in self.replicas)
            for m in self.served_models()
        }

    def retry_after(self) -> str:
        """``Retry-After`` seconds for "no healthy replica": the health-check period (a replica can return
        only at a health check), at least 1."""
        return str(max(1, math.ceil(self._routing.health_interval_s)))

    # --- selection ----------------------------------------------------------------------------------------
    def candidates(
        self, model: str | None, exclude: Iterable[Replica] = (), only: frozenset[str] | None = None
    ) -> list[Replica]:
        """Healthy replicas serving ``model`` (any healthy replica for ``None``), minus ``exclude``; with
        ``only``, just those serving nothing but models in ``only`` (:meth:`Replica.serves_only`). A draining
        replica is never one."""
        skip = set(map(id, exclude))
        return [
            r
            for r in self.replicas
            if r.healthy
            and not r.draining
            and (model is None or r.serves(model))
            and id(r) not in skip
            and (only is None or r.serves_only(only))
        ]

    def serving_only(self, only: frozenset[str]) -> list[Replica]:
        """Replicas, healthy or not, that serve nothing but models in ``only``."""
        return [r for r in self.replicas if r.serves_only(only)]

    def policy(self, model: str | None) -> Policy:
        """``model``'s routing policy (gateway/routing/router.py), ``auto`` resolved by how many replicas,
        healthy or not, serve it."""
        serving = sum(1 for r in self.replicas if not r.draining and (model is None or r.serves(model)))
        return self.router.policy(model, serving)

    def prefix_block_size(self, model: str) -> int | None:
        """Tokens per block to hash ``model``'s prompts in when its policy is cache_aware (the replicas'
        own KV block size), else None: the prompt's prefix is not needed."""
        if self.policy(model) != "cache_aware":
            return None
        return self.router.block_size(model, [r for r in self.replicas if not r.draining and r.serves(model)])

    def route(
        self,
        model: str | None,
        prefix: PromptPrefix | None = None,
        exclude: Iterable[Replica] = (),
        only: frozenset[str] | None = None,
        retry: bool | None = None,
    ) -> RouteDecision[Replica] | None:
        """The routing decision for one attempt: among healthy replicas serving ``model`` (and, with
        ``only``, nothing but those models), minus ``exclude`` (replicas already tried), by the model's
        policy; ``prefix``: the prompt's blocks for cache_aware; ``retry``: an earlier attempt of the request
        failed, so the decision is a ``fallback`` (default: whether ``exclude`` names a replica). None when no
        replica is left."""
        exclude = tuple(exclude)
        replicas = self.candidates(model, exclude, only)
        if not replicas:
            return None
        retry = bool(exclude) if retry is None else retry
        return self.router.choose(self.policy(model), model, replicas, prefix, retry=retry)

    def acquire(self, replica: Replica) -> None:
        replica.outstanding += 1
        replica.last_active_at = time.monotonic()
        if self.present(replica):  # a replica that has left keeps no series
            self._metrics.set_upstream_outstanding(replica.label, replica.outstanding)

    def release(self, replica: Replica) -> None:
        """One request ended; a draining replica leaves the pool with its last one."""
        replica.outstanding -= 1
        replica.last_active_at = time.monotonic()
        if replica.draining and replica.outstanding == 0:
            self._leave(replica)
        elif self.present(replica):
            self._metrics.set_upstream_outstanding(replica.label, replica.outstanding)

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
        if self.present(replica):  # a replica that has left keeps no series
            self._metrics.count_upstream_error(replica.label, reason)
        if not passive:
            return
        replica.consecutive_failures += 1
        if eject or replica.consecutive_failures >= self._routing.failure_threshold:
            if replica.healthy:
                _log.warning("upstream %s ejected (%s)", replica.label, reason)
            self._set_health(replica, False)

    def _set_health(self, replica: Replica, healthy: bool) -> None:
        if healthy != replica.healthy:
            replica.health_epoch += 1
        replica.healthy = healthy
        if self.present(replica):
            self._metrics.set_upstream_up(replica.label, healthy)

    @staticmethod
    def _kind_labels(replica: Replica) -> tuple[str | None, str | None]:
        """(kind, kind source) for its metric series; (None, None) while not known (``unknown``)."""
        return (replica.kind.value, replica.kind_source) if replica.kind_known else (None, None)

    def _sync_kind(self, replica: Replica) -> None:
        """Its series carry its current kind (gateway/metrics.py moves them when it changed)."""
        if self.present(replica):
            self._metrics.set_upstream_kind(replica.label, *self._kind_labels(replica))

    # --- active health ------------------------------------------------------------------------------------
    async def check(self, replica: Replica, client: httpx.AsyncClient) -> bool:
        """One health probe: ``GET /v1/models`` (once more on a fresh connection when a reused keep-alive
        connection turns out closed, :meth:`_probe`); updates the replica's cards, kind and health and returns
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
            reason = probe_failure(exc)
            if replica.healthy or reason != replica.probe_error:
                _log.warning(
                    "upstream %s failed its health check (GET %s/v1/models): %s%s",
                    replica.label,
                    replica.url,
                    reason,
                    "" if replica.healthy else "; no requests go to it until it answers",
                )
            replica.probe_error = reason
            self._set_health(replica, False)
            return False
        instance = _instance_id(cards)
        if not replica.healthy or instance != replica.instance_id:
            replica.restarted()  # back after being down, or a new server instance: an empty cache
        if not replica.healthy:
            _log.info("upstream %s is healthy (%s)", replica.label, ", ".join(cards) or "no models")
        replica.cards, replica.instance_id = cards, instance
        replica.consecutive_failures = replica.probe_timeouts = 0
        replica.probe_error = None
        replica.evaluate_kind()
        self._set_health(replica, True)
        self._sync_kind(replica)  # the first good answer makes a still undecided kind known (openai)
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
        """Probe every replica but the draining ones (they take no new requests; a re-added one is probed
        by whoever re-added it)."""
        await asyncio.gather(*(self.check(r, client) for r in self.replicas if not r.draining))

    async def run_health_checks(self, client: httpx.AsyncClient) -> None:
        """Probe every replica every ``health_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self._routing.health_interval_s)
            await self.check_all(client)


def probe_failure(exc: Exception) -> str:
    """A health probe's failure in words: ``connection refused``, ``no answer within the health timeout``,
    ``GET /v1/models answered 404``, ``not an OpenAI model list (KeyError: 'data')`` …"""
    if isinstance(exc, httpx.ConnectError):
        cause = exc.__cause__ or exc.__context__
        text = str(exc) or repr(exc)
        if "refused" in text.lower() or isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect: {text}"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer within the health timeout"
    if isinstance(exc, httpx.HTTPError):
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, ValueError) and str(exc).startswith("GET /v1/models answered"):
        return str(exc)
    return f"not an OpenAI model list ({type(exc).__name__}: {exc})"


def _instance_id(cards: dict[str, dict[str, Any]]) -> str | None:
    """The server instance a ``/v1/models`` answer names (kvscope's ``kvscope.instance_id``, new at every
    start), None for servers that name none."""
    for card in cards.values():
        info = card.get("kvscope")
        if isinstance(info, dict) and isinstance(info.get("instance_id"), str):
            return info["instance_id"]
    return None
