"""Switch a loaded model's linear layers to compact weights (``--quantization``) and count the bytes it holds.

- ``int8``: every projection and the LM head (for a tied embedding: an int8 copy for the logits, the
  embedding itself stays dense for lookups) quantized per output row from the loaded float weights.
- ``int4``: every decoder projection as int4 groups of 32. From the GGUF's own Q4_0/Q4_1 blocks when the model
  is such a GGUF (no re-quantization: the int4 weights dequantize to exactly the GGUF's values), else
  quantized from the float weights with llama.cpp's Q4_1 quantizer (``gguf.quants``).
- ``gguf``: the GGUF's Q4_0/Q4_1 tensors as int4, all other tensors dense (refuses a model that is not a
  GGUF). For a Q4 GGUF this is the same model as ``int4``.
Every tensor the GGUF stores in another type (Q8_0/Q6_K/F16/F32) stays dense in ``--dtype``, and so does the
LM head under int4/gguf. With kvscope's own CPU kernels (``pair_kernels``, kernels/cpu_decode.py) the int4
layers are stored in those kernels' layout (the same codes, d and min) and the model gets ``decode_head``, an
8-bit Q8_0 copy of the LM head (blocks of 32, llama.cpp's type for SmolLM2's tied ``token_embd``) that the
fused decode step and every one-row logits computation read; logits of more rows (batched decode, prompt
logprobs) keep the dense head. Each compact layer keeps a dense oneDNN-packed copy for batches above the
crossover
:func:`kvscope.engine.platform.kernel_probe.probe_cpu_kernels` measured (see docs/engine-server.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvscope.engine.memory import tensor_nbytes
from kvscope.engine.models.layers import CpuLinearKernel, Linear, packed_linear_kernel
from kvscope.engine.models.llama import _STACKED, LlamaForCausalLM
from kvscope.engine.platform.kernel_probe import NO_DENSE, KernelChoice
from kvscope.engine.weights.gguf import cached_gguf_int4_blocks
from kvscope.engine.weights.quant import (
    CompactLinearKernel,
    Int4Blocks,
    Int4Weight,
    Int8Weight,
    int4_blocks_from_float,
    int4_weight,
)
from kvscope.kernels.cpu_decode import PAIR, TILE, VNNI_LANES, PairBlocks, TileBlocks, VnniBlocks

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8", "int4", "gguf")


@dataclass(frozen=True, slots=True)
class QuantReport:
    """What :func:`quantize_model` did."""

    quantization: str
    from_gguf: int
    """Layers whose int4 weights are the GGUF's own Q4_0/Q4_1 blocks."""
    quantized: int
    """Layers quantized here from float weights (int8, or int4 of a model without Q4 blocks)."""
    dense: int
    """Linear layers left dense (the LM head under int4/gguf; gguf: tensors of other types)."""


def source_names(module_name: str) -> list[str]:
    """HF checkpoint weight names filling a (fused) layer, in shard order:
    ``model.layers.0.self_attn.qkv_proj`` → its q/k/v_proj weights; an unfused layer → its own weight."""
    name = f"{module_name}.weight"
    shards = sorted(
        (shard, fragment, fused) for fragment, (fused, shard) in _STACKED.items() if fused in name
    )
    return [name.replace(fused, fragment) for _, fragment, fused in shards] or [name]


def quantize_model(
    model: LlamaForCausalLM,
    quantization: str,
    choice: KernelChoice,
    gguf_path: Path | None = None,
    cache_dir: Path | None = None,
    *,
    pair_kernels: bool = False,
) -> QuantReport:
    """Replace the dense weights of ``model`` (loaded, on CPU) by compact kernels, in place (module doc).

    ``gguf_path``: the GGUF the model came from (None: a HF folder); ``cache_dir`` holds the int4 block cache
    (``kvscope.engine.weights.gguf.INT4_CACHE_FILE``); ``pair_kernels``: kvscope's CPU kernels are loaded
    (``kvscope.kernels.cpu_decode.load``), so int4 layers use their layout and the LM head gets a Q8_0 copy.
    Raises ValueError for an unknown quantization, or ``gguf`` without a GGUF.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return QuantReport(quantization, 0, 0, 0)
    if quantization == "gguf" and gguf_path is None:
        raise ValueError("quantization 'gguf' needs a GGUF model (a registry name or a .gguf file)")
    blocks = (
        cached_gguf_int4_blocks(gguf_path, cache_dir or gguf_path.parent)
        if quantization in ("int4", "gguf") and gguf_path is not None
        else {}
    )
    counts = {"from_gguf": 0, "quantized": 0, "dense": 0}
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        compact = _compact_weight(name, module, quantization, blocks, counts, pair_kernels)
        if compact is not None:
            module.use_compact(_kernel(compact, module.weight, module.bias, choice))
    if quantization == "int8" and model.config.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        model.logits_kernel = _kernel(Int8Weight.from_float(embed), embed, None, choice)
        counts["quantized"] += 1
    elif pair_kernels and quantization in ("int4", "gguf") and model.config.hidden_size % PAIR == 0:
        # the Q8_0 LM head of the fused decode step (engine/platform/fused_decode.py) and of one-row logits;
        # prompt logprobs and batched decode keep the dense head (compute_logits), as with torch's kernels
        head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
        model.decode_head = PairBlocks.q8_from_float(head)
        if choice.tile == "int16" and model.decode_head.out_features % VNNI_LANES == 0:
            # the fused step's batched logits on the int16 tiles (engine/platform/fused_decode.py)
            model.decode_head_vnni = VnniBlocks.from_pair_blocks(model.decode_head)
    report = QuantReport(quantization, **counts)
    logger.info(  # the kernels chosen: the probe's own line ("CPU kernel probe …"), logged just before
        "quantization %s: %d layers from GGUF Q4 blocks, %d quantized, %d dense",
        quantization,
        report.from_gguf,
        report.quantized,
        report.dense,
    )
    return report


def _compact_weight(
    name: str,
    module: Linear,
    quantization: str,
    blocks: dict[str, Int4Blocks],
    counts: dict[str, int],
    pair_kernels: bool,
) -> Int4Weight | Int8Weight | PairBlocks | None:
    if quantization == "int8":
        counts["quantized"] += 1
        return Int8Weight.from_float(module.weight)
    sources = source_names(name)
    pairs = pair_kernels and module.in_features % PAIR == 0
    if (
        name == "lm_head"
    ):  # dense; kvscope's kernels add a Q8_0 copy for the fused decode step (quantize_model)
        counts["dense"] += 1
        return None
    if all(s in blocks for s in sources):
        counts["from_gguf"] += 1
        return int4_weight(Int4Blocks.cat([blocks[s] for s in sources]), pairs)
    if quantization == "gguf":
        counts["dense"] += 1
        return None
    counts["quantized"] += 1
    return int4_weight(int4_blocks_from_float(module.weight), pairs)


def _kernel(
    compact: Int4Weight | Int8Weight, weight: torch.Tensor, bias: torch.Tensor | None, choice: KernelChoice
) -> CompactLinearKernel:
    # kvscope's pair-block kernels (4- and 8-bit alike) are what the probe timed as "int4" when they are
    # loaded
    fmt = "int4" if isinstance(compact, Int4Weight | PairBlocks) else "int8"
    max_rows = choice.max_rows[fmt]
    dense = None
    if max_rows < NO_DENSE:
        dense = packed_linear_kernel(
            weight.to(choice.dense_dtype), None if bias is None else bias.to(choice.dense_dtype)
        )
    batched = None
    if (
        dense is not None
        and choice.batched_rows > max_rows
        and isinstance(compact, PairBlocks)
        and compact.bits == 4
        and compact.out_features % TILE == 0
    ):
        batched = TileBlocks.from_pair_blocks(compact)
    vnni = None
    if (
        choice.tile == "int16"
        and choice.tile_rows
        and isinstance(compact, PairBlocks)
        and compact.out_features % VNNI_LANES == 0
    ):
        vnni = VnniBlocks.from_pair_blocks(compact)
    tiles = vnni is not None or choice.tile != "int16"
    return CompactLinearKernel(
        compact=compact,
        bias=None if bias is None else bias.detach().clone(),
        dense=dense,
        dense_dtype=choice.dense_dtype,
        max_compact_rows=max_rows if dense else NO_DENSE,
        batched=batched,
        max_batched_rows=choice.batched_rows if batched else 0,
        # int16 tiles run on the VNNI copy only (N % 16 == 0): without it the GEMV at every size
        tile_rows=choice.tile_rows if isinstance(compact, PairBlocks) and tiles else 0,
        tile=choice.tile if choice.tile and tiles else "float32",
        vnni=vnni,
    )


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights the model holds: parameters, buffers, and every kernel's packed/compact copies (each
    storage counted once; a column-major copy that replaced its parameter is not counted twice)."""
    seen: set[int] = set()
    total = 0
    for tensor in _weight_tensors(model):
        key = tensor.untyped_storage().data_ptr() if tensor.layout == torch.strided else id(tensor)
        if key in seen and tensor.layout == torch.strided and tensor.numel():
            continue
        seen.add(key)
        total += tensor_nbytes(tensor)
    return total


def _weight_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    kernels = [m.cpu_kernel for m in model.modules() if isinstance(m, Linear)]
    kernels.append(getattr(model, "logits_kernel", None))
    head = getattr(model, "decode_head", None)
    if head is not None:
        yield from (head.codes, head.scales)
    head_vnni = getattr(model, "decode_head_vnni", None)
    if head_vnni is not None:
        yield from (head_vnni.codes, head_vnni.dm)
    for kernel in {id(k): k for k in kernels if k is not None}.values():
        yield from _kernel_tensors(kernel)


def _kernel_tensors(kernel: object) -> Iterator[torch.Tensor]:
    if isinstance(kernel, CpuLinearKernel):
        yield from (t for t in (kernel.column_major, kernel.packed, kernel.bias) if t is not None)
    elif isinstance(kernel, CompactLinearKernel):
        c = kernel.compact
        if isinstance(c, PairBlocks):
            yield from (c.codes, c.scales)
        else:
            yield from (c.packed, c.scales_and_zeros) if isinstance(c, Int4Weight) else (c.weight, c.scales)
        if kernel.bias is not None:
            yield kernel.bias
        if kernel.dense is not None:
            yield from _kernel_tensors(kernel.dense)
        if kernel.batched is not None:
            yield from (kernel.batched.codes, kernel.batched.dm)
        if kernel.vnni is not None:
            yield from (kernel.vnni.codes, kernel.vnni.dm)
