"""``kvscope eval ppl``: perplexity on the shipped text and greedy agreement per weight format, vs float32.

Exit status: 0 when every requested format meets its bound (engine/eval/formats.py ``BOUND_PCT``), 1 when one
does not, 2 on bad arguments (a message, no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from kvscope.common.cli_help import HelpFormatter

USAGE_ERROR = 2
DEFAULT_CONTEXT = 1024
DEFAULT_STRIDE = 512


def _parser() -> argparse.ArgumentParser:
    from kvscope.engine.eval.formats import DEFAULT_FORMATS

    parser = argparse.ArgumentParser(
        prog="kvscope eval ppl",
        description=(
            "Perplexity (sliding windows, Hugging Face's strided method) of the shipped English text and "
            "greedy agreement (8 prompts x 64 tokens) of each weight format against float32 of the same "
            "model, through the engine's own forward. Exit 0 when every format meets its bound, 1 when one "
            "does not, 2 on bad arguments."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m", help="registry name, .gguf file or HF folder")
    parser.add_argument(
        "--formats",
        default=",".join(DEFAULT_FORMATS),
        help="comma-separated: float32, bfloat16, int8, int4, gguf, auto, or DTYPE/QUANTIZATION "
        "(e.g. bfloat16/gguf); float32 always runs first as the reference",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="score only the first N tokens of the text"
    )
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens per window")
    parser.add_argument("--stride", type=int, default=DEFAULT_STRIDE, help="tokens between window starts")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: the engine's)")
    parser.add_argument(
        "--kernels",
        choices=("compact", "served"),
        default="compact",
        help="compact: int4/int8 layers run their compact kernel at every row count, as a batch-1 "
        "decode does (default); served: the engine's switch to the dense copy above the "
        "probe's crossover (prefill, batches)",
    )
    parser.add_argument("--no-agreement", action="store_true", help="skip the greedy agreement generation")
    parser.add_argument("--save-result", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument(
        "--text", type=Path, default=None, help="a UTF-8 text to score instead of the shipped one"
    )
    return parser


def _fail(message: str) -> int:
    print(f"kvscope eval ppl: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def _check_numbers(args: argparse.Namespace) -> str | None:
    if args.context < 2:
        return f"--context must be at least 2, got {args.context}"
    if not 1 <= args.stride < args.context:
        return f"--stride must be in [1, context - 1] = [1, {args.context - 1}], got {args.stride}"
    if args.max_tokens is not None and args.max_tokens < 2:
        return f"--max-tokens must be at least 2, got {args.max_tokens}"
    if args.num_threads is not None and args.num_threads < 1:
        return f"--num-threads must be at least 1, got {args.num_threads}"
    if args.save_result is not None and not args.save_result.parent.is_dir():
        return f"--save-result: no such directory {args.save_result.parent}"
    return None


def ppl_main(argv: list[str]) -> int:
    """``kvscope eval ppl [options]`` (see ``--help``); returns the exit status."""
    args = _parser().parse_args(argv)
    problem = _check_numbers(args)
    if problem:
        return _fail(problem)
    from kvscope.engine.eval.formats import FormatError, parse_formats
    from kvscope.engine.eval.text import EvalTextError, load_text

    try:
        specs = parse_formats(args.formats)
        text = load_text(args.text)
    except (FormatError, EvalTextError) as exc:
        return _fail(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return _run(args, specs, text)


def _run(args: argparse.Namespace, specs, text) -> int:
    from kvscope.engine.eval.perplexity import sliding_windows
    from kvscope.engine.eval.report import EvalReport, build_rows, markdown_table, this_machine
    from kvscope.engine.eval.runner import run_format
    from kvscope.engine.text.tokenizer import Tokenizer
    from kvscope.engine.weights.files import read_hf_config, resolve_model_dir

    try:
        model_dir = resolve_model_dir(args.model)
    except ValueError as exc:
        return _fail(str(exc))
    max_len = read_hf_config(model_dir).get("max_position_embeddings")
    if max_len is not None and args.context > max_len:
        return _fail(f"--context {args.context} exceeds the model's max_position_embeddings {max_len}")
    token_ids = Tokenizer.from_dir(model_dir).encode(text.text)
    if args.max_tokens is not None:
        token_ids = token_ids[: args.max_tokens]
    if len(token_ids) < 2:
        return _fail(f"the text {text.path} has {len(token_ids)} token(s); at least 2 are needed")
    windows = sliding_windows(len(token_ids), args.context, args.stride)
    load_average = os.getloadavg()
    runs = []
    for spec in specs:
        print(f"{spec.name}: scoring {len(token_ids)} tokens in {len(windows)} windows…", file=sys.stderr)
        try:
            runs.append(
                run_format(
                    args.model,
                    spec,
                    token_ids,
                    windows,
                    args.num_threads,
                    agreement=not args.no_agreement,
                    kernels=args.kernels,
                )
            )
            print(
                f"{spec.name}: ppl {runs[-1].perplexity.perplexity:.4f} in {runs[-1].seconds:.0f} s",
                file=sys.stderr,
            )
        except ValueError as exc:  # the engine refusing an option (e.g. gguf for a model that is no GGUF)
            return _fail(f"format {spec.name}: {exc}")
    machine = this_machine(load_average)
    report = EvalReport(
        model=args.model,
        text=text.name,
        text_sha256=text.sha256,
        num_tokens=len(token_ids),
        context=args.context,
        stride=args.stride,
        num_windows=len(windows),
        kernels=args.kernels,
        machine=machine,
        rows=build_rows(runs),
    )
    print(markdown_table(report))
    if args.save_result is not None:
        args.save_result.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.passed else 1


def eval_main(argv: list[str]) -> int:
    """``kvscope eval SUBCOMMAND``: only ``ppl`` today."""
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: kvscope eval ppl [options]\n\n  ppl  perplexity + greedy agreement per weight format "
            "(kvscope eval ppl --help)",
            file=sys.stdout if argv else sys.stderr,
        )
        return 0 if argv else USAGE_ERROR
    if argv[0] != "ppl":
        return _fail(f"unknown subcommand {argv[0]!r} (known: ppl)")
    started = time.perf_counter()
    code = ppl_main(argv[1:])
    if code != USAGE_ERROR:
        print(f"kvscope eval ppl: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return code
