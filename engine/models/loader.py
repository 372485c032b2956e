"""Find (pull, convert) a model folder and load its weights into one of our model classes.

``name_or_path`` is a registry name (``smollm2-135m``: pulled, then converted once to
``<cache>/models/<name>/hf``), a ``.gguf`` file (converted once to ``<cache>/models/<stem>-<key>/hf``),
a folder holding exactly one ``.gguf`` (same), or a HF folder with ``config.json`` + ``*.safetensors``
(used as is).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.models.gguf import convert_gguf_to_hf
from engine.models.llama import LlamaForCausalLM, check_sliding_window
from engine.models.registry import get_model_class
from kvscope.models.cache import cache_root, hf_dir
from kvscope.models.pull import pull
from kvscope.models.registry import UnknownModelError, is_registered, list_models

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadReport:
    """Timings of one ``load_model`` call (seconds), attached to the model as ``model.load_report``."""

    model_dir: Path
    converted: bool
    """True when this call converted a GGUF (first use); False when the safetensors cache was used."""
    resolve_s: float
    """pull check + GGUF conversion (when ``converted``)."""
    weights_s: float
    """Build the module and copy the safetensors weights in."""

    @property
    def total_s(self) -> float:
        return self.resolve_s + self.weights_s


def resolve_model_dir(name_or_path: str, *, root: Path | None = None) -> Path:
    """HF folder for ``name_or_path`` (see module doc), pulling and converting on first use.

    ``root`` overrides the cache root. Raises UnknownModelError (a ValueError) when it is neither a
    registry name nor a usable path, PullError when a pull fails.
    """
    return _resolve(name_or_path, root)[0]


def _resolve(name_or_path: str, root: Path | None) -> tuple[Path, bool]:
    if is_registered(name_or_path):
        return _ensure_converted(pull(name_or_path, root=root), hf_dir(name_or_path, root))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _ensure_converted(path, gguf_conversion_dir(path, root))
    if path.is_dir() and (path / "config.json").is_file():
        return path, False
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return _ensure_converted(ggufs[0], gguf_conversion_dir(ggufs[0], root))
    raise UnknownModelError(f"model {name_or_path!r} is not a registered name ({', '.join(list_models())}), "
                            "a HF folder with config.json, or a .gguf file")


def gguf_conversion_dir(gguf_path: Path, root: Path | None = None) -> Path:
    """``<cache>/models/<stem>-<key>/hf``, key = sha256(resolved path, size, mtime)[:12]: a changed file
    gets a fresh conversion without hashing gigabytes."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root(root) / "models" / f"{gguf_path.stem}-{key}" / "hf"


def _ensure_converted(gguf_path: Path, out_dir: Path) -> tuple[Path, bool]:
    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir, False
    logger.info("converting %s to %s (first use; dequantizes every tensor once)", gguf_path, out_dir)
    return convert_gguf_to_hf(gguf_path, out_dir), True


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of a HF folder as a dict. Raises FileNotFoundError."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) over every ``*.safetensors`` file of the folder (memory-mapped, one at a time).

    Raises FileNotFoundError when there is none (``pytorch_model.bin`` is not supported).
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield name, f.get_tensor(name)


def build_model(hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device | str,
                model_dir: Path) -> LlamaForCausalLM:
    """Instantiate without initialising (meta device), allocate on ``device``, fill from safetensors."""
    with torch.device("meta"):
        model = get_model_class(hf_config)(hf_config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()


def load_model(model_config: ModelConfig, device: torch.device | str = "cpu", *,
               root: Path | None = None) -> tuple[LlamaForCausalLM, dict[str, Any], Path]:
    """Resolve, (pull, convert,) and load ``model_config.model`` on ``device`` in ``model_config.dtype``.

    Returns (model, HF config dict, model folder); ``model.load_report`` holds a LoadReport. Raises
    ValueError for unsupported architectures or a context longer than a sliding window.
    """
    start = time.perf_counter()
    model_dir, converted = _resolve(model_config.model, root)
    resolved = time.perf_counter()
    hf_config = read_hf_config(model_dir)
    model = build_model(hf_config, DTYPES[model_config.dtype], device, model_dir)
    check_sliding_window(model.config, model_config.max_model_len or hf_config["max_position_embeddings"])
    report = LoadReport(model_dir=model_dir, converted=converted, resolve_s=resolved - start,
                        weights_s=time.perf_counter() - resolved)
    model.load_report = report
    logger.info("loaded %s from %s in %.2fs (resolve%s %.2fs, weights %.2fs)", model_config.model, model_dir,
                report.total_s, " + convert" if converted else "", report.resolve_s, report.weights_s)
    return model, hf_config, model_dir
