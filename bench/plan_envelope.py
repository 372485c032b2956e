"""The "engine vs its own bound" row of docs/plan.md: `kvscope plan --device cpu` (probe) vs the engine's
measured decode ms/step (engine/bench.py ``--step-bench``), same model, dtype, thread count and context.

    python bench/plan_envelope.py [--concurrency 1 32] [--rounds 3] [--out results.json]

Per round: probe the CPU (the plan's envelope), time the engine's decode steps at each concurrency, probe
again. Reports the median over rounds of measured ms/step, the bound, and bound / measured (1.0 = the engine
is at the roofline; 0.5 = it takes twice the bound). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from kvscope.engine.bench import bench_steps, random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams
from kvscope.plan.cpu_probe import ProbeConfig, probe_cpu
from kvscope.plan.model_files import read_model
from kvscope.plan.planner import PlanRequest, plan


def bound_ms(model: str, concurrency: list[int], input_len: int, steps: int, threads: int) -> dict[int, dict]:
    """The plan's decode rows (probe now) at the benchmark's context: prompt + steps/2 tokens on average."""
    device = probe_cpu(ProbeConfig(threads=threads))
    req = PlanRequest(
        model=model,
        dtype="float32",  # what LLM(model) runs: the library's defaults, float32 weights, no quantization
        quantization="none",
        max_model_len=input_len + steps + 8,
        prompt_len=input_len,
        output_len=steps,
        concurrency=max(concurrency),
        kv_cache_memory=1 << 30,
    )
    rows = {r["concurrency"]: r for r in plan(req, read_model(model), device).speed["decode"]}
    return {
        c: rows[c] | {"bandwidth": device.bandwidth, "peak_fp32": device.peak_flops["fp32"]}
        for c in concurrency
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory=1 << 30)
    import torch

    threads = torch.get_num_threads()
    llm.generate([[1000] * 8], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    rounds = []
    for r in range(args.rounds):
        before = bound_ms(args.model, args.concurrency, args.input_len, args.steps, threads)
        measured = {
            c: bench_steps(
                llm, random_prompts(c, args.input_len, llm.engine.vocab_size, r), args.steps
            ).decode_ms_per_step
            for c in args.concurrency
        }
        after = bound_ms(args.model, args.concurrency, args.input_len, args.steps, threads)
        rounds.append({"measured_ms": measured, "bound_before": before, "bound_after": after})
        print(
            json.dumps(
                {
                    c: {
                        "measured_ms": round(measured[c], 2),
                        "bound_ms": round(before[c]["step_ms"], 2),
                        "bound_after_ms": round(after[c]["step_ms"], 2),
                    }
                    for c in args.concurrency
                }
            ),
            flush=True,
        )
    summary = {}
    for c in args.concurrency:
        measured = statistics.median(x["measured_ms"][c] for x in rounds)
        bound = statistics.median(x[k][c]["step_ms"] for x in rounds for k in ("bound_before", "bound_after"))
        summary[c] = {
            "measured_ms_per_step": measured,
            "bound_ms_per_step": bound,
            "bound_over_measured": bound / measured,
            "bound_kind": rounds[0]["bound_before"][c]["bound"],
            "bandwidth_gb_s": statistics.median(x["bound_before"][c]["bandwidth"] for x in rounds) / 1e9,
            "peak_fp32_gflops": statistics.median(x["bound_before"][c]["peak_fp32"] for x in rounds) / 1e9,
        }
    print(
        f"{platform.processor() or platform.machine()}, {threads} torch threads, fp32, prompt "
        f"{args.input_len}, {args.steps} decode steps, {args.rounds} rounds"
    )
    for c, s in summary.items():
        print(
            f"concurrency {c:3d}: measured {s['measured_ms_per_step']:7.1f} ms/step, bound "
            f"{s['bound_ms_per_step']:6.1f} ms ({s['bound_kind']}), bound/measured "
            f"{s['bound_over_measured']:.2f}; probe {s['bandwidth_gb_s']:.1f} GB/s, "
            f"{s['peak_fp32_gflops']:.0f} GFLOP/s fp32"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
