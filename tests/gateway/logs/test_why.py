"""``kvscope logs why`` (gateway/analytics/why.py) on records whose ``kvscope.engine`` comes from the real
scheduler (the 32-arrivals scenario of tests/engine/core/test_attribution.py), through the JSONL back end."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from engine.core.stats import KvscopeStats
from gateway.analytics.cli import logs_main
from gateway.analytics.why import explain, rank_causes, why_query
from gateway.logs.es_setup import attribution_properties, record_properties
from tests.engine.core.factories import FakeClock, make_scheduler
from tests.engine.core.test_attribution import Run
from tests.gateway.logs.records import make_record


def test_the_log_mapping_has_every_kvscope_stats_field() -> None:
    mapped = record_properties()["kvscope"]["properties"]["engine"]["properties"]
    assert sorted(mapped) == sorted(KvscopeStats.__struct_fields__)
    assert attribution_properties()["queue_limit"] == {"type": "keyword", "ignore_above": 1024}


@pytest.fixture(scope="module")
def queued() -> dict:
    """Engine stats of the last of 32 simultaneous arrivals (max_num_seqs 8)."""
    clock = FakeClock()
    run = Run(make_scheduler(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096, clock=clock), clock)
    for i in range(32):
        run.add(f"r{i}", 64, max_tokens=8, start=100 * i)
    run.until_done()
    return run.stats("r31")


def _record(engine: dict, overhead: float = 0.004) -> dict:
    e2e = engine["queue_s"] + engine["prefill_s"] + engine["decode_s"] + overhead + 0.001
    record = make_record(31, ttft_s=engine["ttft_s"] + overhead, tpot_s=engine["tpot_s"], e2e_s=e2e, engine=engine)
    record["kvscope"]["gateway_overhead_s"], record["kvscope"]["upstream_s"] = overhead, e2e - overhead
    return record


def test_explain_names_the_queue_and_its_limit(queued) -> None:
    why = explain(_record(queued))
    first = why.text.splitlines()[0]
    assert first.startswith(f"TTFT {queued['ttft_s'] + 0.004:.3f} s: {queued['queue_s']:.3f} s queued "
                            "(31 requests ahead, 0 running, max_num_seqs reached); prefill")
    assert "over 1 steps shared with 448 prompt and 0 decode tokens of up to 7 other requests (own 64 tokens" \
        in first
    assert why.verdict == "queue"
    causes = dict(why.causes)
    assert causes["queue"] == pytest.approx(queued["queue_s"])
    assert causes["gateway"] == pytest.approx(0.004)
    assert causes["upstream transfer"] == pytest.approx(0.001)
    e2e = queued["queue_s"] + queued["prefill_s"] + queued["decode_s"] + 0.005
    assert sum(causes.values()) == pytest.approx(e2e, rel=0.05)


def test_rank_causes_is_largest_first(queued) -> None:
    ranked = rank_causes(queued)
    assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)
    assert ranked[0] == ("queue", pytest.approx(queued["queue_s"]))


def test_why_reads_the_jsonl_log_by_request_or_trace_id(queued, tmp_path) -> None:
    log = tmp_path / "requests.jsonl"
    other = make_record(1)
    log.write_text(json.dumps(other) + "\n" + json.dumps(_record(queued)) + "\n")
    for key in ("req-000031", f"{31:032x}"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert logs_main(["why", key, "--source", str(log), "--format", "json"], env={}) == 0
        answer = json.loads(out.getvalue())
        assert (answer["request_id"], answer["verdict"]) == ("req-000031", "queue")
        assert answer["engine"]["queue_ahead"] == 31
        assert answer["causes"][0]["cause"] == "queue"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert logs_main(["why", "nope", "--source", str(log)], env={}) == 1
    assert "no request-log record with http.request.id or trace.id 'nope'" in err.getvalue()


def test_why_query_refuses_quotes() -> None:
    with pytest.raises(ValueError, match="no quote characters"):
        why_query("a' OR 1=1 --", es=False)
    assert why_query("abc", es=True) == 'http.request.id:"abc" OR trace.id:"abc"'


def test_report_breaks_the_slowest_and_p99_down_by_cause(tmp_path) -> None:
    import asyncio

    from gateway.analytics import commands
    from gateway.analytics.commands import LogSource

    clock = FakeClock()
    run = Run(make_scheduler(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096, clock=clock), clock)
    for i in range(32):
        run.add(f"r{i}", 64, max_tokens=8, start=100 * i)
    run.until_done()
    records = []
    for i in range(32):
        record = _record(run.stats(f"r{i}"))
        record["http"]["request"]["id"] = f"r{i}"
        records.append(record)
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = asyncio.run(commands.report(LogSource(str(tmp_path / "requests.jsonl")), top=8))
    # the last wave of 8 (admitted together, finished together) is the slowest, and all of it is at the p99
    slowest_ids = {s.request_id for s in report.slowest}
    assert slowest_ids == {f"r{i}" for i in range(24, 32)}
    breakdown = report.cause_breakdown()
    assert breakdown["slowest"]["requests"] == 8
    assert next(iter(breakdown["slowest"]["causes"])) == "queue"
    assert breakdown["slowest"]["causes"]["queue"] == pytest.approx(
        sum(run.stats(f"r{i}")["queue_s"] for i in range(24, 32)))
    p99 = report.total.latency["e2e"][99]
    at_p99 = [r for r in records if r["kvscope"]["e2e_s"] >= p99]
    assert breakdown["p99"]["requests"] == len(at_p99) == 8
    assert report.to_dict()["causes"] == breakdown
    assert {s.cause.split()[0] for s in report.slowest} == {"queue"}
