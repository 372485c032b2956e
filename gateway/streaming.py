"""SSE relay: forwards an upstream stream event by event, as each event completes.

A pump task reads the upstream body into a small queue, so the relay can wait on it with deadlines: the
first-token timeout (until the first token event), the idle timeout (between chunks after that), the total
deadline, and the keep-alive interval (``: keep-alive`` comments to the client while the upstream is silent).
The response starts (200 + SSE headers) with the first event or the first keep-alive; until then a broken
upstream is retried on another replica. Events keep their exact bytes, except when the client did not ask
for usage (the upstream always is): the usage chunk is dropped and the ``"usage": null`` of the other chunks
removed (those chunks are re-encoded). A stream is a success only if every choice got a valid finish_reason;
otherwise the client gets ``data: {"error": …}`` and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import httpx
import msgspec

from gateway.errors import RetryableFailure, UpstreamFailed, UpstreamTimeout
from gateway.sse import (
    DONE_DATA,
    DONE_EVENT,
    KEEPALIVE,
    Action,
    SSESplitter,
    StreamState,
    event_data,
    without_usage,
)
from gateway.upstreams import Replica

if TYPE_CHECKING:
    from gateway.proxy import ProxyCall

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
DRAIN_AFTER_DONE_S = 1.0
"""After ``[DONE]``, wait at most this long for the upstream's end of body (so its connection can be reused);
the client's response has already ended."""
_EOF = object()


class StreamRelay:
    """Relays one upstream SSE response to the client of ``call``."""

    def __init__(self, call: ProxyCall, response: httpx.Response, replica: Replica, deadline: float) -> None:
        self.call, self.ctx, self.response, self.replica = call, call.ctx, response, replica
        self.deadline = deadline
        self.timeouts = call.gw.settings.timeouts
        self.state = StreamState(expected_choices=call.plan.expected_choices,
                                 keep_text=call.gw.settings.logs.log_content)
        self.splitter = SSESplitter()
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=64)
        self.last_chunk_at = call.attempt_start
        self.last_sent_at = self.ctx.start
        self.done = False
        self.forwarded = 0

    async def run(self) -> None:
        pump = asyncio.create_task(self._pump())
        try:
            await self._relay()
        finally:
            pump.cancel()
            await asyncio.wait({pump})
            self._publish()

    async def _pump(self) -> None:
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
                self.call.upstream_end = time.perf_counter()
                await self._end(item)
                return
            self.last_chunk_at = time.perf_counter()
            for raw in self.splitter.feed(item):
                if await self._on_event(raw):
                    await self._finish()
                    if self.done:
                        await self._drain()
                    return

    async def _next(self) -> bytes | object:
        """The next upstream chunk; sends keep-alives meanwhile; raises UpstreamTimeout at a deadline."""
        t = self.timeouts
        while True:
            waiting_first = self.ctx.first_token_at is None
            phase_end = (self.call.attempt_start + t.first_token_s) if waiting_first else (self.last_chunk_at + t.idle_s)
            hard = min(phase_end, self.deadline)
            wake = min(hard, self.last_sent_at + t.keepalive_s)
            try:
                async with asyncio.timeout(max(0.0, wake - time.perf_counter())):
                    return await self.queue.get()
            except TimeoutError:
                if time.perf_counter() >= hard:
                    raise self._timeout(waiting_first, phase_end <= self.deadline) from None
                await self._send(KEEPALIVE)

    async def _drain(self) -> None:
        """After ``[DONE]`` (the client already has its end): read the upstream's end of body, briefly, so
        its connection goes back to the pool instead of being closed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN_AFTER_DONE_S):
                while (item := await self.queue.get()) is not _EOF and not isinstance(item, Exception):
                    pass

    def _timeout(self, waiting_first: bool, phase: bool) -> UpstreamTimeout:
        self.call.gw.pool.report_failure(self.replica, "timeout", passive=False)
        t = self.timeouts
        if not phase:
            return UpstreamTimeout(f"request exceeded the total timeout of {t.total_s:g}s")
        if waiting_first:
            return UpstreamTimeout(f"no first token from the upstream within {t.first_token_s:g}s")
        return UpstreamTimeout(f"upstream sent nothing for {t.idle_s:g}s")

    async def _on_event(self, raw: bytes) -> bool:
        """Handle one complete event; True when the stream is over (``[DONE]`` or an error forwarded)."""
        data = event_data(raw)
        if data is None:
            await self._send(raw)
            return False
        if data == DONE_DATA:
            self.call.upstream_end = time.perf_counter()
            self._check_complete()
            await self._send(raw)
            self.done = True
            return True
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            await self._send(raw)
            return False
        action, has_token = self.state.observe(obj, self.call.plan.include_usage)
        if action is Action.ERROR:
            await self._send(raw)
            self._upstream_error(self.state.error or {})
            return True
        if action is Action.BAD_FINISH:
            raise UpstreamFailed(f"the upstream ended the stream with finish_reason "
                                 f"'{self.state.bad_finish_reason}'", code="stream_aborted")
        if action is Action.FORWARD:
            await self._send(raw)
        elif action is Action.REWRITE:
            await self._send(without_usage(obj))
        if has_token:
            now = time.perf_counter()
            if self.ctx.first_token_at is None:
                self.ctx.first_token_at = now
            self.call.last_token_at = now
        return False

    async def _send(self, data: bytes) -> None:
        if not self.call.committed:
            await self.call.start_response(200, list(SSE_HEADERS))
        await self.call.send_body(data)
        self.forwarded += 1
        self.last_sent_at = time.perf_counter()

    def _check_complete(self) -> None:
        if not self.state.complete:
            self.call.gw.pool.report_failure(self.replica, "stream_incomplete", passive=False)
            raise UpstreamFailed("the upstream stream ended without a finish_reason for every choice",
                                 code="stream_incomplete")

    def _upstream_error(self, error: dict) -> None:
        """An in-band error from the upstream, forwarded as is: the request failed."""
        self.ctx.stream_error = "upstream_error"
        self.ctx.error_type = str(error.get("code") or error.get("type") or "upstream_error")
        self.ctx.error_message = str(error.get("message", ""))
        self.call.gw.pool.report_failure(self.replica, "stream_error", passive=False)

    async def _end(self, item: object) -> None:
        """End of the upstream body (``_EOF``) or a transport error, before any ``[DONE]``."""
        broken = isinstance(item, Exception)
        replica_fault = not self.call.client_caused_failure  # a fault the client injected ejects nothing
        if not self.call.committed and self.forwarded == 0:
            self.call.gw.pool.report_failure(self.replica, "stream_broken", eject=broken and replica_fault,
                                             passive=replica_fault)
            raise RetryableFailure(UpstreamFailed(f"upstream {self.replica.label} closed the stream before any "
                                                  f"event: {item!r}" if broken else "empty stream"))
        if broken:
            self.call.gw.pool.report_failure(self.replica, "stream_broken", eject=replica_fault,
                                             passive=replica_fault)
            raise UpstreamFailed(f"the upstream connection broke mid-stream: {item!r}", code="upstream_disconnected")
        self._check_complete()  # a complete stream without [DONE]: finish it properly
        await self._send(DONE_EVENT)
        await self._finish()

    async def _finish(self) -> None:
        self._publish()  # the request's numbers are final before the client sees the end
        await self.call.send_body(b"", final=True)

    def _publish(self) -> None:
        state, ctx = self.state, self.ctx
        ctx.usage, ctx.engine = state.usage, state.engine
        ctx.response_model = state.model
        ctx.response_id = state.response_id
        ctx.finish_reasons = [state.finish_reasons[i] for i in sorted(state.finish_reasons)]
        ctx.output_events = state.token_events
        if state.keep_text:
            ctx.output_content = state.output_text()
