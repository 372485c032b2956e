"""Idle TTFT A/B of issue-13t's prefill changes (docs/benchmarks.md "Idle TTFT"). A benchmark, not a test.

Two parts, one engine (``--dtype auto --quantization auto``, the default format):
1. prompts of ``--input-len`` tokens, one at a time on an idle engine, alternating every run between this
   tree's prefill path and the one before it (the fresh-prefill K/V gather back from the cache), wall ms from
   ``add_request`` to the first token (CPU ms of the engine thread with one thread);
2. "new lengths": one prompt each of ``--new-lengths`` distinct lengths (none seen before), with the row
   padding of the packed matmuls off (the code before) and then on after ``model.warm_up`` (``--warm-up``),
   so each length pays, or not, oneDNN's per-shape set-up.

Usage: python bench/ttft_ab.py [--threads 2] [--runs 24] [--input-len 128] [--new-lengths 97 131]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import kvscope.engine.models.layers as L
from kvscope.engine.attention.torch_backend import TorchAttentionBackend
from kvscope.engine.bench import random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.platform.cpu import warm_up_prefill
from kvscope.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def ttft_ms(llm: LLM, ids: list[int], tag: str) -> float:
    """ms from add_request to the step returning the first token (the request then finishes): this thread's
    CPU time with one torch thread (steadier on a shared box), else wall time."""
    engine = llm.engine
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    engine.add_request(tag, ids, PARAMS)
    while not any(o.request_id == tag and o.outputs[0].token_ids for o in engine.step().outputs):
        pass
    elapsed = 1000 * (clock() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def old_write_kv(self, key, value, kv_cache, slot_mapping):  # before issue-13t: no record of what was written
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    both = torch.stack((key, value))
    if both.dtype != kv_cache.dtype:
        both = both.to(kv_cache.dtype)
    kv_cache.view(2, -1, num_kv_heads, head_dim).index_copy_(1, slot_mapping, both)


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):6.1f} / min {min(values):6.1f} ms (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--new-lengths", type=int, nargs=2, default=[97, 131], metavar=("LO", "HI"))
    args = parser.parse_args()
    llm = LLM("smollm2-135m", dtype="auto", quantization="auto", num_threads=args.threads)
    engine = llm.engine
    print(f"{torch.get_num_threads()} threads, load average {os.getloadavg()}", flush=True)
    new_write = TorchAttentionBackend.write_kv
    prompts = random_prompts(2 * args.runs + 2, args.input_len, engine.vocab_size, 11)
    ttft_ms(llm, prompts[-1], "warm-0")
    ttft_ms(llm, prompts[-2], "warm-1")
    old, new = [], []
    for i in range(2 * args.runs):
        use_new = i % 2 == 1
        TorchAttentionBackend.write_kv = new_write if use_new else old_write_kv
        (new if use_new else old).append(ttft_ms(llm, prompts[i], f"ab-{i}"))
    TorchAttentionBackend.write_kv = new_write
    print(f"{args.input_len}-token prompt, before (gather) : {summary(old)}")
    print(f"{args.input_len}-token prompt, after (no gather): {summary(new)}", flush=True)
    lo, hi = args.new_lengths
    align_min = L.ALIGN_MIN_ROWS
    begin = time.perf_counter()
    calls = warm_up_prefill(engine.model, engine.config.scheduler.max_num_batched_tokens)
    print(f"warm_up: {calls} matmuls in {time.perf_counter() - begin:.2f} s wall", flush=True)
    cold, padded = [], []
    for i, n in enumerate(n for n in range(lo, hi + 1) if n % 2):  # odd lengths: never a warmed shape
        L.ALIGN_MIN_ROWS = align_min if i % 2 else 1 << 62  # 1 << 62: no padding, the code before
        (padded if i % 2 else cold).append(
            ttft_ms(llm, random_prompts(1, n, engine.vocab_size, n)[0], f"n-{n}")
        )
    same_old, same_new = [], []
    for i in range(2 * args.runs):  # one length, both warm: the cost of the padding rows alone
        L.ALIGN_MIN_ROWS = align_min if i % 2 else 1 << 62
        (same_new if i % 2 else same_old).append(
            ttft_ms(llm, prompts[i], f"same-{i}")
            if lo == args.input_len
            else ttft_ms(llm, random_prompts(1, lo, engine.vocab_size, 1000 + i)[0], f"same-{i}")
        )
    L.ALIGN_MIN_ROWS = align_min
    print(f"new odd lengths {lo}..{hi}, no padding (each a new shape): {summary(cold)}")
    print(f"new odd lengths {lo}..{hi}, padded to 16 rows, warmed     : {summary(padded)}")
    print(f"length {lo} again and again, no padding : {summary(same_old)}")
    print(f"length {lo} again and again, padded     : {summary(same_new)}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
