"""The ``kvscope`` command line from a new user's seat (issue 45): ``--version``, every command in
``kvscope --help`` (``logs why`` too), help in plain text with each option's default, and ``kvscope bench``
aimed at the port ``kvscope serve`` serves on."""

from __future__ import annotations

import argparse
import contextlib
import io

import msgspec
import pytest

from kvscope.bench.serve import build_parser as bench_parser
from kvscope.cli import supervisor
from kvscope.cli.main import main
from kvscope.cli.plan import build_parser as plan_parser
from kvscope.common.cli_help import HelpFormatter, plain
from kvscope.common.version import kvscope_version
from kvscope.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvscope.engine.server.cli import build_parser as engine_parser
from kvscope.gateway.analytics.cli import build_parser as logs_parser
from kvscope.gateway.logs.es_settings import cli_env
from kvscope.gateway.settings import GatewaySettings


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:  # a sub-command's own --help
            code = int(exc.code or 0)
    return code, out.getvalue()


def test_version() -> None:
    assert run(["--version"]) == (0, f"kvscope {kvscope_version()}\n")


def test_help_names_logs_why() -> None:
    code, text = run(["--help"])
    assert code == 0
    assert "request-log analytics: report, search, why (one request's" in text
    assert "--version" in text


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["serve", "--help"], "--port PORT gateway port (default: 4000)"),
        (["bench", "--help"], "(default: http://127.0.0.1:4000)"),
        (["plan", "--help"], "--block-size BLOCK_SIZE tokens per KV-cache block (default: 16)"),
        (["logs", "report", "--help"], "--top TOP slowest requests to list (default: 10)"),
        (["logs", "plot", "--help"], "beside the log file; $KVSCOPE_CACHE/plots for Elasticsearch)"),
        (["logs", "why", "--help"], "response id (chatcmpl-..., what the OpenAI SDK shows)"),
        (["logs", "report", "--help"], "below the row of all requests (default: that row only)"),
        (["engine", "--help"], "--block-size BLOCK_SIZE tokens per KV block (default: 16)"),
        (["engine", "--help"], "--max-num-seqs MAX_NUM_SEQS most requests in one engine step (default: 64)"),
        (["engine", "--help"], "KV cache bytes on CPU (e.g. 256M, 1GiB) (default: 1GiB)"),
        (["engine", "--help"], "--device DEVICE cpu or cuda[:N] (default: cpu)"),
        (["engine", "--help"], "histogram bounds (s) (default: 0.001 … 1800.0, 26 values)"),
    ],
)  # fmt: skip
def test_help_is_plain_text_with_defaults(argv: list[str], line: str, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    code, text = run(argv)
    assert code == 0
    assert "`" not in text  # no reStructuredText literals: help is read in a terminal
    assert line in " ".join(text.split())  # argparse wraps at the width


def test_the_formatter_adds_a_default_once_and_keeps_empty_ones_out() -> None:
    p = argparse.ArgumentParser(
        prog="x", description="``kvscope serve``: the `x` flag", formatter_class=HelpFormatter
    )
    p.add_argument("--a", default=3, help="count")
    p.add_argument("--b", default="z", help="letter (default z)")
    p.add_argument("--c", default="")
    p.add_argument("--d", default=0)
    text = p.format_help()
    assert "kvscope serve: the x flag" in text
    assert "--a A       count (default: 3)" in text
    assert "letter (default z)\n" in text
    assert "--c C\n" in text and "--d D       default: 0" in text
    assert plain("``a`` and `b`") == "a and b"


def test_bench_defaults_to_the_port_kvscope_serve_serves_on() -> None:
    serve_port = supervisor._parser().parse_args([]).port
    gateway_port = next(f.default for f in msgspec.structs.fields(GatewaySettings) if f.name == "port")
    assert serve_port == gateway_port == 4000
    assert bench_parser().parse_args([]).base_url == f"http://127.0.0.1:{serve_port}"


def test_plan_and_logs_parsers_take_wide() -> None:
    assert plan_parser().parse_args(["--list-devices", "--wide"]).wide is True
    args = logs_parser(cli_env({})).parse_args(["search", "x", "--wide"])
    assert (args.wide, args.format) == (True, "table")


SWITCHES = {"--no-prefix-caching", "--enable-fault-injection", "--no-warmup", "--help"}
"""The engine's on/off flags: a switch has no default value to show."""


def test_every_engine_option_names_its_default_as_the_engine_config_holds_it() -> None:
    """``kvscope engine --help`` showed no default for the options whose settings field is None (the engine
    config holds their default): --block-size, --max-num-seqs, --device, … (issue 45)."""
    parser = engine_parser()
    helps = {a.option_strings[-1]: a.help or "" for a in parser._actions if a.option_strings}
    assert sorted(name for name, text in helps.items() if "default" not in text) == sorted(SWITCHES)
    defaults = {
        "--max-num-seqs": SchedulerConfig().max_num_seqs,
        "--max-num-batched-tokens": SchedulerConfig().max_num_batched_tokens,
        "--block-size": CacheConfig().block_size,
        "--gpu-memory-utilization": CacheConfig().gpu_memory_utilization,
        "--cpu-kernels": ModelConfig().cpu_kernels,
        "--seed": ModelConfig().seed,
        "--device": EngineConfig().device,
        "--attention-backend": EngineConfig().attention_backend,
    }
    assert {name: helps[name].rsplit("(default: ", 1)[1] for name in defaults} == {
        name: f"{value})" for name, value in defaults.items()
    }
    assert CacheConfig().kv_cache_memory == 1 << 30
    assert helps["--kv-cache-memory"].endswith("(default: 1GiB)")
