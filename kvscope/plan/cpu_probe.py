"""This machine's CPU as a planner device, measured by a short probe (torch, imported only when probing).

- Bandwidth: the best of ``repeats`` timed ``tensor.sum()`` over a float32 buffer of ``buffer_bytes``
  (default 1 GiB, beyond any last-level cache), i.e. streaming read bandwidth, the traffic of a decode step.
- Peak FLOP/s: the best of ``repeats`` timed ``n × n`` matmuls (``2 n³`` FLOPs each) in fp32 and bf16. Both
run with the torch thread count the engine would use (``kvscope.common.engine_defaults.default_num_threads``:
the CPUs this process may use minus one, at least 1), so the bound is the engine's own ceiling on this
machine. A few seconds: it runs at start of ``kvscope plan --device cpu`` only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from kvscope.common.engine_defaults import default_num_threads
from kvscope.plan.devices import CPU, Device

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    threads: int | None = None
    """torch threads; None = the engine's default (CPUs available minus one, at least 1)."""
    buffer_bytes: int = 1 << 30
    """Bandwidth buffer (bytes): well beyond the last-level cache."""
    matmul_n: int = 1024
    repeats: int = 5

    def __post_init__(self) -> None:
        if self.buffer_bytes < 4096 or self.matmul_n < 16 or self.repeats < 1:
            raise ValueError("buffer_bytes >= 4096, matmul_n >= 16 and repeats >= 1 are required")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"probe threads must be at least 1, got {self.threads}")


def _best_seconds(fn: Callable[[], object], repeats: int, clock: Clock) -> float:
    fn()  # warm-up: page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def measure_bandwidth(buffer_bytes: int, repeats: int, clock: Clock = time.perf_counter) -> float:
    """Streaming read bandwidth, bytes/s: buffer bytes / best time of one ``sum()`` over it."""
    import torch

    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    seconds = _best_seconds(buffer.sum, repeats, clock)
    return buffer.numel() * 4 / seconds


def measure_matmul_flops(n: int, dtype_name: str, repeats: int, clock: Clock = time.perf_counter) -> float:
    """Peak matmul FLOP/s in ``dtype_name`` (``float32``/``bfloat16``): ``2 n³`` / best time of one matmul."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.ones(n, n, dtype=dtype), torch.ones(n, n, dtype=dtype)
    return 2.0 * n**3 / _best_seconds(lambda: a @ b, repeats, clock)


def physical_memory_bytes() -> int:
    """RAM of the machine (bytes), from ``sysconf``."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe_cpu(config: ProbeConfig | None = None, clock: Clock = time.perf_counter) -> Device:
    """Measure this machine's CPU (see module doc) and return it as the ``cpu`` Device."""
    import torch

    config = config or ProbeConfig()
    threads = config.threads or default_num_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = measure_bandwidth(config.buffer_bytes, config.repeats, clock)
        flops = {
            fmt: measure_matmul_flops(config.matmul_n, dtype, config.repeats, clock)
            for fmt, dtype in (("fp32", "float32"), ("bf16", "bfloat16"))
        }
    finally:
        torch.set_num_threads(previous)
    return Device(
        name=CPU,
        memory_bytes=physical_memory_bytes(),
        bandwidth=bandwidth,
        peak_flops=MappingProxyType(flops),
        source="measured on this machine (kvscope/plan/cpu_probe.py)",
        measured={
            "threads": threads,
            "buffer_bytes": config.buffer_bytes,
            "matmul_n": config.matmul_n,
            "repeats": config.repeats,
        },
    )
