"""Decode attention, in process: kvscope's C++ paged op (``torch.ops.kvscope_cpu.paged_decode_attention``,
read from the paged cache in place) against torch SDPA over K/V already gathered (the resident copy's best
case) and SDPA plus the full per-layer gather, at SmolLM2-135M's shapes (9 query / 3 KV heads, head_dim 64,
block 16). Alternates the three every repeat; prints min and median wall ms per call. A benchmark, not a test
(docs/benchmarks.md "Batched decode", issue 13).

Usage: python bench/decode_attention_ab.py [--threads 2] [--batch 1 8 32] [--context 128 256 512 1024]
           [--dtype bfloat16] [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvscope.kernels import cpu_decode


def paged_case(
    batch: int,
    context: int,
    dtype: torch.dtype,
    heads: int = 9,
    kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A random paged cache holding ``batch`` contexts of ``context`` tokens in shuffled blocks, one query
    each."""
    gen = torch.Generator().manual_seed(seed)
    per_req = -(-context // block_size)
    num_blocks = batch * per_req + 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: batch * per_req] + 1).view(batch, per_req).int()
    return {
        "query": torch.randn(batch, heads, head_dim, generator=gen).to(dtype),
        "cache": cache,
        "tables": tables,
        "seq_lens": torch.full((batch,), context, dtype=torch.int32),
    }


def sdpa_gathered(case: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [n, KVH, S, d] gathered from the cache (what the torch backend's resident copy holds)."""
    cache, tables = case["cache"], case["tables"]
    n, width = tables.shape
    kv = cache.index_select(1, tables.long().reshape(-1)).view(2, n, width * cache.shape[2], *cache.shape[3:])
    context = int(case["seq_lens"].max())
    kv = kv[:, :, :context].transpose(2, 3)
    return kv[0], kv[1]


def run_sdpa(
    case: dict[str, torch.Tensor], keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        case["query"][:, :, None], keys, values, scale=scale, enable_gqa=True
    )[:, :, 0]


def run_op(case: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    return torch.ops.kvscope_cpu.paged_decode_attention(
        case["query"], case["cache"], case["tables"], case["seq_lens"], scale
    )


def measure(batch: int, context: int, dtype: torch.dtype, repeats: int) -> str:
    """One table row: min / median ms of each variant and the largest difference to SDPA."""
    case = paged_case(batch, context, dtype)
    scale = case["query"].shape[-1] ** -0.5
    keys, values = sdpa_gathered(case)
    variants = {
        "op": lambda: run_op(case, scale),
        "sdpa": lambda: run_sdpa(case, keys, values, scale),
        "gather+sdpa": lambda: run_sdpa(case, *sdpa_gathered(case), scale),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    diff = (run_op(case, scale).float() - run_sdpa(case, keys, values, scale).float()).abs().max().item()
    cells = " | ".join(f"{1e3 * min(t):.3f} / {1e3 * statistics.median(t):.3f}" for t in times.values())
    return f"| {batch} | {context} | {cells} | {diff:.2e} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--kernels-dir", type=Path, default=Path.home() / ".cache" / "kvscope" / "cpu-kernels"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = cpu_decode.load(args.kernels_dir)
    if not result.ok:
        raise SystemExit(f"kvscope CPU kernels unavailable: {result.detail}")
    dtype = getattr(torch, args.dtype)
    print(
        f"{args.dtype}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; min / median ms "
        "per call"
    )
    print("| batch | context | paged op | SDPA (gathered) | gather + SDPA | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        for context in args.context:
            print(measure(batch, context, dtype, args.repeats), flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
