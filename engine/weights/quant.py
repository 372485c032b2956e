"""Compact CPU weights for linear layers: int4 (groups of 32, from GGUF Q4_0/Q4_1 blocks) and int8 (per output
channel), run with torch's own packed weight-only kernels.

- int4: ``torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes int32 [N, K], 1)`` packs 4-bit codes
  (0…15) into uint8 ``[N, K/2]``; ``aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)``
  computes ``x @ Wᵀ`` with ``W[n, k] = (code - 8) · scale[g, n] + zero[g, n]``, g = k // group, and
  ``scales_and_zeros`` ``[K/group, N, 2]`` in x's dtype (PyTorch ``test/test_linalg.py``
  ``_group_quantize_tensor``: zeros = min + 8·scale, then ``transpose(0, 1)``). GGUF blocks of 32 map onto it
  without re-quantizing (ggml ``dequantize_row_q4_0/q4_1``; ``gguf.quants.Q4_0/Q4_1``):
  Q4_0 ``w = d·(q - 8)`` → scale = d, zero = 0; Q4_1 ``w = d·q + m`` → scale = d, zero = m + 8·d.
  Only bfloat16 activations have a vectorised kernel (float32 ones are many times slower: docs/benchmarks.md
  "Weight formats and the format chooser"), so inputs are cast to bfloat16 and the float16 d and m are rounded
  to bfloat16 (relative error ≤ 2⁻⁹).
- int8: ``aten._weight_int8pack_mm(x bf16 [M, K], w int8 [N, K], scales bf16 [N])`` = ``x @ (w·s)ᵀ``;
  weights are quantized symmetrically per output row, s = max|w| / 127 (weight-only, as torchao's
  ``int8_weight_only``).

Both kernels are memory-bound GEMVs: they win for a few rows and lose to oneDNN's blocked bf16/fp32 matmul
(AMX where present) at batched-decode and prefill sizes. :class:`CompactLinearKernel` therefore keeps an
optional dense packed copy and switches above ``max_compact_rows``, a crossover measured per CPU by
:mod:`kvscope.engine.platform.kernel_probe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from kvscope.engine.memory import tensor_nbytes
from kvscope.kernels.cpu_decode import PairBlocks, TileBlocks, VnniBlocks

INT4_GROUP = 32
"""Weights per scale/zero group: a GGUF Q4_0/Q4_1 block."""
GGUF_INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
COMPUTE_DTYPE = torch.bfloat16
"""Activation dtype of both compact kernels (the only one they vectorise on CPU)."""


@dataclass(frozen=True, slots=True)
class Int4Blocks:
    """Unpacked 4-bit weights of one ``[N, K]`` matrix: ``W = (codes - 8) · scale + zero`` per group of 32."""

    codes: torch.Tensor
    """uint8 ``[N, K]``, values 0…15."""
    scale: torch.Tensor
    """float32 ``[N, K / 32]``."""
    zero: torch.Tensor
    """float32 ``[N, K / 32]``."""

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``, computed as ggml does (float32 arithmetic)."""
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, cols // INT4_GROUP, INT4_GROUP).to(torch.float32) - 8.0
        return (grouped * self.scale[..., None] + self.zero[..., None]).view(rows, cols)

    def map_rows(self, fn) -> Int4Blocks:
        """Apply a row permutation ``fn`` (numpy ``[N, …]`` → ``[N, …]``) to codes, scale and zero alike."""
        return Int4Blocks(
            *(
                torch.from_numpy(np.ascontiguousarray(fn(t.numpy())))
                for t in (self.codes, self.scale, self.zero)
            )
        )

    @staticmethod
    def cat(parts: Sequence[Int4Blocks]) -> Int4Blocks:
        """Stack along the output rows (fused q/k/v or gate/up)."""
        return Int4Blocks(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


def int4_blocks_from_gguf(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> Int4Blocks:
    """Unpack GGUF Q4_0/Q4_1 rows (uint8 ``[N, K/32 · block bytes]``, as ``GGUFReader`` returns them) of a
    ``[N, K]`` matrix into codes/scale/zero, exactly: ``dequantize()`` equals ``gguf.quants.dequantize``.

    Block layout (ggml ``block_q4_0`` / ``block_q4_1``): float16 d, (Q4_1: float16 m,) then 16 bytes whose low
    nibbles are weights 0…15 and high nibbles weights 16…31. Raises ValueError for another type or shape.
    """
    if qtype not in GGUF_INT4_TYPES:
        raise ValueError(f"not a Q4_0/Q4_1 tensor: {qtype!r}")
    rows, cols = shape
    if cols % INT4_GROUP:
        raise ValueError(f"K = {cols} is not a multiple of {INT4_GROUP}")
    header = 2 if qtype == GGMLQuantizationType.Q4_0 else 4
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // INT4_GROUP, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., header:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    if qtype == GGMLQuantizationType.Q4_0:
        zero = np.zeros_like(d)
    else:
        zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + np.float32(8.0) * d
    return Int4Blocks(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))


def int4_blocks_from_float(
    weight: torch.Tensor, qtype: GGMLQuantizationType = GGMLQuantizationType.Q4_1
) -> Int4Blocks:
    """Quantize a float ``[N, K]`` weight as llama.cpp would (``gguf.quants.quantize``, round-to-nearest, no
    importance matrix), for models that do not come as a Q4 GGUF. Raises ValueError when K % 32 != 0."""
    if weight.shape[1] % INT4_GROUP:
        raise ValueError(f"K = {weight.shape[1]} is not a multiple of {INT4_GROUP}")
    raw = quants.quantize(weight.detach().to(torch.float32).numpy(), qtype)
    return int4_blocks_from_gguf(raw, qtype, tuple(weight.shape))


def pair_blocks_from_int4(blocks: Int4Blocks) -> PairBlocks:
    """The same 4-bit weights in kvscope's CPU kernel layout (``w = d·u + m`` with d = scale, m = zero −
    8·scale: a GGUF Q4_1 block's own d and min, exact in float16). Raises ValueError when K is not a
    multiple of 64."""
    return PairBlocks.pack(blocks.codes, blocks.scale, blocks.zero - 8.0 * blocks.scale, 4)


def int4_weight(blocks: Int4Blocks, pair_layout: bool) -> Int4Weight | PairBlocks:
    """The int4 weight the engine runs: kvscope's pair-block layout (``pair_layout``: its CPU kernels are
    loaded and K is a multiple of 64) or torch's int4pack one."""
    return pair_blocks_from_int4(blocks) if pair_layout else Int4Weight.from_blocks(blocks)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A ``[N, K]`` weight packed for ``aten._weight_int4pack_mm_for_cpu``."""

    packed: torch.Tensor
    """uint8 ``[N, K / 2]`` (torch's CPU int4 layout)."""
    scales_and_zeros: torch.Tensor
    """bfloat16 ``[K / 32, N, 2]``."""
    out_features: int

    @classmethod
    def from_blocks(cls, blocks: Int4Blocks) -> Int4Weight:
        """Pack; raises RuntimeError when torch refuses the shape (N must be a multiple of 16)."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            blocks.codes.to(torch.int32).contiguous(), 1
        )
        pairs = torch.stack([blocks.scale, blocks.zero], dim=-1).transpose(0, 1).contiguous()
        return cls(
            packed=packed, scales_and_zeros=pairs.to(COMPUTE_DTYPE), out_features=blocks.codes.shape[0]
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x bfloat16 ``[M, K]`` → bfloat16 ``[M, N]``."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.packed) + tensor_nbytes(self.scales_and_zeros)


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A ``[N, K]`` weight as int8 rows and one bfloat16 scale per row, for ``aten._weight_int8pack_mm``."""

    weight: torch.Tensor
    """int8 ``[N, K]``."""
    scales: torch.Tensor
    """bfloat16 ``[N]``."""

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric per-row quantization: s = max|w| / 127 (rounded to bfloat16 first, so that the stored
        scale is the one the codes were computed with), q = round(w / s) clamped to [-127, 127]."""
        w = weight.detach().to(torch.float32)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny).to(COMPUTE_DTYPE)
        codes = torch.round(w / scales.to(torch.float32)[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(weight=codes.contiguous(), scales=scales)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``."""
        return self.weight.to(torch.float32) * self.scales.to(torch.float32)[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x bfloat16 ``[M, K]`` → bfloat16 ``[M, N]``."""
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.weight) + tensor_nbytes(self.scales)


@dataclass(frozen=True, slots=True)
class CompactLinearKernel:
    """``y = x @ Wᵀ + bias`` from compact weights for up to ``max_compact_rows`` rows, else through
    ``dense`` (a oneDNN-packed copy, see ``kvscope.engine.models.layers.packed_linear_kernel``) when there
    is one. The output has x's dtype."""

    compact: Int4Weight | Int8Weight | PairBlocks
    """torch's packed int4/int8 weights, or kvscope's own pair blocks (kernels/cpu_decode.py: 4-bit from the
    same GGUF blocks, 8-bit Q8_0 for an LM head) where those kernels are built."""
    bias: torch.Tensor | None
    dense: object | None = None
    """A callable ``x [M, K] → [M, N]`` (a ``CpuLinearKernel``) used above ``max_compact_rows``; None =
    never."""
    dense_dtype: torch.dtype | None = None
    max_compact_rows: int = 1 << 62
    batched: TileBlocks | None = None
    """The same 4-bit weights for kvscope's AMX matmul (kernels/csrc/cpu_amx.cpp), used instead of
    ``dense`` from ``max_compact_rows + 1`` up to ``max_batched_rows`` rows (batched decode, short
    prefills); None = never."""
    max_batched_rows: int = 0
    tile_rows: int = 0
    """From how many rows pair blocks run the small-batch matmul instead of the GEMV (0: never; the start-up
    probe's ``KernelChoice.tile_rows``)."""
    tile: str = "float32"
    """The small-batch matmul's tile element type (``KernelChoice.tile``)."""
    vnni: VnniBlocks | None = None
    """The same weights transposed for the ``int16`` tiles (kernels/csrc/cpu_pair_vnni.h), which run from
    ``tile_rows`` rows where the probe chose them; None for the other tile kinds."""

    @property
    def fmt(self) -> str:
        if isinstance(self.compact, PairBlocks):
            return "int4" if self.compact.bits == 4 else "int8"
        return "int4" if isinstance(self.compact, Int4Weight) else "int8"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, in]`` (any float dtype) → ``[M, out]`` in x's dtype."""
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty(0, self.compact.out_features)
        dtype = x.dtype
        if self.runs_batched(rows):
            if dtype not in (torch.float32, torch.bfloat16):
                x = x.to(torch.float32)
            out = self.batched.matmul(x)  # in x's dtype
            if self.bias is not None:
                out += self.bias.to(out.dtype)
            return out if out.dtype == dtype else out.to(dtype)
        if self.dense is not None and rows > self.max_compact_rows:
            out = self.dense(x if dtype == self.dense_dtype else x.to(self.dense_dtype))
            return out if out.dtype == dtype else out.to(dtype)
        if isinstance(self.compact, PairBlocks):  # float32 or bfloat16 in, float32 out
            if self.vnni is None:
                out = self.compact.matmul(x, self.tile_rows, self.tile)
            else:  # the int16 tiles from tile_rows, the GEMV below
                out = self.vnni.matmul(x) if 0 < self.tile_rows <= rows else self.compact.matmul(x)
            if self.bias is not None:
                out += self.bias
            return out if dtype == torch.float32 else out.to(dtype)
        # casts only where needed: each skipped no-op call saves its dispatch, 4 per layer (docs/benchmarks.md
        # "Per-step cost and where the time goes")
        out = self.compact.matmul((x if dtype == COMPUTE_DTYPE else x.to(COMPUTE_DTYPE)).contiguous())
        if self.bias is not None:
            out += self.bias.to(out.dtype)
        return out if dtype == COMPUTE_DTYPE else out.to(dtype)

    def runs_batched(self, rows: int) -> bool:
        """Whether ``rows`` input rows run on the AMX copy (``batched``)."""
        return self.batched is not None and self.max_compact_rows < rows <= self.max_batched_rows

    @property
    def nbytes(self) -> int:
        """Bytes held: compact weights, bias, the dense copy, the AMX copy and the VNNI copy."""
        dense = getattr(self.dense, "nbytes", 0) if self.dense is not None else 0
        batched = 0 if self.batched is None else self.batched.nbytes
        vnni = 0 if self.vnni is None else self.vnni.nbytes
        bias = 0 if self.bias is None else tensor_nbytes(self.bias)
        return self.compact.nbytes + bias + dense + batched + vnni
