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


def _interleaved_best_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best time (ms) of each function, timing them round-robin so that a burst of load elsewhere slows every
    candidate alike instead of one of them."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return {key: t * 1e3 for key, t in best.items()}


def probe_cpu_kernels(out_features: int = 3072, in_features: int = 576, rows: Sequence[int] = PROBE_ROWS,
                      repeats: int = 5) -> KernelChoice:
    """Time dense float32/bfloat16 (oneDNN packed) and compact int4/int8 matmuls of a random
    ``[out_features, in_features]`` weight at each row count; returns the KernelChoice. Uses the current
    torch thread count. Raises RuntimeError when this torch build lacks oneDNN."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.02
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        kernel = packed_linear_kernel(weight.to(dtype), None)
        if kernel is None:
            raise RuntimeError("oneDNN is not available in this torch build")
        kernels[str(dtype).removeprefix("torch.")] = kernel
    kernels["int4"] = Int4Weight.from_blocks(Int4Blocks(
        codes=torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8),
        scale=torch.full((out_features, in_features // 32), 0.01),
        zero=torch.zeros(out_features, in_features // 32))).matmul
    kernels["int8"] = Int8Weight.from_float(weight).matmul
    inputs = {(dtype, n): torch.ones(n, in_features, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)
              for n in rows}
    fns = {f"{name}@{n}": (lambda k=kernel, x=inputs[torch.float32 if name == "float32" else torch.bfloat16, n]: k(x))
           for name, kernel in kernels.items() for n in rows}
    with torch.inference_mode():
        timings = _interleaved_best_ms(fns, repeats)
    series = {name: [timings[f"{name}@{n}"] for n in rows] for name in kernels}
    dense_dtype = torch.bfloat16 if sum(series["bfloat16"]) < sum(series["float32"]) else torch.float32
    dense = series[str(dense_dtype).removeprefix("torch.")]
    max_rows = {fmt: crossover(series[fmt], dense, rows) for fmt in ("int4", "int8")}
    choice = KernelChoice(dense_dtype=dense_dtype, max_rows=max_rows, timings_ms=timings,
                          cpu_capability=torch.backends.cpu.get_cpu_capability())
    logger.info("CPU kernel probe (%d threads, %dx%d): %s; ms %s", torch.get_num_threads(), out_features,
                in_features, choice.describe(), {k: round(v, 3) for k, v in timings.items()})
    return choice


def decode_matmul_ms(shapes: Sequence[tuple[int, int]], rows: int, fmt: str, choice: KernelChoice,
                     repeats: int = 5) -> float:
    """Best time (ms) of one decode step's matmuls ``shapes`` (``[N, K]`` each, in order, e.g.
    :func:`model_linear_shapes`) at ``rows`` rows in format ``fmt``: float32/bfloat16 (dense, as
    ``Linear.prepare_for_cpu``) or int4/int8 (compact kernels switching to dense above ``choice.max_rows``;
    the last shape, the LM head, stays dense under int4 as in ``engine.models.compact``), optionally with the
    model dtype, e.g. ``int4:bfloat16`` (activations and the dense LM head; default float32)."""
    from engine.models.layers import cpu_linear_kernel
    from engine.models.quant import CompactLinearKernel

    quant, _, dtype_name = fmt.partition(":")
    dtype = getattr(torch, dtype_name or ("bfloat16" if quant == "bfloat16" else "float32"))
    gen = torch.Generator().manual_seed(0)
    kernels = []
    for i, (n, k) in enumerate(shapes):
        weight = torch.randn(n, k, generator=gen) * 0.02
        if quant in ("float32", "bfloat16") or (quant == "int4" and i == len(shapes) - 1):
            kernels.append(cpu_linear_kernel(weight.to(dtype), None))
            continue
        compact = Int8Weight.from_float(weight) if quant == "int8" else Int4Weight.from_blocks(Int4Blocks(
            codes=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
            scale=torch.full((n, k // 32), 0.01), zero=torch.zeros(n, k // 32)))
        limit = choice.max_rows[quant]
        dense = packed_linear_kernel(weight.to(choice.dense_dtype), None) if limit < NO_DENSE else None
        kernels.append(CompactLinearKernel(compact=compact, bias=None, dense=dense, dense_dtype=choice.dense_dtype,
                                           max_compact_rows=limit))
    inputs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in shapes]

    def step() -> None:
        for kernel, x in zip(kernels, inputs, strict=True):
            kernel(x)

    with torch.inference_mode():
        return _best_ms(step, repeats)


def model_linear_shapes(hf_config: dict) -> list[tuple[int, int]]:
    """``[N, K]`` of every matmul of one forward, as the engine fuses them (qkv, o, gate_up, down per layer,
    then the LM head)."""
    hidden, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
             (hidden, inter)]
    return layer * hf_config["num_hidden_layers"] + [(hf_config["vocab_size"], hidden)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine.models.kernel_probe [--model M] [--threads 1 2] [--rows 1 32]``: run the probe, then
    print ms per decode step of the model's matmuls per format and thread count."""
    import argparse

    from engine.models.loader import read_hf_config, resolve_model_dir

    p = argparse.ArgumentParser(prog="python -m engine.models.kernel_probe", description=main.__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8", "int8:bfloat16",
                                                        "int4", "int4:bfloat16"])
    args = p.parse_args(argv)
    shapes = model_linear_shapes(read_hf_config(resolve_model_dir(args.model)))
    for threads in args.threads:
        torch.set_num_threads(threads)
        choice = probe_cpu_kernels()
        print(f"{threads} thread(s): {choice.describe()}", flush=True)
        for rows in args.rows:
            times = {fmt: decode_matmul_ms(shapes, rows, fmt, choice) for fmt in args.formats}
            print(f"  {len(shapes)} matmuls x {rows:3d} rows: " + ", ".join(
                f"{fmt} {ms:6.1f} ms" for fmt, ms in times.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
