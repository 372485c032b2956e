"""Where the idle TTFT of one prompt goes (docs/benchmarks.md "Idle TTFT"). A benchmark, not a test.

Loads the default format (``--dtype auto --quantization auto``), runs the server's warm-up, then times the
first step of ``--runs`` single prompts on an idle engine (wall ms, the sequence and min/median), profiles 5
more with torch.profiler (``record_shapes``: top ops by self CPU, and by input shape), and times the four
projection matmuls of one decoder layer alone at the prompt's row count (oneDNN packed bfloat16, min and
median of 200), the matmul floor x the model's layers.

Usage: python bench/ttft_profile.py [--threads 2] [--input-len 128] [--runs 12] [--no-warmup]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvscope.engine.bench import random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.models.layers import Linear
from kvscope.engine.sampling_params import SamplingParams


def first_step_ms(llm: LLM, ids: list[int], tag: str) -> float:
    engine = llm.engine
    engine.add_request(tag, ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    elapsed = 1000 * (time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def matmul_floor(llm: LLM, rows: int) -> str:
    """Each distinct projection of layer 0 alone (its CPU kernel: the dense packed copy above the
    crossover)."""
    layer = llm.engine.model.model.layers[0]
    dtype = llm.engine.model.model.embed_tokens.weight.dtype
    parts, total = [], 0.0
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        module: Linear = layer.get_submodule(name)
        x = torch.randn(rows, module.in_features).to(dtype)
        with torch.inference_mode():
            for _ in range(10):
                module.forward(x)
            times = []
            for _ in range(200):
                start = time.perf_counter()
                module.forward(x)
                times.append(time.perf_counter() - start)
        total += min(times)
        parts.append(
            f"{name} {module.out_features}x{module.in_features}: min {1e6 * min(times):.0f} / median "
            f"{1e6 * statistics.median(times):.0f} us"
        )
    layers = len(llm.engine.model.model.layers)
    return (
        "\n".join(parts)
        + f"\nfloor: {1e3 * total:.2f} ms a layer (sum of mins), {1e3 * total * layers:.1f} ms x {layers}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--no-warmup", action="store_true", help="skip the server's prefill-shape warm-up")
    args = parser.parse_args()
    llm = LLM("smollm2-135m", dtype="auto", quantization="auto", num_threads=args.threads)
    engine = llm.engine
    if not args.no_warmup:
        engine.warm_up_prefill()
    llm.generate([[1000] * 8], SamplingParams(temperature=0.0, max_tokens=2))
    print(
        f"{engine.info.dtype}/{engine.info.quantization}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()}",
        flush=True,
    )
    prompts = random_prompts(args.runs + 5, args.input_len, engine.vocab_size, 21)
    times = [first_step_ms(llm, ids, f"ttft-{i}") for i, ids in enumerate(prompts[: args.runs])]
    print("first-step ms:", [round(t, 1) for t in times])
    print(f"min {min(times):.1f} median {statistics.median(times):.1f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i, ids in enumerate(prompts[args.runs :]):
            first_step_ms(llm, ids, f"prof-{i}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20))
    print(matmul_floor(llm, args.input_len))
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
