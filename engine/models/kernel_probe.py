"""Pick the CPU matmul kernels by timing them on this machine (a ~0.3 s start-up probe), not by CPU model.

What it decides, on one matrix of the model's MLP shape (``[N, K]`` = gate/up of SmolLM2-135M by default):

- ``dense_dtype``: bfloat16 or float32 for dense matmuls of many rows (prefill, batched decode): oneDNN runs
  bfloat16 on AMX tiles (Sapphire Rapids and later) or AVX512_BF16 (Zen 4), and emulates it elsewhere, where
  float32 wins. Also what ``--dtype auto`` resolves to.
- ``max_rows[fmt]`` for fmt int4/int8: up to how many rows the compact weight-only kernel beats the dense
  packed one. The compact kernels are GEMVs: on an AMX Xeon int4 wins at 1–2 rows (0.40 vs 0.73 ms for
  3072×576 at one row) and loses 6x at 32 rows (4.2 vs 0.7 ms), so a compact layer keeps a dense bf16 copy
  for bigger batches. When compact wins at every probed size, no dense copy is kept (``NO_DENSE``).

Each (kernel, rows) pair takes the minimum of a few timed runs, which is robust to other processes on a
shared machine (they only ever make a run slower).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.models.layers import packed_linear_kernel
from engine.models.quant import Int4Blocks, Int4Weight, Int8Weight

logger = logging.getLogger(__name__)

NO_DENSE = 1 << 62
"""``max_rows`` meaning: the compact kernel at every size, no dense copy."""
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The measured choice (see module doc); ``timings_ms`` maps ``"<kernel>@<rows>"`` to the best time."""

    dense_dtype: torch.dtype
    max_rows: dict[str, int]
    timings_ms: dict[str, float] = field(default_factory=dict)
    cpu_capability: str = ""

    def describe(self) -> str:
        """One line for the start-up log."""
        rows = ", ".join(f"{fmt} up to {'all' if n >= NO_DENSE else n} rows" for fmt, n in self.max_rows.items())
        return f"dense {str(self.dense_dtype).removeprefix('torch.')}, compact {rows} (cpu {self.cpu_capability})"


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def crossover(compact_ms: Sequence[float], dense_ms: Sequence[float], rows: Sequence[int]) -> int:
    """The largest row count up to which compact is not slower at any probed size; 0 when it loses at the
    first size, ``NO_DENSE`` when it never loses."""
    best = 0
    for n, c, d in zip(rows, compact_ms, dense_ms, strict=True):
        if c > d:
            return best
        best = n
    return NO_DENSE


def probe_cpu_kernels(out_features: int = 3072, in_features: int = 576, rows: Sequence[int] = PROBE_ROWS,
                      repeats: int = 5) -> KernelChoice:
    """Time dense float32/bfloat16 (oneDNN packed) and compact int4/int8 matmuls of a random
    ``[out_features, in_features]`` weight at each row count; returns the KernelChoice. Uses the current
    torch thread count. Raises RuntimeError when this torch build lacks oneDNN."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.02
    timings: dict[str, float] = {}
    dense = {}
    for dtype in (torch.float32, torch.bfloat16):
        kernel = packed_linear_kernel(weight.to(dtype), None)
        if kernel is None:
            raise RuntimeError("oneDNN is not available in this torch build")
        dense[dtype] = [_best_ms(lambda k=kernel, n=n, d=dtype: k(torch.ones(n, in_features, dtype=d)), repeats)
                        for n in rows]
    dense_dtype = torch.bfloat16 if sum(dense[torch.bfloat16]) < sum(dense[torch.float32]) else torch.float32
    compact = {"int4": Int4Weight.from_blocks(Int4Blocks(
        codes=torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8),
        scale=torch.full((out_features, in_features // 32), 0.01), zero=torch.zeros(out_features, in_features // 32))),
        "int8": Int8Weight.from_float(weight)}
    max_rows = {}
    for fmt, w in compact.items():
        times = [_best_ms(lambda w=w, n=n: w.matmul(torch.ones(n, in_features, dtype=torch.bfloat16)), repeats)
                 for n in rows]
        timings.update({f"{fmt}@{n}": t for n, t in zip(rows, times, strict=True)})
        max_rows[fmt] = crossover(times, dense[dense_dtype], rows)
    for dtype, times in dense.items():
        timings.update({f"{str(dtype).removeprefix('torch.')}@{n}": t for n, t in zip(rows, times, strict=True)})
    choice = KernelChoice(dense_dtype=dense_dtype, max_rows=max_rows, timings_ms=timings,
                          cpu_capability=torch.backends.cpu.get_cpu_capability())
    logger.info("CPU kernel probe (%d threads, %dx%d): %s; ms %s", torch.get_num_threads(), out_features,
                in_features, choice.describe(), {k: round(v, 3) for k, v in timings.items()})
    return choice
