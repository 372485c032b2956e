"""One decode step of a compact Llama-family model in one C++ call, so that a step costs about its matmuls
(the weights read once), on kvscope's CPU kernels (kernels/cpu_decode.py,
``torch.ops.kvscope_cpu.decode_step``).

The eager decoder issues about a thousand torch ops per step at batch 1, whose dispatch and small kernels cost
milliseconds (docs/benchmarks.md "Per-step cost and where the time goes"); this path runs the whole step —
embedding rows, per layer RMSNorm → qkv → RoPE → K/V written to the paged cache → attention read from the
paged cache in place (no gather) → o_proj → residual → RMSNorm → gate_up → SiLU·up → down → residual, then the
final norm and the LM head — in C++ with the block-quantized AVX-512 VNNI GEMVs (from ``tile_rows`` requests
the small-batch matmul on the same weights, kernels/csrc/cpu_pair_gemm.h, or on their transposed copy,
cpu_pair_vnni.h), returning float32 logits.

Numerics differ from the eager compact path by design: the residual stream and every activation stay float32
(eager rounds to bfloat16 after each op); each GEMV quantizes its input per block of 32 to 16-bit codes (the
form of llama.cpp's Q8_1 with 16-bit codes); the KV cache is written in its own dtype (bfloat16 rounding as
eager). The quality guards: ``kvscope eval ppl`` (compact kernels at every row) and the teacher-forced
decode-path perplexity (engine/eval/decode_path.py).

Used for decode-only steps (every request one new token, or one and its speculative drafts, verified as one
row per token: no prefill chunk) of at most ``max_rows`` tokens (the compact kernels' crossover from the
start-up probe, raised by :func:`fused_row_limit`), when every decoder matmul is a 4-bit pair-block weight
and the model has its 8-bit ``decode_head`` (``kvscope.engine.platform.compact`` with ``pair_kernels``), the
architecture has no biases and no q/k norm, and head_dim is 64 or 128.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.models.llama import LlamaForCausalLM
from kvscope.engine.platform.kernel_probe import best_ms
from kvscope.engine.weights.quant import CompactLinearKernel
from kvscope.kernels.cpu_decode import PAIR, TILE_KINDS, PairBlocks, VnniBlocks, is_loaded

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FusedDecoder:
    """The model's weights as the C++ decode step reads them (views of the compact kernels' tensors, plus
    float32 copies of the norm weights)."""

    embed: torch.Tensor
    """``[vocab, hidden]`` bfloat16 or float32 (the embedding lookups), any strides: a tied float32 embedding
    is the column-major view prepare_for_cpu leaves (engine/platform/cpu.py)."""
    inv_freq: torch.Tensor
    """float32 ``[head_dim / 2]`` (RoPE frequencies, scaling applied)."""
    norms: list[torch.Tensor]
    """float32 ``[hidden]``, 2 per layer (input, post-attention)."""
    codes: list[torch.Tensor]
    """4 per layer: qkv, o, gate_up, down (``PairBlocks.codes``)."""
    scales: list[torch.Tensor]
    final_norm: torch.Tensor
    head: PairBlocks
    num_heads: int
    num_kv_heads: int
    eps: float
    max_rows: int
    """Most requests one fused step takes (above it the eager decoder's dense path is faster)."""
    tile_rows: int = 0
    """From how many requests its matmuls run the small-batch matmul instead of the GEMV (0: never)."""
    tile: str = "float32"
    """That matmul's tile element type (``kvscope.kernels.cpu_decode.TILE_KINDS``)."""
    vnni: tuple[VnniBlocks, ...] = ()
    """For ``int16`` tiles: every matrix's VNNI blocks, 4 per layer in the order of ``codes``, then the
    head's; () for the other kinds."""

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> FusedDecoder | None:
        """The fused decoder of a loaded, quantized CPU model, or None where it does not apply (module
        doc)."""
        if not is_loaded() or not isinstance(model, LlamaForCausalLM):
            return None
        c = model.config
        if c.qkv_bias or c.o_bias or c.mlp_bias or c.qk_norm or c.head_dim not in (64, 128):
            return None
        head = getattr(
            model, "decode_head", None
        )  # the Q8_0 LM head kvscope.engine.platform.compact made for this step
        embed = model.model.embed_tokens.weight
        if (
            not isinstance(head, PairBlocks)
            or head.bits != 8
            or embed.dtype not in (torch.bfloat16, torch.float32)
        ):
            return None
        codes, scales, limits, tiles = [], [], [], set()
        norms, vnni = [], []
        for layer in model.model.layers:
            for linear in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ):
                weight = _pair(linear.cpu_kernel, bits=4)
                if weight is None:
                    return None
                codes.append(weight.codes)
                scales.append(weight.scales)
                limits.append(linear.cpu_kernel.max_compact_rows)
                tiles.add((linear.cpu_kernel.tile_rows, linear.cpu_kernel.tile))
                vnni.append(linear.cpu_kernel.vnni)
            norms += [
                layer.input_layernorm.weight.detach().float().contiguous(),
                layer.post_attention_layernorm.weight.detach().float().contiguous(),
            ]
        if len(tiles) != 1:  # one probe choice for every layer (kvscope.engine.platform.compact)
            return None
        ((tile_rows, tile),) = tiles
        if tile == "int16" and tile_rows:
            vnni.append(getattr(model, "decode_head_vnni", None))
            if any(v is None for v in vnni):  # a matrix without its transposed copy: the GEMV at every size
                tile_rows, vnni = 0, []
        else:
            vnni = []
        inv_freq = c.rope.inv_freq(c.head_dim, embed.device).contiguous()
        return cls(
            embed=embed.detach(),
            inv_freq=inv_freq,
            norms=norms,
            codes=codes,
            scales=scales,
            final_norm=model.model.norm.weight.detach().float().contiguous(),
            head=head,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            eps=c.rms_norm_eps,
            max_rows=min(limits),
            tile_rows=tile_rows,
            tile=tile,
            vnni=tuple(vnni),
        )

    def applies(
        self, metadata: AttentionMetadata, kv_caches: list[torch.Tensor], verification: bool = False
    ) -> bool:
        """Whether this step can run fused: decode-only (one new token per request, or with
        ``verification`` its new token and its drafts: the caller checks that every request's tokens are
        that), at most ``max_rows`` tokens, a float32/bfloat16 cache."""
        return (
            (verification or metadata.max_query_len == 1)
            and metadata.num_tokens <= self.max_rows
            and bool(kv_caches)
            and kv_caches[0].dtype in (torch.bfloat16, torch.float32)
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids, positions int64 ``[n]`` (each request's new tokens: one, or one and its drafts) →
        float32 logits ``[n, vocab]``; writes the new tokens' K/V into ``kv_caches`` (``[2, blocks,
        block_size, KVH, head_dim]`` per layer) at ``metadata.slot_mapping``. A request with several tokens
        (a speculative verification) becomes one row per token, each attending to the context up to its own
        position (its request's block table, seq_len = position + 1): the C++ step writes every row's K/V of a
        layer before its attention reads, so each draft token sees the ones before it, as the eager
        decoder's causal mask does. Raises RuntimeError (from the kernel) on inconsistent shapes."""
        block_tables, seq_lens = metadata.block_tables, metadata.seq_lens
        if metadata.num_tokens != metadata.num_reqs:
            query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
            block_tables = block_tables.repeat_interleave(query_lens, dim=0)
            seq_lens = (positions + 1).to(torch.int32)
        return torch.ops.kvscope_cpu.decode_step(
            input_ids,
            positions,
            self.embed,
            self.inv_freq,
            self.norms,
            self.codes,
            self.scales,
            self.final_norm,
            self.head.codes,
            self.head.scales,
            kv_caches,
            block_tables,
            seq_lens,
            metadata.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.tile_rows,
            TILE_KINDS[self.tile],
            [v.codes for v in self.vnni],
            [v.dm for v in self.vnni],
        )


FUSED_PROBE_ROWS = (8, 16, 32, 64)
"""Decode batch sizes at which :func:`fused_row_limit` times the fused step's matmuls against the eager
decoder's on the model's own weights."""


def engine_fused_decoder(model: torch.nn.Module) -> FusedDecoder | None:
    """The engine's fused decoder of ``model`` (:meth:`FusedDecoder.from_model`), its row limit raised by
    :func:`fused_row_limit` where its matmuls run the small-batch tiles (the GEMV alone re-reads the weights
    every 4 rows and never wins there); None where it does not apply. The layers keep the probe's limit: the
    eager steps (prefill chunks) of a few rows run the compact kernel and the others the dense copy, as before
    — a raised limit would let a short prompt prefilled alone take another kernel than the same prompt
    prefilled in a batch, and change its tokens."""
    fused = FusedDecoder.from_model(model)
    if fused is None or not fused.tile_rows:
        return fused
    assert isinstance(model, LlamaForCausalLM)
    return dataclasses.replace(fused, max_rows=fused_row_limit(model, fused, FUSED_PROBE_ROWS))


def fused_row_limit(
    model: LlamaForCausalLM,
    fused: FusedDecoder,
    rows: Sequence[int] = FUSED_PROBE_ROWS,
    repeats: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """Up to how many requests the fused step's matmuls beat the eager decoder's on this model: each size of
    ``rows`` above ``fused.max_rows`` (the kernel probe's crossover) is timed on the model's own weights, the
    fused step's pair-block matmuls (the GEMV or the tiles, as it runs them, and its Q8_0 LM head) against the
    eager path's (each layer as its ``Linear`` runs it: the dense copy above the crossover, and the LM head),
    best of ``repeats``, with the engine's threads; the limit is the largest size up to which the fused ones
    are not slower at any timed size (``fused.max_rows`` when they lose at the first). Why: the kernel probe
    times one matrix that stays in the CPU's caches, where a model's dense copies (4x the bytes of its int4
    weights in float32) stream from memory at every step (docs/benchmarks.md "Small batches without AMX")."""
    above = [n for n in rows if n > fused.max_rows]
    if not above:
        return fused.max_rows
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    dtype = model.model.embed_tokens.weight.dtype
    linears = [
        linear
        for layer in model.model.layers
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    best = fused.max_rows
    gen = torch.Generator().manual_seed(0)
    for n in above:
        xs = {
            k: torch.randn(n, k, generator=gen)
            for k in (hidden, inter, model.config.num_attention_heads * model.config.head_dim)
        }

        def fused_matmuls(xs: dict[int, torch.Tensor] = xs, n: int = n) -> None:
            if fused.vnni and n >= fused.tile_rows:  # the int16 tiles, the head's last
                for v in fused.vnni:
                    v.matmul(xs[v.codes.shape[1] * 32])
                return
            # below the int16 tiles' rows the GEMV (qgemv has no int16 tiles: they need the VNNI copies)
            tile_rows, kind = (0, "float32") if fused.vnni else (fused.tile_rows, fused.tile)
            for codes, scales in zip(fused.codes, fused.scales, strict=True):
                k = scales.shape[1] * PAIR
                torch.ops.kvscope_cpu.qgemv(xs[k], codes, scales, tile_rows, TILE_KINDS[kind])
            fused.head.matmul(xs[hidden], tile_rows, kind)

        def eager_matmuls(xs: dict[int, torch.Tensor] = xs) -> None:
            for linear in linears:
                linear(xs[linear.in_features].to(dtype))
            model.compute_logits(xs[hidden].to(dtype))

        with torch.inference_mode():
            fused_ms, eager_ms = (best_ms(fn, repeats, clock) for fn in (fused_matmuls, eager_matmuls))
        logger.info(
            "fused decode probe at %d rows: fused matmuls %.1f ms, eager %.1f ms", n, fused_ms, eager_ms
        )
        if fused_ms > eager_ms:
            break
        best = n
    return best


def _pair(kernel: object, bits: int) -> PairBlocks | None:
    if (
        isinstance(kernel, CompactLinearKernel)
        and isinstance(kernel.compact, PairBlocks)
        and kernel.compact.bits == bits
        and kernel.bias is None
    ):
        return kernel.compact
    return None
