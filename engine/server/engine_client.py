"""``EngineClient``: everything the server asks of the engine (vLLM's ``EngineClient``,
vllm/engine/protocol.py).

:class:`kvscope.engine.async_engine.AsyncEngine` satisfies it; the server tests' scripted FakeEngine does too.
The server holds the engine only through this protocol, never through ``AsyncEngine``'s internals.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from kvscope.engine.config import SpeculativeConfig
from kvscope.engine.core.admission import AdmissionConfig
from kvscope.engine.core.request import Request
from kvscope.engine.core.stats import SchedulerStats
from kvscope.engine.engine_core import ModelInfo, StepResult
from kvscope.engine.input_processor import EngineRequest
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.structured.backend import StructuredOutputManager
from kvscope.engine.text.tokenizer import Tokenizer


class EngineClient(Protocol):
    """The engine surface of the server: lifecycle, requests, and read-only views of its state."""

    info: ModelInfo
    """The loaded model (name, context length, KV cache and weight bytes)."""
    tokenizer: Tokenizer
    device: str
    """Where the model runs (``cpu``, ``cuda:0`` …)."""
    structured: StructuredOutputManager
    """Structured-output grammar compiler and cache (the server compiles a request's constraint with it)."""
    admission: AdmissionConfig
    """TTFT objectives per tier; while any is set the server waits for each request's queueing (``queued``
    of :meth:`generate`) before it answers."""
    speculative: SpeculativeConfig | None
    """Speculative decoding settings, None when off (k sizes the ``kvscope_engine_spec_decode_*`` series)."""

    @property
    def is_running(self) -> bool:
        """True while the step loop runs and no shutdown began."""
        ...

    def gpu_memory_utilization(self) -> float | None:
        """The share of GPU memory the engine may use (``--gpu-memory-utilization``: the GPU telemetry's
        budget series); None where the engine does not say."""
        ...

    def warm_up_prefill(self) -> int:
        """Build the prefill kernels' shapes before serving (call before :meth:`start`); returns the matmuls
        run (0 where there is nothing to warm)."""
        ...

    def start(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None:
        """Fail every in-flight request ("engine shutting down") and stop the step loop."""
        ...

    def set_step_listener(self, listener: Callable[[StepResult], None] | None) -> None:
        """``listener`` hears every step (on the engine thread)."""
        ...

    def process_inputs(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineRequest:
        """The request's one validation; raises InvalidParameterError / PromptTooLongError."""
        ...

    def generate(
        self,
        request_id: str,
        request: EngineRequest,
        arrival_time: float | None = None,
        trace_context: object | None = None,
        queued: asyncio.Future[float | None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of a validated request until the finished one; closing it early aborts the
        request. ``queued`` is resolved once the engine queued it (its predicted TTFT, or None) or set to
        the exception that refused it (AdmissionRefusedError)."""
        ...

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort in any phase; ``reason`` other than ``abort`` fails the request (RequestFailedError)."""
        ...

    def get_request(self, request_id: str) -> Request | None:
        """The live Request of an unfinished (child) request id (read-only), else None."""
        ...

    def unfinished_requests(self) -> list[Request]:
        """Every unfinished Request (read-only)."""
        ...

    def scheduler_stats(self) -> SchedulerStats: ...
