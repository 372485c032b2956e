"""``load_model``: a model for this machine, from its name or path to a built, quantized module.

Model files → weight format (``--quantization``/``--dtype``, resolved with the CPU kernel probe and whether
kvscope's CPU kernels load) → module (kvscope.engine.weights.files.build_model) → quantization
(kvscope.engine.platform.compact) → the C++ elementwise-op switches. Returns the model with a
:class:`LoadReport` beside it (the module carries no report). Packing the projections for the CPU
(:func:`kvscope.engine.platform.cpu.prepare_for_cpu`) is the engine's next step, not the loader's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvscope.common.models.cache import cache_root
from kvscope.common.models.registry import verified_formats
from kvscope.engine.config import ModelConfig
from kvscope.engine.models.llama import LlamaForCausalLM, check_sliding_window
from kvscope.engine.platform.compact import QuantReport, quantize_model
from kvscope.engine.platform.cpu import load_cpu_kernels, use_cpu_elementwise_ops
from kvscope.engine.platform.format_choice import FormatChoice, choose_format, pinned_format
from kvscope.engine.platform.kernel_probe import KernelChoice, probe_cpu_kernels
from kvscope.engine.weights.files import build_model, read_hf_config, resolve_model_files
from kvscope.kernels.cpu_decode import BuildResult

logger = logging.getLogger(__name__)

PAIR_KERNEL_QUANTIZATIONS = ("auto", "int4", "gguf")
"""``--quantization`` values whose weights kvscope's CPU kernels can hold (4-bit blocks, a Q8_0 LM head)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one ``load_model`` call did and how long it took (seconds); returned beside the model."""

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


class LoadedModel(NamedTuple):
    """The result of :func:`load_model`: unpacks as ``model, hf_config, model_dir, report``."""

    model: LlamaForCausalLM
    hf_config: dict[str, Any]
    """The folder's ``config.json``."""
    model_dir: Path
    report: LoadReport


def load_model(
    model_config: ModelConfig, device: torch.device | str = "cpu", *, root: Path | None = None
) -> LoadedModel:
    """Resolve, (pull, convert,) and load ``model_config.model`` on ``device`` in the weight format the flags
    ask for (``auto``: chosen for this machine). ``root`` overrides the model cache root. Raises ValueError
    for unsupported architectures, a context longer than a sliding window, or a quantization off the CPU;
    UnknownModelError / PullError as kvscope.engine.weights.files.resolve_model_dir."""
    start = time.perf_counter()
    model_dir, converted, gguf_path = resolve_model_files(model_config.model, root)
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
        use_cpu_elementwise_ops(
            model
        )  # norms, residual add + norm, SwiGLU, RoPE: kernels/csrc/cpu_elementwise.cpp
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
    logger.info(  # the format (dtype, quantization, why): the engine's "weights format" line
        "loaded %s from %s in %.2fs (resolve%s %.2fs, weights %.2fs)",
        model_config.model,
        model_dir,
        report.total_s,
        " + convert" if converted else "",
        report.resolve_s,
        report.weights_s,
    )
    return LoadedModel(model, hf_config, model_dir, report)


def resolve_format(
    model_config: ModelConfig,
    device: torch.device,
    kernels: KernelChoice | None,
    gguf_path: Path | None,
    cpu_kernels: bool = False,
) -> FormatChoice:
    """The weight format to load: ``--quantization auto`` with ``--dtype auto`` asks
    :func:`kvscope.engine.platform.format_choice.choose_format` (the model's verified formats, the probe,
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
