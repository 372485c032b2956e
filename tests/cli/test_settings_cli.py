"""kvscope.common.settings_cli: flags and environment variables derived from settings fields (engine and
gateway)."""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import msgspec
import pytest

from kvscope.common.settings_cli import Flag, add_flags, from_env, given, load
from kvscope.engine.server.cli import build_parser
from kvscope.engine.server.settings import engine_options, server_settings
from kvscope.gateway.cli import _gateway_parser


class Inner(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    timeout_s: Annotated[float, Flag("seconds", name="--timeout", metavar="S")] = 5.0
    untouched: int = 3


class Toy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    port: Annotated[int, Flag("port", env="TOY_PORT")] = 4000
    level: Annotated[Literal["info", "debug"], Flag()] = "info"
    verbose: Annotated[bool, Flag("talk more", env="TOY_VERBOSE")] = False
    warmup: Annotated[bool, Flag("skip warm-up", negate=True)] = True
    urls: Annotated[
        tuple[dict[str, str], ...],
        Flag("a URL", name="--url", repeat=True, item=lambda u: {"u": u}, env="TOY_URLS"),
    ] = ()
    inner: Inner = Inner()
    hidden: str = "x"


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_fields_become_typed_flags_with_their_defaults_in_the_help() -> None:
    actions = _options(add_flags(argparse.ArgumentParser(), Toy))
    assert list(actions) == ["--port", "--level", "--verbose", "--no-warmup", "--url", "--timeout"]
    assert (actions["--port"].type("12"), actions["--port"].help, actions["--port"].default) == (
        12,
        "port (default: 4000)",
        None,
    )
    assert (actions["--level"].choices, actions["--level"].type("info")) == (("info", "debug"), "info")
    assert (actions["--verbose"].const, actions["--no-warmup"].const) == (True, False)
    assert (actions["--url"].dest, type(actions["--url"]).__name__) == ("urls", "_AppendAction")
    assert (actions["--timeout"].dest, actions["--timeout"].metavar, actions["--timeout"].help) == (
        "inner.timeout_s",
        "S",
        "seconds (default: 5.0)",
    )


def test_given_flags_env_and_file_layer_in_that_order() -> None:
    parser = add_flags(argparse.ArgumentParser(), Toy)
    args = parser.parse_args(["--port", "9", "--no-warmup", "--url", "a", "--url", "b", "--timeout", "1.5"])
    assert given(args, Toy) == {
        "port": 9,
        "warmup": False,
        "urls": [{"u": "a"}, {"u": "b"}],
        "inner": {"timeout_s": 1.5},
    }
    env = {"TOY_PORT": "7", "TOY_VERBOSE": "Yes", "TOY_URLS": " c, ,d "}
    assert from_env(Toy, env) == {"port": 7, "verbose": True, "urls": [{"u": "c"}, {"u": "d"}]}
    assert from_env(Toy, {"TOY_PORT": "", "TOY_VERBOSE": "0"}) == {"verbose": False}
    file = {"port": 1, "level": "debug", "inner": {"untouched": 4}}
    toy = load(Toy, file, from_env(Toy, env), given(args, Toy))
    assert (toy.port, toy.level, toy.verbose, toy.warmup, toy.urls) == (
        9,
        "debug",
        True,
        False,
        ({"u": "a"}, {"u": "b"}),
    )
    assert toy.inner == Inner(timeout_s=1.5, untouched=4)
    assert load(Toy) == Toy()
    with pytest.raises(ValueError, match=r"Expected `int`, got `str` - at `\$.port`"):
        load(Toy, {"port": "x"})
    with pytest.raises(SystemExit):
        parser.parse_args(["--level", "loud"])


def test_engine_and_gateway_keep_every_flag_name() -> None:
    assert sorted(_options(build_parser())) == sorted(
        [
            "--model",
            "--host",
            "--port",
            "--served-model-name",
            "--max-model-len",
            "--max-num-seqs",
            "--max-num-batched-tokens",
            "--long-prefill-token-threshold",
            "--ttft-slo",
            "--ttft-slo-quantile",
            "--kv-cache-memory",
            "--memory-budget",
            "--num-blocks",
            "--block-size",
            "--gpu-memory-utilization",
            "--no-prefix-caching",
            "--dtype",
            "--quantization",
            "--cpu-kernels",
            "--seed",
            "--device",
            "--attention-backend",
            "--num-threads",
            "--speculative",
            "--num-speculative-tokens",
            "--prompt-lookup-min",
            "--prompt-lookup-max",
            "--sse-keepalive-s",
            "--max-concurrent-requests",
            "--max-sequences-per-request",
            "--structured-output-max-grammar-size",
            "--structured-output-max-pending-compiles",
            "--request-head-timeout",
            "--request-body-timeout",
            "--api-key",
            "--enable-fault-injection",
            "--otlp-endpoint",
            "--service-name",
            "--gpu-telemetry-interval",
            "--ttft-buckets",
            "--tpot-buckets",
            "--duration-buckets",
            "--no-warmup",
            "--log-level",
            "--event-loop",
        ]
    )
    assert sorted(_options(_gateway_parser())) == sorted(
        [
            "--config",
            "--host",
            "--port",
            "--upstream",
            "--tokenizer",
            "--api-key-hash",
            "--trusted-proxy",
            "--allow-unauthenticated",
            "--metrics-public",
            "--redis-url",
            "--workers",
            "--log-file",
            "--log-stdout",
            "--log-content",
            "--otlp-endpoint",
            "--request-head-timeout",
            "--request-body-timeout",
            "--keepalive",
            "--first-token-timeout",
            "--total-timeout",
            "--health-interval",
            "--routing",
            "--no-console",
            "--trace-url",
            "--log-level",
            "--event-loop",
        ]
    )


def test_engine_defaults_env_and_flags() -> None:
    env = {
        "KVSCOPE_ENGINE_API_KEY": "k-env",
        "OTEL_SERVICE_NAME": "svc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c",
    }
    args = build_parser().parse_args([])
    options, settings = engine_options(args), server_settings(args, env)
    # the servers' one default of their own: the fastest verified weight format
    # (engine/platform/format_choice.py)
    assert (
        options.config_kwargs() == {"dtype": "auto", "quantization": "auto"}
        and options.model == "smollm2-135m"
    )
    assert (
        settings.host,
        settings.port,
        settings.sse_keepalive_s,
        settings.max_concurrent_requests,
        settings.log_level,
        settings.warmup,
    ) == ("127.0.0.1", 8000, 15.0, 0, "info", True)
    # OTEL_EXPORTER_OTLP_ENDPOINT is the OTel SDK's to read (kvscope/common/otel_env.py): no flag value
    assert (settings.api_key, settings.service_name, settings.otlp_endpoint) == ("k-env", "svc", None)
    args = build_parser().parse_args(
        [
            "--api-key",
            "k-flag",
            "--service-name",
            "mine",
            "--no-warmup",
            "--dtype",
            "bfloat16",
            "--kv-cache-memory",
            "1M",
            "--tpot-buckets",
            "0.1,1",
        ]
    )
    options, settings = engine_options(args), server_settings(args, env)
    assert options.config_kwargs() == {
        "dtype": "bfloat16",
        "quantization": "auto",
        "kv_cache_memory": 1 << 20,
    }
    assert (settings.api_key, settings.service_name, settings.warmup) == ("k-flag", "mine", False)
    assert settings.buckets.token_latency_s == (0.1, 1.0)
    assert server_settings(build_parser().parse_args([]), {}).service_name == "kvscope-engine"


def test_argparse_errors_name_the_type_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "x"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-cache-memory", "lots"])
    with pytest.raises(SystemExit):
        _gateway_parser().parse_args(["--keepalive", "soon"])
    err = capsys.readouterr().err
    assert "argument --port: invalid int value: 'x'" in err
    assert "argument --kv-cache-memory: invalid parse_size value: 'lots'" in err
    assert "argument --keepalive: invalid float value: 'soon'" in err
