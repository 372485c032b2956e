"""What the engine reads of CUDA memory: the KV cache budget (engine/worker/kv_cache.py ``budget_num_blocks``:
free memory after the model load minus ``total × (1 − gpu_memory_utilization)``, from
``torch.cuda.mem_get_info``) and the device memory gauges of the GPU telemetry (engine/server/gpu_telemetry.py
``torch_cuda``: ``mem_get_info`` and ``memory_stats`` without NVML).

Each runs twice: on every machine with ``torch.cuda.mem_get_info``/``memory_stats`` monkeypatched (exact
values), and on a CUDA device (``gpu``, scripts/gpu_check.sh) with the real calls, recorded as the code under
test makes them so that the expected values come from the same readings."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvscope.engine.config import CacheConfig
from kvscope.engine.server.gpu_telemetry import GpuTelemetry
from kvscope.engine.server.metrics import EngineMetrics
from kvscope.engine.worker.kv_cache import budget_num_blocks

GIB = 1 << 30
CUDA0 = torch.device("cuda:0")


class Recorder:
    """Wraps a ``torch.cuda`` function: every call's arguments and result, in order."""

    def __init__(self, function: Callable) -> None:
        self.function = function
        self.calls: list[tuple[tuple, object]] = []

    def __call__(self, *args):
        result = self.function(*args)
        self.calls.append((args, result))
        return result


def test_the_kv_budget_is_free_memory_less_the_unreserved_share(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = Recorder(lambda device: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", readings)
    per_block = 3 << 20  # bytes of one block over all layers
    cache = CacheConfig(gpu_memory_utilization=0.75)
    assert budget_num_blocks(cache, CUDA0, per_block) == (30 * GIB - 20 * GIB) // per_block == 3413
    assert readings.calls == [((CUDA0,), (30 * GIB, 80 * GIB))]
    # a reading that leaves one byte short of a block
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (20 * GIB + per_block - 1, 80 * GIB))
    with pytest.raises(ValueError, match=r"KV cache budget of 3145727 bytes is smaller than one block"):
        budget_num_blocks(cache, CUDA0, per_block)
    assert (
        budget_num_blocks(CacheConfig(kv_cache_memory=10 * per_block), torch.device("cpu"), per_block) == 10
    )


def telemetry_without_nvml(monkeypatch: pytest.MonkeyPatch, registry: CollectorRegistry) -> GpuTelemetry:
    """GpuTelemetry of cuda:0 bound to the real ``torch.cuda`` functions (``torch_cuda``), NVML absent (its
    import fails), so the device memory series come from ``mem_get_info``."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    telemetry = GpuTelemetry.for_engine(EngineMetrics(registry), "cuda:0", 0.5)
    assert telemetry is not None and telemetry.nvml is None
    return telemetry


def gauge(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, {"device": "cuda:0"})


def test_device_memory_gauges_read_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    free_total = Recorder(lambda device: (7 * GIB, 80 * GIB))
    stats = Recorder(lambda device: {"reserved_bytes.all.current": 5 * GIB, "allocated_bytes.all.current": 3})
    monkeypatch.setattr(torch.cuda, "mem_get_info", free_total)
    monkeypatch.setattr(torch.cuda, "memory_stats", stats)
    registry = CollectorRegistry()
    telemetry_without_nvml(monkeypatch, registry).sample()
    assert [args for args, _ in free_total.calls + stats.calls] == [(CUDA0,), (CUDA0,)]
    assert {
        name: gauge(registry, f"kvscope_engine_{name}")
        for name in (
            "device_memory_used_bytes",
            "device_memory_total_bytes",
            "gpu_memory_budget_bytes",
            "torch_memory_reserved_bytes",
            "torch_memory_allocated_bytes",
        )
    } == {
        "device_memory_used_bytes": 73 * GIB,
        "device_memory_total_bytes": 80 * GIB,
        "gpu_memory_budget_bytes": 40 * GIB,
        "torch_memory_reserved_bytes": 5 * GIB,
        "torch_memory_allocated_bytes": 3,
    }


@pytest.mark.gpu
def test_device_memory_gauges_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same series from the real device, while a 256 MiB tensor is held: used = total − free and the
    allocator's bytes as torch.cuda reported them to the telemetry."""
    held = torch.empty(256 << 20, dtype=torch.uint8, device=CUDA0)
    free_total = Recorder(torch.cuda.mem_get_info)
    stats = Recorder(torch.cuda.memory_stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", free_total)
    monkeypatch.setattr(torch.cuda, "memory_stats", stats)
    registry = CollectorRegistry()
    telemetry_without_nvml(monkeypatch, registry).sample()
    [(_, (free, total))] = free_total.calls
    [(_, allocator)] = stats.calls
    assert total == torch.cuda.get_device_properties(CUDA0).total_memory
    assert gauge(registry, "kvscope_engine_device_memory_used_bytes") == total - free
    assert gauge(registry, "kvscope_engine_device_memory_total_bytes") == total
    assert gauge(registry, "kvscope_engine_gpu_memory_budget_bytes") == 0.5 * total
    allocated = allocator["allocated_bytes.all.current"]
    assert gauge(registry, "kvscope_engine_torch_memory_allocated_bytes") == allocated >= held.numel()
    assert (
        gauge(registry, "kvscope_engine_torch_memory_reserved_bytes")
        == allocator["reserved_bytes.all.current"]
    )
    assert total - free >= allocator["reserved_bytes.all.current"]  # the device holds at least torch's pool


@pytest.mark.gpu
def test_a_cuda_engine_sizes_its_kv_cache_from_mem_get_info(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """An engine on cuda:0 without ``num_blocks``: a utilisation that leaves about 1 GiB of budget on this
    device; its block count is the formula of the reading it made, and the cache is allocated."""
    from kvscope.engine.llm import LLM
    from tests.kernels.tiny_model import build_tiny_model, tokenizer_source

    model = build_tiny_model(tmp_path / "tiny", tokenizer_source(request))
    free, total = torch.cuda.mem_get_info(CUDA0)
    utilization = (total - free + GIB) / total
    readings = Recorder(torch.cuda.mem_get_info)
    monkeypatch.setattr(torch.cuda, "mem_get_info", readings)
    before = torch.cuda.memory_allocated(CUDA0)
    llm = LLM(str(model), device="cuda:0", attention_backend="torch", gpu_memory_utilization=utilization)
    [((device,), (free_at_load, total_seen))] = readings.calls
    assert device == CUDA0 and total_seen == total
    per_block = 2 * 2 * 16 * 2 * 32 * 4  # (K, V) x layers x block x kv_heads x head_dim x float32
    budget = int(free_at_load - total * (1.0 - utilization))
    info = llm.engine.info
    assert info.num_blocks == budget // per_block and info.kv_cache_bytes == info.num_blocks * per_block
    assert torch.cuda.memory_allocated(CUDA0) - before >= info.kv_cache_bytes
    del llm
    torch.cuda.empty_cache()
