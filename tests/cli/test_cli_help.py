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
