"""bench/upstream_truth.py's checks of the request log and its rotation of targets (the script itself needs a
real llama-server: docs/benchmarks.md "The gateway in front of a real llama-server")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "upstream_truth.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("upstream_truth", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_missing_names_each_asked_field_a_line_lacks() -> None:
    truth = load()
    sample = {"requests_running": 1, "requests_waiting": 0, "kv_cache_usage": 0.25, "age_s": 0.5}
    engine = {
        "prefill_s": 0.05,
        "decode_s": 0.2,
        "cached_tokens": 0,
        "batch_size_mean": 1.0,
        "kv_cache_usage": 0.25,
    }
    full = {
        "kvscope": {
            "ttft_s": 0.06,
            "engine": engine,
            "upstream": {"sampled": {"arrival": sample, "finish": sample}},
        }
    }
    assert truth.missing(full) == []  # 0 cached tokens is a value, not a gap
    lacking = {
        "kvscope": {
            "ttft_s": None,
            "engine": {**engine, "cached_tokens": None},
            "upstream": {"sampled": {"arrival": None, "finish": sample}},
        }
    }
    assert truth.missing(lacking) == [
        "kvscope.ttft_s",
        "kvscope.engine.cached_tokens",
        "kvscope.upstream.sampled.arrival.age_s",
    ]
    assert truth.missing({"kvscope": {"engine": None}}) == [".".join(path) for path in truth.ASKED]


def test_every_target_takes_every_position_in_turn() -> None:
    truth = load()
    targets = ("direct", "gateway", "baseline")
    assert [truth.rotated(targets, r) for r in range(4)] == [
        ("direct", "gateway", "baseline"),
        ("gateway", "baseline", "direct"),
        ("baseline", "direct", "gateway"),
        ("direct", "gateway", "baseline"),
    ]
    assert [truth.rotated(targets[:2], r) for r in range(2)] == [("direct", "gateway"), ("gateway", "direct")]
