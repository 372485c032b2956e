"""Per-step cost of the engine's decode (and one idle prefill), in this thread's CPU seconds and wall seconds,
with an optional torch.profiler breakdown of the top ops; also splits a step into the model forward and
the rest (input packing, sampling, scheduling). A benchmark, not a test (docs/benchmarks.md, issue 13).

Usage: python bench/step_profile.py [--dtype auto] [--quantization gguf] [--threads 1] [-c 1 32]
           [--steps 24] [--profile] [--top 25]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvscope.engine.bench import random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams


def _timed_forward(model: torch.nn.Module, log: list[tuple[float, float]]):
    """Wrap ``model.forward`` to record (CPU s, wall s) of each call into ``log``."""
    inner = model.forward

    def forward(*args, **kwargs):
        cpu, wall = time.thread_time(), time.perf_counter()
        out = inner(*args, **kwargs)
        log.append((time.thread_time() - cpu, time.perf_counter() - wall))
        return out

    model.forward = forward
    return inner


def measure(llm: LLM, concurrency: int, steps: int, input_len: int, profile: bool, top: int) -> str:
    """Prefill ``concurrency`` prompts, then time ``steps`` decode steps; returns one summary line."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, ids in enumerate(random_prompts(concurrency, input_len, engine.vocab_size, 3)):
        engine.add_request(f"prof-{concurrency}-{i}-{time.monotonic_ns()}", ids, params)
    model = engine.model
    log: list[tuple[float, float]] = []
    inner = _timed_forward(model, log)
    start_cpu, start_wall = time.thread_time(), time.perf_counter()
    engine.step()
    first = (time.thread_time() - start_cpu, time.perf_counter() - start_wall)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    log.clear()
    cpu, wall = [], []
    for _ in range(steps):
        c, w = time.thread_time(), time.perf_counter()
        engine.step()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    fwd_cpu = (
        statistics.median(c for c, _ in log) if log else None
    )  # the fused single-request step skips forward
    table = ""
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                engine.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        events = [e for e in prof.events() if e.cpu_parent is None]
        table += f"\ntop-level ops per step: {len(events) / 4:.0f}\n"
    model.forward = inner
    resident = getattr(engine.runner.backend, "resident", None)
    if resident is not None:
        table += (
            f"resident decode K/V: {resident.full_gathers} full gathers, {resident.incremental_updates} "
            f"in-place updates, {resident.nbytes / 2**20:.1f} MiB\n"
        )
    while engine.has_unfinished_requests():
        engine.step()
    split = (
        "fused step"
        if fwd_cpu is None
        else f"forward {1e3 * fwd_cpu:.1f} ms, rest {1e3 * (statistics.median(cpu) - fwd_cpu):.1f} ms"
    )
    return (
        f"c={concurrency}: decode step CPU {1e3 * statistics.median(cpu):.1f} ms (min {1e3 * min(cpu):.1f}; "
        f"{split}), wall "
        f"{1e3 * statistics.median(wall):.1f} ms; first step (prefill {concurrency}x{input_len}) CPU "
        f"{1e3 * first[0]:.1f} ms wall {1e3 * first[1]:.1f} ms; load {os.getloadavg()[0]:.2f}\n{table}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_model_len=1024,
    )
    llm.generate([[1000] * 8], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    for concurrency in args.concurrency:
        print(
            f"{args.dtype}/{args.quantization} threads={torch.get_num_threads()} "
            + measure(llm, concurrency, args.steps, args.input_len, args.profile, args.top),
            flush=True,
        )


if __name__ == "__main__":
    main()
