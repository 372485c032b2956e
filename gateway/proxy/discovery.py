"""Replicas that come and go: the sources of the upstream pool's replicas, re-read every
``discovery.interval_s`` and handed to :meth:`UpstreamPool.set_upstreams` (which drains the replicas a source
dropped and returns those that joined, probed here at once so that they take traffic within one probe).

- ``dns:<name>``, one per ``discovery.dns`` entry: the name's A and AAAA records (e.g. a Kubernetes headless
  Service: one record per ready pod), resolved with dnspython's asyncio resolver through
  ``discovery.nameservers`` or the system's (``/etc/resolv.conf``: its name servers, search domains and
  ``ndots``). NXDOMAIN or no record of a type means no replicas of that type (a Service scaled to zero); a
  failed lookup (timeout, SERVFAIL, REFUSED) keeps that type's last known addresses, logs a warning and
  counts in ``kvscope_gateway_discovery_errors_total{source}``. No answer is cached between rounds: each
  round asks the name server (a headless Service's records have a TTL of seconds anyway).
- ``config``: the settings' ``upstreams``, re-read from the ``--config`` file (``discovery.config_reload``)
  when its content changes, through the same precedence as at start (a ``--upstream`` flag or
  ``$KVSCOPE_GATEWAY_UPSTREAMS`` still wins). Only ``upstreams`` apply live: other changed top-level keys are
  named in a warning (restart to apply); a file that cannot be read or no longer loads keeps the last good
  set, logs why and counts as an error of source ``config``. Write the file atomically (a rename, as a
  Kubernetes ConfigMap volume does): a half-written file that happens to parse would apply as it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Protocol

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver
import httpx
import yaml

from kvscope.gateway.metrics import GatewayMetrics
from kvscope.gateway.proxy.upstreams import CONFIG_SOURCE, Replica, UpstreamPool
from kvscope.gateway.settings import (
    DiscoveryConfig,
    DnsDiscoveryConfig,
    GatewaySettings,
    SettingsSource,
    UpstreamConfig,
)

_log = logging.getLogger("kvscope.gateway")

RECORD_TYPES = ("A", "AAAA")


class Resolver(Protocol):
    """What discovery asks of a resolver: :meth:`dns.asyncresolver.Resolver.resolve` (a test may pass a
    stub)."""

    async def resolve(self, qname: str, rdtype: str, *, search: bool | None = None) -> Iterable[Any]: ...


class DiscoveryError(Exception):
    """A source could not be read this round: its replicas stay as they were."""


def make_resolver(config: DiscoveryConfig) -> dns.asyncresolver.Resolver:
    """The resolver of ``discovery.nameservers``, or the system's (``/etc/resolv.conf``) when none are set.
    Raises ValueError when the system has no resolver configuration."""
    if not config.nameservers:
        try:
            return dns.asyncresolver.Resolver()
        except dns.resolver.NoResolverConfiguration as exc:
            raise ValueError(
                f"discovery.dns needs a name server: the system's resolver configuration has none ({exc}); "
                "set discovery.nameservers"
            ) from exc
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [
        dns.nameserver.Do53Nameserver(address, port) for address, port in config.nameserver_addresses()
    ]
    return resolver


class DnsWatch:
    """One ``discovery.dns`` entry and the addresses its records last named, per record type."""

    def __init__(self, entry: DnsDiscoveryConfig, resolver: Resolver) -> None:
        self.entry = entry
        self._resolver = resolver
        self._known: dict[str, tuple[str, ...]] = dict.fromkeys(RECORD_TYPES, ())

    @property
    def source(self) -> str:
        return self.entry.source

    async def resolve(self) -> tuple[tuple[UpstreamConfig, ...], list[tuple[str, Exception]]]:
        """(the upstreams its A and AAAA records name now, the failed lookups: record type and error). A
        record type whose lookup failed keeps its last known addresses."""
        results = await asyncio.gather(*(self._lookup(rdtype) for rdtype in RECORD_TYPES))
        failures: list[tuple[str, Exception]] = []
        for rdtype, result in zip(RECORD_TYPES, results, strict=True):
            if isinstance(result, Exception):
                failures.append((rdtype, result))
            else:
                self._known[rdtype] = result
        addresses = [address for rdtype in RECORD_TYPES for address in self._known[rdtype]]
        return tuple(self.entry.upstream(a) for a in addresses), failures

    async def _lookup(self, rdtype: str) -> tuple[str, ...] | Exception:
        """The addresses of ``rdtype`` records (sorted), or the error of a failed lookup."""
        try:
            answer = await self._resolver.resolve(self.entry.name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return ()  # no such name, or no record of this type: no replicas
        except (dns.exception.DNSException, OSError) as exc:
            return exc
        return tuple(sorted({record.to_text() for record in answer}))


class ConfigWatch:
    """The ``upstreams`` of the config file, read again whenever the file's content changes."""

    def __init__(self, source: SettingsSource, running: GatewaySettings) -> None:
        if source.config_path is None:
            raise ValueError("config reload needs a config file")
        self.path = source.config_path
        self._source = source
        self._running = running
        self._seen: bytes | None = None  # None: not read yet
        self._unreadable: str | None = None

    async def poll(self) -> tuple[UpstreamConfig, ...] | None:
        """The upstreams of the file's new content; None while its content is what was read last. Raises
        DiscoveryError when the file cannot be read (once, until it can be again) or no longer loads (once
        per content)."""
        try:
            text = await asyncio.to_thread(self.path.read_bytes)
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc.strerror or exc}"
            if problem == self._unreadable:
                return None
            self._unreadable = problem
            raise DiscoveryError(f"cannot read {self.path} ({problem})") from exc
        self._unreadable = None
        if text == self._seen:
            return None
        self._seen = text
        try:
            settings = await asyncio.to_thread(self._source.load)
        except (ValueError, OSError, yaml.YAMLError) as exc:
            raise DiscoveryError(f"{self.path} no longer loads: {exc}") from exc
        changed = [
            name
            for name in GatewaySettings.__struct_fields__
            if name != "upstreams" and getattr(settings, name) != getattr(self._running, name)
        ]
        if changed:
            _log.warning(
                "config reload: %s changed %s: restart the gateway to apply (only upstreams apply live)",
                self.path,
                ", ".join(changed),
            )
        return settings.upstreams


class Discovery:
    """Every source of replicas and the loop that re-reads them (started by gateway/lifespan.py)."""

    def __init__(
        self,
        settings: GatewaySettings,
        pool: UpstreamPool,
        metrics: GatewayMetrics,
        source: SettingsSource | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        config = settings.discovery
        self.interval_s = config.interval_s
        self._pool = pool
        self._metrics = metrics
        self._dns: list[DnsWatch] = []
        if config.dns:
            resolver = resolver or make_resolver(config)
            self._dns = [DnsWatch(entry, resolver) for entry in config.dns]
        self._config = (
            ConfigWatch(source, settings)
            if config.config_reload and source is not None and source.config_path is not None
            else None
        )
        self._failing: dict[str, str] = {}
        """Source → the kind of failure last logged (logged again when it changes or after a recovery)."""
        for name in self.sources:
            metrics.discovery_errors.labels(name)

    @property
    def sources(self) -> list[str]:
        return [w.source for w in self._dns] + ([CONFIG_SOURCE] if self._config else [])

    @property
    def active(self) -> bool:
        """Whether there is anything to re-read."""
        return bool(self.sources)

    async def run_once(self, client: httpx.AsyncClient) -> None:
        """One round: resolve every DNS name and re-read the config file (concurrently), hand each source's
        upstreams to the pool, probe the replicas that joined (so they take traffic now, not after
        ``routing.health_interval_s``)."""
        rounds = [self._dns_round(watch) for watch in self._dns]
        if self._config is not None:
            rounds.append(self._config_round(self._config))
        joined = [replica for batch in await asyncio.gather(*rounds) for replica in batch]
        if not joined:
            return
        await asyncio.gather(*(self._pool.check(replica, client) for replica in joined))
        for model in self._pool.served_models():  # zero series for models the new replicas serve
            self._metrics.initialize_model(model)

    async def run(self, client: httpx.AsyncClient) -> None:
        """A round every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.run_once(client)
            except Exception:  # a bug here must not end discovery for good
                _log.exception("discovery round failed")

    async def _dns_round(self, watch: DnsWatch) -> list[Replica]:
        upstreams, failures = await watch.resolve()
        if failures:
            self._failed(
                watch.source,
                f"resolving {watch.entry.name} failed "
                f"({'; '.join(f'{rdtype}: {type(exc).__name__}: {exc}' for rdtype, exc in failures)}); "
                f"keeping its last known addresses ({len(upstreams)} replicas)",
                kind=" ".join(f"{rdtype}:{type(exc).__name__}" for rdtype, exc in failures),
            )
        else:
            self._recovered(watch.source)
        return self._pool.set_upstreams(watch.source, upstreams)

    async def _config_round(self, watch: ConfigWatch) -> list[Replica]:
        try:
            upstreams = await watch.poll()
        except DiscoveryError as exc:
            message = f"config reload: {exc}; keeping the running upstreams"
            self._failed(CONFIG_SOURCE, message, kind=message, error=True)
            return []
        if upstreams is None:
            return []
        self._recovered(CONFIG_SOURCE)
        return self._pool.set_upstreams(CONFIG_SOURCE, upstreams)

    def _failed(self, source: str, message: str, kind: str, error: bool = False) -> None:
        """Count a failure of ``source``; log it unless it is the same ``kind`` as the one logged last
        (a name server that is down would log every round)."""
        self._metrics.discovery_errors.labels(source).inc()
        if self._failing.get(source) != kind:
            self._failing[source] = kind
            _log.log(logging.ERROR if error else logging.WARNING, "discovery: %s", message)
        else:
            _log.debug("discovery: %s", message)

    def _recovered(self, source: str) -> None:
        if self._failing.pop(source, None) is not None:
            _log.info("discovery: %s answers again", source)
