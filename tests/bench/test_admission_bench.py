"""bench/admission.py's request bodies, summary and table (the benchmark itself is not a test)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("admission_bench", ROOT / "bench" / "admission.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("admission_bench", bench)  # dataclasses look their module up while it executes
_spec.loader.exec_module(bench)


def test_bodies_carry_the_tier_and_differ_from_the_first_word() -> None:
    one, other = bench.body(bench.INTERACTIVE, 1), bench.body(bench.INTERACTIVE, 2)
    assert (one["service_tier"], one["max_tokens"], one["ignore_eos"]) == ("priority", 128, True)
    assert len(one["prompt"].split()) == 48 and one["prompt"] != other["prompt"]
    assert bench.body(bench.BATCH, 1)["service_tier"] == "flex"
    assert bench.parse_slos("priority=2,flex=60") == {"priority": 2.0, "flex": 60.0}


def _record(tier: str, status: int, ttft: float | None, tokens: int, **kvscope) -> object:
    record = bench.Record("interactive" if tier == "priority" else "batch", tier, status, ttft, tokens)
    record.kvscope = dict(kvscope)
    if status == 503:
        record.retry_after = "3" if kvscope else None
    return record


def test_summary_counts_goodput_refusals_and_the_predictor() -> None:
    records = [
        _record("priority", 200, 1.0, 32, predicted_ttft_s=1.2, ttft_s=1.0),  # within 2 s, error 0.2
        _record("priority", 200, 3.0, 32, predicted_ttft_s=2.0, ttft_s=2.5),  # late: no goodput; error 0.2
        _record("priority", 503, None, 0, predicted_ttft_s=7.8),  # refused with Retry-After and prediction
        _record("priority", 503, None, 0, predicted_ttft_s=2.1),  # the same, dropped from the queue
        _record("flex", 200, 40.0, 128, predicted_ttft_s=30.0, ttft_s=40.0),  # within 60 s, error 0.25
        _record("flex", 503, None, 0),  # refused without a prediction (say, another server's 503)
    ]
    records[3].error = "waited 1.9 s in the queue; predicted time to first token 2.1 s exceeds the 2 s …"
    summary = bench.summarize(records, {"priority": 2.0, "flex": 60.0}, capacity_tok_s=2.0, seconds=100.0)
    assert summary["tiers"]["priority"] == {
        "sent": 4,
        "answered": 2,
        "refused": 2,
        "refused_with_retry_after_and_prediction": 2,
        "refused_from_queue": 1,
        "failed": 0,
        "ttft_p50_s": 1.0,  # nearest rank
        "ttft_p99_s": 3.0,
        "within_slo": 0.5,
        "slo_s": 2.0,
    }
    assert summary["tiers"]["flex"]["refused_with_retry_after_and_prediction"] == 0
    assert summary["goodput_tok_s"] == 1.6  # (32 + 128) tokens in 100 s
    assert summary["goodput_of_capacity"] == 0.8
    assert (summary["prediction_error_median"], summary["predicted_requests"]) == (0.2, 3)
    lines = bench.table({"on": summary})
    assert lines[1].split() == ["on", "flex", "2", "1", "1(0,", "0)", "40.00", "/", "40.00", "100.0%"]
    assert lines[-1] == "on: goodput 1.6 tok/s (80.0% of capacity); predictor median |error| 20.0% over 3"
