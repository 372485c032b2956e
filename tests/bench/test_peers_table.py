"""bench/peers_table.py turns a peers.sh results folder into the docs table: medians per endpoint, summed
failures and length mismatches over rounds, transformers rows with p50 = p99, and the paired ratios to the
engine (median and range over rounds)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peers_table.py"


def load_script():
    spec = importlib.util.spec_from_file_location("peers_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_json(
    failed: int,
    mismatches: int,
    tok_s: float = 100.0,
    ttft_p99: float = 300.0,
    tpot: float = 30.0,
    concurrency: int = 8,
) -> dict:
    return {
        "load": {"max_concurrency": concurrency},
        "failed": failed,
        "output_len_mismatches": mismatches,
        "output_throughput": tok_s,
        "p99_ttft_ms": ttft_p99,
        "median_tpot_ms": tpot,
    }


def test_table_rows(tmp_path, capsys):
    figures = {
        "output_throughput": [101.26, 88.0],
        "median_ttft_ms": [120.4, 99.6],
        "p99_ttft_ms": [300.0, 250.0],
        "median_tpot_ms": [30.04, 20.0],
        "p99_tpot_ms": [41.0, 22.55],
    }
    (tmp_path / "serve-c8.json").write_text(
        json.dumps(
            {
                "labels": ["kvscope engine", "llama.cpp server"],
                "figures": figures,
                "runs": [
                    [run_json(1, 0, 100.0, 300.0, 30.0), run_json(0, 2, 80.0, 600.0, 15.0)],
                    [run_json(0, 0, 200.0, 400.0, 40.0), run_json(0, 1, 190.0, 100.0, 20.0)],
                    [run_json(0, 0, 100.0, 0.0, 20.0), run_json(0, 0, 110.0, 50.0, 10.0)],
                ],
            }
        )
    )
    (tmp_path / "serve-c32.json").write_text(
        json.dumps(
            {  # sorts after c8 by number, not by name
                "labels": ["kvscope engine", "llama.cpp server"],
                "figures": figures,
                "runs": [[run_json(0, 0, 50.0, 10.0, 10.0, 32), run_json(0, 0, 25.0, 40.0, 30.0, 32)]],
            }
        )
    )
    (tmp_path / "transformers.json").write_text(
        json.dumps(
            [
                {
                    "system": "transformers",
                    "concurrency": 8,
                    "output_throughput": 150.0,
                    "ttft_ms": 400.4,
                    "tpot_ms": 50.0,
                }
            ]
        )
    )
    assert load_script().main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == [
        "| kvscope engine | 8 | 101.3 | 120 | 300 | 30.0 | 41.0 | 1 / 0 |",
        "| kvscope engine | 32 | 101.3 | 120 | 300 | 30.0 | 41.0 | 0 / 0 |",
        "| llama.cpp server | 8 | 88.0 | 100 | 250 | 20.0 | 22.6 | 0 / 3 |",
        "| llama.cpp server | 32 | 88.0 | 100 | 250 | 20.0 | 22.6 | 0 / 0 |",
        "| transformers | 8 | 150.0 | 400 | 400 | 50.0 | 50.0 | n/a |",
        "",
        "Paired ratios: median [lowest–highest] over rounds of each round's figure ÷ kvscope engine's",
        "| concurrency | system ÷ kvscope engine | output tok/s | TTFT p99 | TPOT p50 | rounds |",
        "|---|---|---:|---:|---:|---:|",
        # per round 0.8 / 0.95 / 1.1; TTFT 2.0 / 0.25 / none (the engine's 0); TPOT 0.5 / 0.5 / 0.5
        "| 8 | llama.cpp server | 0.950 [0.80–1.10] | 1.125 [0.25–2.00] | 0.500 [0.50–0.50] | 3 |",
        "| 32 | llama.cpp server | 0.500 [0.50–0.50] | 4.000 [4.00–4.00] | 3.000 [3.00–3.00] | 1 |",
    ]


def test_idle_ttft_line_after_the_ratios(tmp_path, capsys):
    """A run that measured idle TTFT (peers.sh's ``idle-ttft.json``, the shape ``kvscope bench --offline
    --step-bench --save-result`` writes) ends with one line of it; a folder without the file prints none."""
    figures = {
        "output_throughput": [10.0],
        "median_ttft_ms": [1.0],
        "p99_ttft_ms": [2.0],
        "median_tpot_ms": [3.0],
        "p99_tpot_ms": [4.0],
    }
    (tmp_path / "serve-c1.json").write_text(
        json.dumps(
            {"labels": ["kvscope engine"], "figures": figures, "runs": [[run_json(0, 0, concurrency=1)]]}
        )
    )
    assert load_script().main([str(tmp_path)]) == 0
    assert "Idle TTFT" not in capsys.readouterr().out
    steps = {"concurrency": 1, "dtype": "bfloat16", "quantization": "gguf", "input_len": 128}
    ttft = {
        "idle_ttft": {"input_len": 128, "runs": 20, "first_ms": 132.83, "median_ms": 54.349, "min_ms": 51.96},
        "dtype": "bfloat16",
        "quantization": "gguf",
        "input_len": 128,
        "output_len": 128,
        "num_threads": 2,
    }
    (tmp_path / "idle-ttft.json").write_text(json.dumps([steps, ttft]))
    assert load_script().main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "",
        "Idle TTFT (offline engine, one 128-token prompt, 20 runs, 2 threads, bfloat16/gguf): median 54.3 "
        "ms, min 52.0 ms",
    ]
