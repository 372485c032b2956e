"""Find (pull, convert) a model folder and build one of our model classes from its weights.

``name_or_path`` is a registry name (``smollm2-135m``: pulled, then converted once to
``<cache>/models/<name>/hf``), a ``.gguf`` file (converted once to ``<cache>/models/<stem>-<key>/hf``),
a folder holding exactly one ``.gguf`` (same), or a HF folder with ``config.json`` + ``*.safetensors``
(used as is). ``load_model`` (kvscope.engine.platform.loader) joins this with the weight format and the CPU
platform.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors import safe_open

from kvscope.common.models.cache import cache_root, hf_dir
from kvscope.common.models.pull import pull
from kvscope.common.models.registry import UnknownModelError, is_registered, list_models
from kvscope.engine.models.llama import LlamaForCausalLM
from kvscope.engine.models.registry import get_model_class
from kvscope.engine.weights.gguf import convert_gguf_to_hf

logger = logging.getLogger(__name__)


def resolve_model_dir(name_or_path: str, *, root: Path | None = None) -> Path:
    """HF folder for ``name_or_path`` (see module doc), pulling and converting on first use.

    ``root`` overrides the cache root. Raises UnknownModelError (a ValueError) when it is neither a
    registry name nor a usable path, PullError when a pull fails.
    """
    return resolve_model_files(name_or_path, root)[0]


def resolve_model_files(name_or_path: str, root: Path | None = None) -> tuple[Path, bool, Path | None]:
    """(HF folder, converted now, the source GGUF or None) for ``name_or_path`` (see module doc); raises as
    :func:`resolve_model_dir`."""
    if is_registered(name_or_path):
        gguf_path = pull(name_or_path, root=root)
        return *_ensure_converted(gguf_path, hf_dir(name_or_path, root)), gguf_path
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return *_ensure_converted(path, gguf_conversion_dir(path, root)), path
    if path.is_dir() and (path / "config.json").is_file():
        return path, False, None
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return *_ensure_converted(ggufs[0], gguf_conversion_dir(ggufs[0], root)), ggufs[0]
    raise UnknownModelError(
        f"model {name_or_path!r} is not a registered name ({', '.join(list_models())}), "
        "a HF folder with config.json, or a .gguf file"
    )


def gguf_conversion_dir(gguf_path: Path, root: Path | None = None) -> Path:
    """``<cache>/models/<stem>-<key>/hf``, key = sha256(resolved path, size, mtime)[:12]: a changed file
    gets a fresh conversion without hashing gigabytes."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root(root) / "models" / f"{gguf_path.stem}-{key}" / "hf"


def _ensure_converted(gguf_path: Path, out_dir: Path) -> tuple[Path, bool]:
    """(``out_dir``, converted now): the GGUF's HF folder, converted on first use. Processes that start at
    once (``kvscope serve``'s replicas on a fresh machine) convert once: the first holds
    ``<out_dir>.lock``, the others wait and then find the folder (renamed into place whole:
    :func:`convert_gguf_to_hf`)."""
    if _converted(out_dir):
        return out_dir, False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out_dir.with_name(out_dir.name + ".lock")):
        if _converted(out_dir):
            return out_dir, False
        logger.info("converting %s to %s (first use; dequantizes every tensor once)", gguf_path, out_dir)
        return convert_gguf_to_hf(gguf_path, out_dir), True


def _converted(out_dir: Path) -> bool:
    return (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file()


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


def build_model(
    hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device | str, model_dir: Path
) -> LlamaForCausalLM:
    """Instantiate without initialising (meta device), allocate on ``device``, fill from safetensors."""
    with torch.device("meta"):
        model = get_model_class(hf_config)(hf_config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()
