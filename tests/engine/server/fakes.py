"""A scripted stand-in for AsyncEngine (same surface, no model) so server tests run in milliseconds.

Byte-level tokenizer: token id = one UTF-8 byte (0 is EOS), so a multi-byte character spans several tokens and
the incremental text must hold partial characters back, as the real detokenizer does. The reply of every
request is ``FakeEngine.reply`` (bytes), followed by EOS unless ``ignore_eos``; timing is scripted by
``queue_s`` (before scheduling), ``prefill_s`` (before the first token) and ``token_s`` (between tokens).
"""

from __future__ import annotations

import asyncio
import codecs
import time
from dataclasses import dataclass, field

from kvscope.engine.async_engine import GrammarLimitError, RequestFailedError
from kvscope.engine.config import SpeculativeConfig
from kvscope.engine.core.admission import AdmissionConfig, Refusal
from kvscope.engine.core.request import Request, RequestStatus
from kvscope.engine.core.stats import SchedulerStats
from kvscope.engine.engine_core import StepResult
from kvscope.engine.errors import AdmissionRefusedError, EngineDeadError
from kvscope.engine.input_processor import EngineRequest, InputProcessor
from kvscope.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.structured.backend import StructuredOutputManager
from kvscope.engine.structured.batch import ERROR_PREFIX

EOS = 0


def _no_tokenizer_json() -> str:
    raise RuntimeError("the fake engine has no tokenizer JSON (a test compiling grammars sets .structured)")


class FakeTokenizer:
    vocab_size = 256
    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if not (skip_special_tokens and i == EOS)).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = ""
        for m in messages:
            content = m["content"]
            if isinstance(content, list):
                content = "\n".join(part["text"] for part in content)
            text += f"<{m['role']}>{content}\n"
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@dataclass(frozen=True, slots=True)
class FakeInfo:
    name: str = "fake-model"
    model_dir: str = "/models/fake"
    max_model_len: int = 128
    kv_cache_bytes: int = 1000
    weights_bytes: int = 2000
    dtype: str = "bfloat16"
    quantization: str = "gguf"
    format_reason: str = "fake: fastest verified format"
    cpu_kernels: str = "kvscope (fused decode up to 2 rows)"
    row_kernels: tuple[tuple[str, int, int], ...] = (("gemv", 1, 2), ("dense_bfloat16", 3, 1 << 62))
    rss_bytes: int = 5000
    peak_rss_bytes: int = 6000
    num_blocks: int = 7
    block_size: int = 16


class FakeScheduler:
    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def get_stats(self) -> SchedulerStats:
        running = sum(r.status == RequestStatus.RUNNING for r in self.requests.values())
        used = len(self.requests)
        return SchedulerStats(
            num_running=running,
            num_waiting=used - running,
            kv_cache_usage=used / 10,
            num_used_blocks=used,
            num_cached_blocks=0,
            num_free_blocks=10 - used,
            num_preemptions_total=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
        )


class FakeCore:
    def __init__(self, info: FakeInfo) -> None:
        self.scheduler = FakeScheduler()
        self.input_processor = InputProcessor(info.max_model_len, FakeTokenizer.vocab_size)


@dataclass
class FakeEngine:
    reply: bytes = b"Hello world"
    queue_s: float = 0.0
    prefill_s: float = 0.0
    token_s: float = 0.0
    info: FakeInfo = field(default_factory=FakeInfo)
    aborted: list[tuple[str, str]] = field(default_factory=list)
    """(request id, reason) of every abort, in order."""
    started: list[str] = field(default_factory=list)
    spec_drafts: tuple[tuple[int, int], ...] = ()
    """(proposed, accepted) of the speculative drafts each choice verifies (RequestStats.on_spec_verify)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding settings the server reads (EngineClient.speculative)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """Admission's objectives the server reads (EngineClient.admission)."""
    refusal: Refusal | None = None
    """With admission on: refuse every request with this (AdmissionRefusedError), else queue it."""
    dropped: Refusal | None = None
    """Queue every request, then after ``queue_s`` drop it from the queue with this refusal (admission's
    late 503: AdmissionRefusedError from the stream)."""
    queued_requests: list[EngineRequest] = field(default_factory=list)
    """Every EngineRequest generate() was given, in order (its tier, priority and deadline)."""
    """(proposed, accepted) of the speculative drafts each choice verifies (RequestStats.on_spec_verify)."""

    gpu_share: float | None = None
    """What ``gpu_memory_utilization()`` answers (EngineClient.gpu_memory_utilization)."""

    def __post_init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.core = FakeCore(self.info)
        self.device = "cpu"
        self.structured = StructuredOutputManager(_no_tokenizer_json, FakeTokenizer.vocab_size, EOS)
        """EngineClient.structured: the grammar compiler (no grammar compiles without a tokenizer JSON)."""
        self.is_running = False
        self.listener = None
        self._failures: dict[str, str] = {}

    def gpu_memory_utilization(self) -> float | None:
        return self.gpu_share

    def warm_up_prefill(self) -> int:
        return 0

    def start(self) -> None:
        self.is_running = True

    def stop(self, timeout: float = 10.0) -> None:
        self.is_running = False

    def set_step_listener(self, listener) -> None:
        self.listener = listener

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.aborted.append((request_id, reason))
        self._failures[request_id] = reason

    def get_request(self, request_id: str) -> Request | None:
        return self.core.scheduler.get_request(request_id)

    def unfinished_requests(self) -> list[Request]:
        return list(self.core.scheduler.requests.values())

    def scheduler_stats(self) -> SchedulerStats:
        return self.core.scheduler.get_stats()

    def process_inputs(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineRequest:
        return self.core.input_processor.process(prompt_token_ids, params)

    async def generate(
        self,
        request_id: str,
        request: EngineRequest,
        arrival_time: float | None = None,
        trace_context: object | None = None,
        queued: asyncio.Future | None = None,
    ):
        if not self.is_running:
            raise EngineDeadError("fake engine stopped")
        self.queued_requests.append(request)
        if self.refusal is not None:  # as AsyncEngine: the refusal reaches both the future and the stream
            if queued is not None:
                queued.set_exception(AdmissionRefusedError(self.refusal))
            raise AdmissionRefusedError(self.refusal)
        if queued is not None:
            queued.set_result(None)
        prompt_token_ids, params = request.prompt_token_ids, request.params
        self.started.append(request_id)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        children = [
            Request(
                cid,
                list(prompt_token_ids),
                params,
                EOS,
                arrival_time=arrival,
                max_tokens=params.max_tokens or 64,
                trace_context=trace_context,
            )
            for cid in ids
        ]
        finished = False
        try:
            async for output in self._run(request_id, children):
                finished = output.finished
                yield output
        finally:
            for child in children:
                self.core.scheduler.requests.pop(child.request_id, None)
            if not finished:
                self.aborted.append((request_id, "abort"))
            self._notify()

    async def _run(self, request_id: str, children: list[Request]):
        for child in children:
            self.core.scheduler.requests[child.request_id] = child
        await self._sleep(self.queue_s, request_id)
        if self.dropped is not None:
            raise AdmissionRefusedError(self.dropped)
        now = time.monotonic()
        for child in children:
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = len(child.prompt_token_ids)
            child.stats.on_scheduled(now, batch_size=len(children), num_blocks=1)
            for proposed, accepted in self.spec_drafts:
                child.stats.on_spec_verify(proposed, accepted)
        await self._sleep(self.prefill_s, request_id)
        script = list(self.reply)
        decoders = [codecs.getincrementaldecoder("utf-8")("ignore") for _ in children]
        step = 0
        while True:
            if step:
                await self._sleep(self.token_s, request_id)
            else:
                await self._sleep(0, request_id)
            outputs = [
                self._advance(c, i, script, decoders[i]) for i, c in enumerate(children) if not c.is_finished
            ]
            step += 1
            done = all(c.is_finished for c in children)
            yield RequestOutput(request_id, children[0].prompt_token_ids, outputs, finished=done)
            self._notify()
            if done:
                return

    def _advance(self, child: Request, index: int, script: list[int], decoder) -> CompletionOutput:
        params = child.sampling_params
        position = child.num_output_tokens
        token = script[position] if position < len(script) else (EOS if not params.ignore_eos else ord("."))
        now = time.monotonic()
        child.append_output_token_ids([token])
        child.stats.on_token(now)
        text = "" if token == EOS else decoder.decode(bytes([token]))
        out = CompletionOutput(
            index=index, text=text, token_ids=[token], num_output_tokens=child.num_output_tokens
        )
        if params.logprobs is not None:
            top = [(token, -0.5)] + [((token + j) % 256, -1.0 - j) for j in range(1, params.logprobs)]
            out.logprobs = [TokenLogprob(token, -0.5, 1, top[: params.logprobs])]
        reason = (
            "stop" if token == EOS else ("length" if child.num_output_tokens >= child.max_tokens else None)
        )
        if reason is not None:
            child.status = (
                RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
            )
            out.text += decoder.decode(b"", final=True)
            out.finish_reason = reason
            out.stats = child.stats.summary(child.num_output_tokens)
        return out

    async def _sleep(self, seconds: float, request_id: str) -> None:
        await asyncio.sleep(seconds)  # always yield to the loop, as waiting on the engine thread does
        reason = self._failures.pop(request_id, None)
        if reason is not None and reason != "abort":  # the grammar's reasons map as AsyncEngine maps them
            raise (GrammarLimitError if reason.startswith(ERROR_PREFIX) else RequestFailedError)(
                request_id, reason
            )

    def _notify(self) -> None:
        if self.listener is not None:
            stats = self.core.scheduler.get_stats()
            self.listener(
                StepResult(
                    num_running=stats.num_running,
                    num_waiting=stats.num_waiting,
                    kv_cache_usage=stats.kv_cache_usage,
                    batch_size=stats.num_running,
                    num_scheduled_tokens=stats.num_running,
                )
            )
