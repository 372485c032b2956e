"""The model's shape, as the planner needs it: layers, heads, KV heads, head_dim, vocab, tied embeddings.

Read from a HF ``config.json`` (a file, a folder holding one, or a registered model's cached conversion), or
from a GGUF header (``gguf`` package, metadata keys of llama.cpp's ``gguf-py/gguf/constants.py``
``Keys.LLM``/``Keys.Attention``). Nothing is downloaded: a registered model that is not in the cache yet is
read from its ``.gguf`` after ``kvscope pull NAME``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.models.cache import hf_dir, model_dir
from kvscope.models.registry import get_model_spec, is_registered, list_models


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


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """The shape plus the weight files found beside it (for exact on-disk weight bytes)."""

    shape: ModelShape
    safetensors: tuple[Path, ...] = ()
    gguf: Path | None = None
    gguf_weights: Any = None
    """kvscope.plan.gguf_header.GgufWeights when the model was read from its GGUF header."""


def read_model(name_or_path: str, root: Path | None = None) -> ModelFiles:
    """Shape and weight files of a registered name, a HF folder, a ``config.json`` file or a ``.gguf`` file.

    ``root`` overrides the cache root. Raises ModelNotFoundError naming the registered models.
    """
    if is_registered(name_or_path):
        return _registered(name_or_path, root)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, path.stem)
    if path.is_file() and path.suffix == ".json":
        return _from_hf_dir(path.parent, path, path.parent.name)
    if path.is_dir() and (path / "config.json").is_file():
        return _from_hf_dir(path, path / "config.json", path.name)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return _from_gguf(ggufs[0], ggufs[0].stem)
    raise ModelNotFoundError(f"unknown model {name_or_path!r}: not a registered name (known: "
                             f"{', '.join(list_models())}), a HF folder or config.json, or a .gguf file")


def _registered(name: str, root: Path | None) -> ModelFiles:
    converted = hf_dir(name, root)
    if (converted / "config.json").is_file():
        files = _from_hf_dir(converted, converted / "config.json", name)
        gguf = model_dir(name, root) / get_model_spec(name).gguf_filename
        return ModelFiles(files.shape, files.safetensors, gguf if gguf.is_file() else None)
    gguf = model_dir(name, root) / get_model_spec(name).gguf_filename
    if gguf.is_file():
        return _from_gguf(gguf, name)
    raise ModelNotFoundError(f"model {name!r} is registered but not in the cache ({model_dir(name, root)}); "
                             f"run `kvscope pull {name}` first")


def _from_hf_dir(folder: Path, config_path: Path, name: str) -> ModelFiles:
    config = json.loads(config_path.read_text())
    shape = shape_from_hf_config(config, name=name, source=str(config_path))
    return ModelFiles(shape, tuple(sorted(folder.glob("*.safetensors"))))


def _from_gguf(path: Path, name: str) -> ModelFiles:
    from kvscope.plan.gguf_header import read_gguf

    shape, weights = read_gguf(path, name)
    return ModelFiles(shape, gguf=path, gguf_weights=weights)
