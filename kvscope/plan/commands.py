"""The command a plan recommends: the server that runs what was planned, with every flag the plan assumed.

- ``kvscope engine``: the CPU in one of its weight formats (``--dtype``, ``--quantization``
  none/int8/int4/gguf, ``--kv-cache-memory``), or one GPU (``--device cuda``) with unquantized weights and the
  KV cache in the model dtype: the engine has neither tensor parallelism, GPU quantization nor
  ``--kv-cache-dtype``.
- ``vllm serve``: a GPU plan the kvscope engine cannot run: ``--tensor-parallel-size N``, ``--quantization``
  fp8 (vLLM's online dynamic FP8), int4 (``bitsandbytes``: vLLM's in-flight 4-bit quantization; an AWQ/GPTQ
  checkpoint is faster, and vLLM reads its method from the checkpoint), int8 (``compressed-tensors``: a W8A8
  checkpoint, which vLLM cannot make in flight), ``--kv-cache-dtype fp8``. The kvscope gateway fronts it
  (``kvscope gateway --upstream``).
- none: a GGUF block type (``q4_k`` …: llama.cpp's ``llama-server`` serves that file), fp8 weights or an fp8
  KV cache on the CPU, a KV dtype vLLM has no flag for: the plan says why instead of naming flags that would
  not run it.

Every command names ``--dtype`` and ``--quantization`` (the engine's defaults are ``auto``, which could pick
another format than the one planned), the context length, the sequence limit and the block size, and the
step's token budget the TTFT rows and the activation estimate assumed (``--max-num-batched-tokens``): always
for ``vllm serve``, whose default is not the kvscope engine's, and for ``kvscope engine`` when the request set
another than the engine's default.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvscope.plan.devices import CPU, Device
from kvscope.plan.model_files import ModelFiles
from kvscope.plan.request import DEFAULT_MAX_NUM_BATCHED_TOKENS, PlanRequest
from kvscope.plan.resolve import engine_quantization

KVSCOPE_ENGINE = "kvscope engine"
VLLM = "vllm serve"
VLLM_QUANTIZATION = {"fp8": "fp8", "int4": "bitsandbytes", "int8": "compressed-tensors"}
"""The planner's GPU quantization → vLLM's ``--quantization`` (module doc)."""
NEEDS_CHECKPOINT = {"int8": "a W8A8 int8 checkpoint of the model (llm-compressor's compressed-tensors)"}
"""GPU quantizations vLLM cannot apply in flight: the command serves such a checkpoint."""


def _server(req: PlanRequest, device: Device) -> tuple[str | None, str | None]:
    """(the server, None) or (None, why no server runs this plan)."""
    quantization = engine_quantization(req)
    if device.name == CPU:
        if req.kv_dtype != req.dtype:
            return None, f"the kvscope engine keeps the KV cache in --dtype ({req.dtype}), not {req.kv_dtype}"
        if quantization in ("none", "int8", "int4", "gguf"):
            return KVSCOPE_ENGINE, None
        return (
            None,
            f"the kvscope engine has no {quantization} CPU format (llama.cpp's llama-server runs GGUF types)",
        )
    if quantization not in ("none", *VLLM_QUANTIZATION):
        return None, f"{quantization} is a GGUF block type: llama.cpp's llama-server serves that .gguf file"
    if req.kv_dtype not in (req.dtype, "fp8"):
        return (
            None,
            f"neither the kvscope engine nor vLLM has a {req.kv_dtype} KV cache beside {req.dtype} weights",
        )
    simple = req.tensor_parallel_size == 1 and quantization == "none" and req.kv_dtype == req.dtype
    return (KVSCOPE_ENGINE if simple else VLLM), None


def model_argument(req: PlanRequest, files: ModelFiles, server: str) -> str:
    """The model as ``server`` takes it: ``--model``'s text for kvscope; for vLLM a registered name's HF
    folder (vLLM does not know kvscope's registry); for both the folder of a ``config.json`` that ``--model``
    named (neither server takes the file: the engine wants a folder, a name or a .gguf, vLLM a folder or a
    Hub id)."""
    source = Path(files.shape.source)
    if files.registered:
        return str(source.parent) if server == VLLM and source.name == "config.json" else req.model
    named = Path(req.model).expanduser()
    return str(named.parent) if named.suffix == ".json" and named.is_file() else req.model


def recommend(
    req: PlanRequest,
    device: Device,
    files: ModelFiles,
    max_len: int,
    max_num_seqs: int,
    kv_cache_bytes: int,
    fits: bool,
) -> dict[str, Any]:
    """``{"server", "engine": flags, "command", "note"}``: the flags of the planned ``max_len`` and
    ``max_num_seqs`` (``kv_cache_bytes``: the CPU's ``--kv-cache-memory``) and the command. ``command`` is
    None when the plan does not fit (``note`` points at the verdict) or no server runs it (``note`` says
    why)."""
    server, why = _server(req, device)
    quantization = engine_quantization(req)
    flags: dict[str, Any] = {}
    if server == VLLM and req.tensor_parallel_size > 1:
        flags["--tensor-parallel-size"] = req.tensor_parallel_size
    flags |= {"--max-model-len": max_len, "--max-num-seqs": max_num_seqs}
    if server == VLLM or req.max_num_batched_tokens != DEFAULT_MAX_NUM_BATCHED_TOKENS:
        flags["--max-num-batched-tokens"] = req.max_num_batched_tokens
    flags |= {"--block-size": req.block_size, "--dtype": req.dtype}
    if server == VLLM:
        if quantization != "none":
            flags["--quantization"] = VLLM_QUANTIZATION[quantization]
        if req.kv_dtype == "fp8":
            flags["--kv-cache-dtype"] = "fp8"
    else:
        flags["--quantization"] = quantization
    if device.name == CPU:
        flags["--kv-cache-memory"] = f"{math.ceil(kv_cache_bytes / (1 << 20))}MiB"
    else:
        if server == KVSCOPE_ENGINE:
            flags["--device"] = "cuda"
        flags["--gpu-memory-utilization"] = req.gpu_memory_utilization
    note = why
    if server is not None and quantization in NEEDS_CHECKPOINT and server == VLLM:
        note = f"serve {NEEDS_CHECKPOINT[quantization]}"
    command = None
    if server is not None and fits:
        model = model_argument(req, files, server)
        head = f"{server} {model}" if server == VLLM else f"{server} --model {model}"
        command = head + "".join(f" {k} {v}" for k, v in flags.items())
    elif server is not None:
        note = "no command: the model does not fit as planned (see the verdict)"
    return {"server": server, "engine": flags, "command": command, "note": note}
