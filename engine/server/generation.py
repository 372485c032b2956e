"""Drive the engine requests of one HTTP request (one per prompt) and merge their delta outputs.

Each prompt's ``AsyncEngine.generate`` stream is pumped by its own task into one queue, so the reader can wait
with a timeout (SSE keep-alive) or race the client's ``http.disconnect`` without cancelling the engine stream.
:meth:`GenerationRun.close` cancels the pumps; cancelling a pump closes its ``generate`` generator, which
aborts the engine request (before the next engine step) and frees its KV blocks, in any phase.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any, Final, Literal, overload

from litestar.types import Receive

from kvscope.engine.core.request import Request, child_request_id
from kvscope.engine.core.stats import KvscopeStats
from kvscope.engine.errors import AdmissionRefusedError
from kvscope.engine.input_processor import EngineRequest
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.server.engine_client import EngineClient


class Signal(enum.Enum):
    """What :meth:`GenerationRun.next` returns instead of an output."""

    KEEPALIVE = "keepalive"
    DONE = "done"


KEEPALIVE: Final = Signal.KEEPALIVE
"""Returned by :meth:`GenerationRun.next` when nothing arrived within the timeout."""
DONE: Final = Signal.DONE
"""Returned by :meth:`GenerationRun.next` once every prompt's stream ended."""
FAULT_REASON = "injected fault"


def prompt_request_id(request_id: str, k: int, num_prompts: int) -> str:
    """The engine request id of prompt ``k`` of an HTTP request with ``num_prompts`` prompts: the response id
    itself for one prompt, else ``{request_id}-p{k}`` (each prompt's choices are its children)."""
    return request_id if num_prompts == 1 else f"{request_id}-p{k}"


class ClientDisconnected(Exception):
    """The client closed the connection (ASGI ``http.disconnect``)."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI ``receive`` channel reports ``http.disconnect`` (body already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class GenerationRun:
    """The engine side of one HTTP request: one validated engine request per prompt, sharing
    SamplingParams."""

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        requests: list[EngineRequest],
        arrival_time: float,
        trace_context: object | None = None,
        fault_after_tokens: int | None = None,
        wait_queued: bool = False,
    ) -> None:
        """``wait_queued``: ask the engine to confirm each prompt's queueing (:meth:`queued`; admission is
        on)."""
        self.engine = engine
        self.request_id = request_id
        self.requests = requests
        self.params = requests[0].params
        self.engine_ids = [prompt_request_id(request_id, k, len(requests)) for k in range(len(requests))]
        self._arrival = arrival_time
        self._trace_context = trace_context
        self._fault_after = fault_after_tokens
        self._fault_sent = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._open = len(requests)
        self.num_tokens = 0
        """Output tokens received so far (all choices)."""
        self._wait_queued = wait_queued
        self._queued: list[asyncio.Future[float | None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for k, (engine_id, request) in enumerate(zip(self.engine_ids, self.requests, strict=True)):
            if self._wait_queued:
                self._queued.append(loop.create_future())
                stream = self.engine.generate(
                    engine_id,
                    request,
                    arrival_time=self._arrival,
                    trace_context=self._trace_context,
                    queued=self._queued[-1],
                )
            else:
                stream = self.engine.generate(
                    engine_id, request, arrival_time=self._arrival, trace_context=self._trace_context
                )
            self._tasks.append(asyncio.ensure_future(self._pump(k, stream)))
        # After the pumps' first step (which queues the engine request), so an immediate fault finds it.
        asyncio.get_running_loop().call_soon(self._maybe_inject_fault)

    async def _pump(self, k: int, stream: Any) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((k, output))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which answers the client
            self._queue.put_nowait((k, exc))
            return
        self._queue.put_nowait((k, None))

    async def queued(self) -> None:
        """Return once the engine queued every prompt (no-op unless built with ``wait_queued``). Raises
        AdmissionRefusedError when admission refused one; any other failure to queue is left to
        :meth:`next`, which raises it."""
        if not self._queued:
            return
        outcomes = await asyncio.gather(*self._queued, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, AdmissionRefusedError):
                raise outcome

    @overload
    async def next(
        self, timeout: None = None, disconnect: asyncio.Future | None = None
    ) -> tuple[int, RequestOutput] | Literal[Signal.DONE]: ...

    @overload
    async def next(
        self, timeout: float, disconnect: asyncio.Future | None = None
    ) -> tuple[int, RequestOutput] | Signal: ...

    async def next(
        self, timeout: float | None = None, disconnect: asyncio.Future | None = None
    ) -> tuple[int, RequestOutput] | Signal:
        """The next ``(prompt index, delta RequestOutput)``, KEEPALIVE after ``timeout`` seconds without
        one (never without a timeout), or DONE. Raises the engine's exception for a failed request
        (RequestFailedError, EngineDeadError …) and ClientDisconnected when ``disconnect`` completes first."""
        while self._open or not self._queue.empty():
            item = await self._get(timeout, disconnect)
            if item is KEEPALIVE:
                return item
            k, payload = item
            if payload is None:
                self._open -= 1
                continue
            if isinstance(payload, BaseException):
                self._open -= 1
                raise payload
            self.num_tokens += sum(len(c.token_ids) for c in payload.outputs)
            self._maybe_inject_fault()
            return k, payload
        return DONE

    async def _get(self, timeout: float | None, disconnect: asyncio.Future | None) -> Any:
        if not self._queue.empty():
            return self._queue.get_nowait()
        getter = asyncio.ensure_future(self._queue.get())
        waiters = {getter} if disconnect is None else {getter, disconnect}
        try:
            done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this coroutine is cancelled (client gone): never leave the getter pending
            if not getter.done():
                getter.cancel()  # safe: asyncio.Queue.get leaves the item queued when cancelled
        if getter in done:
            return getter.result()
        if disconnect is not None and disconnect in done:
            raise ClientDisconnected()
        return KEEPALIVE

    def _maybe_inject_fault(self) -> None:
        if self._fault_after is not None and not self._fault_sent and self.num_tokens >= self._fault_after:
            self._fault_sent = True
            for engine_id in self.engine_ids:
                self.engine.abort(engine_id, reason=FAULT_REASON)

    def phase(self) -> str:
        """Where the request is now: ``decode`` (tokens arrived), ``prefill`` (scheduled, computing its
        prompt) or ``queued`` (waiting, never scheduled or preempted back to the queue)."""
        if self.num_tokens:
            return "decode"
        if any(request.num_computed_tokens > 0 for request in self.engine_requests().values()):
            return "prefill"
        return "queued"

    def snapshots(self) -> dict[int, KvscopeStats]:
        """Choice index → the engine's live stats (the ``kvscope`` object, docs/engine-server.md) of
        choices still in the engine."""
        return {
            index: request.stats.summary(request.num_output_tokens)
            for index, request in self.engine_requests().items()
        }

    def engine_requests(self) -> dict[int, Request]:
        """Choice index → the engine's live Request (read-only snapshot taken from the event loop)."""
        n = self.params.n
        found = {}
        for k, engine_id in enumerate(self.engine_ids):
            for i in range(n):
                request = self.engine.get_request(child_request_id(engine_id, i, n))
                if request is not None:
                    found[k * n + i] = request
        return found

    def close(self) -> None:
        """Cancel the pumps (aborting unfinished engine requests). Synchronous: safe in ``finally`` blocks
        of a cancelled task."""
        for task in self._tasks:
            if not task.done():
                task.cancel()
