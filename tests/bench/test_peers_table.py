"""bench/peers_table.py turns a peers.sh results folder into the docs table: medians per endpoint, summed
failures and length mismatches over rounds, transformers rows with p50 = p99."""

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


def run_json(failed: int, mismatches: int) -> dict:
    return {"load": {"max_concurrency": 8}, "failed": failed, "output_len_mismatches": mismatches}


def test_table_rows(tmp_path, capsys):
    figures = {"output_throughput": [101.26, 88.0], "median_ttft_ms": [120.4, 99.6], "p99_ttft_ms": [300.0, 250.0],
               "median_tpot_ms": [30.04, 20.0], "p99_tpot_ms": [41.0, 22.55]}
    (tmp_path / "serve-c8.json").write_text(json.dumps({
        "labels": ["kvscope engine", "llama.cpp server"], "figures": figures,
        "runs": [[run_json(1, 0), run_json(0, 2)], [run_json(0, 0), run_json(0, 1)]]}))
    (tmp_path / "transformers.json").write_text(json.dumps([
        {"system": "transformers", "concurrency": 8, "output_throughput": 150.0, "ttft_ms": 400.4, "tpot_ms": 50.0}]))
    assert load_script().main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == [
        "| kvscope engine | 8 | 101.3 | 120 | 300 | 30.0 | 41.0 | 1 / 0 |",
        "| llama.cpp server | 8 | 88.0 | 100 | 250 | 20.0 | 22.6 | 0 / 3 |",
        "| transformers | 8 | 150.0 | 400 | 400 | 50.0 | 50.0 | n/a |",
    ]
