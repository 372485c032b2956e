"""The engine's start-up log says each fact once (issue 45): the kernel probe's choice without its timings
(those are a DEBUG line), the weight format and why in one line, and an ``engine ready`` line that is not a
ModelInfo repr. tests/e2e/test_engine_api.py reads a real engine's whole start-up log."""

from __future__ import annotations

import logging

import pytest
import torch

from kvscope.engine.engine_core import ModelInfo, format_line, ready_line
from kvscope.engine.platform.kernel_probe import probe_cpu_kernels


def test_the_probe_logs_its_choice_at_info_and_its_timings_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvscope.engine.platform.kernel_probe")
    choice = probe_cpu_kernels(out_features=64, in_features=64, rows=(1, 4), repeats=1, batched_rows=(4, 8))
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.endswith("kernel_probe")]
    threads = torch.get_num_threads()
    timings = {k: round(v, 3) for k, v in choice.timings_ms.items()}
    assert records == [
        (
            logging.INFO,
            f"CPU kernel probe (1 thread, CPU time; engine {threads} threads, 64x64): {choice.describe()}",
        ),
        (logging.DEBUG, f"CPU kernel probe timings, ms: {timings}"),
    ]


def test_the_ready_line_adds_what_the_format_line_does_not_say() -> None:
    info = ModelInfo(
        name="smollm2-135m",
        model_dir="/models/smollm2-135m/hf",
        max_model_len=8192,
        vocab_size=49152,
        num_blocks=2912,
        block_size=16,
        kv_cache_bytes=1073479680,
        weights_bytes=423858816,
        load_seconds=1.9596,
        dtype="bfloat16",
        quantization="gguf",
        format_reason="the fastest verified format",
        cpu_kernels="kvscope (fused decode up to 2 rows)",
        rss_bytes=2 << 30,
        peak_rss_bytes=2 << 30,
    )
    assert (
        ready_line(info)
        == "engine ready: smollm2-135m (max_model_len 8192, 16-token KV blocks, built in 1.96 s)"
    )
    assert format_line(info).count("the fastest verified format") == 1
    assert "the fastest verified format" not in ready_line(info)
