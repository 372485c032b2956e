"""What a plan assumes where the request leaves a choice open: ``--dtype auto`` and ``--quantization auto``
resolved as the engine resolves them for the device, each with the reason the plan prints.

- ``--dtype auto`` on a GPU: the checkpoint's own dtype (the config's ``torch_dtype``) when it is bfloat16 or
  float16, else bfloat16 (the kvscope engine's ``--dtype auto`` on CUDA, and what vLLM serves a float32
  checkpoint in); float16 on a device without bfloat16 (a T4: no bf16 peak in the table), as vLLM does on GPUs
  before compute capability 8.0.
- ``--dtype auto`` on the CPU: the faster of float32 and bfloat16 on this machine by the planner's probe (its
  matmul peaks), as the engine's start-up probe picks (engine/config.py ``ModelConfig.dtype``).
- ``--quantization auto`` on a GPU: none (the engine's compact formats are CPU-only).
- ``--quantization auto`` on the CPU: the weight format ``kvscope serve`` runs (engine/platform/
  format_choice.py): ``gguf`` when the model's verified formats include it (the chooser picks it wherever
  kvscope's CPU kernels build: its decode step runs as one C++ call), else the dense format of the dtype. An
  explicit ``--dtype`` with ``--quantization auto`` means dense weights in that dtype, as for the engine.
- An explicit ``--quantization int8|int4`` (or ``none``) on the CPU is planned as the kvscope engine's format
  of that name (``--weights-format``: the bytes the engine holds, dense copies included).
"""

from __future__ import annotations

from dataclasses import replace

from kvscope.common.models.registry import verified_formats
from kvscope.plan import engine_formats as ef
from kvscope.plan.devices import CPU, Device
from kvscope.plan.model_files import ModelFiles
from kvscope.plan.request import PlanRequest

DENSE_ENGINE_FORMATS = ("float32", "bfloat16")
"""Dense dtypes the kvscope engine has a CPU weight format for (kvscope.common.weight_formats)."""
CPU_QUANTIZATIONS = ("int8", "int4")
"""``--quantization`` values the kvscope engine runs on the CPU besides none and gguf."""


def cpu_dtype(device: Device) -> str:
    """The engine's ``--dtype auto`` on this CPU: bfloat16 when the probe's bf16 matmul peak beats fp32's."""
    return (
        "bfloat16" if device.peak_flops.get("bf16", 0.0) > device.peak_flops.get("fp32", 0.0) else "float32"
    )


def gpu_dtype(files: ModelFiles, device: Device) -> tuple[str, str]:
    """(dtype, reason) of ``--dtype auto`` on a GPU (module doc)."""
    checkpoint = files.config_dtype
    if checkpoint in ("bfloat16", "float16"):
        dtype, why = checkpoint, f"the config's torch_dtype {checkpoint}"
    else:
        said = (
            f"the config's torch_dtype is {checkpoint}" if checkpoint else "the config names no torch_dtype"
        )
        dtype, why = "bfloat16", f"the engine's --dtype auto on CUDA ({said})"
    if dtype == "bfloat16" and "bf16" not in device.peak_flops:
        dtype, why = "float16", f"{why}; {device.name} has no bfloat16, so float16 (as vLLM)"
    return dtype, why


def resolve_request(
    req: PlanRequest, files: ModelFiles, device: Device
) -> tuple[PlanRequest, dict[str, str]]:
    """``req`` with ``dtype``, ``quantization`` and (on the CPU) ``weights_format`` decided, and the reasons:
    engine flag → why the plan uses its value (empty for a value the request named). Raises nothing."""
    assumed: dict[str, str] = {}
    on_cpu = device.name == CPU
    dtype = req.dtype
    if dtype == "auto":
        if on_cpu:
            dtype = cpu_dtype(device)
            fp32, bf16 = (device.peak_flops.get(k, 0.0) / 1e12 for k in ("fp32", "bf16"))
            assumed["--dtype"] = (
                f"the engine's --dtype auto on this CPU: the faster by the probe (bf16 {bf16:,.2f}, "
                f"fp32 {fp32:,.2f} TFLOP/s)"
            )
        else:
            dtype, assumed["--dtype"] = gpu_dtype(files, device)
    quantization, weights_format = req.quantization, req.weights_format
    if weights_format is not None:
        quantization = "none" if quantization == "auto" else quantization
    elif not on_cpu:
        if quantization == "auto":
            quantization, assumed["--quantization"] = "none", "the engine's --quantization auto on CUDA"
    elif quantization == "auto":
        verified, _ = verified_formats(files.registered or req.model)
        if req.dtype == "auto" and "gguf" in verified:
            weights_format = "gguf"
            assumed["--quantization"] = (
                "what kvscope serve's --quantization auto runs where kvscope's CPU kernels build "
                f"(verified formats of {files.registered}: {', '.join(verified)})"
            )
        else:
            weights_format = dtype if dtype in DENSE_ENGINE_FORMATS else None
            why = "the --dtype given" if req.dtype != "auto" else f"verified formats: {', '.join(verified)}"
            assumed["--quantization"] = f"dense weights in {dtype} ({why})"
        quantization = "none"
    elif quantization in CPU_QUANTIZATIONS or (quantization == "none" and dtype in DENSE_ENGINE_FORMATS):
        weights_format = dtype if quantization == "none" else quantization
    return replace(req, dtype=dtype, quantization=quantization, weights_format=weights_format), assumed


def engine_quantization(req: PlanRequest) -> str:
    """The ``--quantization`` an engine runs ``req`` with: the weight format's, else the request's."""
    return ef.ENGINE_FORMATS[req.weights_format][1] if req.weights_format else req.quantization
