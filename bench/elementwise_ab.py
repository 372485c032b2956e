"""Idle TTFT A/B of kvscope's C++ elementwise ops (kernels/csrc/cpu_elementwise.cpp; docs/benchmarks.md "C++
elementwise ops for prefill"). A benchmark, not a test.

One engine in the default format (``--dtype auto --quantization auto``), warmed up as the server does; prompts
of ``--input-len`` random tokens one at a time, alternating every prompt between the C++ ops and torch's
(``cpu_op`` of every RMSNorm, MLP and Attention module toggled on the same model); wall ms from
``add_request`` to the end of the step that returns the first token.

Usage: python bench/elementwise_ab.py [--threads 2] [--runs 30] [--input-len 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvscope.engine.bench import random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.models.layers import RMSNorm
from kvscope.engine.models.llama import MLP, Attention
from kvscope.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=30, help="prompts per side")
    parser.add_argument("--input-len", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(
        "smollm2-135m",
        dtype="auto",
        quantization="auto",
        num_threads=args.threads,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    engine.warm_up_prefill()
    llm.generate([[1000] * 8], SamplingParams(temperature=0.0, max_tokens=2))
    modules = [m for m in engine.model.modules() if isinstance(m, (RMSNorm, MLP, Attention))]
    if not any(m.cpu_op for m in modules):
        raise SystemExit(
            "the C++ elementwise ops are off for this model (no kvscope CPU kernels, or not bfloat16)"
        )
    times: dict[bool, list[float]] = {True: [], False: []}
    for i, ids in enumerate(random_prompts(2 * args.runs, args.input_len, engine.vocab_size, 1)):
        on = i % 2 == 0
        for module in modules:
            module.cpu_op = on
        start = time.perf_counter()
        engine.add_request(f"ab-{i}", ids, PARAMS)
        while engine.has_unfinished_requests():
            engine.step()
        times[on].append(1000 * (time.perf_counter() - start))
    for on in (False, True):
        label = "C++ ops " if on else "torch ops"
        print(
            f"{label}: median {statistics.median(times[on]):.1f} ms, min {min(times[on]):.1f} ms "
            f"({args.runs} prompts of {args.input_len} tokens, {args.threads} threads)"
        )


if __name__ == "__main__":
    main()
