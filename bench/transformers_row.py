"""The transformers row of docs/benchmarks.md: ``generate`` on the same weights, one static batch per
concurrency, timed with engine/bench.py's ``bench_transformers`` (greedy, min = max new tokens, no padding).

A static batch starts and ends together, so every request has the same TTFT and TPOT (p50 = p99): TTFT = wall
time of a 1-new-token ``generate`` (prefill of the whole batch + the first token); TPOT = (wall time of the
full ``generate`` − TTFT) / (output_len − 1); output tok/s = batch · output_len / wall time. Medians over
``--rounds`` repetitions (each loads the model once per measured call; loading is not timed).

    python bench/transformers_row.py --model-dir ~/.cache/kvscope/models/smollm2-135m/hf --concurrency
    1 8 32
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kvscope.engine.bench import bench_transformers, random_prompts


def measure(
    model_dir: str, concurrency: int, input_len: int, output_len: int, dtype: torch.dtype, seed: int
) -> dict[str, float]:
    """One round at one concurrency: output tok/s, TTFT and TPOT in ms. Raises ValueError if output_len <
    2."""
    if output_len < 2:
        raise ValueError("output_len must be ≥ 2 to define TPOT")
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(concurrency, input_len, vocab_size, seed)
    first = bench_transformers(model_dir, prompts, 1, dtype)
    full = bench_transformers(model_dir, prompts, output_len, dtype)
    return {
        "output_throughput": full.output_tokens_per_s,
        "ttft_ms": first.seconds * 1000,
        "tpot_ms": (full.seconds - first.seconds) / (output_len - 1) * 1000,
        "seconds": full.seconds,
        "output_tokens": full.output_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="HF folder (config.json + model.safetensors)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", help="JSON file for the rows")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    for concurrency in args.concurrency:
        runs = [
            measure(args.model_dir, concurrency, args.input_len, args.output_len, dtype, args.seed + r)
            for r in range(args.rounds)
        ]
        row = {
            "system": f"transformers generate ({args.dtype}, static batch)",
            "concurrency": concurrency,
            "threads": torch.get_num_threads(),
            "runs": runs,
            **{
                k: statistics.median(run[k] for run in runs)
                for k in ("output_throughput", "ttft_ms", "tpot_ms")
            },
        }
        rows.append(row)
        print(
            f"{row['system']} c={concurrency}: {row['output_throughput']:.1f} out tok/s, TTFT "
            f"{row['ttft_ms']:.1f} ms, TPOT {row['tpot_ms']:.2f} ms",
            flush=True,
        )
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
