"""EngineCore: one engine step = schedule → execute → update → outputs (the nano-vllm three lines).

Single-threaded: the AsyncEngine runs it in its own thread; the offline LLM calls it directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvscope.common.models.registry import default_served_name
from kvscope.engine.attention.selector import get_attention_backend
from kvscope.engine.config import EngineConfig
from kvscope.engine.core.admission import Refusal
from kvscope.engine.core.block_pool import BlockPool
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.request import Request, RequestStatus, child_request_id
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvscope.engine.core.stats import SchedulerStats
from kvscope.engine.errors import AdmissionRefusedError
from kvscope.engine.input_processor import EngineRequest, InputProcessor
from kvscope.engine.memory import process_memory_bytes, with_kv_budget
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.platform.compact import model_weight_bytes
from kvscope.engine.platform.cpu import configure_threads, prepare_for_cpu, warm_up_prefill
from kvscope.engine.platform.fused_decode import engine_fused_decoder
from kvscope.engine.platform.kernel_probe import NO_DENSE, describe_row_kernels
from kvscope.engine.platform.loader import load_model
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.spec_decode.drafter import NgramDrafter
from kvscope.engine.spec_decode.stats import SpecDecodingStats
from kvscope.engine.structured.backend import StructuredOutputManager
from kvscope.engine.text.output_processor import OutputProcessor
from kvscope.engine.text.tokenizer import Tokenizer
from kvscope.engine.worker.kv_cache import KVCacheSpec, budget_num_blocks
from kvscope.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
DEADLINE_REASON = "deadline exceeded before the first admission"
"""The failure reason of a request dropped from the queue by its deadline (StepResult.failed)."""
OVERDUE_REASON = "dropped from the queue: its first token could no longer come within its tier's objective"
"""The failure reason of a request admission dropped from the queue (StepResult.failed; its Refusal is in
StepResult.refused)."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server reports about the loaded model."""

    name: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    kv_cache_bytes: int
    weights_bytes: int
    load_seconds: float
    dtype: str = "float32"
    """Weights/activations dtype as loaded (``--dtype auto`` resolved)."""
    quantization: str = "none"
    """``--quantization`` as loaded (``auto`` resolved)."""
    format_reason: str = ""
    """Why this format (kvscope.engine.platform.format_choice)."""
    cpu_kernels: str = ""
    """The CPU kernels of the compact weights: ``kvscope (fused decode up to N rows)``
    (kernels/cpu_decode.py), ``torch`` (and why not kvscope's), or empty off CPU / for dense formats."""
    row_kernels: tuple[tuple[str, int, int], ...] = ()
    """Which kernel serves which row counts of a decode step on CPU: ``(kernel, first, last)`` (last
    ``NO_DENSE``: and above): ``KernelChoice.row_kernels`` where kvscope's CPU kernels run the weights,
    ``dense_<dtype>`` from row 1 for dense weights; () off CPU and for torch's own compact kernels."""
    rss_bytes: int = 0
    """Process resident set size once the engine is built (weights + KV cache + runtime)."""
    peak_rss_bytes: int = 0
    """Peak resident set size so far (the load may peak above the steady state)."""


@dataclass(slots=True)
class StepResult:
    """Outputs of one step plus what the metrics layer needs (the gauges of docs/metrics.md)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None
    """The scheduler's snapshot after the step (None only in hand-built notifications); listeners read it
    instead of taking another one."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    batch_size: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    duration_s: float = 0.0
    scheduled_only: bool = False
    """Sent right after scheduling, before the model runs (gauges only): a long prefill step would
    otherwise leave the running/waiting gauges at the previous step's values for its whole duration."""
    spec_decoding: SpecDecodingStats | None = None
    """The step's verified drafts (speculative decoding); None in steps without drafts."""
    failed: list[RequestOutput] = field(default_factory=list)
    """Final outputs of the requests this step failed (a grammar matcher error; a deadline that passed
    while the request waited for its first admission: reason :data:`DEADLINE_REASON`; admission dropped it
    from the queue: :data:`OVERDUE_REASON`), already finished (FINISHED_ERROR, blocks freed): each choice's
    ``finish_reason`` is the reason. AsyncEngine answers them as RequestFailedError (an error, never a
    ``stop``), or AdmissionRefusedError for those in :attr:`refused`; they are not in ``outputs``."""
    refused: dict[str, Refusal] = field(default_factory=dict)
    """Request id → the refusal of each request admission dropped from the queue this step (its output is
    in :attr:`failed`)."""


def resolve_device(name: str) -> torch.device:
    """The torch device of ``--device`` (``cpu``, ``cuda`` or ``cuda:N``). Raises ValueError for another
    name, or for a CUDA device this torch build or machine does not have (torch would fail later with an
    AssertionError or a CUDA error at the first allocation)."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {name!r}") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device {name!r}: torch {torch.__version__} sees no CUDA device on this machine "
                "(use --device cpu)"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"device {name!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    return device


class EngineCore:
    """Loads the model, sizes the KV cache, and runs steps. See docs/architecture.md."""

    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        self.device = resolve_device(config.device)
        configure_threads(self.device, config.num_threads)
        self.model, hf_config, model_dir, self.load_report = load_model(config.model, self.device)
        """The loaded model and what its load did (LoadReport: format, CPU kernels, timings)."""
        if self.device.type == "cpu":
            prepare_for_cpu(self.model)  # packed/column-major weights (models/layers.py CpuLinearKernel)
        dtype = self.load_report.dtype  # --dtype auto resolved by the loader
        self.tokenizer = Tokenizer.from_dir(model_dir)
        block_size = config.cache.block_size
        kv_spec = KVCacheSpec.from_hf_config(hf_config, block_size, dtype)
        per_block = kv_spec.bytes_per_block
        backend = get_attention_backend(config.attention_backend, self.device)
        self.vocab_size = hf_config["vocab_size"]
        weights = model_weight_bytes(self.model)  # after packing: compact and packed copies
        cache = with_kv_budget(config.cache, weights) if self.device.type == "cpu" else config.cache
        num_blocks = config.cache.num_blocks or budget_num_blocks(cache, self.device, per_block)
        self.max_model_len = self._max_model_len(hf_config, num_blocks * block_size)
        self.structured = StructuredOutputManager(
            self.tokenizer.hf.to_str, self.vocab_size, self.tokenizer.eos_token_id
        )
        """Grammar compile cache for structured outputs (engine/structured); the runner's matchers use it."""
        self.runner = ModelRunner(
            self.model,
            backend,
            kv_spec,
            num_blocks,
            self.vocab_size,
            self.device,
            structured=self.structured,
            fused=engine_fused_decoder(self.model) if self.device.type == "cpu" else None,
        )
        self.kv_cache_manager = KVCacheManager(
            BlockPool(num_blocks, config.cache.enable_prefix_caching),
            block_size,
            config.cache.enable_prefix_caching,
        )
        self.drafter = NgramDrafter(config.speculative) if config.speculative is not None else None
        """Speculative decoding's draft source (engine/spec_decode); None when it is off."""
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.kv_cache_manager,
            self.max_model_len,
            drafter=self.drafter,
            ttft_objectives=config.admission.ttft_slo_s,
        )
        self.admission = config.admission
        """TTFT objectives per tier (engine/core/admission.py); empty: every request is queued."""
        self.input_processor = InputProcessor(self.max_model_len, self.vocab_size, self.structured.wait_for)
        self.output_processor = OutputProcessor(self.tokenizer)
        fmt = self.load_report.weight_format
        rss, peak_rss = process_memory_bytes()
        self.info = ModelInfo(
            name=config.model.served_model_name or default_served_name(config.model.model),
            model_dir=str(model_dir),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_cache_bytes=num_blocks * per_block,
            weights_bytes=weights,
            load_seconds=time.perf_counter() - start,
            dtype=str(dtype).removeprefix("torch."),
            quantization=fmt.quantization if fmt else "none",
            format_reason=fmt.reason if fmt else "",
            cpu_kernels=self._cpu_kernels_line(),
            row_kernels=self._row_kernels(
                str(dtype).removeprefix("torch."), fmt.quantization if fmt else "none"
            ),
            rss_bytes=rss,
            peak_rss_bytes=peak_rss,
        )
        logger.info("%s", format_line(self.info))
        logger.info("%s", ready_line(self.info))

    def _row_kernels(self, dtype: str, quantization: str) -> tuple[tuple[str, int, int], ...]:
        """Which kernel serves which rows of a decode step on CPU (ModelInfo.row_kernels): the probe's spans
        up to the fused step's limit where kvscope's kernels run the weights, ``dense_<dtype>`` at every row
        for dense weights; () off CPU and for torch's own compact kernels."""
        fused, choice = self.runner.fused, self.load_report.kernels
        if fused is not None and choice is not None:
            return tuple(choice.row_kernels(fused.max_rows))
        if self.device.type == "cpu" and quantization == "none":
            return ((f"dense_{dtype}", 1, NO_DENSE),)
        return ()

    def _cpu_kernels_line(self) -> str:
        fused, built = self.runner.fused, self.load_report.cpu_kernels
        if fused is not None:
            choice = self.load_report.kernels
            spans = choice.row_kernels(fused.max_rows) if choice is not None else []
            rows = f"; decode rows: {describe_row_kernels(spans)}" if spans else ""
            return f"kvscope (fused decode up to {fused.max_rows} rows{rows})"
        if built is not None and not built.ok:
            return f"torch ({built.detail})"
        quantization = self.load_report.quantization
        return "torch" if quantization is not None and quantization.quantization != "none" else ""

    def _max_model_len(self, hf_config: dict, capacity_tokens: int) -> int:
        model_len = hf_config.get("max_position_embeddings") or capacity_tokens
        asked = self.config.model.max_model_len
        if asked is not None and asked > model_len:
            raise ValueError(f"max_model_len {asked} exceeds the model's max_position_embeddings {model_len}")
        limit = asked or model_len
        if limit > capacity_tokens:
            if asked is not None:
                raise ValueError(
                    f"max_model_len {asked} needs more KV cache than the budget holds "
                    f"({capacity_tokens} tokens); raise --kv-cache-memory or lower max_model_len"
                )
            logger.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity_tokens, limit)
            limit = capacity_tokens
        return limit

    def warm_up_prefill(self) -> int:
        """Build the prefill matmuls' oneDNN primitives for every padded size up to the token budget now,
        not in the first prefill of each prompt length (kvscope.engine.platform.cpu.warm_up_prefill). Call
        before the step loop starts. Returns the matmuls run (0 off the CPU)."""
        if self.device.type != "cpu":
            return 0
        start = time.perf_counter()
        calls = warm_up_prefill(self.model, self.config.scheduler.max_num_batched_tokens)
        logger.info("prefill shapes warmed: %d matmuls in %.2f s", calls, time.perf_counter() - start)
        return calls

    # --- requests -------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        trace_context: object | None = None,
    ) -> list[Request]:
        """Validate (:class:`~kvscope.engine.input_processor.InputProcessor`) and queue a request (``n``
        children for ``params.n > 1``). Raises InvalidParameterError / PromptTooLongError before any work
        is done."""
        return self.add_engine_request(
            request_id, self.input_processor.process(prompt_token_ids, params), arrival_time, trace_context
        )

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The resolved max_tokens of a request, or the errors of :meth:`add_request`; queues nothing (the
        same
        :class:`~kvscope.engine.input_processor.InputProcessor` check)."""
        return self.input_processor.process(prompt_token_ids, params).max_tokens

    def add_engine_request(
        self,
        request_id: str,
        request: EngineRequest,
        arrival_time: float | None = None,
        trace_context: object | None = None,
    ) -> list[Request]:
        """Queue a validated request: ``n`` sibling Requests for ``n > 1`` (vLLM v1 parallel sampling), with
        the time to first token the scheduler predicts for the first (``stats.predicted_ttft_s``, shared by
        its siblings). Raises ValueError for an id already in flight and AdmissionRefusedError, before
        anything is queued, when admission is on and the prediction exceeds the tier's objective."""
        params = request.params
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        sampling = (
            None if request.sampling is None else request.sampling.to(self.device)
        )  # once, for every child
        for index in range(params.n):
            child_params = params if params.n == 1 else _child_params(params, index)
            child_id = child_request_id(request_id, index, params.n)
            children.append(
                Request(
                    child_id,
                    list(request.prompt_token_ids),
                    child_params,
                    self.tokenizer.eos_token_id,
                    arrival_time=arrival,
                    max_tokens=request.max_tokens,
                    trace_context=trace_context,
                    parent_id=request_id if params.n > 1 else None,
                    prepared_sampling=sampling,
                    fairness_group=request.fairness_group,
                    fairness_tenant=request.fairness_tenant,
                    service_tier=request.service_tier,
                    priority=request.priority,
                    deadline=request.deadline,
                )
            )
            children[-1].stats.structured_compile_s = request.structured_compile_s
        prediction = self.scheduler.predict_ttft(children[0])
        ratio = None
        if self.admission.enabled:
            ratio = self.scheduler.ttft_calibration.ratio(
                children[0].schedule_class[0], self.admission.quantile, now=self.scheduler.clock()
            )
        refusal = self.admission.decide(
            request.service_tier, prediction.seconds, prediction.requests_ahead, ratio, prediction.running
        )
        if refusal is not None:
            raise AdmissionRefusedError(refusal)
        self.output_processor.add_request(request_id, children)
        for child in children:
            self.scheduler.add_request(child, prediction)
        return children

    def abort_request(self, request_id: str, reason: str = "abort") -> list[RequestOutput]:
        """Abort a request (all its children) in any state; frees its blocks. Unknown ids are ignored."""
        child_ids = self.output_processor.child_ids(request_id)
        status = RequestStatus.FINISHED_ABORTED if reason == "abort" else RequestStatus.FINISHED_ERROR
        for child_id in child_ids:
            self.scheduler.finish_request(child_id, status)
        return self.output_processor.abort(child_ids, reason)

    def request_ids(self) -> list[str]:
        """Ids of the (parent) requests the engine still tracks."""
        return self.output_processor.request_ids()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the step -------------------------------------------------------------------------------------------

    def step(self, on_scheduled: Callable[[StepResult], None] | None = None) -> StepResult:
        """schedule → execute → update → detokenize → finish stop-string matches → outputs. Data flows one
        way: the scheduler and output processor never call each other. Returns the outputs that changed.
        ``on_scheduled`` gets the scheduler's state (running, waiting, KV usage; ``scheduled_only``) once
        the step is scheduled and before the model runs."""
        start = time.perf_counter()
        expired = self._expire_waiting()
        overdue, refused = self._shed_overdue()
        expired += overdue
        if not self.scheduler.has_unfinished_requests():
            stats = self.scheduler.get_stats()
            return StepResult(failed=expired, refused=refused, stats=stats, num_waiting=stats.num_waiting)
        scheduler_output = self.scheduler.schedule()
        if on_scheduled is not None:
            now = self.scheduler.get_stats()
            on_scheduled(
                StepResult(
                    stats=now,
                    num_running=now.num_running,
                    num_waiting=now.num_waiting,
                    kv_cache_usage=now.kv_cache_usage,
                    scheduled_only=True,
                )
            )
        clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
        run_start = clock()
        runner_output = self.runner.execute(scheduler_output)
        self._record_step_cost(scheduler_output, clock() - run_start)
        _record_structured_time(scheduler_output, runner_output)
        failed = self._grammar_failures(runner_output)
        self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        _trim_logprobs(runner_output)
        detokenized = self.output_processor.detokenize(runner_output)
        for request_id in detokenized.stopped_request_ids:
            self.scheduler.finish_request(
                request_id, RequestStatus.FINISHED_STOPPED, detokenized.num_output_tokens.get(request_id)
            )
        outputs = self.output_processor.make_outputs(detokenized)
        failed_outputs = expired + [
            output
            for request_id, reason in failed.items()
            for output in self.abort_request(request_id, reason)
        ]
        stats = self.scheduler.get_stats()
        return StepResult(
            spec_decoding=SpecDecodingStats.from_drafts(
                [
                    (len(item.spec_token_ids), runner_output.num_accepted_tokens.get(item.request_id, 0))
                    for item in scheduler_output.scheduled
                    if item.spec_token_ids
                ]
            ),
            outputs=outputs,
            failed=failed_outputs,
            refused=refused,
            stats=stats,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            batch_size=len(scheduler_output.scheduled),
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            num_prefill_tokens=scheduler_output.num_prefill_tokens,
            num_decode_tokens=scheduler_output.num_decode_tokens,
            num_preemptions=len(scheduler_output.preempted_req_ids),
            duration_s=time.perf_counter() - start,
        )

    def _expire_waiting(self) -> list[RequestOutput]:
        """Fail (reason :data:`DEADLINE_REASON`) the requests whose deadline passed before their first
        admission (Scheduler.expire_waiting), with every sibling of theirs: no prefill is spent on them."""
        parents = {request.parent_id or request.request_id for request in self.scheduler.expire_waiting()}
        return [
            output for parent in sorted(parents) for output in self.abort_request(parent, DEADLINE_REASON)
        ]

    def _shed_overdue(self) -> tuple[list[RequestOutput], dict[str, Refusal]]:
        """Fail (reason :data:`OVERDUE_REASON`) the requests admission drops from the queue
        (Scheduler.shed_overdue), with every sibling of theirs, and build each one's Refusal: its wait and
        earliest first token against its tier's objective, and a Retry-After from the (calibrated)
        prediction of the same request arriving now."""
        dropped = self.scheduler.shed_overdue()
        outputs: list[RequestOutput] = []
        refused: dict[str, Refusal] = {}
        for overdue in dropped:
            request = overdue.request
            parent = request.parent_id or request.request_id
            if parent in refused:
                continue
            outputs += self.abort_request(parent, OVERDUE_REASON)
            tier = request.service_tier
            fresh = self.scheduler.predict_ttft(request).seconds
            basis = None
            if fresh is not None:
                basis = max(fresh - overdue.waited_s, 0.0)
                ratio = self.scheduler.ttft_calibration.ratio(
                    request.schedule_class[0], self.admission.quantile, now=self.scheduler.clock()
                )
                basis *= 1.0 if ratio is None else ratio
            refused[parent] = Refusal(
                tier,
                overdue.predicted_ttft_s,
                self.admission.ttft_slo_s[tier],
                overdue.requests_ahead,
                waited_s=overdue.waited_s,
                retry_basis_s=basis,
            )
        return outputs, refused

    def _grammar_failures(self, runner_output: ModelRunnerOutput) -> dict[str, str]:
        """(Parent) request id → reason of the requests whose grammar matcher failed in this step
        (MatcherTable.take_errors); their tokens of this step are dropped, so the EOS the error mask forced
        never ends them as ``stop``."""
        matchers = self.runner.matchers
        errors = matchers.take_errors() if matchers is not None else {}
        failed: dict[str, str] = {}
        for child_id, reason in errors.items():
            runner_output.sampled_token_ids.pop(child_id, None)
            runner_output.logprobs.pop(child_id, None)
            runner_output.num_accepted_tokens.pop(child_id, None)
            request = self.scheduler.get_request(child_id)
            if request is not None:
                failed.setdefault(request.parent_id or child_id, reason)
        return failed

    def _record_step_cost(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """Feed a decode-only step's seconds to the drafter's cost model (engine/spec_decode/adaptive.py):
        this thread's CPU seconds (``time.thread_time``, blind to other processes taking the core) with one
        torch thread, wall seconds with more (the OpenMP workers' CPU time is not this thread's)."""
        if self.drafter is None or not scheduler_output.scheduled or scheduler_output.num_prefill_tokens:
            return
        num_draft = sum(len(item.spec_token_ids) for item in scheduler_output.scheduled)
        self.drafter.record_step(len(scheduler_output.scheduled), num_draft, seconds)


def _trim_logprobs(runner_output: ModelRunnerOutput) -> None:
    """Drop the logprob entries of tokens the scheduler dropped after a stop (one entry per kept token)."""
    for request_id, entries in runner_output.logprobs.items():
        kept = len(runner_output.sampled_token_ids.get(request_id, ()))
        if len(entries) > kept:
            del entries[kept:]


def _record_structured_time(scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
    """Add the step's grammar-mask seconds to each constrained request's stats, before the scheduler may
    finish it (its ``kvscope`` object is taken at its finish)."""
    if not runner_output.structured_mask_s:
        return
    for item in scheduler_output.scheduled:
        mask_s = runner_output.structured_mask_s.get(item.request.request_id)
        if mask_s is not None:
            item.request.stats.add_structured_time(mask_s, runner_output.structured_wait_s)


def format_line(info: ModelInfo) -> str:
    """The start-up line naming the weight format: dtype, quantization, why, weights bytes, KV bytes, RSS."""
    kernels = f", CPU kernels {info.cpu_kernels}" if info.cpu_kernels else ""
    return (
        f"weights format: dtype {info.dtype}, quantization {info.quantization} "
        f"({info.format_reason}){kernels}; "
        f"weights {info.weights_bytes} B, KV cache {info.kv_cache_bytes} B ({info.num_blocks} blocks), "
        f"process RSS {info.rss_bytes} B (peak {info.peak_rss_bytes} B)"
    )


def ready_line(info: ModelInfo) -> str:
    """The start-up line once the engine is built: what the format line (:func:`format_line`) does not say
    (the model, its context, the KV block size, the build time in seconds). The format facts are also the
    ``kvscope`` field of ``/v1/models``."""
    return (
        f"engine ready: {info.name} (max_model_len {info.max_model_len}, {info.block_size}-token KV blocks, "
        f"built in {info.load_seconds:.2f} s)"
    )


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sibling ``index`` of an n > 1 request: n = 1 and, when seeded, seed + index (vLLM v1 parallel
    sampling)."""
    from dataclasses import replace

    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)
