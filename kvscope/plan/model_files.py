"""Finding a model's shape and weight files: a HF ``config.json`` (a file, a folder holding one, or a
registered model's cached conversion), or a GGUF header (``gguf`` package, metadata keys of llama.cpp's
``gguf-py/gguf/constants.py`` ``Keys.LLM``/``Keys.Attention``). Nothing is downloaded: a registered model that
is not in the cache yet is read from its ``.gguf`` after ``kvscope pull NAME``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvscope.common.models.cache import hf_dir, model_dir
from kvscope.common.models.registry import get_model_spec, is_registered, list_models
from kvscope.plan.gguf_header import read_gguf
from kvscope.plan.shape import ModelNotFoundError, ModelShape, shape_from_hf_config


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """The shape plus the weight files found beside it (for exact on-disk weight bytes)."""

    shape: ModelShape
    safetensors: tuple[Path, ...] = ()
    gguf: Path | None = None
    gguf_weights: Any = None
    """kvscope.plan.gguf_header.GgufWeights when the model was read from its GGUF header."""
    config_dtype: str | None = None
    """The config's ``torch_dtype`` (``dtype`` in newer transformers) when it names one of float32, bfloat16,
    float16: the dtype the checkpoint was published in; None for a GGUF or a config without it."""
    registered: str | None = None
    """The registry name when ``--model`` was one (its verified weight formats decide the engine's CPU
    default)."""


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
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not a registered name (known: "
        f"{', '.join(list_models())}), a HF folder or config.json, or a .gguf file"
    )


def _registered(name: str, root: Path | None) -> ModelFiles:
    converted = hf_dir(name, root)
    if (converted / "config.json").is_file():
        files = _from_hf_dir(converted, converted / "config.json", name)
        gguf = model_dir(name, root) / get_model_spec(name).gguf_filename
        return replace(files, gguf=gguf if gguf.is_file() else None, registered=name)
    gguf = model_dir(name, root) / get_model_spec(name).gguf_filename
    if gguf.is_file():
        return replace(_from_gguf(gguf, name), registered=name)
    raise ModelNotFoundError(
        f"model {name!r} is registered but not in the cache ({model_dir(name, root)}); "
        f"run `kvscope pull {name}` first"
    )


def _from_hf_dir(folder: Path, config_path: Path, name: str) -> ModelFiles:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError: say which file
        raise ValueError(f"config {config_path} is not JSON: {exc}") from None
    shape = shape_from_hf_config(config, name=name, source=str(config_path))
    return ModelFiles(shape, tuple(sorted(folder.glob("*.safetensors"))), config_dtype=config_dtype(config))


def config_dtype(config: Any) -> str | None:
    """The checkpoint's dtype from a HF config: ``torch_dtype`` (``dtype`` since transformers 4.56), one of
    float32, bfloat16, float16 (``torch.`` prefix dropped); None when absent or another value."""
    if not isinstance(config, dict):
        return None
    value = config.get("torch_dtype") or config.get("dtype")
    name = str(value).removeprefix("torch.") if isinstance(value, str) else None
    return name if name in ("float32", "bfloat16", "float16") else None


def _from_gguf(path: Path, name: str) -> ModelFiles:
    shape, weights = read_gguf(path, name)
    return ModelFiles(shape, gguf=path, gguf_weights=weights)
