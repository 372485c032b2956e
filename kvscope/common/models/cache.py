"""Where models live on disk: ``<cache root>/models/<name>/`` (the .gguf) and ``…/<name>/hf`` (converted)."""

from __future__ import annotations

from pathlib import Path

from kvscope.common.models.settings import ModelSettings

HF_SUBDIR = "hf"


def cache_root(root: Path | None = None) -> Path:
    """``root`` if given, else ``$KVSCOPE_CACHE`` or ``~/.cache/kvscope`` (read at call time)."""
    return Path(root) if root is not None else ModelSettings.from_env().cache_root


def model_dir(name: str, root: Path | None = None) -> Path:
    """Directory holding everything of model ``name``: ``<root>/models/<name>``."""
    return cache_root(root) / "models" / name


def hf_dir(name: str, root: Path | None = None) -> Path:
    """Directory of the HF-format conversion (config.json + model.safetensors + tokenizer) of ``name``."""
    return model_dir(name, root) / HF_SUBDIR
