"""``--from-log``: a synthetic request log with known concurrency replays to the known peak (exactly)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.cli.plan import plan_main
from kvscope.cli.plan_log import read_spans
from kvscope.plan.replay import Capacity, Span, quantile, sweep
from kvscope.testing.records import T0, make_record

T0_S = T0.timestamp()


def staircase_and_burst() -> list[dict]:
    """Minute 0: 10 requests starting 1 s apart, 4.5 s each: at most 5 in flight (4.0–4.5 s and on).
    Minute 1: 7 requests all starting at 100 s for 2 s, then one starting exactly at 102 s, when they end
    (half-open intervals: not concurrent with them). 60 tokens each = 4 blocks of 16."""
    records = []
    for i in range(10):
        records.append(make_record(i, ts=T0 + timedelta(seconds=i + 4.5), e2e_s=4.5))
    for i in range(10, 17):
        records.append(make_record(i, ts=T0 + timedelta(seconds=102), e2e_s=2.0))
    records.append(make_record(17, ts=T0 + timedelta(seconds=103), e2e_s=1.0, ttft_s=3.0))
    # not generations (no usage: held no KV), in flight during the burst: the replay must leave them out
    records.append(
        make_record(
            18,
            ts=T0 + timedelta(seconds=102),
            e2e_s=1.5,
            status=401,
            input_tokens=None,
            output_tokens=None,
            ttft_s=None,
            tpot_s=None,
            finish=None,
        )
    )
    models = make_record(
        19,
        ts=T0 + timedelta(seconds=101),
        e2e_s=0.5,
        input_tokens=None,
        output_tokens=None,
        ttft_s=None,
        tpot_s=None,
        finish=None,
    )
    models["url"]["path"], models["http"]["request"]["method"] = "/v1/models", "GET"
    records.append(models)
    return records


@pytest.fixture
def log_file(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in staircase_and_burst()) + '{"cut short\n')
    return path


def test_read_spans_takes_start_end_and_tokens_from_the_record(log_file):
    spans, meta = read_spans(log_file)
    assert meta == {"unparsed_lines": 1, "not_generations": 2}
    assert len(spans) == 18
    assert spans[0] == Span(T0_S, T0_S + 4.5, 20, 40, 0.05)
    assert spans[-1] == Span(T0_S + 102, T0_S + 103, 20, 40, 3.0)


def test_sweep_finds_the_known_peak_and_minute_peaks(log_file):
    spans, _ = read_spans(log_file)
    timeline = sweep(spans, block_size=16, capacity=Capacity(num_blocks=1000, max_num_seqs=6, block_size=16))
    assert timeline.peak_concurrency == 7
    assert timeline.peak_concurrency_at_s == T0_S + 100
    assert timeline.peak_blocks == 7 * 4
    minute0 = int(T0_S // 60)
    assert timeline.minute_peak_concurrency == {minute0: 5, minute0 + 1: 7}
    assert timeline.minute_peak_blocks == {minute0: 20, minute0 + 1: 28}
    assert timeline.concurrency_at_arrival == (1, 2, 3, 4, 5, 5, 5, 5, 5, 5, 1, 2, 3, 4, 5, 6, 7, 1)
    assert timeline.queued_arrivals == 1  # the 7th of the burst finds max_num_seqs = 6 busy
    assert timeline.seconds_over_capacity == 2.0


def test_a_request_that_ends_as_another_starts_is_not_concurrent():
    spans = [Span(0.0, 1.0), Span(1.0, 2.0), Span(2.0, 2.0)]
    assert sweep(spans, 16).peak_concurrency == 1
    assert sweep(spans, 16).concurrency_at_arrival == (1, 1, 1)


def test_idle_minutes_count_as_zero_and_long_requests_fill_every_minute():
    spans = [Span(0.0, 150.0, 16, 0), Span(300.0, 301.0, 32, 0)]
    timeline = sweep(spans, 16)
    assert timeline.minute_peak_concurrency == {0: 1, 1: 1, 2: 1, 3: 0, 4: 0, 5: 1}
    assert timeline.minute_peak_blocks == {0: 1, 1: 1, 2: 1, 3: 0, 4: 0, 5: 2}


def test_quantile_is_type_7():
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([0.0, 10.0], 0.99) == pytest.approx(9.9)
    assert quantile([], 0.5) is None


def test_cli_from_log_reports_the_peak_queueing_and_slo(log_file, model_dir, capsys):
    code = plan_main(
        [
            "--model",
            str(model_dir),
            "--device",
            "h100",
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--concurrency",
            "6",
            "--ttft-slo",
            "1.0",
            "--from-log",
            str(log_file),
            "--format",
            "json",
        ]
    )
    assert code == 0
    log = json.loads(capsys.readouterr().out)["log"]
    assert log["requests"] == 18
    assert log["unparsed_lines"] == 1
    assert log["peak_concurrency"] == 7
    assert log["peak_concurrency_at"] == "2025-01-01T12:01:40.000Z"
    assert log["peak_kv_blocks"] == 28
    assert log["peak_kv_bytes"] == 28 * 16 * 46_080
    assert log["minutes"] == 2
    assert log["minute_kv_bytes"] == {
        "p50": 24 * 737_280,
        "p99": pytest.approx(27.92 * 737_280),
        "max": 28 * 737_280,
    }
    assert log["capacity"]["max_num_seqs"] == 6
    assert (log["would_queue"], log["queued_arrivals"], log["seconds_over_capacity"]) == (True, 1, 2.0)
    assert log["prompt_tokens"]["p99"] == 20.0
    slo = log["ttft_slo"]
    # concurrency 1: TTFTs 0.05, 0.05, 3.0 → p99 = 0.05 + 0.98 × 2.95 (type 7)
    assert slo["observed_p99_by_concurrency"] == {
        "1": pytest.approx(0.05 + 0.98 * 2.95),
        "2": 0.05,
        "3": 0.05,
        "4": 0.05,
        "5": 0.05,
        "6": 0.05,
        "7": 0.05,
    }
    assert slo["observed_breaks_at_concurrency"] == 1
    assert slo["bound_breaks_at_concurrency"] is None  # an H100 prefills 20 tokens of a 135M model in µs


def test_cli_missing_log_is_exit_2(tmp_path, model_dir, capsys):
    code = plan_main(
        ["--model", str(model_dir), "--device", "h100", "--from-log", str(tmp_path / "none.jsonl")]
    )
    assert code == 2
    assert (
        capsys.readouterr().err == f"kvscope plan: error: no request log files at {tmp_path / 'none.jsonl'}\n"
    )


def brute_force_peak(spans: list[Span], block_size: int) -> tuple[int, int]:
    """Most requests (and KV blocks) in flight at any arrival instant, by checking every span at every
    start."""

    def alive(t: float) -> list[Span]:
        return [s for s in spans if s.start_s <= t < max(s.end_s, s.start_s + 1e-6)]

    counts = [
        (
            len(alive(s.start_s)),
            sum(-(-(a.input_tokens + a.output_tokens) // block_size) for a in alive(s.start_s)),
        )
        for s in spans
    ]
    return max(c for c, _ in counts), max(b for _, b in counts)


@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 20), st.integers(1, 40), st.integers(0, 40)),
        min_size=1,
        max_size=30,
    )
)
@settings(max_examples=200, deadline=None)
def test_sweep_peak_equals_brute_force(raw):
    spans = [
        Span(float(start), float(start + length), prompt, output) for start, length, prompt, output in raw
    ]
    timeline = sweep(spans, block_size=8)
    assert (timeline.peak_concurrency, timeline.peak_blocks) == brute_force_peak(spans, 8)
