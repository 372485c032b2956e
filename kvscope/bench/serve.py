"""``kvscope bench``: serving benchmark against any OpenAI-compatible server (kvscope engine or gateway, vLLM,
llama.cpp's llama-server …), measured on the client side with ``vllm bench serve``'s definitions.

    kvscope bench --model smollm2-135m --num-prompts 64 \\
        --max-concurrency 8 --input-len 128 --output-len 128 --ignore-eos --save-result out.json
    kvscope bench … --compare http://127.0.0.1:8080 --label kvscope --label llama.cpp

The engine benchmark without a server (in process: decode ms/step, idle TTFT, vs transformers) is
``kvscope bench --offline`` (its own flags: ``kvscope bench --offline --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from kvscope.bench.client import EndpointConfig
from kvscope.bench.compare import Comparison, run_comparison
from kvscope.bench.dataset import SampleRequest, jsonl_dataset, load_tokenizer, random_dataset
from kvscope.bench.report import comparison_lines, print_summary, run_to_json, warning_lines, write_json
from kvscope.bench.runner import BenchmarkError, LoadConfig, RunResult, run_benchmark
from kvscope.common.cli_help import HelpFormatter
from kvscope.common.net import SERVE_PORT

DEFAULT_BASE_URL = f"http://127.0.0.1:{SERVE_PORT}"
"""The gateway ``kvscope serve`` / ``make run`` start (an engine alone: ``--base-url http://127.0.0.1:8000``)."""


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments (names as ``vllm bench serve`` where it has them)."""
    p = argparse.ArgumentParser(prog="kvscope bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--base-url",
        default=DEFAULT_BASE_URL,
        help="server root, …/v1/… is appended (the gateway that kvscope serve and make run start)",
    )
    p.add_argument(
        "--model", default="smollm2-135m", help="model name sent in requests; also finds the tokenizer"
    )
    p.add_argument("--served-model-name", help="model field sent in requests (default: --model)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument(
        "--max-concurrency", type=int, help="at most this many requests in flight (default: no limit)"
    )
    p.add_argument(
        "--dataset", default="random", help='\'random\' or a JSONL file of {"prompt", "output_len"?}'
    )
    p.add_argument("--input-len", type=int, default=128, help="random dataset: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (max_tokens)")
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="random dataset: lengths uniform in len·(1±r)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos and min_tokens = max_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--tokenizer", help="tokenizer.json or its folder (default: the model's cached hf folder)")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-warmups", type=int, default=1, help="untimed requests before the run")
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles to report")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds without a byte before giving up"
    )
    p.add_argument("--save-result", help="write every request's timings and the figures as JSON here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="URL",
        help="run the same workload against URL too, in rounds: A B, B A, … (repeatable)",
    )
    p.add_argument(
        "--compare-model",
        action="append",
        default=[],
        metavar="NAME",
        help="model field for each --compare URL (default: the same as A)",
    )
    p.add_argument(
        "--compare-rounds",
        type=int,
        default=3,
        help="rounds; each runs every endpoint once, in an order rotated by one each round (default 3)",
    )
    p.add_argument("--label", action="append", default=[], help="names of A, B, … in output (repeatable)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvscope bench`` (without ``--offline``). 0 when requests completed, 1 when the warm-up
    or every request failed, 2 on bad arguments."""
    args = build_parser().parse_args(argv)
    try:
        endpoints = _endpoints(args)
        load = _load(args)
        make_samples = _sampler(args)
        if not args.compare:
            return asyncio.run(_single(args, endpoints[0], make_samples, load))
        return asyncio.run(_compare(args, endpoints, make_samples, load))
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvscope bench: {exc}", file=sys.stderr)
        return 2
    except BenchmarkError as exc:
        print(f"kvscope bench: {exc}", file=sys.stderr)
        return 1


def _endpoints(args: argparse.Namespace) -> list[EndpointConfig]:
    if len(args.compare_model) > len(args.compare):
        raise ValueError("more --compare-model than --compare")
    model = args.served_model_name or args.model
    urls = [args.base_url, *args.compare]
    models = [model, *args.compare_model] + [model] * (len(args.compare) - len(args.compare_model))
    if not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return [
        EndpointConfig(
            url, m, args.endpoint, args.temperature, args.ignore_eos, args.api_key, dict(args.extra_body)
        )
        for url, m in zip(urls, models, strict=True)
    ]


def _load(args: argparse.Namespace) -> LoadConfig:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be ≥ 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be ≥ 1")
    percentiles = tuple(float(q) for q in args.percentiles.split(",") if q.strip())
    return LoadConfig(
        args.request_rate,
        args.burstiness,
        args.max_concurrency,
        args.seed,
        args.num_warmups,
        args.request_timeout,
        percentiles,
    )


def _sampler(args: argparse.Namespace):
    """A function round → that round's samples (seed + round), the tokenizer loaded once."""
    tokenizer_path = args.tokenizer or _default_tokenizer(args.model)
    if args.dataset == "random":
        if tokenizer_path is None:
            raise ValueError("the random dataset needs a tokenizer: pass --tokenizer PATH (tokenizer.json)")
        tokenizer = load_tokenizer(tokenizer_path)
        return lambda r: random_dataset(
            tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed + r
        )
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    return lambda r: jsonl_dataset(args.dataset, args.num_prompts, args.output_len, tokenizer, args.seed + r)


def _default_tokenizer(model: str) -> str | None:
    from kvscope.common.models.cache import hf_dir

    path = hf_dir(model) / "tokenizer.json"
    return str(path) if path.is_file() else None


def _labels(args: argparse.Namespace, n: int) -> list[str]:
    return [args.label[i] if i < len(args.label) else chr(ord("A") + i) for i in range(n)]


def _config_json(args: argparse.Namespace) -> dict:
    return {
        "dataset": args.dataset,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "tokenizer": args.tokenizer,
        "argv": sys.argv[1:],
    }


async def _single(args: argparse.Namespace, endpoint: EndpointConfig, make_samples, load: LoadConfig) -> int:
    samples: list[SampleRequest] = make_samples(0)
    _print_dataset(samples)
    result = await run_benchmark(endpoint, samples, load, progress=not args.disable_tqdm)
    print_summary(result, sys.stdout)
    if args.save_result:
        write_json(run_to_json(result, _config_json(args) | {"label": _labels(args, 1)[0]}), args.save_result)
    return 0 if result.metrics.completed else 1


async def _compare(
    args: argparse.Namespace, endpoints: list[EndpointConfig], make_samples, load: LoadConfig
) -> int:
    labels = _labels(args, len(endpoints))
    _print_dataset(make_samples(0))

    def on_run(r: int, letter: str, result: RunResult) -> None:
        m = result.metrics
        name = labels[ord(letter) - ord("A")]
        print(
            f"round {r + 1} {letter} {name:<14} {m.output_throughput:8.1f} out tok/s  "
            f"TTFT p50 {m.latencies['ttft'].median:8.1f} ms  TPOT p50 {m.latencies['tpot'].median:7.2f} ms  "
            f"ok {m.completed} failed {m.failed}",
            flush=True,
        )
        for line in warning_lines(m):
            print("  " + line, flush=True)

    comparison = await run_comparison(
        endpoints, make_samples, load, args.compare_rounds, progress=not args.disable_tqdm, on_run=on_run
    )
    figures, ratios = comparison.figures(), comparison.ratios()
    print(
        f"\nMedians over {args.compare_rounds} rounds; ratios are medians of per-round ratios to {labels[0]}:"
    )
    for line in comparison_lines(labels, figures, ratios):
        print(line)
    if args.save_result:
        write_json(_comparison_json(args, labels, comparison, figures, ratios), args.save_result)
    return 0 if all(run.metrics.completed for row in comparison.runs for run in row) else 1


def _comparison_json(args, labels, comparison: Comparison, figures, ratios) -> dict:
    config = _config_json(args)
    return {
        "labels": labels,
        "endpoints": [e.base_url for e in comparison.endpoints],
        "config": config,
        "rounds": args.compare_rounds,
        "figures": figures,
        "ratios": ratios,
        "runs": [
            [run_to_json(run, {"label": labels[e], "round": r}) for e, run in enumerate(row)]
            for r, row in enumerate(comparison.runs)
        ],
    }


def _print_dataset(samples: list[SampleRequest]) -> None:
    lens = [s.prompt_len for s in samples]
    mismatched = sum(1 for s in samples if s.token_mismatch)
    print(
        f"{len(samples)} prompts, {min(lens)}–{max(lens)} prompt tokens, "
        f"{min(s.expected_output_len for s in samples)}–{max(s.expected_output_len for s in samples)} output "
        f"tokens"
        + (f" ({mismatched} prompts off their target length after re-encoding)" if mismatched else ""),
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
