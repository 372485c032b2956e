"""GPU telemetry (engine/server/gpu_telemetry.py, issue 39) against a fake NVML library on CPU: a ``pynvml``
module injected into ``sys.modules`` and fake ``torch.cuda.memory_stats``/``mem_get_info``. The series follow
the fake device from sample to sample, and a CPU engine exports none of them."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry

from kvscope.engine.server import app as app_module
from kvscope.engine.server.app import create_app
from kvscope.engine.server.gpu_telemetry import GpuTelemetry, TorchCuda
from kvscope.engine.server.metrics import GPU_THROTTLE_REASONS, EngineMetrics
from kvscope.engine.server.settings import ServerSettings
from kvscope.testing.wait import wait_until
from tests.engine.server.fakes import FakeEngine
from tests.engine.server.helpers import metric_samples, sample

GB = 10**9
SW_POWER_CAP, SW_THERMAL = 4, 32  # NVML's clocks event reason bits


class NVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    """What the fake NVML and torch.cuda report; tests change it between samples."""

    used: int = 73 * GB
    total: int = 80 * GB
    util_percent: int = 70
    temperature: int = 66
    power_mw: int = 350_000
    limit_mw: int = 700_000
    reasons: int = SW_POWER_CAP
    reserved: int = 70 * GB
    allocated: int = 60 * GB
    retries: int = 0
    ooms: int = 0
    calls: list[str] = field(default_factory=list)
    power_supported: bool = True


def fake_pynvml(gpu: FakeGpu) -> types.ModuleType:
    """A ``pynvml`` with the calls the telemetry makes (nvidia-ml-py's names and units)."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.nvmlInit = lambda: gpu.calls.append("init")
    nvml.nvmlShutdown = lambda: gpu.calls.append("shutdown")

    def by_uuid(uuid: str) -> object:
        raise NVMLError("Not Found")

    def by_index(index: int) -> str:
        gpu.calls.append(f"handle {index}")
        return f"gpu{index}"

    def power(handle: str) -> int:
        if not gpu.power_supported:
            raise NVMLError("Not Supported")
        return gpu.power_mw

    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetHandleByIndex = by_index
    nvml.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(
        used=gpu.used, total=gpu.total, free=gpu.total - gpu.used
    )
    nvml.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=gpu.util_percent, memory=10)
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: gpu.temperature
    nvml.nvmlDeviceGetPowerUsage = power
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda h: gpu.limit_mw
    nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda h: gpu.reasons
    return nvml


def fake_cuda(gpu: FakeGpu) -> TorchCuda:
    return TorchCuda(
        lambda: {
            "reserved_bytes.all.current": gpu.reserved,
            "allocated_bytes.all.current": gpu.allocated,
            "num_alloc_retries": gpu.retries,
            "num_ooms": gpu.ooms,
        },
        lambda: (gpu.total - gpu.used, gpu.total),
    )


def gpu_samples(registry: CollectorRegistry) -> dict[str, float]:
    """``name{labels}`` → value of every GPU-related sample."""
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if any(k in s.name for k in ("gpu_", "torch_", "device_memory")) and not s.name.endswith(
                "_created"
            ):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    state = FakeGpu()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(state))
    return state


def test_every_series_follows_the_device_from_sample_to_sample(gpu: FakeGpu) -> None:
    registry = CollectorRegistry()
    telemetry = GpuTelemetry.for_engine(EngineMetrics(registry), "cuda:1", 0.9, cuda=fake_cuda(gpu))
    assert telemetry is not None
    telemetry.sample()
    first = gpu_samples(registry)
    reasons = {
        f"kvscope_engine_gpu_throttled{{device=cuda:1,reason={r}}}": float(r == "sw_power_cap")
        for r in GPU_THROTTLE_REASONS
    }
    assert first == {
        "kvscope_engine_device_memory_used_bytes{device=cuda:1}": 73e9,
        "kvscope_engine_device_memory_total_bytes{device=cuda:1}": 80e9,
        "kvscope_engine_gpu_memory_budget_bytes{device=cuda:1}": 72e9,  # 0.9 x total: the reservation
        "kvscope_engine_gpu_utilization_ratio{device=cuda:1}": 0.7,
        "kvscope_engine_gpu_temperature_celsius{device=cuda:1}": 66.0,
        "kvscope_engine_gpu_power_watts{device=cuda:1}": 350.0,
        "kvscope_engine_gpu_power_limit_watts{device=cuda:1}": 700.0,
        **reasons,
        "kvscope_engine_torch_memory_reserved_bytes{device=cuda:1}": 70e9,
        "kvscope_engine_torch_memory_allocated_bytes{device=cuda:1}": 60e9,
        "kvscope_engine_torch_alloc_retries_total{device=cuda:1}": 0.0,
        "kvscope_engine_torch_ooms_total{device=cuda:1}": 0.0,
    }
    assert gpu.calls == ["init", "handle 1"]  # no torch UUID on CPU: the index
    # the device heats and throttles, memory climbs, the allocator retries 3 times and fails once
    gpu.used, gpu.temperature, gpu.reasons, gpu.util_percent = 79 * GB, 91, SW_POWER_CAP | SW_THERMAL, 100
    gpu.reserved, gpu.retries, gpu.ooms = 75 * GB, 3, 1
    telemetry.sample()
    gpu.retries = 5
    telemetry.sample()
    second = gpu_samples(registry)
    changed = {k: v for k, v in second.items() if first[k] != v}
    assert changed == {
        "kvscope_engine_device_memory_used_bytes{device=cuda:1}": 79e9,
        "kvscope_engine_gpu_utilization_ratio{device=cuda:1}": 1.0,
        "kvscope_engine_gpu_temperature_celsius{device=cuda:1}": 91.0,
        "kvscope_engine_gpu_throttled{device=cuda:1,reason=sw_thermal_slowdown}": 1.0,
        "kvscope_engine_torch_memory_reserved_bytes{device=cuda:1}": 75e9,
        "kvscope_engine_torch_alloc_retries_total{device=cuda:1}": 5.0,  # the allocator's cumulative count
        "kvscope_engine_torch_ooms_total{device=cuda:1}": 1.0,
    }
    telemetry.close()
    assert gpu.calls[-1] == "shutdown"


def test_an_unsupported_query_leaves_its_series_unset(gpu: FakeGpu) -> None:
    gpu.power_supported = False
    registry = CollectorRegistry()
    GpuTelemetry.for_engine(EngineMetrics(registry), "cuda:0", 0.9, cuda=fake_cuda(gpu)).sample()
    names = {k.split("{")[0] for k in gpu_samples(registry)}
    assert "kvscope_engine_gpu_power_watts" not in names
    assert {"kvscope_engine_gpu_power_limit_watts", "kvscope_engine_gpu_temperature_celsius"} <= names


def test_without_nvml_the_allocator_and_device_memory_are_still_sampled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = FakeGpu(used=10 * GB)
    nvml = fake_pynvml(gpu)

    def no_driver() -> None:
        raise NVMLError("Driver Not Loaded")

    nvml.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    registry = CollectorRegistry()
    GpuTelemetry.for_engine(EngineMetrics(registry), "cuda:0", 0.5, cuda=fake_cuda(gpu)).sample()
    assert {k: v for k, v in gpu_samples(registry).items() if "torch_" not in k} == {
        "kvscope_engine_device_memory_used_bytes{device=cuda:0}": 10e9,  # torch.cuda.mem_get_info
        "kvscope_engine_device_memory_total_bytes{device=cuda:0}": 80e9,
        "kvscope_engine_gpu_memory_budget_bytes{device=cuda:0}": 40e9,
    }


def test_a_cpu_engine_exports_no_gpu_series(gpu: FakeGpu) -> None:
    assert GpuTelemetry.for_engine(EngineMetrics(CollectorRegistry()), "cpu", None) is None
    with TestClient(
        create_app(ServerSettings(), engine=FakeEngine(), registry=CollectorRegistry())
    ) as client:
        text = client.get("/metrics").text
    assert 'kvscope_engine_device_memory_used_bytes{device="cpu"}' in text
    series = [line for line in text.splitlines() if not line.startswith("#")]
    assert [line for line in series if "_gpu_" in line or "_torch_" in line] == []  # absent, not 0
    assert gpu.calls == []  # NVML never opened


def test_the_server_samples_the_gpu_on_its_clock(gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvscope.engine.server.gpu_telemetry.torch_cuda", lambda device: fake_cuda(gpu))
    monkeypatch.setattr(app_module, "host_memory_bytes", lambda: 1)  # not asked on CUDA
    engine = FakeEngine()
    engine.device = "cuda:0"
    engine.gpu_share = 0.9
    settings = ServerSettings(gpu_telemetry_interval_s=0.05)
    with TestClient(create_app(settings, engine=engine, registry=CollectorRegistry())) as client:
        first = metric_samples(client.get("/metrics").text)
        gpu.used, gpu.temperature = 78 * GB, 88
        wait_until(
            lambda: (
                sample(
                    metric_samples(client.get("/metrics").text),
                    "kvscope_engine_gpu_temperature_celsius",
                    device="cuda:0",
                )
                == 88
            ),
            10,
            "a sample with the new temperature",
            interval_s=0.05,
        )
        last = metric_samples(client.get("/metrics").text)
    assert [
        sample(first, n, device="cuda:0")
        for n in (
            "kvscope_engine_device_memory_used_bytes",
            "kvscope_engine_gpu_memory_budget_bytes",
            "kvscope_engine_gpu_temperature_celsius",
        )
    ] == [73e9, 72e9, 66]
    assert [
        sample(last, n, device="cuda:0")
        for n in ("kvscope_engine_device_memory_used_bytes", "kvscope_engine_gpu_temperature_celsius")
    ] == [78e9, 88]
    assert gpu.calls[0] == "init" and gpu.calls[-1] == "shutdown"  # closed with the server
