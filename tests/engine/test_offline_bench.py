"""``kvscope bench --offline --step-bench`` (engine/bench.py): a saved result names what it was measured
with."""

from __future__ import annotations

import json
import logging

import pytest

from kvscope.engine.bench import main

pytestmark = pytest.mark.slow


def test_a_saved_step_bench_names_its_weights_lengths_and_threads(tmp_path, model_dir, caplog) -> None:
    out = tmp_path / "steps.json"
    caplog.set_level(logging.INFO, logger="kvscope.engine.engine_core")
    assert (
        main(
            [
                "--model",
                str(model_dir),
                "--step-bench",
                "--concurrency",
                "2",
                "--steps",
                "2",
                "--input-len",
                "8",
                "--num-threads",
                "1",
                "--dtype",
                "float32",
                "--ttft-runs",
                "3",
                "--save-result",
                str(out),
            ]
        )
        == 0
    )
    result, ttft = json.loads(out.read_text())
    assert {
        k: result[k]
        for k in ("concurrency", "dtype", "quantization", "input_len", "output_len", "num_threads")
    } == {
        "concurrency": 2,
        "dtype": "float32",
        "quantization": "none",
        "input_len": 8,
        "output_len": 128,
        "num_threads": 1,
    }
    assert sorted(ttft["idle_ttft"]) == ["first_ms", "input_len", "median_ms", "min_ms", "runs"]
    assert (ttft["idle_ttft"]["input_len"], ttft["idle_ttft"]["runs"], ttft["num_threads"]) == (8, 3, 1)
    assert 0 < ttft["idle_ttft"]["min_ms"] <= ttft["idle_ttft"]["median_ms"]
    # the served engine's warm-up ran first: SmolLM2's 4 projection shapes x 60 padded sizes (80, 96, … 1024
    # rows)
    assert [
        r.getMessage().split(" in ")[0] for r in caplog.records if "prefill shapes" in r.getMessage()
    ] == ["prefill shapes warmed: 240 matmuls"]
