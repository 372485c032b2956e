"""GPU telemetry of the engine's CUDA device: NVML and torch's allocator, sampled on the engine server's
clock.

While the engine runs on ``cuda:N``, :func:`sample_every` calls :meth:`GpuTelemetry.sample` every
``--gpu-telemetry-interval`` seconds (on a worker thread: NVML calls block for a few milliseconds) and sets
the ``kvscope_engine_gpu_*``, ``kvscope_engine_torch_*`` and ``kvscope_engine_device_memory_*`` series of
docs/metrics.md:

- NVML (the maintained ``nvidia-ml-py`` bindings, module ``pynvml``): utilisation, memory used/total,
  temperature, power draw and limit, clocks event (throttle) reasons;
- ``torch.cuda.memory_stats``: the caching allocator's reserved and allocated bytes, and its cumulative
  ``num_alloc_retries`` and ``num_ooms`` (exported as counters: the increase since the last sample);
- the engine's memory budget, ``gpu_memory_utilization`` x total: what it reserves on purpose.

On CPU nothing is created: the series are absent, not 0. Without NVML (no driver, no ``pynvml``) the torch
allocator series and the device memory (``torch.cuda.mem_get_info``) are still sampled. A query the GPU does
not support (power on some boards) leaves its series unset. Importing this module imports neither torch nor
pynvml.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvscope.engine.server.metrics import GPU_THROTTLE_REASONS, EngineMetrics

logger = logging.getLogger(__name__)

MemoryStats = Callable[[], Mapping[str, Any]]
"""``torch.cuda.memory_stats`` of the device."""
MemGetInfo = Callable[[], tuple[int, int]]
"""``torch.cuda.mem_get_info`` of the device: (free, total) bytes."""


@dataclass(frozen=True, slots=True)
class TorchCuda:
    """The two torch.cuda calls the telemetry makes, bound to one device (tests pass fakes)."""

    memory_stats: MemoryStats
    mem_get_info: MemGetInfo


def torch_cuda(device: str) -> TorchCuda:
    """``torch.cuda.memory_stats`` / ``mem_get_info`` of ``device`` (imports torch)."""
    import torch

    dev = torch.device(device)
    return TorchCuda(lambda: torch.cuda.memory_stats(dev), lambda: torch.cuda.mem_get_info(dev))


def open_nvml(device: str) -> tuple[Any, Any] | None:
    """(the ``pynvml`` module, the NVML handle of ``device``), or None when NVML is unavailable (logged once).
    The handle is found by the device's UUID as torch sees it (``CUDA_VISIBLE_DEVICES`` renumbers devices;
    NVML does not), else by its index."""
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception as exc:  # ImportError, or NVMLError: no driver / library
        logger.warning(
            "GPU telemetry without NVML (%s): no utilisation, temperature, power or throttle series", exc
        )
        return None
    index = int(device.partition(":")[2] or 0)
    try:
        return nvml, nvml.nvmlDeviceGetHandleByUUID(_torch_uuid(index))
    except Exception:  # no torch UUID (older torch, no CUDA in a test) or NVML does not know it
        pass
    try:
        return nvml, nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        logger.warning("GPU telemetry without NVML: no NVML device for %s (%s)", device, exc)
        nvml.nvmlShutdown()
        return None


def _torch_uuid(index: int) -> str:
    import torch

    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


class GpuTelemetry:
    """Samples one CUDA device into an :class:`EngineMetrics`; build with :meth:`for_engine`."""

    def __init__(
        self,
        metrics: EngineMetrics,
        device: str,
        memory_utilization: float | None,
        cuda: TorchCuda,
        nvml: tuple[Any, Any] | None,
    ) -> None:
        """``memory_utilization``: the engine's ``gpu_memory_utilization`` (None: no budget series)."""
        self.metrics = metrics
        self.device = device
        self.memory_utilization = memory_utilization
        self.cuda = cuda
        self.nvml, self.handle = nvml if nvml is not None else (None, None)
        self._counted = {"num_alloc_retries": 0, "num_ooms": 0}
        self._unsupported: set[str] = set()

    @classmethod
    def for_engine(
        cls,
        metrics: EngineMetrics,
        device: str,
        memory_utilization: float | None,
        cuda: TorchCuda | None = None,
    ) -> GpuTelemetry | None:
        """Telemetry of ``device``, None off CUDA (``cpu``: no GPU series at all). ``cuda`` defaults to
        :func:`torch_cuda` of the device."""
        if not device.startswith("cuda"):
            return None
        return cls(metrics, device, memory_utilization, cuda or torch_cuda(device), open_nvml(device))

    def sample(self) -> None:
        """Read NVML and the torch allocator once and set every series (call from any thread)."""
        m, d = self.metrics, self.device
        total = self._sample_nvml()
        if total is None:  # no NVML: the memory torch sees on the device (the whole device, every process)
            free, total = self.cuda.mem_get_info()
            m.device_memory_used.labels(device=d).set(total - free)
            m.device_memory_total.labels(device=d).set(total)
        if self.memory_utilization is not None:
            m.gpu_memory_budget.labels(device=d).set(self.memory_utilization * total)
        stats = self.cuda.memory_stats()
        m.torch_memory_reserved.labels(device=d).set(stats.get("reserved_bytes.all.current", 0))
        m.torch_memory_allocated.labels(device=d).set(stats.get("allocated_bytes.all.current", 0))
        for key, counter in (("num_alloc_retries", m.torch_alloc_retries), ("num_ooms", m.torch_ooms)):
            value = int(stats.get(key, 0))
            child = counter.labels(device=d)  # created at the first sample: 0 until the allocator counts one
            if value > self._counted[key]:
                child.inc(value - self._counted[key])
            self._counted[key] = value

    def _sample_nvml(self) -> int | None:
        """Set the NVML series; returns the device's total memory (bytes), None without NVML."""
        if self.nvml is None:
            return None
        nvml, handle, m, d = self.nvml, self.handle, self.metrics, self.device
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        m.device_memory_used.labels(device=d).set(memory.used)
        m.device_memory_total.labels(device=d).set(memory.total)
        reading = self._read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu, "utilization")
        if reading is not None:
            m.gpu_utilization.labels(device=d).set(reading / 100)
        reading = self._read(
            lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU), "temperature"
        )
        if reading is not None:
            m.gpu_temperature.labels(device=d).set(reading)
        for name, gauge, call in (
            ("power", m.gpu_power, nvml.nvmlDeviceGetPowerUsage),
            ("power limit", m.gpu_power_limit, nvml.nvmlDeviceGetEnforcedPowerLimit),
        ):
            reading = self._read(lambda call=call: call(handle), name)
            if reading is not None:
                gauge.labels(device=d).set(reading / 1000)  # milliwatts
        reasons = self._read(lambda: _throttle_reasons(nvml, handle), "throttle reasons")
        if reasons is not None:
            for bit, reason in enumerate(GPU_THROTTLE_REASONS):
                m.gpu_throttled.labels(device=d, reason=reason).set(1 if reasons & (1 << bit) else 0)
        return memory.total

    def _read(self, query: Callable[[], Any], name: str) -> Any:
        """``query()``, None when NVML fails it (logged once per query: e.g. power on a board without
        sensor)."""
        nvml = self.nvml
        if nvml is None:  # shut down
            return None
        try:
            return query()
        except nvml.NVMLError as exc:
            if name not in self._unsupported:
                self._unsupported.add(name)
                logger.info("NVML %s of %s unavailable: %s", name, self.device, exc)
            return None

    def close(self) -> None:
        """Release NVML (``nvmlShutdown``)."""
        if self.nvml is not None:
            self.nvml.nvmlShutdown()
            self.nvml = None


def _throttle_reasons(nvml: Any, handle: Any) -> int:
    """NVML's clocks event reasons bitmask (``…ClocksEventReasons``; ``…ClocksThrottleReasons`` before
    R535)."""
    query = (
        getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    return int(query(handle))


async def sample_every(telemetry: GpuTelemetry, interval_s: float) -> None:
    """Sample every ``interval_s`` seconds (the first after one interval: the server samples once at start-up)
    until cancelled; a failing sample is logged and the next one tried (telemetry never stops the server)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(telemetry.sample)
        except Exception:
            logger.exception("GPU telemetry sample of %s failed", telemetry.device)
