"""AsyncEngine: the EngineCore step loop in its own thread, with per-request asyncio output streams.

The server's event loop never runs model code: requests and aborts go to the engine thread through a queue,
outputs come back with ``loop.call_soon_threadsafe``, one call per step for all of its outputs. A failing step
fails the requests it touched (error outputs) and the loop keeps serving: no input may leave the engine dead.

All of the engine's torch work runs on that one thread: building the EngineCore (weights, the kernel probe),
the prefill warm-up and every step. Why: GNU OpenMP (torch's CPU runtime) keeps a worker pool per thread that
ever ran a parallel region, and once the process holds more OpenMP threads than CPUs, every worker stops
spinning between parallel regions (libgomp's throttled spin count, ``GOMP_SPINCOUNT`` docs) and each op then
pays a futex wake-up (docs/benchmarks.md "CPU threads"; docs/architecture.md "Engine threads (CPU)").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.request import Request
from kvscope.engine.core.stats import SchedulerStats
from kvscope.engine.engine_core import DEADLINE_REASON, EngineCore, StepResult
from kvscope.engine.errors import AdmissionRefusedError, EngineDeadError
from kvscope.engine.input_processor import EngineRequest
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.structured.batch import ERROR_PREFIX

logger = logging.getLogger(__name__)

StepListener = Callable[[StepResult], None]
_T = TypeVar("_T")


class RequestFailedError(RuntimeError):
    """The engine failed a request after it started (step error, shutdown, injected fault)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class GrammarLimitError(RequestFailedError):
    """The request's grammar matcher hit one of llguidance's limits while generating (a row above
    ``max_items_in_row``, too many items): the client's constraint is beyond what the matcher serves, not an
    engine fault (the server answers a 400 naming the constraint's field). ``detail`` is llguidance's error in
    one line."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(request_id, reason)
        self.detail = reason.removeprefix(ERROR_PREFIX)


class DeadlineExceededError(RequestFailedError):
    """The request's deadline passed while it waited for its first admission: the engine dropped it before
    any prefill (engine/core/scheduler.py ``expire_waiting``)."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Thread-backed engine (the server's ``EngineClient``, engine/server/engine_client.py).
    ``process_inputs`` validates a request, ``generate`` yields its delta RequestOutputs; cancelling it
    aborts the request."""

    def __init__(self, config: EngineConfig, step_listener: StepListener | None = None) -> None:
        """Start the engine thread and build the EngineCore on it; returns once the model is loaded. Raises
        what ``EngineCore(config)`` raises (the thread then exits). Requests are served after
        :meth:`start`."""
        self._listener = step_listener
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._serving = False
        built: concurrent.futures.Future[EngineCore] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._main, args=(config, built), name="kvscope-engine", daemon=True
        )
        self._thread.start()
        self.core = built.result()
        self.info = self.core.info
        self.tokenizer = self.core.tokenizer
        self.device = str(self.core.device)
        self.structured = self.core.structured
        """Grammar compile cache (engine/structured): the server compiles constraints with it off its loop."""
        self.admission = config.admission
        """TTFT objectives per tier (engine/core/admission.py); the server waits for each request's queueing
        while any is set."""
        self.speculative = config.speculative
        """Speculative decoding settings (None: off); the server sizes its spec-decode metrics from them."""

    def start(self) -> None:
        """Start serving: from now on the engine thread steps whenever requests are unfinished."""
        self._serving = True
        self._wake.set()

    def gpu_memory_utilization(self) -> float | None:
        """``--gpu-memory-utilization`` (the server's GPU telemetry reads it on CUDA)."""
        return self.core.config.cache.gpu_memory_utilization

    def warm_up_prefill(self) -> int:
        """``EngineCore.warm_up_prefill``, run on the engine thread (the caller blocks until it is done;
        call it before :meth:`start`, from any thread but the engine's)."""
        return self._call(EngineCore.warm_up_prefill)

    def _call(self, fn: Callable[[EngineCore], _T]) -> _T:
        """Run ``fn(core)`` on the engine thread between steps and return its result (or raise its error)."""
        if not self._thread.is_alive() or self._stopping:
            raise EngineDeadError("the engine thread is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, done))
        self._wake.set()
        return done.result()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail every in-flight request ("shutdown") and stop the step loop."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._serving and not self._stopping

    def set_step_listener(self, listener: StepListener | None) -> None:
        self._listener = listener

    def process_inputs(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineRequest:
        """The request's one validation (engine/input_processor.py), on the caller's thread: raises
        InvalidParameterError / PromptTooLongError before anything is queued."""
        return self.core.input_processor.process(prompt_token_ids, params)

    async def generate(
        self,
        request_id: str,
        request: EngineRequest,
        arrival_time: float | None = None,
        trace_context: object | None = None,
        queued: asyncio.Future[float | None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request (from :meth:`process_inputs`) and yield its delta outputs until the last one
        (``finished``).

        Raises EngineDeadError when the loop is not running, RequestFailedError when the engine fails the
        request later (DeadlineExceededError: dropped from the queue by its deadline), AdmissionRefusedError
        when admission refused it (at once, or later when it dropped it from the queue overdue). Closing the
        generator early (client disconnect) aborts the request and frees its KV blocks. ``queued`` (a future
        of the caller's loop) is resolved once the engine thread took the request: with its predicted time to
        first token (None: no prediction yet), or with the exception that kept it out
        (AdmissionRefusedError); the server waits on it before it commits a stream's 200.
        """
        if not self.is_running:
            raise EngineDeadError("the engine step loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._inbox.put(("add", request_id, request, arrival, trace_context, queued))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort in any phase (queued, prefill, decode); takes effect before the next step. Thread-safe."""
        self._inbox.put(("abort", request_id, reason))
        self._wake.set()

    def get_request(self, request_id: str) -> Request | None:
        """The engine's live Request of an unfinished (child) request id, else None. Read it, never change it:
        the engine thread owns it (a snapshot for the server's phase and stats of unfinished requests)."""
        return self.core.scheduler.get_request(request_id)

    def unfinished_requests(self) -> list[Request]:
        """The scheduler's unfinished requests (read-only, as :meth:`get_request`)."""
        return list(self.core.scheduler.requests.values())

    def scheduler_stats(self) -> SchedulerStats:
        """A scheduler snapshot (running, waiting, KV blocks, counters)."""
        return self.core.scheduler.get_stats()

    # --- engine thread --------------------------------------------------------------------------------------

    def _main(self, config: EngineConfig, built: concurrent.futures.Future) -> None:
        try:
            core = EngineCore(config)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's caller
            built.set_exception(exc)
            return
        self.core = core
        built.set_result(core)
        self._run()

    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self._serving or not self.core.has_unfinished_requests():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                # the listener also hears right after scheduling, so gauges show a long prefill as running
                result = self.core.step(self._notify if self._listener is not None else None)
            except Exception as exc:  # noqa: BLE001 - a bad step must not kill the loop
                logger.exception("engine step failed; failing in-flight requests")
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            self._deliver_step(result.outputs)
            for output in result.failed:  # a grammar matcher error: the S3 path (an error, never a stop)
                refusal = result.refused.get(output.request_id)
                if refusal is not None:  # admission dropped it from the queue: its 503
                    self._deliver(output.request_id, AdmissionRefusedError(refusal))
                    continue
                reason = str(output.outputs[0].finish_reason)
                error = (
                    GrammarLimitError
                    if reason.startswith(ERROR_PREFIX)
                    else DeadlineExceededError
                    if reason == DEADLINE_REASON
                    else RequestFailedError
                )
                self._deliver(output.request_id, error(output.request_id, reason))
            if self._listener is not None:
                self._notify(result)
        self._fail_all("engine shutting down")
        while True:  # calls queued behind the stop get an error instead of a wait forever
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "call":
                command[2].set_exception(EngineDeadError("the engine thread stopped"))

    def _notify(self, result: StepResult) -> None:
        try:
            self._listener(result)
        except Exception:  # noqa: BLE001 - metrics must never stop the engine
            logger.exception("step listener failed")

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "call":
                _, fn, done = command
                try:
                    done.set_result(fn(self.core))
                except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                    done.set_exception(exc)
            else:
                self._abort(command[1], command[2])

    def _add(
        self,
        request_id: str,
        request: EngineRequest,
        arrival: float,
        trace_context: object | None,
        queued: asyncio.Future[float | None] | None,
    ) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:  # the client left before the engine saw the request
            return
        try:
            children = self.core.add_engine_request(request_id, request, arrival, trace_context)
        except Exception as exc:  # noqa: BLE001 - validation already ran; anything here is a failure
            if queued is not None:
                stream.loop.call_soon_threadsafe(_settle, queued, exc)
            self._deliver(request_id, exc)
            return
        if queued is not None:
            stream.loop.call_soon_threadsafe(_settle, queued, children[0].stats.predicted_ttft_s)

    def _abort(self, request_id: str, reason: str) -> None:
        outputs = self.core.abort_request(request_id, reason)
        if reason == "abort":
            for output in outputs:
                self._deliver(request_id, output)
        else:
            self._deliver(request_id, RequestFailedError(request_id, reason))
        if self._listener is not None and outputs:
            stats = self.scheduler_stats()
            self._notify(
                StepResult(
                    outputs=outputs,
                    stats=stats,
                    num_running=stats.num_running,
                    num_waiting=stats.num_waiting,
                    kv_cache_usage=stats.kv_cache_usage,
                )
            )

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            request_ids = set(self._streams)
        for request_id in request_ids | set(self.core.request_ids()):
            self._abort(request_id, reason)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs in one ``call_soon_threadsafe`` per event loop, not one per request: each call
        writes the loop's self-pipe (a syscall on this thread, inside the step loop: 32 of them a step at 32
        requests). Per stream the order is kept."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _settle(future: asyncio.Future[float | None], outcome: float | BaseException | None) -> None:
    """Resolve ``queued`` (on its loop) unless its waiter gave up."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream_queue, item in items:
        stream_queue.put_nowait(item)
