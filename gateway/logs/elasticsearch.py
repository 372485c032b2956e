"""The Elasticsearch log sink: memory queue → bulk shipper, with an on-disk spool for outages.

``emit`` appends to a bounded deque (no I/O, no await). One background task takes batches of
``batch_size`` (or what arrived within ``flush_interval_s``) and bulk-creates them (:mod:`es_shipper`).

Two modes:

- **direct**: the spool is empty; batches go from memory to Elasticsearch. Records the cluster does not
  take (unreachable, timeouts, 429/5xx after per-item retries) are appended to the spool, which switches
  to…
- **spooled**: new records are moved from memory to the spool every ``SPOOLED_HANDOFF_S`` (so replay
  order is arrival order, and a killed process loses only the last few dozen milliseconds of records, not a
  flush interval's worth) and the spool is replayed batch by batch, oldest first. While the cluster keeps
  failing, replay is probed with exponential backoff (``initial_backoff_s`` doubling to ``max_backoff_s``).
  When the spool is empty again the sink returns to direct mode. A spool left by a previous process is
  replayed at start.

If the memory queue is full (cluster slow), ``emit`` appends the record to the spool itself (one
buffered write; the fsync is left to the background task). Records are dropped only when the spool is
at ``max_bytes``: counted as ``dropped`` and logged at ERROR (at most every 10 s, with totals).

Every record ends in exactly one final outcome of ``kvscope_gateway_log_records_total{sink,outcome}``:
``shipped`` (indexed, incl. 409 already-indexed), ``failed`` (refused for good, kept in
``rejected.jsonl``; or a damaged spool line) or ``dropped``; ``spooled`` counts records written to disk
on the way. So ``emitted == shipped + failed + dropped + queued + spool pending``.

Call ``emit`` on the event loop thread (it is not thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from elasticsearch import ApiError, AsyncElasticsearch, TransportError

from kvscope.gateway.logs.es_client import EsConnectionConfig, make_client
from kvscope.gateway.logs.es_setup import EsIndexConfig, ensure_setup
from kvscope.gateway.logs.es_shipper import RETRY_STATUSES, ShipperConfig, ShipResult, ship_batch
from kvscope.gateway.logs.sink import LogRecord
from kvscope.gateway.logs.spool import AppendResult, Spool, SpoolBatch, SpoolConfig

logger = logging.getLogger(__name__)

OUTCOMES = ("shipped", "failed", "spooled", "dropped")
SPOOLED_HANDOFF_S = 0.05
"""In spooled mode (cluster down, or a spool being replayed), queued records are moved to the spool at
least this often: spooling has no batching benefit to wait for, and only the memory queue is lost on
SIGKILL. (At most 20 worker-thread hand-offs a second; the flush interval still paces bulks.)"""


class SinkMetrics(Protocol):
    """What the sink reports; the gateway adapts it to its Prometheus metrics (see docs/logs.md)."""

    def on_outcome(self, outcome: str, n: int) -> None:
        """``n`` records reached ``outcome`` (one of :data:`OUTCOMES`)."""

    def on_spool_bytes(self, n: int) -> None:
        """The spool now holds ``n`` unshipped bytes."""


@dataclass(frozen=True, slots=True)
class ElasticsearchSinkConfig:
    spool: SpoolConfig
    """On-disk spool (directory, cap, fsync policy)."""
    connection: EsConnectionConfig = field(default_factory=EsConnectionConfig)
    """Hosts, auth, TLS, compatibility mode."""
    index: EsIndexConfig = field(default_factory=EsIndexConfig)
    """Data stream name and the ILM/template settings."""
    shipper: ShipperConfig = field(default_factory=ShipperConfig)
    """Queue, batching, retries, backoff."""
    setup_on_start: bool = True
    """Put the ILM policy and templates before the first bulk (retried until the cluster answers)."""


@dataclass(slots=True)
class SinkStats:
    emitted: int = 0
    shipped: int = 0
    failed: int = 0
    spooled: int = 0
    dropped: int = 0
    duplicates: int = 0
    """409s, included in ``shipped``."""
    replayed: int = 0
    """Records shipped from the spool, included in ``shipped``."""


class _Throttled:
    """An ERROR log line at most every ``every_s`` seconds, carrying the count since the last one."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s, self._last, self._count = every_s, float("-inf"), 0

    def error(self, n: int, msg: str, *args: Any) -> None:
        self._count += n
        now = time.monotonic()
        if now - self._last >= self.every_s:
            logger.error(msg + " (%d records since the last report)", *args, self._count)
            self._last, self._count = now, 0


class ElasticsearchSink:
    """:class:`kvscope.gateway.logs.sink.LogSink` that ships to an Elasticsearch data stream (module
    docstring)."""

    name = "elasticsearch"

    def __init__(
        self,
        config: ElasticsearchSinkConfig,
        metrics: SinkMetrics | None = None,
        *,
        client: AsyncElasticsearch | None = None,
    ) -> None:
        self.config = config
        self.stats = SinkStats()
        self._metrics = metrics
        self._client = client
        self._owns_client = client is None
        self._buf: deque[LogRecord] = deque()
        self._wake = asyncio.Event()
        self._spool: Spool | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: list[LogRecord] = []
        self._handing_off = 0
        self._replay: tuple[SpoolBatch, list[LogRecord]] | None = None
        self._setup_ok = not config.setup_on_start
        self._closing = self._closed = False
        self._backoff = config.shipper.initial_backoff_s
        self._next_try = 0.0
        self._outage: str | None = None
        self._outage_logged = 0.0
        self._drop_log = _Throttled()

    # ---- LogSink -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the spool (replaying any left by a previous run) and start the shipper task."""
        self._spool = await asyncio.to_thread(Spool, self.config.spool)
        if self._client is None:
            self._client = make_client(self.config.connection)
        self._report_spool_bytes()
        self._task = asyncio.create_task(self._run(), name="kvscope-log-sink-elasticsearch")

    def emit(self, record: LogRecord) -> None:
        """Queue ``record``; O(1), never blocks on the network, never raises."""
        try:
            self.stats.emitted += 1
            if self._closed:
                self._count("dropped", 1)
                self._drop_log.error(1, "elasticsearch log sink is closed; dropping records")
            elif len(self._buf) < self.config.shipper.queue_size:
                self._buf.append(record)
                if len(self._buf) >= self.config.shipper.batch_size:
                    self._wake.set()
            else:
                self._overflow(record)
        except Exception:  # noqa: BLE001 - the request path must never see a logging error
            logger.exception("elasticsearch log sink: emit failed")
            self._count("failed", 1)

    async def aclose(self) -> None:
        """Ship or spool everything queued (for at most ``close_timeout_s``), then close spool and client."""
        if self._closed:
            return
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.config.shipper.close_timeout_s)
            except TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        self._closed = True
        leftover, self._inflight = self._inflight + list(self._buf), []
        self._buf.clear()
        if self._spool is None:
            self._count("dropped", len(leftover))
            if leftover:
                logger.error(
                    "elasticsearch log sink closed before it started; %d records dropped", len(leftover)
                )
        else:
            if leftover:
                self._account_append(leftover, self._spool.append(leftover))
            await asyncio.to_thread(self._spool.close)
        if self._client is not None and self._owns_client:
            await self._client.close()

    # ---- observation (tests, driver, bench) ----------------------------------------------------------
    @property
    def queued(self) -> int:
        """Records in memory: queue, the batch in flight, records being written to the spool."""
        return len(self._buf) + len(self._inflight) + self._handing_off

    @property
    def spool(self) -> Spool | None:
        return self._spool

    def _started_spool(self) -> Spool:
        """The spool :meth:`start` opened. Raises RuntimeError before the sink is started."""
        if self._spool is None:
            raise RuntimeError("the Elasticsearch sink is not started")
        return self._spool

    @property
    def _es(self) -> AsyncElasticsearch:
        assert self._client is not None, "start() creates the client"
        return self._client

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until memory and spool are empty; False on timeout. For tests and tools, not the gateway."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spool_empty = self._spool is not None and self._spool.pending_records == 0
            if not self.queued and self._replay is None and spool_empty:
                return True
            self._wake.set()
            await asyncio.sleep(0.01)
        return False

    # ---- background task ---------------------------------------------------------------------------
    async def _run(self) -> None:
        while not (self._closing and not self._buf):
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the shipper must outlive any bug or disk error
                logger.exception("elasticsearch log sink: shipper step failed; retrying")
                await asyncio.sleep(self._backoff)

    async def _step(self) -> None:
        assert self._spool is not None
        if self._spool.sync_due():
            await asyncio.to_thread(self._spool.maybe_sync)
        probe_due = time.monotonic() >= self._next_try
        if not self._setup_ok and probe_due and not self._closing:
            probe_due = await self._ensure_setup()
        if self._setup_ok and self._replay is None and self._spool.pending_bytes == 0:
            batch = await self._take_batch()
            if batch:
                await self._ship_direct(batch)
            return
        await self._spool_queue()
        if self._closing:
            return
        if probe_due and self._setup_ok:
            await self._replay_batch()
        else:
            await self._sleep(min(self._next_try - time.monotonic(), SPOOLED_HANDOFF_S))

    async def _take_batch(self) -> list[LogRecord]:
        size = self.config.shipper.batch_size
        if len(self._buf) < size and not self._closing:
            await self._sleep(self.config.shipper.flush_interval_s)
        return [self._buf.popleft() for _ in range(min(size, len(self._buf)))]

    async def _sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds`` (capped at the flush interval); a full batch or close wakes it early."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), min(seconds, self.config.shipper.flush_interval_s))
        except TimeoutError:
            pass

    async def _ensure_setup(self) -> bool:
        if self._setup_ok:
            return True
        try:
            await ensure_setup(self._es, self.config.index)
        except ApiError as exc:
            if exc.status_code in RETRY_STATUSES:
                return self._failed_attempt(f"setup: {exc.status_code} {exc.message}")
            logger.error(
                "elasticsearch setup refused (%s %s); shipping anyway. Run `kvscope logs setup-es` "
                "with a key that may manage ILM and index templates.",
                exc.status_code,
                exc.message,
            )
        except (TransportError, OSError) as exc:
            return self._failed_attempt(f"setup: {exc}")
        self._setup_ok = True
        return True

    async def _ship_direct(self, batch: list[LogRecord]) -> None:
        self._inflight = batch
        try:
            result = await ship_batch(self._es, self.config.index.data_stream, batch, self.config.shipper)
        finally:
            self._inflight = []
        await self._settle(result, replayed=False)
        if result.retry:
            await self._spool_records(result.retry)
            self._failed_attempt(result.error or "records kept after retries")

    async def _replay_batch(self) -> None:
        assert self._spool is not None
        if self._replay is None:
            batch = await asyncio.to_thread(self._spool.read_batch, self.config.shipper.batch_size)
            if batch.corrupt:
                self._count("failed", batch.corrupt)
            self._replay = (batch, batch.records)
        batch, records = self._replay
        result = await ship_batch(self._es, self.config.index.data_stream, records, self.config.shipper)
        await self._settle(result, replayed=True)
        if result.retry:
            self._replay = (batch, result.retry)
            self._failed_attempt(result.error or "records kept after retries")
            return
        self._replay = None
        await asyncio.to_thread(self._spool.ack, batch)
        self._report_spool_bytes()
        self._recovered()

    async def _settle(self, result: ShipResult, *, replayed: bool) -> None:
        self._count("shipped", result.shipped)
        self.stats.duplicates += result.duplicates
        self.stats.replayed += result.shipped if replayed else 0
        if result.rejected:
            records, reasons = zip(*result.rejected, strict=True)
            await asyncio.to_thread(self._started_spool().reject, records, reasons)
            self._count("failed", len(records))
            logger.error(
                "elasticsearch refused %d log records for good (first: %s); kept in %s",
                len(records),
                reasons[0],
                self.config.spool.directory,
            )
        if result.shipped and not result.retry and not replayed:
            self._recovered()

    # ---- spool -------------------------------------------------------------------------------------
    async def _spool_queue(self) -> None:
        records = list(self._buf)
        self._buf.clear()
        if records:
            await self._spool_records(records)

    async def _spool_records(self, records: list[LogRecord]) -> None:
        self._handing_off += len(records)
        try:
            result = await asyncio.to_thread(self._started_spool().append, records)
        except OSError as exc:
            self._count("dropped", len(records))
            self._drop_log.error(len(records), "log spool write failed (%s); dropping records", exc)
            return
        finally:
            self._handing_off -= len(records)
        self._account_append(records, result)

    def _overflow(self, record: LogRecord) -> None:
        if self._spool is None:
            self._count("dropped", 1)
            self._drop_log.error(1, "log queue full before the sink started; dropping records")
            return
        self._account_append([record], self._spool.append([record], sync=False))

    def _account_append(self, records: list[LogRecord], result: AppendResult) -> None:
        self._count("spooled", result.appended)
        self._count("failed", result.invalid)
        if result.dropped:
            self._count("dropped", result.dropped)
            self._drop_log.error(
                result.dropped,
                "log spool full (%d bytes cap at %s); dropping records",
                self.config.spool.max_bytes,
                self.config.spool.directory,
            )
        self._report_spool_bytes()

    # ---- outage bookkeeping ------------------------------------------------------------------------
    def _failed_attempt(self, reason: str) -> bool:
        now = time.monotonic()
        if self._outage is None or now - self._outage_logged >= 60.0:
            pending = self._spool.pending_records if self._spool else 0
            logger.warning(
                "elasticsearch unavailable (%s); %d log records spooled to %s",
                reason,
                pending,
                self.config.spool.directory,
            )
            self._outage_logged = now
        self._outage = reason
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.config.shipper.max_backoff_s)
        return False

    def _recovered(self) -> None:
        self._backoff = self.config.shipper.initial_backoff_s
        self._next_try = 0.0
        if self._outage is not None:
            pending = self._spool.pending_records if self._spool else 0
            logger.warning(
                "elasticsearch is back (was: %s); %d spooled records left to replay", self._outage, pending
            )
            self._outage = None

    def _count(self, outcome: str, n: int) -> None:
        if n <= 0:
            return
        setattr(self.stats, outcome, getattr(self.stats, outcome) + n)
        if self._metrics is not None:
            self._metrics.on_outcome(outcome, n)

    def _report_spool_bytes(self) -> None:
        if self._metrics is not None and self._spool is not None:
            self._metrics.on_spool_bytes(self._spool.pending_bytes)
