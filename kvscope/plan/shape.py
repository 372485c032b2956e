"""The model's shape, as the planner needs it: layers, heads, KV heads, head_dim, vocab, tied embeddings, from
a HF ``config.json`` dict. Finding the files (registered name, folder, config, GGUF header) is
kvscope/plan/model_files.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ModelNotFoundError(ValueError):
    """``--model`` is neither a registered name nor a usable path; the message names what is known."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The architecture numbers of a decoder-only transformer (Llama family: GQA, SwiGLU MLP, RMSNorm)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    """Equal to ``num_heads`` for MHA, 1 for MQA, in between for GQA."""
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    source: str = ""
    """Where the numbers came from (a config.json or .gguf path)."""

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def attention_kind(self) -> str:
        """``MHA`` (one KV head per query head), ``MQA`` (one KV head) or ``GQA`` (groups)."""
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


MAX_DIMENSION = 1 << 24
"""Largest layer count, width, head count or vocabulary a config may state (real models are far below)."""


def _count(config: dict[str, Any], key: str, where: str, default: Any = None) -> int:
    """A positive whole number from ``config[key]`` (``default`` when absent or null). Raises ValueError
    naming the field for a missing, non-integer, boolean, non-positive or absurdly large value."""
    value = config.get(key, default) if config.get(key) is not None else default
    if value is None:
        raise ValueError(f"config {where} has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"config {where}: {key} must be a whole number, got {value!r}")
    if not 1 <= value <= MAX_DIMENSION:
        raise ValueError(f"config {where}: {key} must be between 1 and {MAX_DIMENSION}, got {value!r}")
    return int(value)


def shape_from_hf_config(config: dict[str, Any], name: str = "", source: str = "") -> ModelShape:
    """A ModelShape from a HF ``config.json`` dict (transformers' ``LlamaConfig`` field names and defaults:
    ``num_key_value_heads`` defaults to ``num_attention_heads``, ``head_dim`` to hidden/heads).
    Raises ValueError naming the field for a config that is not a JSON object, a missing or invalid
    dimension (attention-free models such as Mamba have no ``num_attention_heads``), or heads that do not
    divide."""
    where = source or name or "config.json"
    if not isinstance(config, dict):
        raise ValueError(f"config {where} must be a JSON object, got {type(config).__name__}")
    heads = _count(config, "num_attention_heads", where)
    hidden = _count(config, "hidden_size", where)
    kv_heads = _count(config, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ValueError(
            f"config {where}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    return ModelShape(
        name=name or str(config.get("_name_or_path") or config.get("model_type") or "model"),
        num_layers=_count(config, "num_hidden_layers", where),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_count(config, "head_dim", where, default=max(1, hidden // heads)),
        intermediate_size=_count(config, "intermediate_size", where),
        vocab_size=_count(config, "vocab_size", where),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=_count(config, "max_position_embeddings", where, default=2048),
        qkv_bias=bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2",
        qk_norm=config.get("model_type") == "qwen3",
        source=source,
    )
