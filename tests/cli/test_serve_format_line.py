"""``kvscope serve`` says which weight format its engine serves, read from the engine's /v1/models card."""

from __future__ import annotations

from kvscope.cli.supervisor import engine_format_line


def test_the_serve_line_names_the_engine_format_and_the_float32_flag() -> None:
    card = {
        "id": "smollm2-135m",
        "kvscope": {
            "dtype": "bfloat16",
            "quantization": "gguf",
            "weights_bytes": 392 << 20,
            "kv_cache_bytes": 1 << 30,
            "rss_bytes": 1100 << 20,
            "reason": "fastest verified format",
        },
    }
    assert engine_format_line(card) == (
        "engine weight format: dtype bfloat16, quantization gguf, weights 392 MiB, process RSS 1100 MiB "
        "(fastest verified format); exact float32: --engine-args '--dtype float32'"
    )
    card["kvscope"]["cpu_kernels"] = "kvscope (fused decode up to 2 rows)"
    assert engine_format_line(card) == (
        "engine weight format: dtype bfloat16, quantization gguf, weights 392 MiB, process RSS 1100 MiB "
        "(fastest verified format), CPU kernels kvscope (fused decode up to 2 rows); exact float32: "
        "--engine-args '--dtype float32'"
    )
    assert (
        engine_format_line({"id": "x"})
        == engine_format_line(None)
        == ("engine weight format: unknown (its /v1/models card has no kvscope field)")
    )
