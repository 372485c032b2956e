"""``kvscope serve`` says which weight format its engine serves, read from the engine's /v1/models card."""

from __future__ import annotations

from kvscope.cli.supervisor import engine_format_line


def test_the_serve_line_names_the_engine_format_and_the_float32_flag() -> None:
    """The reason (the card's ``reason``) is not repeated: the engine's own ``weights format`` log line,
    printed just above, says it once (issue 45)."""
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
        "engine weight format: dtype bfloat16, quantization gguf, weights 392 MiB, process RSS 1100 MiB; "
        "dense float32 weights, exact as transformers: --engine-args '--dtype float32'"
    )
    card["kvscope"]["cpu_kernels"] = "kvscope (fused decode up to 2 rows)"
    assert engine_format_line(card) == (
        "engine weight format: dtype bfloat16, quantization gguf, weights 392 MiB, process RSS 1100 MiB, "
        "CPU kernels kvscope (fused decode up to 2 rows); dense float32 weights, exact as transformers: "
        "--engine-args '--dtype float32'"
    )
    assert (
        engine_format_line({"id": "x"})
        == engine_format_line(None)
        == ("engine weight format: unknown (its /v1/models card has no kvscope field)")
    )


def test_a_float32_engine_is_not_told_to_pass_dtype_float32() -> None:
    """dtype float32 with no quantization is exactly what ``--dtype float32`` serves: no hint then; float32
    activations with gguf weights (what ``make run`` serves on a CPU without fast bfloat16) still get it,
    worded as dense weights: "dtype float32 …; exact float32: --dtype float32" read as a contradiction."""
    fmt = {"dtype": "float32", "quantization": "none", "weights_bytes": 513 << 20, "rss_bytes": 1 << 30}
    assert engine_format_line({"kvscope": {**fmt, "reason": "--dtype float32 given"}}) == (
        "engine weight format: dtype float32, quantization none, weights 513 MiB, process RSS 1024 MiB"
    )
    assert engine_format_line({"kvscope": {**fmt, "quantization": "gguf", "reason": "r"}}) == (
        "engine weight format: dtype float32, quantization gguf, weights 513 MiB, process RSS 1024 MiB; "
        "dense float32 weights, exact as transformers: --engine-args '--dtype float32'"
    )
