"""TTFT/TPOT of a closed-loop burst on the engine, timed in this thread's CPU seconds (so a loaded machine
changes the numbers little): C clients, N prompts of 128 random tokens, OUT output tokens, greedy,
ignore_eos; a client sends its next prompt when its request finishes. One line per scheduler config.

Usage: python bench/burst_ttft.py [--dtype float32] [--quantization none] [-c 32] [-n 32] [--output-len 16]
           [--budgets 2048:0 1024:0 512:0]      (max_num_batched_tokens:long_prefill_token_threshold)
A benchmark, not a test (docs/benchmarks.md "Scheduler defaults").
"""

from __future__ import annotations

import argparse
import time

from kvscope.engine.bench import random_prompts
from kvscope.engine.config import SchedulerConfig
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of ``values`` (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_burst(llm: LLM, budget: int, threshold: int, clients: int, num_prompts: int, output_len: int) -> str:
    """One closed-loop run under ``SchedulerConfig(max_num_batched_tokens=budget, ...)``; returns its line."""
    engine = llm.engine
    engine.scheduler.scheduler_config = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold
    )
    prompts = random_prompts(num_prompts, 128, engine.vocab_size, 7)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    clock, arrive, first, done = 0.0, {}, {}, {}

    def send() -> None:
        request_id = f"burst-{budget}-{threshold}-{len(arrive)}"
        engine.add_request(request_id, prompts[len(arrive)], params)
        arrive[request_id] = clock

    for _ in range(clients):
        send()
    steps = 0
    while engine.has_unfinished_requests():
        start = time.thread_time()
        result = engine.step()
        clock += time.thread_time() - start
        steps += 1
        for output in result.outputs:
            if output.request_id not in first and output.outputs and output.outputs[0].token_ids:
                first[output.request_id] = clock
            if output.finished:
                done[output.request_id] = clock
                if len(arrive) < num_prompts:
                    send()
    ttft = [first[r] - arrive[r] for r in arrive]
    tpot = [(done[r] - first[r]) / max(1, output_len - 1) for r in arrive]
    return (
        f"budget={budget} threshold={threshold}: TTFT p50 {quantile(ttft, 0.5) * 1e3:.0f} ms, p99 "
        f"{quantile(ttft, 0.99) * 1e3:.0f} ms; TPOT p50 {quantile(tpot, 0.5) * 1e3:.1f} ms; {clock:.1f} CPU "
        f"s, {steps} steps"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("-c", "--clients", type=int, default=32)
    parser.add_argument("-n", "--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--budgets", nargs="+", default=["2048:0", "1024:0", "512:0", "256:0"])
    args = parser.parse_args()
    llm = LLM(
        "smollm2-135m",
        dtype=args.dtype,
        quantization=args.quantization,
        num_threads=1,
        enable_prefix_caching=False,
        max_model_len=1024,
    )
    llm.generate([[1000] * 8], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    for spec in args.budgets:
        budget, threshold = (int(v) for v in spec.split(":"))
        line = run_burst(llm, budget, threshold, args.clients, args.num_prompts, args.output_len)
        print(
            f"{args.dtype}/{args.quantization} c={args.clients} n={args.num_prompts} out={args.output_len} "
            f"{line}",
            flush=True,
        )


if __name__ == "__main__":
    main()
