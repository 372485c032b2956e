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
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def attention_kind(self) -> str:
        """``MHA`` (one KV head per query head), ``MQA`` (one KV head) or ``GQA`` (groups)."""
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


def shape_from_hf_config(config: dict[str, Any], name: str = "", source: str = "") -> ModelShape:
    """A ModelShape from a HF ``config.json`` dict (transformers' ``LlamaConfig`` field names and defaults:
    ``num_key_value_heads`` defaults to ``num_attention_heads``, ``head_dim`` to hidden/heads).
    Raises ValueError for a missing required field."""
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelShape(
            name=name or str(config.get("_name_or_path") or config.get("model_type") or "model"),
            num_layers=int(config["num_hidden_layers"]), hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            qkv_bias=bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2",
            qk_norm=config.get("model_type") == "qwen3", source=source)
    except KeyError as exc:
        raise ValueError(f"config {source or name} has no {exc.args[0]!r}") from None
