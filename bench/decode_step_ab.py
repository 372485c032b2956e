"""In-process A/B of the decode attention: one engine (``--dtype auto --quantization gguf``), kvscope's C++
paged decode attention (``TorchAttentionBackend.paged_decode``) switched on and off every 5 steps (the first
step after a switch untimed), 4 timed steps per switch, 10 switches each way; wall seconds of
``EngineCore.step``. A benchmark, not a test (docs/benchmarks.md "Batched decode", issue 13).

Usage: python bench/decode_step_ab.py [--batch 32] [--threads 2] [--input-len 128] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvscope.engine.bench import random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    llm = LLM(
        "smollm2-135m",
        dtype="auto",
        quantization="gguf",
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_model_len=1024,
    )
    engine = llm.engine
    backend = engine.runner.backend
    max_tokens = 2 * args.rounds * 5 + 16
    for i, ids in enumerate(random_prompts(args.batch, args.input_len, engine.vocab_size, 1)):
        engine.add_request(
            f"ab{i}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(2 * args.rounds):
        paged = rnd % 4 in (0, 3)  # on, off, off, on, ...
        backend.paged_decode = paged
        engine.step()
        for _ in range(4):
            start = time.perf_counter()
            engine.step()
            times[paged].append(time.perf_counter() - start)
    backend.paged_decode = True
    context = args.input_len + max_tokens // 2
    cells = {k: f"median {1e3 * statistics.median(v):.1f} min {1e3 * min(v):.1f}" for k, v in times.items()}
    print(
        f"batch {args.batch}, {args.threads} thread(s), contexts "
        f"{args.input_len}-{args.input_len + max_tokens} (~{context}): SDPA {cells[False]} | paged op "
        f"{cells[True]} ms wall per decode step; load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
