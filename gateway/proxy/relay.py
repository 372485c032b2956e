"""Reading one upstream answer into the client's response, and what it amounted to.

:class:`StreamRelay` forwards an upstream SSE stream event by event, as each event completes. A pump task
reads the upstream body into a small queue, so the relay can wait on it with deadlines: the first-token
timeout (until the first token event), the idle timeout (between chunks after that), the total deadline, and
the keep-alive interval (``: keep-alive`` comments to the client while the upstream is silent). The response
starts (200 + SSE headers) with the first event or the first keep-alive; until then a broken upstream is
retried on another replica. Events keep their exact bytes, except when the client did not ask for usage (the
upstream always is): the usage chunk is dropped and the ``"usage": null`` of the other chunks removed (those
chunks are re-encoded). A stream is a success only if every choice got a valid finish_reason; otherwise the
client gets ``data: {"error": …}`` and no ``[DONE]``.

The relay never ends the client's response and never writes the request context: :meth:`StreamRelay.run`
returns a :class:`RelayOutcome` (usage, finish reasons, token times, the failure if any) that the call
(gateway/proxy/call.py) applies first, so the request's numbers are final before the client sees the end.
:func:`completion_outcome` is the same for a JSON answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import msgspec

from kvscope.gateway.errors import GatewayError, RetryableFailure, UpstreamFailed, UpstreamTimeout
from kvscope.gateway.proxy.chunk_queue import ChunkQueue
from kvscope.gateway.proxy.client import ClientResponse
from kvscope.gateway.proxy.network import AsyncioStream
from kvscope.gateway.proxy.upstreams import Replica, UpstreamPool
from kvscope.gateway.settings import TimeoutConfig
from kvscope.gateway.sse import (
    DONE_DATA,
    DONE_EVENT,
    KEEPALIVE,
    Action,
    SSESplitter,
    StreamState,
    event_data,
    without_usage,
)

SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
DRAIN_BEFORE_END_S = 0.05
"""After ``[DONE]``, wait at most this long for the upstream's end of body before ending the client's
response, so the connection is back in the pool before the client's next request (else the pool may open a
second one)."""
DRAIN_AFTER_DONE_S = 1.0
"""Then, the client's response ended, wait at most this long more for it (so the connection can still be
reused)."""


class _Marker(enum.Enum):
    """Queue items that are not upstream chunks: the upstream's end of body, a re-armed wait."""

    EOF = "eof"
    REARM = "rearm"


_EOF: Final = _Marker.EOF
_REARM: Final = _Marker.REARM
_DONE, _ERROR, _BAD_FINISH = "done", "error", "bad_finish"


@dataclass(slots=True)  # not frozen: one per token, and a frozen dataclass's __init__ costs 3x
class _Decision:
    """What one event amounts to (:meth:`StreamRelay._decide`)."""

    end: str | None
    """``_DONE``, ``_ERROR`` or ``_BAD_FINISH`` when the event ends the stream; None otherwise."""
    send: bytes | None
    """The bytes to forward (None: nothing, e.g. the usage chunk the client did not ask for)."""
    token: bool
    """The event carried a token."""


@dataclass(frozen=True, slots=True)
class _Handover:
    """Events the tap's callback left to the relay task: one already decided (or None) and the rest raw."""

    decision: _Decision | None
    rest: list[bytes]
    bug: Exception | None = None


@dataclass(frozen=True, slots=True)
class RelayOutcome:
    """What one upstream answer amounted to; times are ``time.perf_counter()`` seconds."""

    usage: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    """The upstream's ``kvscope`` stats object, when it sent one."""
    timings: dict[str, Any] | None = None
    """llama.cpp's ``timings`` object, when it sent one (gateway/engines/reports.py)."""
    response_model: Any = None
    response_id: str | None = None
    finish_reasons: tuple[Any, ...] = ()
    """One per finished choice, in choice order."""
    token_events: int = 0
    """Stream events that carried a token (the output token count when the upstream sent no usage)."""
    output_content: list[Any] | None = None
    """Each choice's text, only when the content is logged."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    """When each token event was sent to the client (perf_counter seconds), in order: the gaps after the
    first are ``gen_ai.client.operation.time_per_output_chunk`` (one append per token: nothing heavier per
    chunk)."""
    upstream_end: float | None = None
    """When the upstream's answer ended (``[DONE]``, end of body or a broken connection); None: it did not."""
    upstream_error: dict[str, Any] | None = None
    """An in-band error event the upstream sent (forwarded to the client as is): the request failed."""
    failure: GatewayError | RetryableFailure | None = None
    """Why the relay stopped short (a timeout, a broken or incomplete stream); raised by the call."""
    drain: bool = False
    """``[DONE]`` was relayed: read the upstream's end of body (:meth:`StreamRelay.drain`) after the
    client's."""


@dataclass(frozen=True, slots=True)
class StreamTerms:
    """What one stream relay must hold to: the plan's expectations and the attempt's clock."""

    timeouts: TimeoutConfig
    deadline: float
    """The request's total deadline (perf_counter seconds)."""
    attempt_start: float
    request_start: float
    first_token_at: float | None
    """A token already sent by an earlier attempt (None: waiting for the first)."""
    expected_choices: int
    include_usage: bool
    keep_text: bool
    client_fault: bool
    """The client asked the upstream to fail (``x-kvscope-fault``): its failures eject no replica."""


def completion_outcome(body: bytes, keep_text: bool) -> RelayOutcome | None:
    """The outcome of a JSON completion ``body``; None when it is not a JSON object."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    choices = [c for c in obj.get("choices") or [] if isinstance(c, dict)]
    return RelayOutcome(
        usage=obj.get("usage") if isinstance(obj.get("usage"), dict) else None,
        engine=obj.get("kvscope") if isinstance(obj.get("kvscope"), dict) else None,
        timings=obj.get("timings") if isinstance(obj.get("timings"), dict) else None,
        response_model=obj.get("model"),
        response_id=obj.get("id") if isinstance(obj.get("id"), str) else None,
        finish_reasons=tuple(c.get("finish_reason") for c in choices if c.get("finish_reason")),
        output_content=[(c.get("message") or {}).get("content") or c.get("text") for c in choices]
        if keep_text
        else None,
    )


class StreamRelay:
    """Relays one upstream SSE response to ``client``; reports replica failures to ``pool``."""

    def __init__(
        self,
        client: ClientResponse,
        response: httpx.Response,
        replica: Replica,
        pool: UpstreamPool,
        terms: StreamTerms,
    ) -> None:
        self.client, self.response, self.replica, self.pool, self.terms = (
            client,
            response,
            replica,
            pool,
            terms,
        )
        self.state = StreamState(expected_choices=terms.expected_choices, keep_text=terms.keep_text)
        self.splitter = SSESplitter()
        self.queue: ChunkQueue[bytes | _Marker | Exception | _Handover] = ChunkQueue(maxsize=64)
        self.last_chunk_at = terms.attempt_start
        self.last_sent_at = terms.request_start
        self.first_token_at = terms.first_token_at
        self.last_token_at: float | None = None
        self.token_times: list[float] = []
        self.upstream_end: float | None = None
        self.upstream_error: dict[str, Any] | None = None
        self.done = False
        self.forwarded = 0
        self._pump: asyncio.Task | None = None
        self._tap: AsyncioStream | None = None
        self._parked = False
        """The relay task waits in :meth:`_next` (the tap's callback may relay events itself)."""

    async def run(self) -> RelayOutcome:
        """Relay events until the stream is over; returns the outcome (its ``failure`` set when it failed).
        The client's response is left open: the caller ends it."""
        stream = self.response.extensions.get("network_stream")
        chunked = self.response.headers.get("transfer-encoding", "").strip().lower() == "chunked"
        if isinstance(stream, AsyncioStream) and chunked and stream.tap_body(self._offer):
            self._tap = stream  # the body's chunks come straight from the connection (network.tap_body)
            self.queue.on_room = stream.tap_room
        else:
            self._pump = asyncio.create_task(self._read_upstream())
        try:
            await self._relay()
        except (GatewayError, RetryableFailure) as exc:
            return self.outcome(exc)
        return self.outcome()

    def outcome(self, failure: GatewayError | RetryableFailure | None = None) -> RelayOutcome:
        """What was relayed so far (also after a cancellation: the client left mid-stream)."""
        state = self.state
        return RelayOutcome(
            usage=state.usage,
            engine=state.engine,
            timings=state.timings,
            response_model=state.model,
            response_id=state.response_id,
            finish_reasons=tuple(state.finish_reasons[i] for i in sorted(state.finish_reasons)),
            token_events=state.token_events,
            output_content=state.output_text() if state.keep_text else None,
            first_token_at=self.first_token_at,
            last_token_at=self.last_token_at,
            token_times=self.token_times,
            upstream_end=self.upstream_end,
            upstream_error=self.upstream_error,
            failure=failure,
            drain=self.done and failure is None,
        )

    async def drain(self, within_s: float) -> bool:
        """After ``[DONE]``: read the upstream's end of body for at most ``within_s`` seconds, so its
        connection goes back to the pool instead of being closed. True when the drain is over (the body
        ended, or broke: nothing more to wait for); False when ``within_s`` passed first: a later call
        waits on."""
        until = time.perf_counter() + within_s
        try:
            while (item := await self.queue.get(until - time.perf_counter())) is not _EOF and not isinstance(
                item, Exception
            ):
                pass
        except TimeoutError:
            return False
        if item is _EOF and self._tap is not None:  # httpcore reads the end the tap left it (buffered)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_AFTER_DONE_S):
                    async for _ in self.response.aiter_raw():
                        pass
        return True

    async def aclose(self) -> None:
        """Stop reading the upstream."""
        if self._tap is not None:
            self._tap.untap()
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.wait({self._pump})

    async def _read_upstream(self) -> None:
        try:
            async for chunk in self.response.aiter_raw():
                await self.queue.put(chunk)
            await self.queue.put(_EOF)
        except httpx.HTTPError as exc:
            await self.queue.put(exc)

    async def _relay(self) -> None:
        while True:
            item = await self._next()
            if item is _EOF or isinstance(item, Exception):
                self.upstream_end = time.perf_counter()
                await self._end(item)
                return
            if item is _REARM:
                continue
            if isinstance(item, _Handover):
                if item.bug is not None:
                    raise item.bug
                if item.decision is not None and await self._act(item.decision):
                    return
                for raw in item.rest:
                    if await self._on_event(raw):
                        return
                continue
            self.last_chunk_at = time.perf_counter()
            for raw in self.splitter.feed(item):
                if await self._on_event(raw):
                    return

    def _deadlines(self) -> tuple[float, float, bool, bool]:
        """(hard deadline, next keep-alive, waiting for the first token, the phase's own timeout comes
        first), from the stream's state now."""
        t = self.terms.timeouts
        waiting_first = self.first_token_at is None
        phase_end = (
            (self.terms.attempt_start + t.first_token_s) if waiting_first else (self.last_chunk_at + t.idle_s)
        )
        return (
            min(phase_end, self.terms.deadline),
            self.last_sent_at + t.keepalive_s,
            waiting_first,
            phase_end <= self.terms.deadline,
        )

    async def _next(self) -> bytes | _Marker | Exception | _Handover:
        """The next upstream chunk; sends keep-alives meanwhile; raises UpstreamTimeout at a deadline. While
        it waits here the tap's callback may relay events itself (:meth:`_offer`), moving the deadlines: a
        timer that fires is checked against them anew (one timer per quiet spell, not one per chunk)."""
        while True:
            hard, keepalive, _, _ = self._deadlines()
            self._parked = True
            try:  # a chunk already read is taken at once, whatever the deadlines
                return await self.queue.get(min(hard, keepalive) - time.perf_counter())
            except TimeoutError:
                pass
            finally:
                self._parked = False
            hard, keepalive, waiting_first, phase = self._deadlines()
            now = time.perf_counter()
            if now >= hard:
                raise self._timeout(waiting_first, phase) from None
            if now >= keepalive:
                await self._send(KEEPALIVE)

    def _timeout(self, waiting_first: bool, phase: bool) -> UpstreamTimeout:
        self.pool.report_failure(self.replica, "timeout", passive=False)
        t = self.terms.timeouts
        if not phase:
            return UpstreamTimeout(f"request exceeded the total timeout of {t.total_s:g}s")
        if waiting_first:
            return UpstreamTimeout(f"no first token from the upstream within {t.first_token_s:g}s")
        return UpstreamTimeout(f"upstream sent nothing for {t.idle_s:g}s")

    def _decide(self, raw: bytes) -> _Decision:
        """What one complete event amounts to; updates the stream's state (once per event)."""
        data = event_data(raw)
        if data is None:
            return _Decision(None, raw, False)
        if data == DONE_DATA:
            return _Decision(_DONE, raw, False)
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return _Decision(None, raw, False)
        action, has_token = self.state.observe(obj, self.terms.include_usage)
        if action is Action.ERROR:
            return _Decision(_ERROR, raw, has_token)
        if action is Action.BAD_FINISH:
            return _Decision(_BAD_FINISH, None, has_token)
        if action is Action.FORWARD:
            return _Decision(None, raw, has_token)
        if action is Action.REWRITE:
            return _Decision(None, without_usage(obj), has_token)
        return _Decision(None, None, has_token)  # DROP

    async def _act(self, decision: _Decision) -> bool:
        """Carry out a decision; True when the stream is over (``[DONE]`` or an error forwarded)."""
        if decision.end is _DONE:
            self.upstream_end = time.perf_counter()
            self._check_complete()
            if decision.send is not None:  # always: [DONE] is forwarded as it came
                await self._send(decision.send)
            self.done = True
            return True
        if decision.end is _ERROR:
            if decision.send is not None:  # always: the error event is forwarded as it came
                await self._send(decision.send)
            self.upstream_error = self.state.error or {}
            self.pool.report_failure(self.replica, "stream_error", passive=False)
            return True
        if decision.end is _BAD_FINISH:
            raise UpstreamFailed(
                f"the upstream ended the stream with finish_reason '{self.state.bad_finish_reason}'",
                code="stream_aborted",
            )
        if decision.send is not None:
            await self._send(decision.send)
        if decision.token:
            self._token_sent()
        return False

    async def _on_event(self, raw: bytes) -> bool:
        """Handle one complete event; True when the stream is over (``[DONE]`` or an error forwarded)."""
        return await self._act(self._decide(raw))

    def _token_sent(self) -> None:
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.token_times.append(now)

    def _offer(self, item: bytes | Exception | None) -> bool:
        """The tap's delivery (gateway/proxy/network.py): a chunk of the body, its end (None) or its error.
        While the relay task waits for the next chunk with nothing queued and the response has started, a
        chunk's events are relayed right here, in the connection's callback, through the server's direct body
        writer: no task switch and no timer per token. The first event that needs more (the end, an error,
        the client not reading) goes to the task with the rest, decided once."""
        if (
            self._parked
            and type(item) is bytes
            and not len(self.queue)
            and self.client.committed
            and self.client.direct
        ):
            try:
                return self._relay_now(item)
            except Exception as bug:  # noqa: BLE001 - never in the connection's callback: the task raises it
                return self.queue.offer(_Handover(None, [], bug))
        return self.queue.offer(_EOF if item is None else item)

    def _relay_now(self, chunk: bytes) -> bool:
        self.last_chunk_at = time.perf_counter()
        waiting_first = self.first_token_at is None
        events = self.splitter.feed(chunk)
        for i, raw in enumerate(events):
            decision = self._decide(raw)
            if decision.end is None and (decision.send is None or self.client.write_now(decision.send)):
                if decision.send is not None:
                    self.forwarded += 1
                    self.last_sent_at = time.perf_counter()
                if decision.token:
                    self._token_sent()
                continue
            return self.queue.offer(_Handover(decision, events[i + 1 :]))
        if waiting_first and self.first_token_at is not None:
            # the first token moves the deadline from first_token_s to idle_s, maybe earlier than the waiting
            # task's timer: it takes its deadlines anew (every other deadline only ever moves later)
            return self.queue.offer(_REARM)
        return True

    async def _send(self, data: bytes) -> None:
        if not self.client.committed:
            await self.client.start(200, list(SSE_HEADERS))
        await self.client.body(data)
        self.forwarded += 1
        self.last_sent_at = time.perf_counter()

    def _check_complete(self) -> None:
        if not self.state.complete:
            self.pool.report_failure(self.replica, "stream_incomplete", passive=False)
            raise UpstreamFailed(
                "the upstream stream ended without a finish_reason for every choice", code="stream_incomplete"
            )

    async def _end(self, item: object) -> None:
        """End of the upstream body (``_EOF``) or a transport error, before any ``[DONE]``."""
        broken = isinstance(item, Exception)
        replica_fault = not self.terms.client_fault  # a fault the client injected ejects nothing
        if not self.client.committed and self.forwarded == 0:
            self.pool.report_failure(
                self.replica, "stream_broken", eject=broken and replica_fault, passive=replica_fault
            )
            raise RetryableFailure(
                UpstreamFailed(
                    f"upstream {self.replica.label} closed the stream before any event: {item!r}"
                    if broken
                    else "empty stream"
                )
            )
        if broken:
            self.pool.report_failure(
                self.replica, "stream_broken", eject=replica_fault, passive=replica_fault
            )
            raise UpstreamFailed(
                f"the upstream connection broke mid-stream: {item!r}", code="upstream_disconnected"
            )
        self._check_complete()  # a complete stream without [DONE]: finish it properly
        await self._send(DONE_EVENT)
