"""Speculative decoding benchmark (issue 16): output tok/s with n-gram speculation off vs on, on copy-heavy
prompts ("rewrite this code with one variable renamed", "repeat the list with one change", built from text
that ships in this repository) and on random-token prompts, at concurrency 1 and 8, with the acceptance
figures (accepted / proposed draft tokens, vLLM's mean acceptance length 1 + accepted / drafts); and on
open-ended stories, where there is little to copy. Then the adaptive policy's measured step costs per batch
size (the step without drafts, the extra per draft token: engine/spec_decode/adaptive.py) after the runs.

Offline (kvscope.engine.llm.LLM, no HTTP), greedy (``open`` stories: temperature 0.8 with a seed per prompt),
chat template for the chat prompts. c=1 runs its prompts one after the other (single stream); c=8 submits 8 at
once (continuous batching, ``max_num_seqs`` 8). Output tok/s = generated tokens / wall time (prefill
included); decode tok/s per stream = the mean over requests of (tokens − 1) / (last token − first token), from
the requests' ``kvscope`` stats (prefill and queueing excluded: the issue's single-stream decode rate at c=1,
and what each of 8 streams sees at c=8). Each cell is the best of ``--repeats`` (the least disturbed by other
load on a shared machine); "same tokens" says whether the speculative run's tokens equal the plain run's
(greedy identity). Prints the machine (CPU model, flags, threads, load average before and after) and a
markdown table. A benchmark, not a test: it asserts nothing.

    python bench/spec_decode.py [--max-tokens 128] [--repeats 2] [--num-speculative-tokens 4]
                                [--dtype auto] [--quantization auto] [--workloads code,list,random,open]
                                [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvscope.engine.bench import random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
CODE_FILES = (
    "engine/sampling_params.py",
    "engine/core/block_pool.py",
    "engine/text/output_processor.py",
    "engine/core/kv_cache_manager.py",
    "engine/server/metrics.py",
    "gateway/logs/record.py",
    "dashboards/promql.py",
    "engine/core/request.py",
)
"""Source files of this repository the code prompts copy from (one ~30-line slice each)."""
LIST_SOURCE = "docs/metrics.md"
"""The list prompts repeat metric names from this page."""
CONCURRENCIES = (1, 8)
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
_IDENT = re.compile(r"\b[a-z_][a-z0-9_]{3,}\b")
_KEYWORDS = {
    "self",
    "return",
    "from",
    "import",
    "none",
    "true",
    "false",
    "class",
    "with",
    "while",
    "elif",
    "else",
    "pass",
    "raise",
    "assert",
    "lambda",
    "yield",
    "async",
    "await",
    "global",
    "field",
    "float",
    "list",
    "dict",
    "tuple",
    "bool",
    "str",
    "int",
    "for",
    "not",
    "and",
    "def",
}


def code_prompt(path: Path, lines: int = 30) -> list[dict]:
    """A chat asking to rewrite a ~``lines``-line slice of ``path`` (from its first ``def``) with its most
    frequent identifier renamed: the answer is the slice again, one name changed."""
    text = path.read_text().splitlines()
    start = next((i for i, line in enumerate(text) if line.lstrip().startswith("def ")), 0)
    code = "\n".join(text[start : start + lines])
    names = Counter(n for n in _IDENT.findall(code) if n.lower() not in _KEYWORDS)
    old = names.most_common(1)[0][0] if names else "value"
    return [
        {
            "role": "user",
            "content": f"Rewrite this code with the variable `{old}` renamed to `{old}_2`. "
            f"Change nothing else and output only the code.\n\n```python\n{code}\n```",
        }
    ]


def list_prompt(items: list[str], index: int) -> list[dict]:
    """A chat asking to repeat a numbered list with item ``index`` replaced."""
    listing = "\n".join(f"{i + 1}. {item}" for i, item in enumerate(items))
    return [
        {
            "role": "user",
            "content": f"Repeat the list below exactly, but replace item {index + 1} with "
            f"`banana`. Output only the list.\n\n{listing}",
        }
    ]


def metric_names(path: Path) -> list[str]:
    """The metric series names of docs/metrics.md's tables, in order."""
    return re.findall(r"^\| `(kvscope_[a-z_]+)`", path.read_text(), flags=re.MULTILINE)


TOPICS = (
    "a lighthouse keeper",
    "a lost umbrella",
    "the first day of school",
    "a city under snow",
    "a robot learning to paint",
    "an old map",
    "a night train",
    "a garden on the moon",
)
"""Open-ended story prompts (``open``): little to copy from the prompt."""
SAMPLED = {"open"}
"""Workloads sampled at temperature 0.8 (a fixed seed per prompt, the same with speculation off and on)."""


def workloads(llm: LLM, names: list[str], count: int, seed: int) -> dict[str, list[list[int]]]:
    """Token-id prompts per workload: ``code`` and ``list`` (chat template applied), ``random`` (128 random
    ids, kvscope.engine.bench.random_prompts; a small model tends to loop on them) and ``open`` (short
    stories)."""
    out: dict[str, list[list[int]]] = {}
    template = llm.tokenizer.apply_chat_template
    if "code" in names:
        out["code"] = [
            template(code_prompt(ROOT / CODE_FILES[i % len(CODE_FILES)]), add_generation_prompt=True)
            for i in range(count)
        ]
    if "list" in names:
        metrics = metric_names(ROOT / LIST_SOURCE)
        out["list"] = [
            template(list_prompt(metrics[i : i + 12], (3 + i) % 12), add_generation_prompt=True)
            for i in range(count)
        ]
    if "random" in names:
        out["random"] = random_prompts(count, 128, llm.engine.vocab_size, seed)
    if "open" in names:
        out["open"] = [
            template(
                [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}],
                add_generation_prompt=True,
            )
            for i in range(count)
        ]
    return out


@dataclass(frozen=True, slots=True)
class Run:
    workload: str
    concurrency: int
    speculative: bool
    output_tokens: int
    seconds: float
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    token_ids: tuple[tuple[int, ...], ...]
    decode_tok_s: float
    """Mean over the requests of (output tokens − 1) / (last token − first token): the decode rate of one
    stream, prefill and queueing excluded (the issue's "single-stream decode tok/s" at c=1)."""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def run(
    llm: LLM, workload: str, prompts: list[list[int]], concurrency: int, max_tokens: int, spec: bool
) -> Run:
    """Generate for ``prompts`` (one at a time for c=1, all at once otherwise); wall time and the summed
    speculative-decoding fields of the requests' kvscope stats."""
    temperature = 0.8 if workload in SAMPLED else 0.0
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens) for i in range(len(prompts))
    ]
    start = time.perf_counter()
    if concurrency == 1:
        outputs = [o for p, sp in zip(prompts, params, strict=True) for o in llm.generate([p], sp)]
    else:
        outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    choices = [o.outputs[0] for o in outputs]
    stats = [c.stats for c in choices if c.stats is not None]
    rates = [
        (len(c.token_ids) - 1) / c.stats.decode_s
        for c in choices
        if c.stats is not None and c.stats.decode_s and len(c.token_ids) > 1
    ]
    return Run(
        workload,
        concurrency,
        spec,
        sum(len(c.token_ids) for c in choices),
        seconds,
        sum(s.spec_drafts or 0 for s in stats),
        sum(s.spec_draft_tokens or 0 for s in stats),
        sum(s.spec_accepted_tokens or 0 for s in stats),
        tuple(tuple(c.token_ids) for c in choices),
        sum(rates) / len(rates) if rates else 0.0,
    )


def machine() -> dict[str, object]:
    """CPU model, the SIMD flags that matter to the kernels, torch threads, load average."""
    model, flags = platform.processor() or "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        text = cpuinfo.read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", text, flags=re.MULTILINE)
        model = found.group(1).strip() if found else model
        found = re.search(r"^flags\s*:\s*(.+)$", text, flags=re.MULTILINE)
        flags = set(found.group(1).split()) if found else set()
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "flags": [f for f in FLAGS if f in flags],
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def table(best: dict[tuple[str, int, bool], Run]) -> str:
    """Markdown: one row per workload and concurrency, speculation off vs on."""
    rows = [
        "| workload | c | off tok/s | on tok/s | speedup | decode tok/s per stream off → on | decode speedup "
        "| acceptance rate | mean acceptance length | drafts | same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (workload, c, spec), on in best.items():
        if not spec or (workload, c, False) not in best:
            continue
        off = best[(workload, c, False)]
        rate = f"{on.accepted_tokens / on.draft_tokens:.0%}" if on.draft_tokens else "—"
        length = f"{1 + on.accepted_tokens / on.drafts:.2f}" if on.drafts else "—"
        decode = f"{on.decode_tok_s / off.decode_tok_s:.2f}×" if off.decode_tok_s else "—"
        rows.append(
            f"| {workload} | {c} | {off.tok_s:.1f} | {on.tok_s:.1f} | {on.tok_s / off.tok_s:.2f}× "
            f"| {off.decode_tok_s:.1f} → {on.decode_tok_s:.1f} | {decode} | {rate} "
            f"| {length} | {on.drafts} | {'yes' if on.token_ids == off.token_ids else 'no'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts-c1", type=int, default=2, help="prompts run one after the other at c=1")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--quantization", default="auto", help="the servers' default: the fastest verified format"
    )
    parser.add_argument("--workloads", default="code,list,random,open")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    before = machine()
    common = dict(dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(CONCURRENCIES))
    engines = {
        False: LLM(**common),
        True: LLM(**common, speculative="ngram", num_speculative_tokens=args.num_speculative_tokens),
    }
    prompts = workloads(engines[False], args.workloads.split(","), max(CONCURRENCIES), args.seed)
    for llm in engines.values():  # warm-up: first-call allocations and kernel selection
        llm.generate([prompts[next(iter(prompts))][0]], SamplingParams(temperature=0.0, max_tokens=8))
    best: dict[tuple[str, int, bool], Run] = {}
    for _ in range(args.repeats):
        for workload, texts in prompts.items():
            for c in CONCURRENCIES:
                batch = texts[: args.prompts_c1] if c == 1 else texts[:c]
                for spec in (False, True):  # interleaved, so slow phases of the box hit both
                    result = run(engines[spec], workload, batch, c, args.max_tokens, spec)
                    key = (workload, c, spec)
                    if key not in best or result.tok_s > best[key].tok_s:
                        best[key] = result
    after = machine()
    info = engines[False].engine.info
    print(
        f"machine: {before['cpu']} ({before['cpus']} CPUs; {', '.join(before['flags']) or 'no AVX2/512'}), "
        f"torch {after['torch']} with {after['torch_threads']} engine threads; load average "
        f"{before['load_average']} before, {after['load_average']} after"
    )
    report = engines[False].engine.load_report
    fmt = report.weight_format
    served = (
        f"{fmt.dtype} {fmt.quantization}" if fmt is not None else str(report.dtype).removeprefix("torch.")
    )
    print(
        f"model: {info.name} (--dtype {args.dtype} --quantization {args.quantization} → {served}), greedy "
        f"(open: temperature 0.8, seeded), "
        f"max_tokens {args.max_tokens}, k = {args.num_speculative_tokens}, best of {args.repeats}\n"
    )
    print(table(best))
    drafter = engines[True].engine.drafter
    costs = drafter.cost.costs() if drafter is not None else {}
    print(
        "\nthe adaptive policy's step-cost model after the runs (per batch-size bucket: the step without "
        "drafts, the extra per draft token, whether drafts pay):"
    )
    for rows, (t0, per_token, pays) in costs.items():
        print(
            f"  {rows:3d} rows: {'-' if t0 is None else f'{t0 * 1e3:.2f} ms'}, "
            f"{'-' if per_token is None else f'+{per_token * 1e3:.2f} ms'} per draft token, "
            f"{'undecided' if pays is None else 'drafts on' if pays else 'drafts off'}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine_before": before,
                    "machine_after": after,
                    "step_costs_ms": {
                        rows: {
                            "step": None if t0 is None else t0 * 1e3,
                            "per_draft_token": None if m is None else m * 1e3,
                            "drafts_pay": pays,
                        }
                        for rows, (t0, m, pays) in costs.items()
                    },
                    "runs": [
                        {k: v for k, v in asdict(r).items() if k != "token_ids"} | {"tok_s": r.tok_s}
                        for r in best.values()
                    ],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
