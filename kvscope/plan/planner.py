"""``plan()``: model shape + device + workload → memory, capacity, speed envelope and engine flags.

The memory model is the engine's own (engine/worker/kv_cache.py ``budget_num_blocks``): on CUDA the KV cache
gets ``memory × gpu_memory_utilization − weights − CUDA context`` (the engine measures free memory after
loading the weights; activations come out of the ``1 − utilization`` headroom); on CPU it gets
``--kv-cache-memory``. Every figure is in bytes, seconds or tokens; see formulas.py for the formulas and their
sources.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any

from kvscope.plan import engine_formats as ef
from kvscope.plan import formulas as f
from kvscope.plan.commands import recommend
from kvscope.plan.devices import CPU, FORMAT_OF_DTYPE, Device
from kvscope.plan.model_files import ModelFiles
from kvscope.plan.request import DEFAULT_MAX_NUM_BATCHED_TOKENS, PlanRequest
from kvscope.plan.resolve import resolve_request
from kvscope.plan.shape import ModelShape
from kvscope.plan.weights_on_disk import on_disk

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "Plan", "PlanRequest", "plan"]

CUDA_CONTEXT_BYTES = 512 << 20
"""CUDA context + cuBLAS workspace that the engine's free-memory budget loses (estimate: ~500 MiB with
torch 2.x)."""
MAX_SEQS_CAP = 256
"""Largest --max-num-seqs recommended when no --concurrency is asked for."""
CONCURRENCY_ROWS = (1, 8, 32, 64, 128, 256)
PROMPT_ROWS = (128, 512, 2048, 8192, 32768)


@dataclass(frozen=True, slots=True)
class Plan:
    """The answer, section by section (JSON-ready dicts; ``kvscope plan --format json`` prints
    ``to_dict()``)."""

    request: dict[str, Any]
    model: dict[str, Any]
    device: dict[str, Any]
    weights: dict[str, Any]
    kv_cache: dict[str, Any]
    memory: dict[str, Any]
    speed: dict[str, Any]
    flags: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    log: dict[str, Any] | None = None
    assumed: dict[str, str] = field(default_factory=dict)
    """Engine flag → why the plan uses its value, for each value the request left to ``auto``."""
    verdict: dict[str, Any] = field(default_factory=dict)
    """``fits``, ``text`` (one sentence: by how much it fits or does not), ``needed_bytes`` and
    ``usable_bytes`` per device, ``short_bytes`` (0 when it fits) and, when it does not fit,
    ``alternatives`` (kvscope/plan/advice.py)."""

    @property
    def fits(self) -> bool:
        """Whether the model fits as requested (``kvscope plan`` exits 3 when not)."""
        return bool(self.verdict.get("fits"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Fit:
    """How the request fits one device (or each of ``tensor_parallel_size`` devices): the context length and
    sequence limit planned, the KV blocks, and the bytes needed against the bytes usable."""

    fits: bool
    max_len: int
    max_num_seqs: int
    num_blocks: int
    kv_budget: int
    """Bytes of KV cache the engine gets (GPU: what is left after the weights; CPU: ``--kv-cache-memory``)."""
    needed: int
    """Weights + runtime overhead + the KV of the sequences asked for, bytes per device."""
    usable: int
    """Device memory × utilization, bytes (CPU with ``--kv-cache-memory``: the weights + that budget)."""
    text: str
    lowered_from: int | None = None
    """The model's context length when ``max_len`` was lowered to what fits."""


def plan(req: PlanRequest, files: ModelFiles, device: Device) -> Plan:
    """Plan ``req`` for the model ``files`` on ``device`` (``auto`` values decided by resolve.py). Raises
    ValueError (max_model_len beyond the model, a number format the device has no peak for, a compact engine
    format or tensor parallelism where they do not apply, a tensor-parallel size the heads do not divide)."""
    shape = files.shape
    req, assumed = resolve_request(req, files, device)
    if ef.ENGINE_FORMATS.get(req.weights_format or "", ("", "none"))[1] != "none" and device.name != CPU:
        raise ValueError(
            f"--weights-format {req.weights_format} is a CPU format of the kvscope engine (its compact "
            "kernels are torch's CPU ops); use --device cpu, or float32/bfloat16"
        )
    tp = req.tensor_parallel_size
    if tp > 1 and device.name == CPU:
        raise ValueError("--tensor-parallel-size splits a model over GPUs; the cpu device is one machine")
    rank_shape = shard(shape, tp)
    if (
        req.weights_format is not None
    ):  # the engine's format: its dense dtype, and its bytes for the speed rows
        req = replace(
            req,
            dtype=ef.format_dtype(req.weights_format, req.dtype),
            quantization=ef.SPEED_QUANTIZATION[ef.ENGINE_FORMATS[req.weights_format][1]],
        )
    if req.max_model_len is not None and req.max_model_len > shape.max_position_embeddings:
        raise ValueError(
            f"max_model_len {req.max_model_len} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}"
        )
    weights = (
        f.weight_bytes(shape, req.dtype, req.quantization)
        if req.weights_format is None
        else ef.engine_weight_bytes(shape, req.weights_format, req.dtype)
    )
    per_block = req.block_size * f.kv_bytes_per_token(rank_shape, req.kv_dtype)
    fit = fit_device(req, shape, device, weights, per_block)
    warnings: list[str] = []
    if fit.lowered_from is not None:
        warnings.append(
            f"one sequence of {fit.lowered_from} tokens does not fit the KV budget: max_model_len lowered to "
            f"{fit.max_len}"
        )
    capacity = f.max_concurrent_sequences(fit.num_blocks, fit.max_len, req.block_size)
    workload = min(req.prompt_len + req.output_len, fit.max_len)
    memory = {
        "device_bytes": device.memory_bytes,
        "devices": tp,
        "utilization": req.gpu_memory_utilization,
        "weights_bytes": weights,
        "weights_bytes_per_device": math.ceil(weights / tp),
        "runtime_overhead_bytes": 0 if device.name == CPU else CUDA_CONTEXT_BYTES,
        "kv_budget_bytes": fit.kv_budget,
        "kv_block_bytes": per_block,
        "num_blocks": fit.num_blocks,
        "activation_peak_bytes": _activation_bytes(req, shape),
        "max_concurrent_sequences": capacity,
        "fits": fit.fits,
        "workload_tokens": workload,
        "max_concurrent_sequences_at_workload": f.max_concurrent_sequences(
            fit.num_blocks, workload, req.block_size
        ),
    }
    memory["activation_fits_headroom"] = _activation_fits(memory, device)
    speed = _speed(req, shape, aggregate(device, tp), fit.max_len, fit.max_num_seqs)
    kv_cache_bytes = req.kv_cache_memory or fit.max_num_seqs * f.kv_bytes_per_sequence(
        rank_shape, req.kv_dtype, fit.max_len, req.block_size
    )
    return Plan(
        request=asdict(req),
        model=_model_section(files),
        device=_device_section(device) | {"count": tp},
        weights=_weights_section(req, files, weights),
        kv_cache=_kv_section(req, shape, rank_shape, fit.max_len),
        memory=memory,
        speed=speed,
        flags=recommend(req, device, files, fit.max_len, fit.max_num_seqs, kv_cache_bytes, fit.fits),
        warnings=warnings,
        assumed=assumed,
        verdict={
            "fits": fit.fits,
            "text": fit.text,
            "needed_bytes": fit.needed,
            "usable_bytes": fit.usable,
            "short_bytes": max(0, fit.needed - fit.usable),
            "alternatives": [],
        },
    )


def shard(shape: ModelShape, tp: int) -> ModelShape:
    """The shape one of ``tp`` tensor-parallel ranks holds: ``num_heads / tp`` query heads and
    ``num_kv_heads / tp`` KV heads, at least one (vLLM replicates a KV head over the ranks when there are
    fewer KV heads than ranks). Raises ValueError when ``tp`` does not divide the heads as vLLM requires."""
    if tp == 1:
        return shape
    if shape.num_heads % tp or (shape.num_kv_heads % tp and tp % shape.num_kv_heads):
        raise ValueError(
            f"--tensor-parallel-size {tp} does not divide the model's {shape.num_heads} attention heads and "
            f"{shape.num_kv_heads} KV heads"
        )
    return replace(shape, num_heads=shape.num_heads // tp, num_kv_heads=max(1, shape.num_kv_heads // tp))


def aggregate(device: Device, tp: int) -> Device:
    """``tp`` devices as one for the speed bounds: bandwidth and peaks times ``tp`` (ideal: no all-reduce
    time, so the bounds stay lower bounds)."""
    if tp == 1:
        return device
    peaks = MappingProxyType({k: v * tp for k, v in device.peak_flops.items()})
    return replace(device, name=f"{tp} × {device.name}", bandwidth=device.bandwidth * tp, peak_flops=peaks)


def fit_device(req: PlanRequest, shape: ModelShape, device: Device, weights: int, per_block: int) -> Fit:
    """Whether the model fits ``device`` (each of ``tensor_parallel_size`` of them) as requested, and the
    context length and sequence limit to run it with.

    Needed per device: the weights (1/N of them), the CUDA context on a GPU, and the KV cache of
    ``concurrency`` (else 1) sequences of the context length; usable: memory × utilization (the CPU with
    ``--kv-cache-memory``: that budget after the weights). The context length is ``--max-model-len`` when
    given; otherwise the model's, lowered to what fits those sequences but never below the workload
    (``prompt_len + output_len``): a context shorter than the work it is planned for does not fit.
    """
    tp = req.tensor_parallel_size
    weights_dev = math.ceil(weights / tp)
    on_cpu = device.name == CPU
    overhead = 0 if on_cpu else CUDA_CONTEXT_BYTES
    usable = int(device.memory_bytes * req.gpu_memory_utilization)
    available = usable - weights_dev - overhead
    if on_cpu and req.kv_cache_memory:
        available = min(req.kv_cache_memory, max(available, 0))
    blocks = max(available, 0) // per_block
    seqs = req.concurrency or 1
    model_len = shape.max_position_embeddings
    explicit = req.max_model_len is not None
    target = req.max_model_len or model_len
    workload = min(req.prompt_len + req.output_len, model_len)
    max_len, lowered = target, None
    if not explicit:
        room = blocks // seqs * req.block_size
        if room < target:
            max_len = max(room, workload)
            lowered = target if room >= workload else None
    need_blocks = seqs * f.blocks_for(max_len, req.block_size)
    fits = available > 0 and need_blocks <= blocks
    needed = weights_dev + overhead + need_blocks * per_block
    if on_cpu and req.kv_cache_memory:
        usable = min(usable, weights_dev + req.kv_cache_memory)
    capacity = f.max_concurrent_sequences(blocks, max_len, req.block_size)
    if on_cpu:  # the engine's KV cache: --kv-cache-memory, what the sequences need, else all that is left
        kv_budget = req.kv_cache_memory or (need_blocks * per_block if req.concurrency else max(available, 0))
    else:
        kv_budget = max(available, 0)
    num_blocks = kv_budget // per_block
    max_num_seqs = max(1, min(req.concurrency or MAX_SEQS_CAP, capacity or 1))
    text = _verdict_text(req, device, fits, seqs, max_len, weights_dev, overhead, needed, usable, available)
    if fits:
        text += f": room for {capacity} sequence{'s' if capacity > 1 else ''} of {max_len} tokens" + (
            f" (the model's {lowered} lowered to fit)" if lowered else ""
        )
    return Fit(fits, max_len, max_num_seqs, num_blocks, kv_budget, needed, usable, text, lowered)


def _verdict_text(
    req: PlanRequest,
    device: Device,
    fits: bool,
    seqs: int,
    max_len: int,
    weights: int,
    overhead: int,
    needed: int,
    usable: int,
    available: int,
) -> str:
    """One sentence: what fits and in how much, or what does not and by how much."""
    gib = 1 << 30
    per = " per GPU" if req.tensor_parallel_size > 1 else ""
    where = f"{req.tensor_parallel_size} × {device.name}" if req.tensor_parallel_size > 1 else device.name
    of = (
        f"{device.memory_bytes / gib:,.1f} GiB × {req.gpu_memory_utilization:g}"
        if not (device.name == CPU and req.kv_cache_memory)
        else f"the weights + --kv-cache-memory {req.kv_cache_memory / gib:,.2f} GiB"
    )
    sequences = f"{seqs} sequence{'s' if seqs > 1 else ''} of {max_len} tokens"
    parts = f"weights {weights / gib:,.2f} GiB{per}" + (
        f" + CUDA context {overhead / gib:,.2f} GiB" if overhead else ""
    )
    kv = needed - weights - overhead
    if fits:
        return (
            f"fits on {where}: {parts} leave {available / gib:,.2f} GiB{per} of the {usable / gib:,.2f} GiB "
            f"usable ({of}) for the KV cache"
        )
    short = needed - usable
    if available <= 0:
        return (
            f"does not fit on {where}: {parts} need {(weights + overhead) / gib:,.2f} GiB{per}, more than "
            f"the {usable / gib:,.2f} GiB usable ({of}); with the KV cache of {sequences} it is "
            f"{short / gib:,.2f} GiB short"
        )
    return (
        f"does not fit on {where}: {sequences} need {kv / gib:,.2f} GiB of KV cache{per}, "
        f"{available / gib:,.2f} GiB is left after the {parts} ({of}): {short / gib:,.2f} GiB short"
    )


def _activation_bytes(req: PlanRequest, shape) -> int:
    """Peak activations of one step of max_num_batched_tokens (hidden states, q/k/v, gate/up/act) plus fp32
    logits and probabilities of the sampled rows (an estimate; the engine does not profile them)."""
    tokens = req.max_num_batched_tokens
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_token = (4 * shape.hidden_size + q + 2 * kv + 3 * shape.intermediate_size) * f.DTYPE_BYTES[req.dtype]
    return int(tokens * per_token + 2 * min(tokens, MAX_SEQS_CAP) * shape.vocab_size * 4)


def _activation_fits(memory: dict[str, Any], device: Device) -> bool:
    if device.name == CPU:
        return True
    headroom = memory["device_bytes"] * (1.0 - memory["utilization"])
    return memory["activation_peak_bytes"] <= headroom


def _speed(req: PlanRequest, shape, device: Device, max_len: int, max_num_seqs: int) -> dict[str, Any]:
    fmt = f.COMPUTE_FORMAT.get(req.quantization) or FORMAT_OF_DTYPE[req.dtype]
    peak = device.flops_for(fmt)
    streamed = f.streamed_weight_bytes(shape, req.dtype, req.quantization)
    context = min(req.prompt_len + req.output_len // 2, max_len)
    rows = sorted({c for c in (*CONCURRENCY_ROWS, req.concurrency or 1) if c <= max_num_seqs} | {1})
    decode = [
        _decode_row(f.decode_step(shape, c, context, streamed, req.kv_dtype, device.bandwidth, peak), c)
        for c in rows
    ]
    prompts = sorted({p for p in (*PROMPT_ROWS, req.prompt_len, max_len) if p <= max_len})
    ttft = [_ttft_row(_prefill_bound(req, shape, p, streamed, device, peak), p) for p in prompts]
    return {
        "compute_format": fmt,
        "peak_flops": peak,
        "bandwidth_bytes_per_s": device.bandwidth,
        "streamed_weight_bytes": streamed,
        "decode_context_tokens": context,
        "decode": decode,
        "ttft": ttft,
        "ttft_slo": _slo(req, shape, device, peak, streamed, context, max_num_seqs),
    }


def _prefill_bound(
    req: PlanRequest, shape, tokens: int, streamed: int, device: Device, peak: float
) -> f.Roofline:
    chunks = math.ceil(
        tokens / req.max_num_batched_tokens
    )  # each chunked-prefill step reads the weights again
    return f.Roofline(chunks * streamed, f.prefill_flops(shape, tokens), device.bandwidth, peak)


def _decode_row(bound: f.Roofline, concurrency: int) -> dict[str, Any]:
    return {
        "concurrency": concurrency,
        "step_ms": 1e3 * bound.seconds,
        "memory_ms": 1e3 * bound.memory_s,
        "compute_ms": 1e3 * bound.compute_s,
        "bound": bound.bound,
        "output_tokens_per_s": concurrency / bound.seconds,
        "tpot_ms": 1e3 * bound.seconds,
    }


def _ttft_row(bound: f.Roofline, prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_ms": 1e3 * bound.seconds,
        "memory_ms": 1e3 * bound.memory_s,
        "compute_ms": 1e3 * bound.compute_s,
        "bound": bound.bound,
    }


def mixed_step_s(
    req: PlanRequest,
    shape,
    device: Device,
    peak: float,
    streamed: int,
    context: int,
    concurrency: int,
    prompt_tokens: int,
) -> float:
    """Lower bound (s) of the TTFT of a prompt arriving while ``concurrency − 1`` sequences decode: its
    prefill chunks share steps with their decodes (the engine mixes both in one step)."""
    prefill = _prefill_bound(req, shape, prompt_tokens, streamed, device, peak)
    decodes = f.decode_step(shape, concurrency - 1, context, 0, req.kv_dtype, device.bandwidth, peak)
    return f.Roofline(
        prefill.bytes + decodes.bytes, prefill.flops + decodes.flops, device.bandwidth, peak
    ).seconds


def slo_break_concurrency(
    req: PlanRequest,
    shape,
    device: Device,
    peak: float,
    streamed: int,
    context: int,
    max_num_seqs: int,
    prompt_tokens: int,
) -> int | None:
    """Smallest concurrency ≤ max_num_seqs whose TTFT lower bound exceeds ``req.ttft_slo_s`` (binary search:
    the bound grows with concurrency); None when even max_num_seqs meets it."""

    def breaks(c: int) -> bool:
        return mixed_step_s(req, shape, device, peak, streamed, context, c, prompt_tokens) > req.ttft_slo_s

    if not breaks(max_num_seqs):
        return None
    low, high = 1, max_num_seqs
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if breaks(mid) else (mid + 1, high)
    return low


def _slo(
    req: PlanRequest, shape, device: Device, peak: float, streamed: int, context: int, max_num_seqs: int
) -> dict[str, Any]:
    at = slo_break_concurrency(req, shape, device, peak, streamed, context, max_num_seqs, req.prompt_len)
    return {
        "ttft_slo_s": req.ttft_slo_s,
        "prompt_tokens": req.prompt_len,
        "breaks_at_concurrency": at,
        "note": "lower bound: an ideal engine misses the SLO from this concurrency on"
        if at
        else f"met up to max_num_seqs={max_num_seqs}; beyond it requests queue",
    }


def _model_section(files: ModelFiles) -> dict[str, Any]:
    shape = files.shape
    counts = f.param_counts(shape)
    return asdict(shape) | {
        "attention": shape.attention_kind,
        "parameters": counts.total,
        "parameters_by_part": {
            "embedding": counts.embedding,
            "layers": counts.per_layer * counts.num_layers,
            "final_norm": counts.final_norm,
            "lm_head": counts.lm_head,
        },
    }


def _device_section(device: Device) -> dict[str, Any]:
    return {
        "name": device.name,
        "vendor": device.vendor,
        "memory_bytes": device.memory_bytes,
        "bandwidth_bytes_per_s": device.bandwidth,
        "peak_flops": dict(device.peak_flops),
        "source": device.source,
        "measured": device.measured or None,
    }


def _weights_section(req: PlanRequest, files: ModelFiles, weights: int) -> dict[str, Any]:
    shape = files.shape
    formats = {"float32": f.weight_bytes(shape, "float32"), "bfloat16": f.weight_bytes(shape, "bfloat16")}
    formats |= {q: f.weight_bytes(shape, req.dtype, q) for q in f.QUANT_BYTES if q != "none"}
    engine = {fmt: ef.engine_weight_bytes(shape, fmt, req.dtype) for fmt in ef.ENGINE_FORMATS}
    return {
        "bytes": weights,
        "dtype": req.dtype,
        "quantization": req.quantization,
        "by_format": formats,
        "weights_format": req.weights_format,
        "engine_by_format": engine,
        "formula": "linear params × bytes(quantization) + (embedding + norms) × bytes(dtype)",
        "on_disk": on_disk(files),
    }


def _kv_section(req: PlanRequest, shape: ModelShape, rank_shape: ModelShape, max_len: int) -> dict[str, Any]:
    """Bytes of KV per token, block and sequence on one device (``rank_shape``: its share of the KV heads
    under tensor parallelism)."""
    per_token = f.kv_bytes_per_token(rank_shape, req.kv_dtype)
    heads = f"{rank_shape.num_kv_heads} kv_heads"
    if rank_shape is not shape:
        heads += f" per GPU ({shape.num_kv_heads} / TP {req.tensor_parallel_size}, at least 1)"
    return {
        "dtype": req.kv_dtype,
        "bytes_per_token": per_token,
        "block_size": req.block_size,
        "bytes_per_block": per_token * req.block_size,
        "max_model_len": max_len,
        "bytes_per_sequence": f.kv_bytes_per_sequence(rank_shape, req.kv_dtype, max_len, req.block_size),
        "formula": (
            f"2 × {shape.num_layers} layers × {heads} × {shape.head_dim} head_dim"
            f" × {f.DTYPE_BYTES[req.kv_dtype]:g} B = {per_token} B/token"
        ),
    }
