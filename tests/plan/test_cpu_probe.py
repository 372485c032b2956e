"""The CPU probe's arithmetic with a fake clock (every timed call takes exactly 1 s or 0.5 s)."""

from __future__ import annotations

import itertools

import pytest

from kvscope.plan.cpu_probe import (
    ProbeConfig,
    measure_bandwidth,
    measure_matmul_flops,
    probe_cpu,
)


def ticking(step: float):
    """A clock that advances ``step`` seconds per call: each timed call lasts ``step``."""
    counter = itertools.count()
    return lambda: next(counter) * step


def test_bandwidth_is_buffer_bytes_over_the_best_time():
    assert measure_bandwidth(1 << 20, repeats=3, clock=ticking(1.0)) == float(1 << 20)
    assert measure_bandwidth(1 << 20, repeats=3, clock=ticking(0.5)) == float(2 << 20)


def test_matmul_flops_are_two_n_cubed_over_the_best_time():
    assert measure_matmul_flops(64, "float32", repeats=2, clock=ticking(1.0)) == 2.0 * 64**3
    assert measure_matmul_flops(32, "bfloat16", repeats=2, clock=ticking(0.25)) == 8.0 * 32**3


def test_probe_cpu_builds_the_cpu_device_and_restores_torch_threads():
    import torch

    before = torch.get_num_threads()
    device = probe_cpu(
        ProbeConfig(threads=1, buffer_bytes=1 << 16, matmul_n=32, repeats=1), clock=ticking(1.0)
    )
    assert device.name == "cpu"
    assert device.bandwidth == float(1 << 16)
    assert dict(device.peak_flops) == {"fp32": 2.0 * 32**3, "bf16": 2.0 * 32**3}
    assert device.measured == {"threads": 1, "buffer_bytes": 1 << 16, "matmul_n": 32, "repeats": 1}
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(("cpus", "expected"), [({0, 1}, 1), (set(range(6)), 5)])
def test_probe_without_threads_runs_with_the_engines_default_thread_count(
    monkeypatch: pytest.MonkeyPatch, cpus: set[int], expected: int
):
    """The probe measures what the engine will get: usable CPUs - 1 (kvscope.common.engine_defaults)."""
    from kvscope.common import engine_defaults

    monkeypatch.setattr(engine_defaults.os, "sched_getaffinity", lambda pid: cpus)
    device = probe_cpu(ProbeConfig(buffer_bytes=1 << 16, matmul_n=32, repeats=1), clock=ticking(1.0))
    assert device.measured["threads"] == expected


def test_probe_config_refuses_tiny_sizes():
    with pytest.raises(ValueError, match="buffer_bytes >= 4096"):
        ProbeConfig(buffer_bytes=100)
