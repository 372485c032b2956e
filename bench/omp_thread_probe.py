"""Why the served engine runs all torch work on one thread (engine/async_engine.py; docs/benchmarks.md "CPU
threads"). A benchmark, not a test.

Times small parallel torch ops (bfloat16 ``a + a`` of 32 × 3,072, ``F.linear`` 32 × 576 → 3,072, ``F.silu``)
on the main thread, on a fresh thread while the main thread has never run a parallel region, and on a fresh
thread after it has: with GNU OpenMP the last is several times slower once the process holds more OpenMP
threads than CPUs.

Usage: python bench/omp_thread_probe.py [--threads 2]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.nn.functional as F


def bench(label: str) -> None:
    a = torch.randn(32, 3072, dtype=torch.bfloat16)
    x = torch.randn(32, 576, dtype=torch.bfloat16)
    w = torch.randn(3072, 576, dtype=torch.bfloat16)
    for name, fn in (("add", lambda: a + a), ("linear", lambda: F.linear(x, w)), ("silu", lambda: F.silu(a))):
        for _ in range(50):
            fn()
        start = time.perf_counter()
        for _ in range(2000):
            fn()
        print(f"{label:44s} {name:6s} {(time.perf_counter() - start) / 2000 * 1e6:7.1f} µs")


def on_thread(label: str) -> None:
    thread = threading.Thread(target=bench, args=(label,))
    thread.start()
    thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(parser.parse_args().threads)
    on_thread("new thread, main has run no parallel region")
    bench("main thread")
    on_thread("new thread, main's OpenMP pool alive")


if __name__ == "__main__":
    main()
