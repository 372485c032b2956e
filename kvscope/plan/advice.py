"""What would fit when a plan does not: the same request re-planned with one change, the first of each kind
that fits (kvscope/plan/planner.py decides "fits").

- A quantization (same device): on a GPU fp8 (where the device has fp8 tensor cores: vLLM's W8A8 needs them
  to compute in fp8), then int4 (weights only, computing in the dtype); on the CPU the kvscope engine's int8,
  then int4 (gguf for a registered model whose verified formats include it).
- A tensor-parallel degree (GPU): 2, 4, 8 devices of this kind, at the planned quantization.
- A bigger device: the smallest device of the table with more memory that fits at one device with the
  planned dtype and quantization (the table's devices have no CPU; for the CPU the answer is the RAM needed).

Each alternative is a full plan: its verdict and its recommended command carry every flag it assumes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvscope.common.models.registry import verified_formats
from kvscope.plan import formulas as f
from kvscope.plan.devices import CPU, Device, load_devices
from kvscope.plan.model_files import ModelFiles
from kvscope.plan.planner import Plan, PlanRequest, plan

GPU_QUANTIZATIONS = ("fp8", "int4")
"""Tried in this order on a GPU (least precision lost first)."""
CPU_FORMATS = ("int8", "int4")
"""The kvscope engine's compact CPU formats, tried in this order."""
TP_DEGREES = (2, 4, 8)


def _try(req: PlanRequest, files: ModelFiles, device: Device) -> Plan | None:
    """The plan of ``req`` on ``device``, or None when it cannot be planned there (a number format the
    device has no peak for, heads that a tensor-parallel degree does not divide)."""
    try:
        return plan(req, files, device)
    except ValueError:
        return None


def _entry(change: str, result: Plan) -> dict[str, Any]:
    flags = result.flags
    return {
        "change": change,
        "verdict": result.verdict["text"],
        "max_model_len": flags["engine"]["--max-model-len"],
        "max_num_seqs": flags["engine"]["--max-num-seqs"],
        "command": flags["command"],
        "note": flags["note"],
    }


def alternatives(planned: Plan, files: ModelFiles, device: Device) -> list[dict[str, Any]]:
    """Changes that make a plan that does not fit fit (module doc): ``change`` (the flag or device),
    ``verdict``, the planned ``max_model_len``/``max_num_seqs``, ``command`` and ``note``. Empty when
    ``planned`` fits or nothing tried fits."""
    if planned.fits:
        return []
    req = PlanRequest(**planned.request)  # resolved: no auto left
    out: list[dict[str, Any]] = []
    if device.name == CPU:
        out += _cpu_formats(req, files, device)
        need = planned.verdict["needed_bytes"] / req.gpu_memory_utilization
        out.append(
            {
                "change": "a machine with more RAM",
                "verdict": f"needs at least {need / (1 << 30):,.1f} GiB of RAM at utilization "
                f"{req.gpu_memory_utilization:g} (this one has {device.memory_bytes / (1 << 30):,.1f} GiB)",
                "max_model_len": None,
                "max_num_seqs": None,
                "command": None,
                "note": None,
            }
        )
        return out
    out += _gpu_quantizations(req, files, device)
    for tp in TP_DEGREES:
        if tp > req.tensor_parallel_size:
            result = _try(replace(req, tensor_parallel_size=tp), files, device)
            if result is not None and result.fits:
                out.append(_entry(f"--tensor-parallel-size {tp}", result))
                break
    bigger = sorted(
        (d for d in load_devices().values() if d.memory_bytes > device.memory_bytes),
        key=lambda d: (d.memory_bytes, d.name),
    )
    for other in bigger:
        result = _try(replace(req, device=other.name, tensor_parallel_size=1), files, other)
        if result is not None and result.fits:
            out.append(_entry(f"--device {other.name}", result))
            break
    return out


def _gpu_quantizations(req: PlanRequest, files: ModelFiles, device: Device) -> list[dict[str, Any]]:
    current = f.QUANT_BYTES[req.quantization] or f.DTYPE_BYTES[req.dtype]
    for quantization in GPU_QUANTIZATIONS:
        if (f.QUANT_BYTES[quantization] or 0) >= current:
            continue
        result = _try(replace(req, quantization=quantization), files, device)
        if result is not None and result.fits:
            return [_entry(f"--quantization {quantization}", result)]
    return []


def _cpu_formats(req: PlanRequest, files: ModelFiles, device: Device) -> list[dict[str, Any]]:
    verified, _ = verified_formats(files.registered or req.model)
    order = ["int8", "gguf" if "gguf" in verified else "int4"]
    if req.weights_format in order:
        order = order[order.index(req.weights_format) + 1 :]
    for weights_format in order:
        result = _try(replace(req, weights_format=weights_format, quantization="none"), files, device)
        if result is not None and result.fits:
            quantization = "gguf" if weights_format == "gguf" else weights_format
            return [_entry(f"--quantization {quantization}", result)]
    return []
