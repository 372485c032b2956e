"""The kvscope engine's default cache and scheduler settings, declared once.

kvscope.engine.config's dataclasses take their defaults from here, and the capacity planner (kvscope.plan),
which must not import the engine, plans with the same numbers. Units: tokens, sequences, a fraction of device
memory. Why each value is what it is: docs/benchmarks.md "Scheduler defaults".
"""

from __future__ import annotations

import os

BLOCK_SIZE = 16
"""Tokens per KV-cache block (vLLM's default ``--block-size``)."""

GPU_MEMORY_UTILIZATION = 0.9
"""CUDA: fraction of device memory for weights, activations and KV cache (vLLM's default)."""

MAX_NUM_SEQS = 64
"""Most sequences in one engine step."""

MAX_NUM_BATCHED_TOKENS = 1024
"""Token budget of one step (prefill chunks + decodes)."""


def default_num_threads() -> int:
    """torch threads of the engine when ``EngineConfig.num_threads`` is None: the CPUs this process may use
    minus one (left for the server loop, the tokenizer and the OS), at least 1.

    Why not all of them: OpenMP threads spin at every barrier, so when another process or the server's own
    thread takes a core, every parallel op waits for a descheduled thread (docs/benchmarks.md "CPU threads").
    A deployment that sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads can pass ``num_threads`` = all CPUs.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus - 1)
