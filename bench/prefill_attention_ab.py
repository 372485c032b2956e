"""Prefill attention on CPU: kvscope's C++ paged op (every prompt token a one-token query at its own position,
K/V read from the paged bfloat16 cache in place) against the torch backend's SDPA path (gather or slice the
K/V, upcast to its compute dtype — float32, or bfloat16 where the CPU has AMX — then causal SDPA). A
benchmark, not a test (docs/benchmarks.md "Prefill attention").

Two parts:
1. the attention of one layer alone at SmolLM2's shapes (9 query / 3 KV heads, head_dim 64, 16-token blocks),
   whole prompts and chunks after cached tokens: median µs of ``--reps`` calls each, and the largest
   difference;
2. in one engine (``--dtype auto --quantization auto``, the default format, after the server's prefill
warm-up),
   the idle TTFT of single ``--input-len`` prompts, alternating every run between the two paths
   (``TorchAttentionBackend.paged_prefill``), wall ms of the first step.

Usage: python bench/prefill_attention_ab.py [--threads 2] [--reps 40] [--runs 16] [--input-len 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvscope.common.models.cache import cache_root
from kvscope.engine.attention.torch_backend import attention_compute_dtype, cpu_has_amx
from kvscope.engine.bench import random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.platform.cpu import load_cpu_kernels

sys.path.append(
    str(Path(__file__).resolve().parents[1])
)  # for `bench`; after site-packages, so the root kernels/ shadows nothing
from bench.ttft_profile import first_step_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = ((32, 32), (128, 128), (256, 256), (512, 512), (1024, 1024), (1024, 128), (2048, 256))
"""(context after the step, query tokens): whole prompts, then chunks after cached tokens."""


def median_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def op_table(reps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 256, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    compute_dtype = attention_compute_dtype(cache, native_bf16=cpu_has_amx())  # the backend's own rule
    print(f"SDPA path computes in {compute_dtype}")
    print("context, query tokens | paged op µs | SDPA path µs | ratio | max |diff|")
    for seq_len, q_len in SHAPES:
        blocks = torch.randperm(cache.shape[1], generator=gen)[: seq_len // BLOCK].to(torch.int32)
        query = torch.randn(q_len, HEADS, HEAD_DIM, generator=gen)
        tables = blocks[None].expand(q_len, -1).contiguous()
        lens = torch.arange(seq_len - q_len + 1, seq_len + 1, dtype=torch.int32)
        mask = (
            None
            if q_len == seq_len
            else torch.arange(seq_len)[None] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        )

        def paged(query=query, tables=tables, lens=lens):
            return torch.ops.kvscope_cpu.paged_decode_attention(query, cache, tables, lens, HEAD_DIM**-0.5)

        def sdpa(query=query, blocks=blocks, mask=mask):
            kv = cache[:, blocks.long()].flatten(1, 2).to(compute_dtype).transpose(1, 2)  # [2, KVH, S, d]
            q = query.to(compute_dtype).transpose(0, 1)[None]
            return F.scaled_dot_product_attention(
                q,
                kv[0][None],
                kv[1][None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=HEAD_DIM**-0.5,
                enable_gqa=True,
            )[0].transpose(0, 1)

        diff = (paged() - sdpa().float()).abs().max().item()
        a, b = median_us(paged, reps), median_us(sdpa, reps)
        print(f"{seq_len:5d}, {q_len:4d} | {a:9.0f} | {b:9.0f} | {b / a:4.2f} | {diff:.1e}", flush=True)


def engine_ab(runs: int, input_len: int, threads: int) -> None:
    llm = LLM(
        "smollm2-135m", dtype="auto", quantization="auto", num_threads=threads, enable_prefix_caching=False
    )
    llm.engine.warm_up_prefill()
    backend = llm.engine.runner.backend
    prompts = random_prompts(2 * runs + 2, input_len, llm.engine.vocab_size, 7)
    first_step_ms(llm, prompts[-1], "warm-0")
    first_step_ms(llm, prompts[-2], "warm-1")
    times: dict[bool, list[float]] = {False: [], True: []}
    default = backend.paged_prefill
    for i in range(2 * runs):
        backend.paged_prefill = bool(i % 2)
        times[backend.paged_prefill].append(first_step_ms(llm, prompts[i], f"ab-{i}"))
    backend.paged_prefill = default
    for paged, values in times.items():
        print(
            f"idle TTFT, {input_len}-token prompt, {'paged op' if paged else 'SDPA path'}: median "
            f"{statistics.median(values):.1f} / min {min(values):.1f} ms (n={len(values)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = load_cpu_kernels(cache_root())
    if not result.ok:
        raise SystemExit(f"kvscope's CPU kernels did not load: {result.detail}")
    print(f"{args.threads} threads, load average {os.getloadavg()}", flush=True)
    op_table(args.reps)
    engine_ab(args.runs, args.input_len, args.threads)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
