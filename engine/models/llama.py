"""Llama-family decoders over a paged KV cache: Llama (SmolLM2), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

One implementation, per-architecture flags (``ArchConfig``). Input is packed tokens ``[T]`` with positions
``[T]`` (no batch dim, no padding); attention reads the forward context (engine/attention/forward_context.py).
Weights use HF names; q/k/v and gate/up are stored fused (``qkv_proj``, ``gate_up_proj``) and filled
shard by shard in ``load_weights``.

Sliding-window attention (Mistral v0.1, Qwen with ``use_sliding_window``) is not implemented: the loader
refuses a context longer than the window (``check_sliding_window``), where full attention is identical.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.engine.attention.forward_context import get_forward_context
from kvscope.engine.models.layers import (
    Linear,
    RMSNorm,
    RopeConfig,
    RotaryEmbedding,
    add_norm,
    apply_rope,
    rope_tables,
    silu_and_mul,
)

SKIPPED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """The subset of a HF config this implementation reads, plus the architecture's flags."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig
    qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2; Llama/Qwen3 with ``attention_bias``)."""
    o_bias: bool = False
    """Bias on the output projection (Llama/Qwen3 with ``attention_bias``)."""
    mlp_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


def _base_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Common fields of a HF config dict. Raises ValueError for a non-SiLU activation."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"only hidden_act='silu' is supported, got {cfg.get('hidden_act')!r}")
    heads = cfg["num_attention_heads"]
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        rope=RopeConfig.from_hf(cfg),
    )


class Attention(nn.Module):
    """GQA self-attention: fused qkv → (q/k norm) → RoPE → write K/V to the paged cache → backend → o_proj."""

    def __init__(self, config: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.cpu_op = False
        """RoPE through kvscope's C++ kernel (``torch.ops.kvscope_cpu.rope``); set by
        ``kvscope.engine.platform.cpu.use_cpu_elementwise_ops``."""

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size], cos/sin [T, 1, head_dim] from :func:`rope_tables` → [T, hidden_size]."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qkv[:, : self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # RoPE of q and k in one pass (elementwise: the same numbers as two calls)
            qk = qkv[:, : self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
            if (
                self.cpu_op
                and qk.dtype == cos.dtype == sin.dtype == torch.bfloat16
                and self.head_dim % 32 == 0
                and cos.is_contiguous()
                and sin.is_contiguous()
                and not torch.is_grad_enabled()
            ):
                roped = torch.ops.kvscope_cpu.rope(
                    qk, cos, sin
                )  # apply_rope's 4 ops in one pass, bit for bit
            else:
                roped = apply_rope(qk, cos, sin)
            q, k = roped.split([self.num_heads, self.num_kv_heads], dim=1)
        context = get_forward_context()
        kv_cache = context.kv_caches[self.layer_idx]
        context.backend.write_kv(k, v, kv_cache, context.attn_metadata.slot_mapping)
        out = context.backend.forward(q, kv_cache, context.attn_metadata, self.scale)
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.cpu_op = False
        """SwiGLU through kvscope's C++ kernel (:func:`silu_and_mul`); set by
        ``kvscope.engine.platform.cpu.use_cpu_elementwise_ops``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x), self.cpu_op))


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)) (same operation order as HF). The second
    residual add is left to the next norm (:meth:`forward` returns the MLP output beside the residual
    stream, as vLLM's layers do), so that with kvscope's CPU kernels every add runs fused with the norm
    after it."""

    def __init__(self, config: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden_size]: the previous layer's MLP output, or the embeddings when ``residual`` is
        None (the first layer); residual [T, hidden_size]: the stream before that output was added. Returns
        (this layer's MLP output, the stream before it): the caller adds them, fused into the next norm
        (:func:`add_norm`)."""
        # children's ``forward`` called directly inside the decoder (here, in Attention and MLP): nn.Module's
        # ``__call__`` (hooks, tracing state) costs microseconds a call, 9 calls per layer, and nothing
        # registers hooks (docs/benchmarks.md "Per-step cost and where the time goes")
        if residual is None:
            residual, normed = hidden, self.input_layernorm.forward(hidden)
        else:
            residual, normed = add_norm(self.input_layernorm, hidden, residual)
        attn = self.self_attn.forward(normed, cos, sin)
        residual, normed = add_norm(self.post_attention_layernorm, attn, residual)
        return self.mlp.forward(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        # nn.Embedding's own normal_ init on the meta device (build_model) goes through torch._refs, whose
        # first use imports torch._dynamo: most of a float32 load (docs/benchmarks.md "Engine start-up"). Same
        # init, skipped only on meta.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = rope_tables(*self.rotary_emb(positions, hidden.dtype))
        residual = None
        for layer in self.layers:
            hidden, residual = layer.forward(hidden, residual, cos, sin)
        if residual is None:  # no layers
            return self.norm(hidden)
        return add_norm(self.norm, hidden, residual)[1]


# HF checkpoint name fragment → (fused parameter fragment, shard index); shards are laid out in order.
_STACKED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama / SmolLM2. Subclasses only change ``arch_config`` flags."""

    family: ClassVar[str] = "llama"

    def __init__(self, hf_config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = self.arch_config(hf_config)
        self.model = LlamaModel(self.config)
        if not self.config.tie_word_embeddings:
            self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.decode_head = None
        """An 8-bit copy of the LM head (kvscope.kernels.cpu_decode.PairBlocks) for the fused CPU decode
        step (engine/platform/fused_decode.py), set by kvscope.engine.platform.compact with kvscope's CPU
        kernels; None otherwise."""
        self.decode_head_vnni = None
        """The same 8-bit head transposed for the int16 tiles (kvscope.kernels.cpu_decode.VnniBlocks), where
        the start-up probe chose them: the fused step's logits of batched decode steps; None otherwise."""
        self.logits_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        """CPU kernel of the LM head: a CpuLinearKernel (set by kvscope.engine.platform.cpu.prepare_for_cpu),
        or a compact one (kvscope.engine.platform.compact)."""

    @classmethod
    def arch_config(cls, cfg: Mapping[str, Any]) -> ArchConfig:
        bias = bool(cfg.get("attention_bias", False))
        return ArchConfig(
            **_base_fields(cfg),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=cfg.get("sliding_window"),
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [T], positions int64 [T] → hidden [T, hidden_size]. Needs a forward context."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] → logits float32 [N, vocab_size] (tied: the embedding matrix). One row
        goes through the 8-bit ``decode_head`` where there is one, as in the fused decode step: the first
        token of a lone prompt comes from the same head as the tokens after it (a GEMV reading the 8-bit
        weights once; docs/benchmarks.md)."""
        if (
            self.decode_head is not None
            and hidden.shape[0] == 1
            and not torch.is_grad_enabled()
            and hidden.dtype in (torch.float32, torch.bfloat16)
        ):
            return self.decode_head.matmul(hidden.contiguous())
        if self.logits_kernel is not None and not torch.is_grad_enabled():
            return self.logits_kernel(hidden).float()
        if not self.config.tie_word_embeddings:
            return self.lm_head.forward(hidden).float()  # a compact lm_head has no dense weight
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the HF names used.

        Skips rotary caches and a tied ``lm_head.weight``. Raises KeyError for an unknown name, ValueError
        for a shape mismatch or when parameters are left unfilled.
        """
        params = dict(self.named_parameters())
        filled: set[tuple[str, int]] = set()
        used: set[str] = set()
        for name, tensor in weights:
            if name.endswith(SKIPPED_WEIGHT_SUFFIXES) or (
                name == "lm_head.weight" and self.config.tie_word_embeddings
            ):
                continue
            target, shard = self._target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            self._copy_shard(params[target], target, shard, tensor)
            filled.add((target, shard))
            used.add(name)
        self._check_filled(params, filled)
        return used

    @staticmethod
    def _target(name: str) -> tuple[str, int]:
        for fragment, (fused, shard) in _STACKED.items():
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, -1

    def _copy_shard(self, param: nn.Parameter, name: str, shard: int, tensor: torch.Tensor) -> None:
        rows = param.data if shard < 0 else param.data.narrow(0, *self._shard_range(name, shard))
        if rows.shape != tensor.shape:
            raise ValueError(
                f"shape mismatch for {name} shard {shard}: {tuple(tensor.shape)} vs {tuple(rows.shape)}"
            )
        with torch.no_grad():
            rows.copy_(tensor)

    def _shard_range(self, name: str, shard: int) -> tuple[int, int]:
        """(start row, num rows) of shard ``shard`` inside fused parameter ``name``."""
        c = self.config
        if ".qkv_proj." in name:
            sizes = [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2
        else:
            sizes = [c.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]

    @staticmethod
    def _check_filled(params: dict[str, nn.Parameter], filled: set[tuple[str, int]]) -> None:
        missing = []
        for name in params:
            shards = (0, 1, 2) if ".qkv_proj." in name else (0, 1) if ".gate_up_proj." in name else (-1,)
            missing += [f"{name}[{s}]" if s >= 0 else name for s in shards if (name, s) not in filled]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layers; ``sliding_window`` honoured only as a context-length limit (see module doc)."""

    family: ClassVar[str] = "mistral"


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: bias on q/k/v (not on o_proj)."""

    family: ClassVar[str] = "qwen2"

    @classmethod
    def arch_config(cls, cfg: Mapping[str, Any]) -> ArchConfig:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        return ArchConfig(**_base_fields(cfg), qkv_bias=True, o_bias=False, sliding_window=window)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm of q and k before RoPE; ``head_dim`` from the config."""

    family: ClassVar[str] = "qwen3"

    @classmethod
    def arch_config(cls, cfg: Mapping[str, Any]) -> ArchConfig:
        bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        return ArchConfig(
            **_base_fields(cfg), qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window
        )


def check_sliding_window(config: ArchConfig, max_model_len: int) -> None:
    """Raise ValueError when the model uses a sliding window shorter than ``max_model_len`` (not implemented;
    up to the window, full causal attention is exactly sliding-window attention)."""
    window = config.sliding_window
    if window is not None and max_model_len > window:
        raise ValueError(
            f"sliding-window attention is not implemented: set max_model_len <= {window} "
            f"(the window), got {max_model_len}"
        )
