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
from filelock import FileLock
from safetensors import safe_open

from kvscope.common.models.cache import cache_root, hf_dir
from kvscope.common.models.pull import pull
from kvscope.common.models.registry import UnknownModelError, is_registered, list_models, verified_formats
from kvscope.engine.config import ModelConfig
from kvscope.engine.models.compact import QuantReport, quantize_model
from kvscope.engine.models.format_choice import FormatChoice, choose_format, pinned_format
from kvscope.engine.models.gguf import convert_gguf_to_hf
from kvscope.engine.models.kernel_probe import KernelChoice, probe_cpu_kernels
from kvscope.engine.models.llama import LlamaForCausalLM, check_sliding_window
from kvscope.engine.models.registry import get_model_class
from kvscope.kernels.cpu_decode import BuildResult, load

logger = logging.getLogger(__name__)

PAIR_KERNEL_QUANTIZATIONS = ("auto", "int4", "gguf")
"""``--quantization`` values whose weights kvscope's CPU kernels can hold (4-bit blocks, a Q8_0 LM head)."""
CPU_KERNELS_DIR = "cpu-kernels"
"""Folder under the model cache root for kvscope's compiled CPU kernels (one library per source/torch/CPU)."""

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
    """Build the module and copy the safetensors weights in (and quantize)."""
    dtype: torch.dtype = torch.float32
    """The dtype the model runs in (``--dtype auto`` resolved)."""
    quantization: QuantReport | None = None
    kernels: KernelChoice | None = None
    """The CPU kernel probe's result, when one ran (``--dtype auto`` or a quantization)."""
    gguf_path: Path | None = None
    """The GGUF the weights came from, if any."""
    weight_format: FormatChoice | None = None
    """The weight format loaded and why (``--quantization auto`` chose it, or the flags pinned it)."""
    cpu_kernels: BuildResult | None = None
    """kvscope's CPU kernels (kernels/cpu_decode.py): loaded or why not; None when not tried
    (``--cpu-kernels torch``, or not on CPU)."""

    @property
    def total_s(self) -> float:
        return self.resolve_s + self.weights_s


def resolve_model_dir(name_or_path: str, *, root: Path | None = None) -> Path:
    """HF folder for ``name_or_path`` (see module doc), pulling and converting on first use.

    ``root`` overrides the cache root. Raises UnknownModelError (a ValueError) when it is neither a
    registry name nor a usable path, PullError when a pull fails.
    """
    return _resolve(name_or_path, root)[0]


def _resolve(name_or_path: str, root: Path | None) -> tuple[Path, bool, Path | None]:
    """(HF folder, converted now, the source GGUF or None)."""
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


def load_model(
    model_config: ModelConfig, device: torch.device | str = "cpu", *, root: Path | None = None
) -> tuple[LlamaForCausalLM, dict[str, Any], Path]:
    """Resolve, (pull, convert,) and load ``model_config.model`` on ``device`` in ``model_config.dtype``.

    Returns (model, HF config dict, model folder); ``model.load_report`` holds a LoadReport. Raises
    ValueError for unsupported architectures or a context longer than a sliding window.
    """
    start = time.perf_counter()
    model_dir, converted, gguf_path = _resolve(model_config.model, root)
    resolved = time.perf_counter()
    hf_config = read_hf_config(model_dir)
    device = torch.device(device)
    if model_config.quantization not in ("none", "auto") and device.type != "cpu":
        raise ValueError(
            f"quantization {model_config.quantization!r} runs on CPU only (torch's packed CPU "
            f"kernels); use --quantization none on {device}"
        )
    # the kernels' build folder is the configured cache root's even when ``root`` moves the models elsewhere
    # (a test's tmp folder): one compile per machine, not per model folder
    cpu_kernels = (
        load_cpu_kernels(cache_root())
        if device.type == "cpu"
        and model_config.cpu_kernels == "auto"
        and model_config.quantization in PAIR_KERNEL_QUANTIZATIONS
        else None
    )
    kernels = (
        probe_cpu_kernels()
        if device.type == "cpu"
        and (model_config.dtype == "auto" or model_config.quantization not in ("none", "auto"))
        else None
    )
    fmt = resolve_format(
        model_config, device, kernels, gguf_path, cpu_kernels=cpu_kernels is not None and cpu_kernels.ok
    )
    dtype = DTYPES[fmt.dtype]
    model = build_model(hf_config, dtype, device, model_dir)
    check_sliding_window(model.config, model_config.max_model_len or hf_config["max_position_embeddings"])
    quant = None
    if fmt.quantization != "none":
        quant = quantize_model(
            model,
            fmt.quantization,
            kernels,
            gguf_path,
            model_dir,
            pair_kernels=cpu_kernels is not None and cpu_kernels.ok,
        )
    if cpu_kernels is not None and cpu_kernels.ok and dtype == torch.bfloat16:
        model.use_cpu_elementwise_ops()  # norms, residual add + norm, SwiGLU, RoPE: kernels/csrc/cpu_elementwise.cpp
    report = LoadReport(
        model_dir=model_dir,
        converted=converted,
        resolve_s=resolved - start,
        weights_s=time.perf_counter() - resolved,
        dtype=dtype,
        quantization=quant,
        kernels=kernels,
        gguf_path=gguf_path,
        weight_format=fmt,
        cpu_kernels=cpu_kernels,
    )
    model.load_report = report
    logger.info(
        "loaded %s from %s in %.2fs (resolve%s %.2fs, weights %.2fs), dtype %s, quantization %s",
        model_config.model,
        model_dir,
        report.total_s,
        " + convert" if converted else "",
        report.resolve_s,
        report.weights_s,
        fmt.dtype,
        fmt.quantization,
    )
    return model, hf_config, model_dir


def load_cpu_kernels(root: Path) -> BuildResult:
    """Build (first start on a machine: ~15 s of C++ compile) and load kvscope's CPU kernels from
    ``root``/:data:`CPU_KERNELS_DIR`; logs where they are not usable (torch's kernels are used then)."""
    started = time.perf_counter()
    logger.info(
        "kvscope CPU kernels: loading from %s (the first start on a machine compiles them, ~15-45 s)",
        root / CPU_KERNELS_DIR,
    )
    result = load(root / CPU_KERNELS_DIR)
    level = logging.INFO if result.ok else logging.WARNING
    logger.log(
        level,
        "kvscope CPU kernels %s (%s, %.1fs)%s",
        "loaded" if result.ok else "unavailable",
        result.detail,
        time.perf_counter() - started,
        "" if result.ok else ": using torch's kernels",
    )
    return result


def resolve_format(
    model_config: ModelConfig,
    device: torch.device,
    kernels: KernelChoice | None,
    gguf_path: Path | None,
    cpu_kernels: bool = False,
) -> FormatChoice:
    """The weight format to load: ``--quantization auto`` with ``--dtype auto`` asks
    :func:`kvscope.engine.models.format_choice.choose_format` (the model's verified formats, the probe,
    whether kvscope's CPU kernels loaded: ``cpu_kernels``); an explicit ``--dtype`` with ``auto`` pins dense
    weights in it; explicit flags are kept as given (dtype auto resolved).
    """
    if model_config.quantization == "auto" and model_config.dtype == "auto":
        verified, source = verified_formats(model_config.model)
        return choose_format(
            verified,
            kernels,
            source=source,
            device_type=device.type,
            has_gguf=gguf_path is not None,
            cpu_kernels=cpu_kernels,
        )
    dtype = str(resolve_dtype(model_config.dtype, device, kernels)).removeprefix("torch.")
    if model_config.quantization == "auto":
        return pinned_format(dtype, "none", f"--dtype {model_config.dtype} given: dense weights")
    return pinned_format(
        dtype,
        model_config.quantization,
        f"--dtype {model_config.dtype} --quantization {model_config.quantization} given",
    )


def resolve_dtype(name: str, device: torch.device, kernels: KernelChoice | None) -> torch.dtype:
    """The torch dtype for ``--dtype name``: ``auto`` is the probe's faster dense dtype on CPU (float32
    when no probe ran) and bfloat16 elsewhere. Raises KeyError for an unknown name."""
    if name != "auto":
        return DTYPES[name]
    if device.type != "cpu":
        return torch.bfloat16
    return kernels.dense_dtype if kernels is not None else torch.float32
