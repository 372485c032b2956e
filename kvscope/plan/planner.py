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
from typing import Any

from kvscope.common import engine_defaults
from kvscope.plan import engine_formats as ef
from kvscope.plan import formulas as f
from kvscope.plan.devices import CPU, FORMAT_OF_DTYPE, Device
from kvscope.plan.model_files import ModelFiles
from kvscope.plan.weights_on_disk import on_disk

CUDA_CONTEXT_BYTES = 512 << 20
"""CUDA context + cuBLAS workspace that the engine's free-memory budget loses (estimate: ~500 MiB with
torch 2.x)."""
MAX_SEQS_CAP = 256
"""Largest --max-num-seqs recommended when no --concurrency is asked for."""
CONCURRENCY_ROWS = (1, 8, 32, 64, 128, 256)
DEFAULT_MAX_NUM_BATCHED_TOKENS = engine_defaults.MAX_NUM_BATCHED_TOKENS
"""The engine's prefill token budget per step (declared once in kvscope.common.engine_defaults)."""
PROMPT_ROWS = (128, 512, 2048, 8192, 32768)


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What to plan for (the ``kvscope plan`` options)."""

    model: str
    device: str = CPU
    dtype: str = "float32"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    """``auto`` = the model dtype."""
    max_model_len: int | None = None
    """None = the model's max_position_embeddings."""
    concurrency: int | None = None
    gpu_memory_utilization: float = engine_defaults.GPU_MEMORY_UTILIZATION
    kv_cache_memory: int | None = None
    """CPU KV budget (bytes); None = what ``concurrency`` (or the RAM) needs."""
    block_size: int = engine_defaults.BLOCK_SIZE
    prompt_len: int = 128
    output_len: int = 128
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    ttft_slo_s: float = 1.0
    weights_format: str | None = None
    """The kvscope engine's CPU weight format (``float32``, ``bfloat16``, ``int8``, ``int4``, ``gguf``):
    weights are counted as the engine holds them (kvscope/plan/engine_formats.py, compact formats with
    ``dtype`` as their dense dtype) and the recommended flags name ``--dtype``/``--quantization``. None:
    ``dtype``/``quantization`` as a generic format (formulas.weight_bytes)."""

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.weights_format is not None:
            _choice("weights_format", self.weights_format, tuple(ef.ENGINE_FORMATS))
        _choice("quantization", self.quantization, tuple(f.QUANT_BYTES))
        _choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", *f.DTYPE_BYTES))
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_model_len", "concurrency", "kv_cache_memory"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if min(self.prompt_len, self.output_len, self.max_num_batched_tokens) < 1 or self.ttft_slo_s <= 0:
            raise ValueError("prompt_len, output_len, max_num_batched_tokens and ttft_slo_s must be positive")

    @property
    def kv_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(req: PlanRequest, files: ModelFiles, device: Device) -> Plan:
    """Plan ``req`` for the model ``files`` on ``device``. Raises ValueError (max_model_len beyond the model,
    a number format the device has no peak for)."""
    shape = files.shape
    if ef.ENGINE_FORMATS.get(req.weights_format or "", ("", "none"))[1] != "none" and device.name != CPU:
        raise ValueError(
            f"--weights-format {req.weights_format} is a CPU format of the kvscope engine (its compact "
            "kernels are torch's CPU ops); use --device cpu, or float32/bfloat16"
        )
    if (
        req.weights_format is not None
    ):  # the engine's format: its dense dtype, and its bytes for the speed rows
        req = replace(
            req,
            dtype=ef.format_dtype(req.weights_format, req.dtype),
            quantization=ef.SPEED_QUANTIZATION[ef.ENGINE_FORMATS[req.weights_format][1]],
        )
    max_len = req.max_model_len or shape.max_position_embeddings
    if max_len > shape.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}"
        )
    warnings: list[str] = []
    weights = (
        f.weight_bytes(shape, req.dtype, req.quantization)
        if req.weights_format is None
        else ef.engine_weight_bytes(shape, req.weights_format, req.dtype)
    )
    memory = _memory(req, shape, device, weights, max_len)
    max_len = _fit_max_len(memory, max_len, req.block_size, warnings)
    if device.name == CPU and weights + memory["kv_budget_bytes"] > device.memory_bytes:
        warnings.append(
            f"weights ({weights} B) + KV cache ({memory['kv_budget_bytes']} B) exceed this machine's "
            f"{device.memory_bytes} B of RAM"
        )
    capacity = f.max_concurrent_sequences(memory["num_blocks"], max_len, req.block_size)
    max_num_seqs = max(1, min(req.concurrency or MAX_SEQS_CAP, capacity or 1))
    if req.concurrency and req.concurrency > capacity:
        warnings.append(
            f"{req.concurrency} sequences of {max_len} tokens need "
            f"{req.concurrency * f.blocks_for(max_len, req.block_size)} KV blocks; the budget holds "
            f"{memory['num_blocks']} ({capacity} sequences)"
        )
    workload = min(req.prompt_len + req.output_len, max_len)
    memory |= {
        "max_concurrent_sequences": capacity,
        "fits": req.concurrency is None or req.concurrency <= capacity,
        "workload_tokens": workload,
        "max_concurrent_sequences_at_workload": f.max_concurrent_sequences(
            memory["num_blocks"], workload, req.block_size
        ),
        "activation_fits_headroom": _activation_fits(memory, device),
    }
    speed = _speed(req, shape, device, max_len, max_num_seqs)
    return Plan(
        request=asdict(req),
        model=_model_section(files),
        device=_device_section(device),
        weights=_weights_section(req, files, weights),
        kv_cache=_kv_section(req, shape, max_len),
        memory=memory,
        speed=speed,
        flags=_flags(req, device, shape, max_len, max_num_seqs),
        warnings=warnings,
    )


def _memory(req: PlanRequest, shape, device: Device, weights: int, max_len: int) -> dict[str, Any]:
    per_block = req.block_size * f.kv_bytes_per_token(shape, req.kv_dtype)
    if device.name == CPU:  # --kv-cache-memory, else what --concurrency needs, else the RAM left
        needed = (
            req.concurrency * f.blocks_for(max_len, req.block_size) * per_block if req.concurrency else None
        )
        budget = (
            req.kv_cache_memory or needed or int(device.memory_bytes * req.gpu_memory_utilization) - weights
        )
        overhead = 0
    else:
        usable = int(device.memory_bytes * req.gpu_memory_utilization)
        overhead = CUDA_CONTEXT_BYTES
        budget = usable - weights - overhead
    activation = _activation_bytes(req, shape)
    return {
        "device_bytes": device.memory_bytes,
        "utilization": req.gpu_memory_utilization,
        "weights_bytes": weights,
        "runtime_overhead_bytes": overhead,
        "kv_budget_bytes": max(0, budget),
        "kv_block_bytes": per_block,
        "num_blocks": f.num_kv_blocks(budget, shape, req.kv_dtype, req.block_size),
        "activation_peak_bytes": activation,
    }


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


def _fit_max_len(memory: dict[str, Any], max_len: int, block_size: int, warnings: list[str]) -> int:
    fits = memory["num_blocks"] * block_size
    if fits >= max_len:
        return max_len
    if fits < 16:
        warnings.append(
            f"the KV budget ({memory['kv_budget_bytes']} B) holds {fits} tokens: the model does not "
            "fit this device at these settings"
        )
        return max(fits, 1)
    warnings.append(
        f"one sequence of {max_len} tokens does not fit the KV budget: max_model_len lowered to {fits}"
    )
    return fits


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


def _kv_section(req: PlanRequest, shape, max_len: int) -> dict[str, Any]:
    per_token = f.kv_bytes_per_token(shape, req.kv_dtype)
    return {
        "dtype": req.kv_dtype,
        "bytes_per_token": per_token,
        "block_size": req.block_size,
        "bytes_per_block": per_token * req.block_size,
        "max_model_len": max_len,
        "bytes_per_sequence": f.kv_bytes_per_sequence(shape, req.kv_dtype, max_len, req.block_size),
        "formula": (
            f"2 × {shape.num_layers} layers × {shape.num_kv_heads} kv_heads × {shape.head_dim} head_dim"
            f" × {f.DTYPE_BYTES[req.kv_dtype]:g} B = {per_token} B/token"
        ),
    }


def _flags(req: PlanRequest, device: Device, shape, max_len: int, max_num_seqs: int) -> dict[str, Any]:
    flags: dict[str, Any] = {
        "--max-model-len": max_len,
        "--max-num-seqs": max_num_seqs,
        "--block-size": req.block_size,
        "--dtype": req.dtype,
    }
    if req.weights_format is not None:
        flags["--quantization"] = ef.ENGINE_FORMATS[req.weights_format][1]
    if device.name == CPU:
        need = max_num_seqs * f.kv_bytes_per_sequence(shape, req.kv_dtype, max_len, req.block_size)
        flags["--kv-cache-memory"] = f"{math.ceil((req.kv_cache_memory or need) / (1 << 20))}MiB"
    else:
        flags |= {"--device": "cuda", "--gpu-memory-utilization": req.gpu_memory_utilization}
    command = "kvscope engine --model " + req.model + "".join(f" {k} {v}" for k, v in flags.items())
    return {"engine": flags, "command": command}
