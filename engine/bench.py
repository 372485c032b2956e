"""Offline throughput benchmark: kvscope's engine vs transformers ``generate`` (static batching), same
weights.

Run: ``kvscope bench --offline`` or ``python -m kvscope.engine.bench``. Prints output tokens/s for each
concurrency (128 prompt / 128 output tokens by default, greedy, ignore_eos) and the median TTFT.
``--step-bench`` instead times single engine steps: decode ms/step at each concurrency (all prompts prefilled
first), the first step of each concurrency (its prefill), and the idle TTFT: ``--ttft-runs`` single prompts of
``--input-len`` tokens, each on an idle engine, from ``add_request`` to the step that returns its first token
(median and min; the first of them is also reported alone: the first prompt of that length pays oneDNN's
per-shape set-up unless the engine warmed it up). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kvscope.common.cli_help import HelpFormatter
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class BenchResult:
    system: str
    concurrency: int
    output_tokens: int
    seconds: float
    ttft_s: float | None = None
    """Median time to first token over the requests (kvscope only: from the engine's request stats)."""

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
    ttfts = [
        stats.ttft_s
        for o in outputs
        if (stats := o.outputs[0].stats) is not None and stats.ttft_s is not None
    ]
    return BenchResult("kvscope", len(prompts), tokens, seconds, statistics.median(ttfts) if ttfts else None)


@dataclass(frozen=True, slots=True)
class StepBenchResult:
    concurrency: int
    decode_ms_per_step: float
    """Median wall time of one ``EngineCore.step()`` while all ``concurrency`` requests decode."""
    prefill_ms: float
    """The first step: prefill of every prompt that fits the token budget (one prompt: its TTFT)."""


@dataclass(frozen=True, slots=True)
class IdleTtftResult:
    """Time to first token of single prompts on an idle engine (:func:`bench_idle_ttft`), milliseconds."""

    input_len: int
    runs: int
    first_ms: float
    """The first run alone (the engine's first prompt of this length)."""
    median_ms: float
    min_ms: float


def bench_steps(llm: LLM, prompts: list[list[int]], steps: int) -> StepBenchResult:
    """Queue ``prompts``, time the first step (prefill), run until every prompt is prefilled, then time
    ``steps`` decode steps one by one. Returns medians in milliseconds."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"step-bench-{len(prompts)}-{i}", ids, params)
    start = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - start
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return StepBenchResult(len(prompts), 1000 * statistics.median(times), 1000 * prefill)


def bench_idle_ttft(llm: LLM, input_len: int, runs: int, seed: int) -> IdleTtftResult:
    """``runs`` prompts of ``input_len`` random tokens, one at a time on an idle engine: each is timed (wall)
    from ``add_request`` to the end of the step that returns its first output token, then finished."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i, ids in enumerate(random_prompts(runs, input_len, engine.vocab_size, seed)):
        request_id = f"idle-ttft-{input_len}-{i}"
        start = time.perf_counter()
        engine.add_request(request_id, ids, params)
        while not any(o.request_id == request_id and o.outputs[0].token_ids for o in engine.step().outputs):
            pass
        times.append(1000 * (time.perf_counter() - start))
        while engine.has_unfinished_requests():
            engine.step()
    return IdleTtftResult(input_len, runs, times[0], statistics.median(times), min(times))


def bench_transformers(
    model_dir: str, prompts: list[list[int]], output_len: int, dtype: torch.dtype
) -> BenchResult:
    """transformers ``generate(do_sample=False)`` on one static batch (all prompts the same length: no
    padding)."""
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
    return BenchResult(
        f"transformers ({str(dtype).removeprefix('torch.')}, static batch)", len(prompts), tokens, seconds
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvscope bench --offline", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["auto", "none", "int8", "int4", "gguf"],
        help="linear-layer weights of the kvscope engine (docs/engine-server.md; auto: what "
        "kvscope serve picks)",
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, help="torch CPU threads (default: the engine's choice)")
    parser.add_argument(
        "--speculative",
        default="none",
        choices=["none", "ngram"],
        help="speculative decoding (engine/spec_decode)",
    )
    parser.add_argument("--num-speculative-tokens", type=int, help="draft tokens per step (default 4)")
    parser.add_argument(
        "--step-bench",
        action="store_true",
        help="time single steps instead: decode ms/step per concurrency and one prompt's prefill",
    )
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed by --step-bench")
    parser.add_argument(
        "--ttft-runs",
        type=int,
        default=8,
        help="single idle prompts timed by --step-bench for the idle TTFT (0: skip)",
    )
    parser.add_argument("--save-result", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        num_threads=args.num_threads,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    args.dtype = str(llm.engine.load_report.dtype).removeprefix("torch.")  # auto resolved
    args.quantization = llm.engine.info.quantization  # auto resolved
    if args.step_bench:
        return _run_step_bench(llm, args)
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
            json.dump(
                [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} | _setup(args) for r in results],
                fh,
                indent=2,
            )
    return 0


def _setup(args: argparse.Namespace) -> dict[str, object]:
    """What a saved result was measured with (weights, lengths, threads), so results can be compared."""
    return {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_threads": torch.get_num_threads(),
    }


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n != 1 else ''}"


def _run_step_bench(llm: LLM, args: argparse.Namespace) -> int:
    # the served engine's warm-up (engine/server/app.py): prefill shapes, a generation
    llm.engine.warm_up_prefill()
    llm.generate([[1000] * 8], SamplingParams(temperature=0.0, max_tokens=2))
    results = []
    for concurrency in args.concurrency:
        prompts = random_prompts(concurrency, args.input_len, llm.engine.vocab_size, args.seed)
        results.append(bench_steps(llm, prompts, args.steps))
        print(
            f"kvscope {args.dtype}/{args.quantization}, {_threads()}, concurrency {concurrency:3d}: decode "
            f"{results[-1].decode_ms_per_step:7.1f} ms/step; first step (prefill of {concurrency} x "
            f"{args.input_len} tokens) {results[-1].prefill_ms:8.1f} ms",
            flush=True,
        )
    saved = [asdict(r) | _setup(args) for r in results]
    if args.ttft_runs > 0:
        ttft = bench_idle_ttft(llm, args.input_len, args.ttft_runs, args.seed + 1)
        print(
            f"kvscope {args.dtype}/{args.quantization}, {_threads()}: idle TTFT of one "
            f"{args.input_len}-token prompt over {ttft.runs} runs: median {ttft.median_ms:.1f} ms, min "
            f"{ttft.min_ms:.1f} ms (first run {ttft.first_ms:.1f} ms)",
            flush=True,
        )
        saved.append({"idle_ttft": asdict(ttft)} | _setup(args))
    if args.save_result:
        with open(args.save_result, "w") as fh:
            json.dump(saved, fh, indent=2)
    return 0


def _print(result: BenchResult) -> None:
    ttft = "" if result.ttft_s is None else f", median TTFT {result.ttft_s * 1000:.0f} ms"
    print(
        f"{result.system:40s} concurrency {result.concurrency:3d}: {result.output_tokens_per_s:8.1f} output "
        f"tok/s ({result.output_tokens} tokens in {result.seconds:.2f} s{ttft})",
        flush=True,
    )


def _print_table(results: list[BenchResult], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Offline output tokens/s — {args.input_len} prompt / {args.output_len} output tokens, "
        f"greedy, {args.dtype}, quantization {args.quantization}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    table.add_column("system")
    for concurrency in args.concurrency:
        table.add_column(f"c={concurrency}", justify="right")
    for system in dict.fromkeys(r.system for r in results):
        row = {r.concurrency: f"{r.output_tokens_per_s:.1f}" for r in results if r.system == system}
        table.add_row(system, *(row.get(c, "-") for c in args.concurrency))
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(main())
