"""The ``kvscope`` command: one entry point that dispatches to each component's own CLI.

Sub-CLIs are imported lazily so that ``kvscope pull`` or ``kvscope gateway`` never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from kvscope.common.cli_help import HelpFormatter
from kvscope.common.version import kvscope_version

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "kvscope.cli.supervisor:serve_main",
        "pull the model if needed, start engine + gateway, print the URL",
    ),
    "engine": ("kvscope.engine.server.cli:engine_main", "run the engine's OpenAI-compatible server"),
    "gateway": ("kvscope.gateway.cli:gateway_main", "run the gateway in front of one or more upstreams"),
    "keys": ("kvscope.gateway.cli:keys_main", "create gateway API keys (stored as sha256 hashes)"),
    "pull": ("kvscope.cli.pull:pull_main", "download a registered model into the cache"),
    "logs": (
        "kvscope.gateway.analytics.cli:logs_main",
        "request-log analytics: report, search, why (one request's latency by cause), plot, setup-es",
    ),
    "bench": ("kvscope.cli.bench:bench_main", "serving benchmark (or --offline engine benchmark)"),
    "plan": ("kvscope.cli.plan:plan_main", "KV-cache capacity planner"),
    "eval": (
        "kvscope.engine.eval.cli:eval_main",
        "quality of the weight formats: eval ppl (perplexity + greedy agreement)",
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope",
        description="Observability-first LLM inference stack.",
        epilog="kvscope COMMAND --help shows a command's options and their defaults.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvscope {kvscope_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvscope`` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"kvscope {kvscope_version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = _parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"kvscope: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    target, _ = COMMANDS[argv[0]]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        code = int(func(argv[1:]) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        return _reader_left()
    return code


def _reader_left() -> int:
    """stdout's reader closed it (``kvscope logs search | head``): no traceback, exit 141 as a process killed
    by SIGPIPE would; stdout is pointed at /dev/null so the interpreter's final flush does not fail again
    (the recipe of Python's ``signal`` documentation, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE
