"""Structured-output overhead (issue 14): decode tok/s of a batch of 32 where half the requests are
grammar-constrained vs the same batch unconstrained, plus the compile time of a typical JSON schema.

Offline (kvscope.engine.llm.LLM, no HTTP). Unconstrained rows use ``ignore_eos``; constrained rows use a regex
that cannot complete within ``--max-tokens`` (so both runs decode exactly the same number of tokens). Runs are
interleaved ``--repeats`` times and the best tok/s of each kind is reported (the least disturbed by other
load).

    python bench/structured_overhead.py [--constraint json|regex] [--batch 32] [--max-tokens 64] [--repeats 3]
                                        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.structured.params import StructuredOutputsParams

CONSTRAINTS = {
    # a JSON string field: llguidance's token-trie slices make its mask cheap (the common case)
    "json": StructuredOutputsParams.json_schema(
        {
            "type": "object",
            "required": ["text"],
            "properties": {"text": {"type": "string", "minLength": 2000}},
        }
    ),
    # a character class no slice covers: the whole token trie is walked every step (the worst case)
    "regex": StructuredOutputsParams("regex", "[a-z ,.]{1000}"),
}
TYPICAL_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "address", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "required": ["city"],
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
}


def run(
    llm: LLM, batch: int, max_tokens: int, constrained: int, constraint: StructuredOutputsParams
) -> float:
    """tok/s of one batch with ``constrained`` grammar rows."""
    params = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=i >= constrained,
            structured_outputs=constraint if i < constrained else None,
        )
        for i in range(batch)
    ]
    start = time.perf_counter()
    outputs = llm.generate([f"Write about topic {i}:" for i in range(batch)], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == batch * max_tokens, tokens
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--constraint", choices=sorted(CONSTRAINTS), default="json")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    llm = LLM(max_num_seqs=args.batch)
    mask_times: list[float] = []
    llm.engine.structured.mask_observer = mask_times.append
    constraint = CONSTRAINTS[args.constraint]
    llm.engine.structured.compile(constraint)  # builds the grammar tokenizer once, outside the timing
    run(llm, 4, 4, 2, constraint)  # warm-up
    plain, mixed = [], []
    for _ in range(args.repeats):
        plain.append(run(llm, args.batch, args.max_tokens, 0, constraint))
        mixed.append(run(llm, args.batch, args.max_tokens, args.batch // 2, constraint))
    compile_s = [
        llm.engine.structured.compile(
            StructuredOutputsParams.json_schema({**TYPICAL_SCHEMA, "title": str(i)})
        )
        for i in range(5)
    ]
    result = {
        "constraint": args.constraint,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "unconstrained_tok_s": max(plain),
        "half_constrained_tok_s": max(mixed),
        "ratio": max(mixed) / max(plain),
        "mask_ms_per_step_median": statistics.median(mask_times) * 1e3,
        "schema_compile_ms_median": statistics.median(compile_s) * 1e3,
        "all_unconstrained": plain,
        "all_half_constrained": mixed,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
