"""Run one weight format through the engine (``kvscope.engine.llm.LLM``, the serving path): prompt
log-probabilities per window for perplexity and greedy continuations for agreement.

The prompt log-probabilities are the engine's ``prompt_logprobs`` (what completions ``echo`` returns): the
same ModelRunner step, paged KV cache, attention backend and per-format linear kernels as a served request
(chunked prefill, packed oneDNN / compact int4/int8 kernels as the CPU probe chose them), then
``model.compute_logits`` and a float32 log-softmax. Prefix caching is off so that every window is computed
from its own tokens.

Kernel mode (``--kernels``): a compact (int4/int8) layer switches to its dense bfloat16 copy above the probe's
crossover (a few rows), so a served prefill or a batch of 8 decodes never runs the compact kernel at all.
``compact`` (the default) drops those dense copies after loading, so that every position runs the int4/int8
weight-only kernel exactly as a batch-1 decode step does: the quality of the compact weights themselves.
``served`` keeps the engine's switch (a prompt's perplexity as served; for a compact format that is the dense
copy's quality).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from kvscope.engine.eval.agreement import AGREEMENT_PROMPTS, AGREEMENT_TOKENS
from kvscope.engine.eval.formats import FormatSpec
from kvscope.engine.eval.perplexity import PerplexityResult, Window, score_windows
from kvscope.engine.llm import LLM
from kvscope.engine.platform.compact import model_weight_bytes
from kvscope.engine.platform.kernel_probe import NO_DENSE
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.weights.quant import CompactLinearKernel

KERNEL_MODES = ("compact", "served")
KV_CACHE_BYTES = 512 << 20
"""KV cache of each evaluation engine (float32: ~11k tokens of SmolLM2-135M; one window runs at a time)."""


@dataclass(frozen=True, slots=True)
class FormatRun:
    """What one format measured."""

    spec: FormatSpec
    dtype: str
    """``--dtype`` as resolved by the engine (float32 / bfloat16)."""
    dense_dtype: str | None
    """Dtype of the dense copies the compact kernels switch to above the probe's crossover (quantized
    only)."""
    weights_bytes: int
    perplexity: PerplexityResult
    greedy: tuple[tuple[int, ...], ...]
    """Greedy continuation (token ids) of each :data:`AGREEMENT_PROMPTS` prompt."""
    seconds: float
    """Wall time of load + perplexity + greedy."""
    ppl_seconds: float
    kernels: str = "served"
    """``compact`` (compact kernels at every row count) or ``served`` (the engine's dense switch): module
    doc."""
    quantization: str | None = None
    """``--quantization`` as resolved by the engine (``auto`` → what it loaded); None: the spec's own."""


def engine_prompt_logprobs(llm: LLM) -> Callable[[list[int]], list[float]]:
    """``f(tokens)`` → logprob of tokens[1:] through ``llm`` (one request, ``prompt_logprobs=0``)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs(tokens: list[int]) -> list[float]:
        (out,) = llm.generate({"prompt_token_ids": tokens}, params)
        return [entry.logprob for entry in out.prompt_logprobs[1:]]

    return logprobs


def greedy_continuations(
    llm: LLM, prompts: Sequence[str] = AGREEMENT_PROMPTS, max_tokens: int = AGREEMENT_TOKENS
) -> tuple[tuple[int, ...], ...]:
    """Greedy (temperature 0, ignore_eos) continuations of ``prompts``, batched as the engine batches them."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return tuple(tuple(o.outputs[0].token_ids) for o in llm.generate(list(prompts), params))


def force_compact_kernels(model: torch.nn.Module) -> int:
    """Make every compact layer (and an int8 logits kernel) run its int4/int8 kernel at any row count: drop
    its dense copy. Returns the number of kernels changed (0 for a dense model)."""
    changed = 0
    for module in model.modules():
        kernel = getattr(module, "cpu_kernel", None)
        if isinstance(kernel, CompactLinearKernel):
            module.cpu_kernel = replace(kernel, dense=None, max_compact_rows=NO_DENSE)
            changed += 1
    logits = getattr(model, "logits_kernel", None)
    if isinstance(logits, CompactLinearKernel):
        model.logits_kernel = replace(logits, dense=None, max_compact_rows=NO_DENSE)
        changed += 1
    return changed


def build_llm(model: str, spec: FormatSpec, num_threads: int | None) -> LLM:
    """An offline engine for ``model`` in ``spec``'s format (prefix caching off). Raises what the engine's
    loader raises (ValueError, UnknownModelError, PullError)."""
    return LLM(
        model,
        dtype=spec.dtype,
        quantization=spec.quantization,
        num_threads=num_threads,
        enable_prefix_caching=False,
        kv_cache_memory=KV_CACHE_BYTES,
    )


def run_format(
    model: str,
    spec: FormatSpec,
    token_ids: Sequence[int],
    windows: Sequence[Window],
    num_threads: int | None,
    on_window: Callable[[int, int], None] | None = None,
    *,
    agreement: bool = True,
    kernels: str = "compact",
) -> FormatRun:
    """Load ``model`` in ``spec``, score ``token_ids`` in ``windows``, generate the agreement prompts (unless
    ``agreement`` is False: ``greedy`` is then empty) with ``kernels`` (module doc); the engine is released
    before returning. Raises ValueError for an unknown kernel mode."""
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
    start = time.perf_counter()
    llm = build_llm(model, spec, num_threads)
    try:
        engine_model = llm.engine.model
        report = llm.engine.load_report
        weights_bytes = model_weight_bytes(engine_model)  # as served, dense copies included
        if kernels == "compact":
            force_compact_kernels(engine_model)
        ppl_start = time.perf_counter()
        with torch.inference_mode():
            ppl = score_windows(token_ids, windows, engine_prompt_logprobs(llm), on_window)
        ppl_seconds = time.perf_counter() - ppl_start
        greedy = greedy_continuations(llm) if agreement else ()
        probe = report.kernels
        quantization = (
            report.weight_format.quantization if report.weight_format is not None else spec.quantization
        )
        return FormatRun(
            spec=spec,
            dtype=str(report.dtype).removeprefix("torch."),
            dense_dtype=(
                str(probe.dense_dtype).removeprefix("torch.")
                if probe is not None and quantization != "none"
                else None
            ),
            weights_bytes=weights_bytes,
            perplexity=ppl,
            greedy=greedy,
            seconds=time.perf_counter() - start,
            ppl_seconds=ppl_seconds,
            kernels=kernels,
            quantization=quantization,
        )
    finally:
        del llm
        gc.collect()
