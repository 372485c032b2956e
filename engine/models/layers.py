"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding (RoPE), SwiGLU activation, and
:class:`Linear` (``nn.Linear`` with a CPU fast path).

Numerics follow HF transformers (``models/llama/modeling_llama.py``, ``modeling_rope_utils.py``) operation
for operation so that float32 logits match to ~1e-6.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.engine.memory import tensor_nbytes

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
PACK_BATCH_HINT = 32
"""Rows oneDNN tunes its packed weight layout for (decode batches of 2…64 all gain, see CpuLinearKernel)."""
ROW_ALIGN = 16
"""Prefill-sized inputs of the oneDNN-packed matmuls are zero-padded to a multiple of this many rows (see
:func:`aligned_rows`)."""
ALIGN_MIN_ROWS = 64
"""Inputs of up to this many rows (decode batches up to the default ``max_num_seqs``) are never padded."""


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x², -1) + eps), computed in float32 (Zhang & Sennrich 2019; HF
    LlamaRMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.cpu_op = False
        """Run bfloat16 rows through kvscope's C++ kernel (``torch.ops.kvscope_cpu.rms_norm``,
        kernels/csrc/cpu_elementwise.cpp: torch's roundings in one pass); set by
        ``kvscope.engine.platform.cpu.use_cpu_elementwise_ops`` when the library is loaded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., size] → [..., size] in x's dtype."""
        if self.cpu_op and cpu_op_applies(x) and self.weight.dtype == torch.bfloat16:
            return torch.ops.kvscope_cpu.rms_norm(x, self.weight, self.eps)
        if x.dtype == self.weight.dtype == torch.float32:  # the same float32 operations, in one call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if x.dtype == self.weight.dtype:
            # F.rms_norm of a bfloat16/float16 x without weight upcasts to float32, normalizes and rounds back
            # to x's dtype (``type_as``): HF's ``h.to(dtype)``; the weight multiply then runs in x's dtype as
            # HF's ``weight * h.to(dtype)``: bit-identical in 2 calls instead of 7 (test_cpu_fast_paths.py)
            return F.rms_norm(x, self.weight.shape, None, self.eps) * self.weight
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


@dataclass(frozen=True, slots=True)
class CpuLinearKernel:
    """``y = x @ weight.T + bias`` on CPU with the fastest kernel per input size (measured on AVX-512 cores:
    docs/benchmarks.md "Weight formats and the format chooser").

    - float32, one row (single-stream decode): MKL GEMV on the weight stored column-major
      (``weight.t().contiguous().t()``): MKL's GEMV over the row-major ``[out, in]`` layout runs at about
      half the memory bandwidth.
    - everything else: oneDNN's matmul on a weight pre-packed once into its blocked layout
      (``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile``'s CPU freezing pass uses), faster
      than MKL's SGEMM from a few rows to prefill sizes; for bfloat16 it wins at every size.
    Results equal ``F.linear`` up to float rounding (a different summation order).
    """

    column_major: torch.Tensor | None
    """float32 ``[out, in]`` with strides ``(1, out)``, used for one-row inputs; None = always packed."""
    packed: torch.Tensor
    """oneDNN-packed ``[out, in]`` weight (an opaque ``torch._mkldnn`` tensor)."""
    bias: torch.Tensor | None
    """``[out]`` or None."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, in]`` → ``[N, out]`` in x's dtype."""
        if self.column_major is not None and x.shape[0] == 1:
            return F.linear(x, self.column_major, self.bias)
        if x.shape[0] == 0:
            return x.new_empty(0, self.packed.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed copy, the column-major copy (it replaces the parameter) and the bias."""
        return sum(tensor_nbytes(t) for t in (self.column_major, self.packed, self.bias) if t is not None)


def cpu_linear_kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> CpuLinearKernel | None:
    """Build the CPU fast path for ``weight`` ``[out, in]`` (float32 or bfloat16, on CPU), or None when this
    torch build has no oneDNN or the dtype has no fast path (float16). The float32 column-major copy is a new
    tensor: callers may re-point their parameter at it (see :meth:`Linear.prepare_for_cpu`)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    weight = weight.detach()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
    except (AttributeError, RuntimeError):  # op missing from this build, or oneDNN refused the shape
        return None
    column_major = weight.t().contiguous().t() if weight.dtype == torch.float32 else None
    return CpuLinearKernel(
        column_major=column_major, packed=packed, bias=None if bias is None else bias.detach()
    )


def packed_linear_kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> CpuLinearKernel | None:
    """Only the oneDNN-packed copy of ``weight`` (no column-major one): the dense path of a compact layer,
    used for batched rows. None when oneDNN is unavailable or refuses the weight."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
    except (AttributeError, RuntimeError):
        return None
    return CpuLinearKernel(column_major=None, packed=packed, bias=None if bias is None else bias.detach())


def aligned_rows(rows: int) -> int:
    """Rows a packed oneDNN matmul of ``rows`` input rows runs with: ``rows`` up to :data:`ALIGN_MIN_ROWS`,
    else rounded up to a multiple of :data:`ROW_ALIGN`.

    Why: oneDNN builds (JIT-compiles) a primitive per input shape on its first use and caches it, milliseconds
    per shape paid by the first prefill of every new prompt length (docs/benchmarks.md "The prefill warm-up:
    one oneDNN primitive per shape"). Padding bounds the
    shapes to ``max_num_batched_tokens / 16`` per matrix (warmed at start-up by
    ``platform.cpu.warm_up_prefill``) for at most 15 wasted rows. Rows are independent: above 64 rows the
    padded float32 result was bit-identical to the unpadded one for every size tested; in bfloat16 oneDNN
    may block the padded size differently (another float32 summation order), so an output can be one
    bfloat16 rounding step away (tests/engine/test_prefill_fast_paths.py)."""
    return rows if rows <= ALIGN_MIN_ROWS else -(-rows // ROW_ALIGN) * ROW_ALIGN


def _padded_call(kernel: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``kernel(x)`` with x's rows zero-padded to :func:`aligned_rows` (the padding rows sliced off again)."""
    rows = x.shape[0]
    padded = aligned_rows(rows)
    if padded == rows:
        return kernel(x)
    return kernel(F.pad(x, (0, 0, 0, padded - rows)))[:rows]


def uses_packed_dense(kernel: object, rows: int) -> bool:
    """Whether ``kernel`` (a :class:`CpuLinearKernel` or a compact one) runs ``rows`` rows on a oneDNN-packed
    dense weight (the calls :func:`aligned_rows` pads)."""
    if isinstance(kernel, CpuLinearKernel):
        return rows > 1 or kernel.column_major is None
    dense = getattr(kernel, "dense", None)
    runs_batched = getattr(kernel, "runs_batched", None)
    if runs_batched is not None and runs_batched(rows):
        return False  # kvscope's AMX matmul (pads to 16 rows itself)
    return dense is not None and rows > getattr(kernel, "max_compact_rows", rows)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same HF weight names) that can switch to :class:`CpuLinearKernel`, or
    to compact weights (:meth:`use_compact`, ``kvscope.engine.weights.quant``).

    Until :meth:`prepare_for_cpu` or :meth:`use_compact` is called it is exactly ``nn.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.cpu_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.compact = False

    def use_compact(self, kernel: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace the dense weight by ``kernel`` (a ``quant.CompactLinearKernel``): ``weight`` and ``bias``
        become None (the kernel holds what it needs), :meth:`prepare_for_cpu` keeps the kernel."""
        self.cpu_kernel = kernel
        self.compact = True
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    def prepare_for_cpu(self) -> bool:
        """Pack the (loaded) weight for CPU inference. The float32 weight parameter is re-pointed at the
        column-major copy (same values, same shape), so the extra memory is one packed copy. Returns False
        (and changes nothing) when there is no fast path. Call again after changing the weights. A compact
        layer keeps its kernel (returns True)."""
        if self.compact:
            return True
        kernel = cpu_linear_kernel(self.weight, self.bias)
        if kernel is None:
            return False
        if kernel.column_major is not None:
            self.weight.data = kernel.column_major
        self.cpu_kernel = kernel
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, in]`` → ``[N, out]``. Prefill-sized inputs of a packed dense weight run padded to
        :func:`aligned_rows` rows (bounded oneDNN shapes; float32: the same results)."""
        kernel = self.cpu_kernel
        if kernel is None or (not self.compact and torch.is_grad_enabled()):
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] > ALIGN_MIN_ROWS and uses_packed_dense(kernel, x.shape[0]):
            return _padded_call(kernel, x)
        return kernel(x)


def silu_and_mul(gate_up: torch.Tensor, cpu_op: bool = False) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): [..., 2·I] laid out [gate | up] → silu(gate) * up [..., I]. ``cpu_op``:
    bfloat16 rows go through ``torch.ops.kvscope_cpu.silu_and_mul`` (kernels/csrc/cpu_elementwise.cpp;
    torch's roundings in one pass)."""
    if cpu_op and cpu_op_applies(gate_up):
        return torch.ops.kvscope_cpu.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def cpu_op_applies(x: torch.Tensor) -> bool:
    """Whether ``x`` suits kvscope's C++ elementwise kernels (kernels/csrc/cpu_elementwise.cpp): contiguous
    bfloat16 rows [R, H], H a multiple of 32, outside autograd (the ops have no backward). The device is not
    checked: only a CPU model turns the ops on (``kvscope.engine.platform.cpu.use_cpu_elementwise_ops``)."""
    return (
        x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.shape[1] % 32 == 0
        and x.is_contiguous()
        and not torch.is_grad_enabled()
    )


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, norm(residual + x)) for x, residual [T, hidden_size]: one pass of kvscope's C++
    ``add_rms_norm`` where the norm uses the CPU kernels (the add bit for bit torch's bfloat16 add), else
    torch's add and the norm's own forward."""
    if norm.cpu_op and cpu_op_applies(x) and cpu_op_applies(residual) and norm.weight.dtype == torch.bfloat16:
        return torch.ops.kvscope_cpu.add_rms_norm(x, residual, norm.weight, norm.eps)
    total = residual + x
    return total, norm.forward(total)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters, read from HF ``rope_parameters`` (v5) or
    ``rope_theta``/``rope_scaling`` (v4)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> RopeConfig:
        """Parse a HF config dict. Raises ValueError for unsupported scalings or partial rotary factors."""
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        original = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
        )

    def inv_freq(self, head_dim: int, device: torch.device) -> torch.Tensor:
        """float32 [head_dim / 2]: 1 / theta^(2i/d) (Su et al. 2021), then the configured scaling."""
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
        inv_freq = 1.0 / (self.theta**exponent)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Llama 3.1 frequency smoothing, as HF ``_compute_llama3_parameters``."""
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the given positions (NeoX "rotate half" layout, as HF Llama)."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] → (cos, sin), each [T, head_dim] in ``dtype`` (computed in float32)."""
        inv_freq = self.rope.inv_freq(self.head_dim, positions.device)
        freqs = positions[:, None].to(torch.float32) * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1 | x2] → [-x2 | x1] along the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim], cos/sin [T, head_dim] → x·cos + rotate_half(x)·sin."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] → (cos, signed sin), each [T, 1, head_dim], for :func:`apply_rope`: built once
    per step and shared by every layer. The signed sin is ``[-sin₁ | sin₂]`` (halves of the last dim)."""
    half = sin.shape[-1] // 2
    return cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE, NeoX "rotate half" layout (HF ``apply_rotary_pos_emb``): x [T, heads, head_dim] with the tables
    of
    :func:`rope_tables` → ``x·cos + rotate_half(x)·sin`` in 4 ops, bit for bit: ``rotate_half(x)·sin`` =
    ``[-x₂·sin₁ | x₁·sin₂]`` = ``roll(x, half)·[-sin₁ | sin₂]`` (a negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
