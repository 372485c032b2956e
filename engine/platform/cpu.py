"""The CPU platform: thread count, kvscope's C++ CPU kernels, the projections' CPU kernels, the elementwise-op
switches and the oneDNN warm-up. Functions over a loaded model (engine/models/llama.py), which carries no
platform code; EngineCore (engine/engine_core.py) and the loader (engine/platform/loader.py) call them once,
before the step loop. Measurements behind these choices: docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from kvscope.common.engine_defaults import default_num_threads
from kvscope.engine.models.layers import ALIGN_MIN_ROWS, ROW_ALIGN, Linear, RMSNorm, cpu_linear_kernel
from kvscope.engine.models.llama import MLP, Attention, LlamaForCausalLM
from kvscope.kernels.cpu_decode import BuildResult, kernel_isa, load

logger = logging.getLogger(__name__)

CPU_KERNELS_DIR = "cpu-kernels"
"""Folder under the model cache root for kvscope's compiled CPU kernels (one library per source/torch/CPU)."""


def configure_threads(device: torch.device, num_threads: int | None) -> int:
    """Set torch's intra-op thread count for an engine on ``device``: ``num_threads``, or on CPU
    ``kvscope.common.engine_defaults.default_num_threads()`` (usable CPUs − 1, at least 1: OpenMP workers
    spin at barriers, so a thread per CPU thrashes beside any other busy process). Off the CPU torch's default
    is kept unless ``num_threads`` is given. Returns the thread count in effect."""
    if device.type == "cpu":
        torch.set_num_threads(num_threads or default_num_threads())
    elif num_threads:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def load_cpu_kernels(root: Path) -> BuildResult:
    """Build (the first start on a machine compiles C++) and load kvscope's CPU kernels from
    ``root``/:data:`CPU_KERNELS_DIR`; logs where they are not usable (torch's kernels are used then)."""
    started = time.perf_counter()
    logger.info(
        "kvscope CPU kernels: loading from %s (the first start on a machine compiles them, ~15-45 s)",
        root / CPU_KERNELS_DIR,
    )
    result = load(root / CPU_KERNELS_DIR)
    isa = kernel_isa() if result.ok else None
    level = logging.INFO if result.ok else logging.WARNING
    logger.log(
        level,
        "kvscope CPU kernels %s (%s%s, %.1fs)%s",
        "loaded" if result.ok else "unavailable",
        f"{isa.upper()} build, " if isa else "",
        result.detail,
        time.perf_counter() - started,
        "" if result.ok else ": using torch's kernels",
    )
    return result


def prepare_for_cpu(model: LlamaForCausalLM) -> int:
    """Switch every projection and the LM head of a loaded CPU model to
    :class:`~kvscope.engine.models.layers.CpuLinearKernel` (call once, after the weights are loaded and
    quantized). A tied float32 embedding is re-pointed at its column-major copy (embedding lookups then gather
    strided rows). Costs one packed copy of the weights in memory. Returns the number of matrices switched (0
    when oneDNN is unavailable)."""
    switched = sum(m.prepare_for_cpu() for m in model.modules() if isinstance(m, Linear))
    if not model.config.tie_word_embeddings:
        model.logits_kernel = model.lm_head.cpu_kernel
        return switched
    if getattr(model.logits_kernel, "compact", None) is not None:  # int8 logits (engine/platform/compact.py)
        return switched + 1
    embed = model.model.embed_tokens
    kernel = cpu_linear_kernel(embed.weight, None)
    model.logits_kernel = kernel
    if kernel is None:
        return switched
    if kernel.column_major is not None:
        embed.weight.data = kernel.column_major
    return switched + 1


def use_cpu_elementwise_ops(model: LlamaForCausalLM) -> int:
    """Route the bfloat16 RMSNorms, residual-add + norm pairs, SwiGLUs and RoPEs of every step through
    kvscope's C++ elementwise kernels (kernels/csrc/cpu_elementwise.cpp; call once ``torch.ops.kvscope_cpu``
    is loaded, on a bfloat16 CPU model; inputs the kernels do not take keep torch's ops). One pass over memory
    instead of torch's 2-7 ops, the same roundings (the add and RoPE bit for bit, RMSNorm and SwiGLU up to a
    rare one-ulp bfloat16 difference; tests/kernels/test_cpu_elementwise.py). Returns the number of modules
    switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, MLP, Attention)):
            module.cpu_op = True
            switched += 1
    return switched


@torch.inference_mode()
def warm_up_prefill(model: LlamaForCausalLM, max_num_tokens: int) -> int:
    """Run every distinct projection shape of the decoder once at each padded prefill size up to
    ``max_num_tokens`` rows (``layers.aligned_rows``: 80, 96, … rows), so that oneDNN builds its primitives
    now instead of during the first prefill of each new prompt length (docs/benchmarks.md "Idle TTFT"). Call
    after :func:`prepare_for_cpu`; does nothing for layers without a CPU kernel. Returns the number of
    matmuls run."""
    dtype = model.model.embed_tokens.weight.dtype
    shapes: dict[tuple[int, int, type], Linear] = {}
    for module in model.model.modules():  # the decoder's projections (the LM head runs on sampled rows only)
        if isinstance(module, Linear) and module.cpu_kernel is not None:
            shapes.setdefault((module.in_features, module.out_features, type(module.cpu_kernel)), module)
    calls = 0
    for rows in range(ALIGN_MIN_ROWS + ROW_ALIGN, max_num_tokens + ROW_ALIGN, ROW_ALIGN):
        for (in_features, _, _), module in shapes.items():
            module.forward(torch.zeros(rows, in_features, dtype=dtype))
            calls += 1
    return calls
