"""Offline throughput benchmark: kvscope's engine vs transformers ``generate`` (static batching), same weights.

Run: ``kvscope bench --offline`` or ``python -m engine.bench``. Prints output tokens/s for each concurrency
(128 prompt / 128 output tokens by default, greedy, ignore_eos). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time
from dataclasses import asdict, dataclass

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class BenchResult:
    system: str
    concurrency: int
    output_tokens: int
    seconds: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of exactly ``input_len`` random token ids (ids 1000…vocab-1 avoid special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab_size) for _ in range(input_len)] for _ in range(num)]


def bench_kvscope(llm: LLM, prompts: list[list[int]], output_len: int) -> BenchResult:
    """All prompts submitted at once; continuous batching does the rest. Wall time of the whole batch."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return BenchResult("kvscope", len(prompts), tokens, seconds)


def bench_transformers(model_dir: str, prompts: list[list[int]], output_len: int, dtype: torch.dtype) -> BenchResult:
    """transformers ``generate(do_sample=False)`` on one static batch (all prompts the same length: no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    input_ids = torch.tensor(prompts, dtype=torch.int64)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(input_ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        seconds = time.perf_counter() - start
    tokens = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    del model
    gc.collect()
    return BenchResult(f"transformers ({str(dtype).removeprefix('torch.')}, static batch)", len(prompts), tokens,
                       seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvscope bench --offline", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype)
    results = []
    for concurrency in args.concurrency:
        prompts = random_prompts(concurrency, args.input_len, llm.engine.vocab_size, args.seed)
        results.append(bench_kvscope(llm, prompts, args.output_len))
        _print(results[-1])
    if not args.skip_transformers:
        dtype = getattr(torch, args.dtype)
        for concurrency in args.concurrency:
            prompts = random_prompts(concurrency, args.input_len, llm.engine.vocab_size, args.seed)
            results.append(bench_transformers(llm.engine.info.model_dir, prompts, args.output_len, dtype))
            _print(results[-1])
    _print_table(results, args)
    if args.save_result:
        with open(args.save_result, "w") as fh:
            json.dump([asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results], fh, indent=2)
    return 0


def _print(result: BenchResult) -> None:
    print(f"{result.system:40s} concurrency {result.concurrency:3d}: {result.output_tokens_per_s:8.1f} output tok/s "
          f"({result.output_tokens} tokens in {result.seconds:.2f} s)", flush=True)


def _print_table(results: list[BenchResult], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Offline output tokens/s — {args.input_len} prompt / {args.output_len} output tokens, "
                        f"greedy, {args.dtype}, {platform.processor() or platform.machine()}, "
                        f"{torch.get_num_threads()} threads")
    table.add_column("system")
    for concurrency in args.concurrency:
        table.add_column(f"c={concurrency}", justify="right")
    for system in dict.fromkeys(r.system for r in results):
        row = {r.concurrency: f"{r.output_tokens_per_s:.1f}" for r in results if r.system == system}
        table.add_row(system, *(row.get(c, "-") for c in args.concurrency))
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(main())
