"""EngineScraper: samples every upstream's Prometheus endpoint in the background, one asyncio task per gateway
(started and stopped by gateway/lifespan.py beside the health checks, on an HTTP client of its own:
``new_scrape_client``).

For each healthy replica with a ``metrics_path`` it GETs ``{url}{metrics_path}`` within
``upstream_metrics.timeout_s`` and keeps the reduced :class:`~kvscope.gateway.engines.samples.EngineSample` on
the replica (``observe_sample``): every ``interval_s`` while the replica has requests in flight or had one in
the last :data:`BUSY_WINDOW_S` seconds, else every ``idle_interval_s``. Requests only read the replica's last
sample (stamped at their arrival and finish, with its age); nothing a request does waits for a scrape, and a
slow or hanging ``/metrics`` costs one background task its timeout, never a request.

A replica of kind ``llamacpp`` also has its ``GET /slots`` read in the same tick (current llama-servers
export no KV usage in ``/metrics``; :func:`~kvscope.gateway.engines.samples.sample_from_slots`), and the
sample is the ``/metrics`` one with the ``/slots`` values filling what it lacks (KV usage and capacity; the
busy slots when ``/metrics`` is off, llama-server's default).

A failed scrape keeps the last sample, whose age then grows (when only one of ``/metrics`` and ``/slots``
failed, the other's fresh values replace their old ones and the sample keeps the older age). A transient
failure (a timeout, a refused connection, a 5xx or 429) never stops the scraping: after
:data:`FAILURES_TO_BACK_OFF` in a row the replica is asked only every ``idle_interval_s`` until a read
succeeds (a CPU llama-server answers ``/metrics`` between decode batches, so one long prefill can outlast
several timeouts; stopping would lose its samples for good on a server that stays healthy). What says there is
nothing to read stops asking that path of that replica until its next health transition (down → up, up → down,
a restart: ``health_epoch``), or for :data:`RETRY_STOPPED_S` (a server restarted between two health checks
with other flags, llama-server now with ``--metrics``, is no health transition: llama.cpp's cards name no
instance): a 404 or 501 (llama-server without ``--metrics`` answers 501, without
``--slots`` 501 too), an answer with no series the gateway reads (a plain OpenAI-compatible server), or
:data:`MALFORMED_TO_STOP` unreadable answers in a row (another status, a text that does not parse). A replica
whose ``metrics_path`` is null is not scraped at all. When nothing stronger has said the replica's kind
(``kind_source == "default"``: no configured kind, no telling card, no known ``/metrics`` names), the scraper
asks ``/info`` (TGI) and ``/props`` (llama.cpp) once per health transition.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx

from kvscope.gateway.engines.kinds import (
    INFO_PATH,
    PROPS_PATH,
    KindSource,
    UpstreamKind,
    kind_from_info,
    probe_source,
)
from kvscope.gateway.engines.samples import EngineSample, sample_from_metrics, sample_from_slots
from kvscope.gateway.settings import UpstreamMetricsConfig

_log = logging.getLogger("kvscope.gateway")

BUSY_WINDOW_S = 10.0
"""A replica that had a request in flight this recently is scraped every ``interval_s``."""
FAILURES_TO_BACK_OFF = 3
"""Transient failures in a row after which a replica is scraped every ``idle_interval_s`` until a read
succeeds."""
MALFORMED_TO_STOP = 3
"""Unreadable answers in a row that stop scraping that path of a replica until its next health transition."""
RETRY_STOPPED_S = 300.0
"""A stopped path is asked again after this long even without a health transition (module docstring)."""
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Statuses that say "not now" (overloaded, restarting, a proxy in front timing out): backed off, never
stopped."""
STOP_STATUSES = frozenset({404, 501})
"""Statuses that say there is no metrics endpoint (llama-server without ``--metrics``: 501)."""
MAX_BODY_BYTES = 8 * 1024 * 1024
"""A ``/metrics`` answer larger than this fails (a vLLM one is a few hundred kB)."""
PROBES = (INFO_PATH, PROPS_PATH)
"""Kind probes, in order: TGI's ``/info``, llama.cpp's ``/props``."""
SLOTS_PATH = "/slots"
"""llama.cpp's per-slot state (its KV usage and capacity), read beside ``/metrics`` for kind ``llamacpp``."""


class ScrapedReplica(Protocol):
    """What the scraper reads and calls on a replica (gateway/proxy/upstreams.py ``Replica``)."""

    healthy: bool
    outstanding: int
    health_epoch: int
    last_active_at: float | None
    kind: UpstreamKind
    kind_source: KindSource
    engine_sample: EngineSample | None

    @property
    def url(self) -> str:
        """Base URL without a trailing ``/``."""
        ...

    @property
    def label(self) -> str:
        """Its name in logs and metrics."""
        ...

    @property
    def metrics_path(self) -> str | None:
        """Path of its Prometheus endpoint; None: not scraped."""
        ...

    def auth_headers(self) -> dict[str, str]:
        """The headers that authenticate the gateway to it."""
        ...

    def observe_sample(self, sample: EngineSample) -> None:
        """Keep a good scrape's sample."""
        ...

    def observe_probe(self, kind: UpstreamKind, source: KindSource) -> None:
        """Its ``/info`` or ``/props`` said ``kind``."""
        ...


class _NoEndpoint(Exception):
    """The answer says there is nothing to scrape (404/501, or no series the gateway reads)."""


class _Unavailable(Exception):
    """A transient status (:data:`TRANSIENT_STATUSES`): try again later."""


@dataclass(slots=True)
class _Endpoint:
    """One path the scraper reads on a replica (``/metrics``, ``/slots``)."""

    failures: int = 0
    """Transient failures in a row (timeouts, refused connections, :data:`TRANSIENT_STATUSES`)."""
    malformed: int = 0
    """Unreadable answers in a row."""
    stopped_at: float | None = None
    """When it was stopped (the scraper's clock): not asked again until the replica's next health transition
    or :data:`RETRY_STOPPED_S` later; None: asked."""

    def asked(self, now: float) -> bool:
        """Whether the path is read at ``now``: not stopped, or stopped :data:`RETRY_STOPPED_S` ago."""
        return self.stopped_at is None or now - self.stopped_at >= RETRY_STOPPED_S


@dataclass(slots=True)
class _State:
    """The scraper's bookkeeping for one replica, reset at each of its health transitions."""

    replica: ScrapedReplica
    """Held so that its ``id`` (the key) is not reused while the entry lives."""
    epoch: int
    last_attempt_at: float | None = None
    metrics: _Endpoint = field(default_factory=_Endpoint)
    slots: _Endpoint = field(default_factory=_Endpoint)
    probed: bool = False


Read = EngineSample | Literal["failed"] | None
"""One path's read in a tick: its sample, ``failed`` (counted; the old values stay), or None (not asked, or
it just said there is nothing to read there)."""


class EngineScraper:
    """Samples the replicas that ``replicas()`` returns (the pool's current list, read at every tick)."""

    def __init__(
        self,
        config: UpstreamMetricsConfig,
        replicas: Callable[[], Sequence[ScrapedReplica]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._replicas = replicas
        self._clock = clock
        self._states: dict[int, _State] = {}

    async def run(self, client: httpx.AsyncClient) -> None:
        """Scrape the due replicas every ``interval_s`` (a fixed rate; a tick that ran late is not made up)
        until cancelled. A tick that raises (a bug) is logged and the next one runs: the request log's
        sampled fields go stale, the gateway keeps serving."""
        interval = self._config.interval_s
        next_at = self._clock()
        while True:
            try:
                await self.scrape_due(client)
            except Exception:
                _log.exception("upstream metrics scrape failed")
            now = self._clock()
            next_at = max(next_at + interval, now)
            await asyncio.sleep(next_at - now)

    async def scrape_due(self, client: httpx.AsyncClient) -> None:
        """One tick: scrape (and, where the kind is unknown, probe) every replica that is due, concurrently;
        returns when all are done or have timed out (each within ``timeout_s`` per request)."""
        now = self._clock()
        replicas = list(self._replicas())
        alive = {id(r) for r in replicas}
        for key in [k for k in self._states if k not in alive]:
            del self._states[key]
        due = [r for r in replicas if self._due(r, now)]
        if due:
            await asyncio.gather(*(self._scrape(r, client) for r in due))

    def _state(self, replica: ScrapedReplica) -> _State:
        """Its bookkeeping, started over when its health changed since the last look."""
        state = self._states.get(id(replica))
        if state is None or state.epoch != replica.health_epoch:
            state = self._states[id(replica)] = _State(replica, replica.health_epoch)
        return state

    def _due(self, replica: ScrapedReplica, now: float) -> bool:
        """Whether ``replica`` is scraped or probed this tick: healthy, something left to ask, and its
        interval (busy or idle) elapsed since the last attempt (half a tick of slack for timer jitter)."""
        if not replica.healthy:
            return False
        state = self._state(replica)
        if not (
            self._scrapes(replica, state, now)
            or self._reads_slots(replica, state, now)
            or self._probes(replica, state)
        ):
            return False
        if state.last_attempt_at is None:
            return True
        busy = replica.outstanding > 0 or (
            replica.last_active_at is not None and now - replica.last_active_at < BUSY_WINDOW_S
        )
        backing_off = any(e.failures >= FAILURES_TO_BACK_OFF for e in (state.metrics, state.slots))
        interval = self._config.interval_s if busy and not backing_off else self._config.idle_interval_s
        return now - state.last_attempt_at >= interval - self._config.interval_s / 2

    @staticmethod
    def _scrapes(replica: ScrapedReplica, state: _State, now: float) -> bool:
        return replica.metrics_path is not None and state.metrics.asked(now)

    @staticmethod
    def _reads_slots(replica: ScrapedReplica, state: _State, now: float) -> bool:
        return (
            replica.metrics_path is not None
            and replica.kind is UpstreamKind.LLAMACPP
            and state.slots.asked(now)
        )

    @staticmethod
    def _probes(replica: ScrapedReplica, state: _State) -> bool:
        return replica.kind_source == "default" and not state.probed

    async def _scrape(self, replica: ScrapedReplica, client: httpx.AsyncClient) -> None:
        """One tick for ``replica``: ``/metrics`` and (llama.cpp) ``/slots`` at once, their samples combined
        (module docstring) and handed to the replica; then the kind probes where still due."""
        state = self._state(replica)
        state.last_attempt_at = now = self._clock()
        path = replica.metrics_path
        reads: list[Coroutine[Any, Any, Read]] = []
        if path is not None and self._scrapes(replica, state, now):
            strong = replica.kind if replica.kind_source in ("config", "models") else None
            reads.append(
                self._read(
                    client,
                    replica,
                    path,
                    state.metrics,
                    lambda body: sample_from_metrics(body.decode("utf-8", "replace"), strong, self._clock()),
                )
            )
        if self._reads_slots(replica, state, now):
            reads.append(
                self._read(
                    client,
                    replica,
                    SLOTS_PATH,
                    state.slots,
                    lambda body: sample_from_slots(json.loads(body), self._clock()),
                )
            )
        if reads:
            self._observe(replica, await asyncio.gather(*reads))
        if self._probes(replica, state):
            state.probed = True
            await self._probe(replica, client)

    @staticmethod
    def _observe(replica: ScrapedReplica, reads: Sequence[Read]) -> None:
        """Hand ``replica`` the tick's sample: the fresh samples, the earlier read first filled by the later
        ones, and, when a read failed, by the replica's last sample (the result has the oldest part's
        ``at``). Nothing when no read gave a sample."""
        fresh = [r for r in reads if isinstance(r, EngineSample)]
        if not fresh:
            return
        sample = fresh[0]
        for other in fresh[1:]:
            sample = sample.filled(other)
        if "failed" in reads and replica.engine_sample is not None:
            sample = sample.filled(replica.engine_sample)
        replica.observe_sample(sample)

    async def _read(
        self,
        client: httpx.AsyncClient,
        replica: ScrapedReplica,
        path: str,
        endpoint: _Endpoint,
        parse: Callable[[bytes], EngineSample],
    ) -> Read:
        """``GET {url}{path}`` parsed by ``parse`` in a worker thread (ValueError, UnicodeError: a failure),
        with ``endpoint``'s bookkeeping: a 404/501 or an empty sample stop it at once,
        :data:`MALFORMED_TO_STOP` unreadable answers in a row too (each for :data:`RETRY_STOPPED_S` or until
        a health transition); transient failures are counted (the back-off of :meth:`_due`)."""
        try:
            body = await self._get(client, replica, path)
            # off the event loop: up to MAX_BODY_BYTES of text is scanned (8 MB: 0.2 s inline, which every
            # request in flight would wait for; a worker thread lets the loop run between GIL switches)
            sample = await asyncio.to_thread(parse, body)
            if sample.empty:
                raise _NoEndpoint("no series the gateway reads")
        except _NoEndpoint as exc:
            again = endpoint.stopped_at is not None  # a retry after RETRY_STOPPED_S: said once already
            endpoint.stopped_at = self._clock()
            _log.log(
                logging.DEBUG if again else logging.INFO,
                "upstream %s: nothing to sample at %s (%s); asking again after its next health change or in "
                "%gs",
                replica.label,
                path,
                exc,
                RETRY_STOPPED_S,
            )
            return None
        except (_Unavailable, httpx.HTTPError, TimeoutError) as exc:
            endpoint.failures += 1
            if endpoint.failures == FAILURES_TO_BACK_OFF:
                _log.warning(
                    "upstream %s: %d scrapes of %s failed in a row (last: %r); asking every %gs until one "
                    "succeeds",
                    replica.label,
                    endpoint.failures,
                    path,
                    exc,
                    self._config.idle_interval_s,
                )
            return "failed"
        except (ValueError, UnicodeError) as exc:
            endpoint.malformed += 1
            if endpoint.malformed >= MALFORMED_TO_STOP:
                again = endpoint.stopped_at is not None
                endpoint.stopped_at = self._clock()
                _log.log(
                    logging.DEBUG if again else logging.WARNING,
                    "upstream %s: %d answers of %s in a row could not be read (last: %r); stopped until its "
                    "next health change or for %gs",
                    replica.label,
                    endpoint.malformed,
                    path,
                    exc,
                    RETRY_STOPPED_S,
                )
            return "failed"
        endpoint.failures = endpoint.malformed = 0
        endpoint.stopped_at = None
        return sample

    async def _probe(self, replica: ScrapedReplica, client: httpx.AsyncClient) -> None:
        """Ask ``/info`` then ``/props``; the first answer that names a kind (``kind_from_info``) tells the
        replica. Failures say nothing (most servers have neither)."""
        for path in PROBES:
            try:
                data: Any = json.loads(await self._get(client, replica, path))
            except (_NoEndpoint, _Unavailable, httpx.HTTPError, TimeoutError, ValueError, UnicodeError):
                continue
            kind = kind_from_info(path, data) if isinstance(data, dict) else None
            if kind is not None:
                replica.observe_probe(kind, probe_source(path))
                return

    async def _get(self, client: httpx.AsyncClient, replica: ScrapedReplica, path: str) -> bytes:
        """The body of ``GET {url}{path}``, all of it within ``timeout_s`` (a second try on a fresh connection
        included, when a pooled one turned out closed by the upstream: an idle-timeout race that says
        nothing about the upstream, as in the health probe). Raises _NoEndpoint (404, 501), _Unavailable
        (:data:`TRANSIENT_STATUSES`), ValueError (another status, or over :data:`MAX_BODY_BYTES`),
        httpx.HTTPError, TimeoutError."""
        async with asyncio.timeout(self._config.timeout_s):
            try:
                return await self._fetch(client, replica, path)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                return await self._fetch(client, replica, path)

    @staticmethod
    async def _fetch(client: httpx.AsyncClient, replica: ScrapedReplica, path: str) -> bytes:
        headers = {**replica.auth_headers(), "accept": "text/plain, */*;q=0.5"}
        async with client.stream("GET", replica.url + path, headers=headers) as resp:
            if resp.status_code in STOP_STATUSES:
                raise _NoEndpoint(f"GET {path} answered {resp.status_code}")
            if resp.status_code in TRANSIENT_STATUSES:
                raise _Unavailable(f"GET {path} answered {resp.status_code}")
            if resp.status_code != 200:
                raise ValueError(f"GET {path} answered {resp.status_code}")
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ValueError(f"GET {path} answered more than {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
