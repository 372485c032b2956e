"""``kvscope logs why`` (gateway/logs/why.py) on records whose ``kvscope.engine`` comes from the real
scheduler (the 32-arrivals scenario of tests/engine/core/test_attribution.py), through the JSONL back end."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from kvscope.engine.core.stats import KvscopeStats
from kvscope.gateway.analytics.cli import logs_main
from kvscope.gateway.logs.es_setup import attribution_properties, record_properties
from kvscope.gateway.logs.why import explain, rank_causes
from kvscope.testing.records import make_record
from tests.engine.core.factories import FakeClock, make_scheduler
from tests.engine.core.test_attribution import Run


def test_the_log_mapping_has_every_kvscope_stats_field() -> None:
    mapped = record_properties()["kvscope"]["properties"]["engine"]["properties"]
    assert sorted(mapped) == sorted(KvscopeStats.__struct_fields__)
    assert attribution_properties()["queue_limit"] == {"type": "keyword", "ignore_above": 1024}
    assert [
        mapped[f"spec_{f}"] for f in ("drafts", "draft_tokens", "accepted_tokens", "mean_accepted_length")
    ] == [{"type": "long"}] * 3 + [{"type": "double"}]


@pytest.fixture(scope="module")
def queued() -> dict:
    """Engine stats of the last of 32 simultaneous arrivals (max_num_seqs 8)."""
    clock = FakeClock()
    run = Run(make_scheduler(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096, clock=clock), clock)
    for i in range(32):
        run.add(f"r{i}", 64, max_tokens=8, start=100 * i)
    run.until_done()
    return run.stats("r31")


PHASES = {"auth_s": 0.0006, "rate_limit_s": 0.0012, "tokenize_s": 0.0008, "retry_s": 0.25, "other_s": 0.0016}
"""Gateway phases of the records below (seconds): a retried request, 0.004 s of the gateway's own time."""
TRANSFER = 0.001
"""Answering-attempt seconds the engine did not account for."""


def _record(engine: dict, phases: dict | None = None) -> dict:
    """The gateway's record of a request the engine attributed as ``engine``: ``phases`` as its gateway part
    (None: a record from before ``kvscope.gateway``, 0.004 s of gateway overhead)."""
    engine_e2e = engine["queue_s"] + engine["prefill_s"] + engine["decode_s"]
    answered = engine_e2e + TRANSFER
    own = sum((phases or {"overhead": 0.004}).values())
    e2e = answered + own
    record = make_record(31, ttft_s=engine["ttft_s"] + own, tpot_s=engine["tpot_s"], e2e_s=e2e, engine=engine)
    kv = record["kvscope"]
    if phases is None:
        del kv["gateway"]
        kv["gateway_overhead_s"], kv["upstream_s"] = own, answered
    else:
        kv["gateway"] = {**phases, "upstream_connect_s": 0.002, "upstream_response_s": answered - 0.002}
        kv["upstream_s"], kv["gateway_overhead_s"], kv["attempts"] = answered + 0.2, e2e - answered - 0.2, 2
        assert sum(kv["gateway"].values()) == pytest.approx(e2e, abs=1e-12)
    return record


def test_explain_names_the_queue_and_its_limit(queued) -> None:
    why = explain(_record(queued, None))
    first = why.text.splitlines()[0]
    assert first.startswith(
        f"TTFT {queued['ttft_s'] + 0.004:.3f} s: {queued['queue_s']:.3f} s queued "
        "(31 requests ahead, 0 running, max_num_seqs reached); prefill"
    )
    assert (
        "over 1 steps shared with 448 prompt and 0 decode tokens of up to 7 other requests (own 64 tokens"
        in first
    )
    assert why.verdict == "queue"
    causes = dict(why.causes)
    assert causes["queue"] == pytest.approx(queued["queue_s"])
    assert causes["gateway"] == pytest.approx(0.004)  # an older record: one gateway cause
    assert causes["upstream transfer"] == pytest.approx(TRANSFER)
    assert why.text.splitlines()[-2] == (
        f"e2e {_record(queued, None)['kvscope']['e2e_s']:.3f} s at the gateway: "
        "0.004 s in the gateway (auth, limits, tokenize, connect, 1 attempt(s)), "
        f"{queued['queue_s'] + queued['prefill_s'] + queued['decode_s'] + TRANSFER:.3f}"
        " s upstream"
    )
    e2e = queued["queue_s"] + queued["prefill_s"] + queued["decode_s"] + 0.005
    assert sum(causes.values()) == pytest.approx(e2e, rel=0.05)


def test_explain_ranks_the_gateway_phases_among_the_causes(queued) -> None:
    record = _record(queued, PHASES)
    why = explain(record)
    causes = dict(why.causes)
    assert "gateway" not in causes
    assert {c: causes[c] for c in ("auth", "rate limit", "tokenize", "retry", "gateway other")} == {
        "auth": 0.0006,
        "rate limit": 0.0012,
        "tokenize": 0.0008,
        "retry": 0.25,
        "gateway other": 0.0016,
    }
    assert causes["upstream transfer"] == pytest.approx(TRANSFER)
    # every second of the client's e2e is in exactly one cause: engine + gateway phases + transfer
    assert sum(causes.values()) == pytest.approx(record["kvscope"]["e2e_s"], abs=1e-9)
    names = [c for c, _ in why.causes]
    assert (
        names.index("retry")
        < names.index("gateway other")
        < names.index("rate limit")
        < names.index("tokenize")
        < names.index("auth")
    )
    assert why.text.splitlines()[-2] == (
        f"e2e {record['kvscope']['e2e_s']:.3f} s at the gateway: auth 0.001 s, rate limit 0.001 s, tokenize "
        "0.001 s, retry 0.250 s (2 attempt(s)), other 0.002 s; the answering upstream "
        f"{queued['queue_s'] + queued['prefill_s'] + queued['decode_s'] + TRANSFER:.3f} s (0.002 s to its "
        "response headers)"
    )


def test_rank_causes_is_largest_first(queued) -> None:
    ranked = rank_causes(queued)
    assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)
    assert ranked[0] == ("queue", pytest.approx(queued["queue_s"]))


def test_why_reads_the_jsonl_log_by_request_or_trace_id(queued, tmp_path) -> None:
    log = tmp_path / "requests.jsonl"
    other = make_record(1)
    log.write_text(json.dumps(other) + "\n" + json.dumps(_record(queued, PHASES)) + "\n")
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
    assert err.getvalue() == (
        "kvscope logs why: no request-log record whose response id, request id, trace id or event id is or "
        "starts with 'nope'\n"
    )


def test_report_breaks_the_slowest_and_p99_down_by_cause(tmp_path) -> None:
    import asyncio

    from kvscope.gateway.analytics import commands
    from kvscope.gateway.analytics.commands import LogSource

    clock = FakeClock()
    run = Run(make_scheduler(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096, clock=clock), clock)
    for i in range(32):
        run.add(f"r{i}", 64, max_tokens=8, start=100 * i)
    run.until_done()
    records = []
    for i in range(32):
        record = _record(run.stats(f"r{i}"), PHASES)
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
        sum(run.stats(f"r{i}")["queue_s"] for i in range(24, 32))
    )
    p99 = report.total.latency["e2e"][99]
    at_p99 = [r for r in records if r["kvscope"]["e2e_s"] >= p99]
    assert breakdown["p99"]["requests"] == len(at_p99) == 8
    assert report.to_dict()["causes"] == breakdown
    assert {s.cause.split()[0] for s in report.slowest} == {"queue"}


def test_explain_names_the_grammar_mask_time_of_a_constrained_request(queued) -> None:
    why = explain(_record({**queued, "structured_mask_s": 0.0123, "structured_wait_s": 0.0046}, None))
    assert (
        "grammar masks 0.012 s (overlapped with the forward pass), sampling waited 0.005 s for them"
        in why.text.splitlines()
    )
    assert not any(
        line.startswith("grammar masks") for line in explain(_record(queued, None)).text.splitlines()
    )


def test_a_grammar_compile_before_the_engine_is_its_own_cause_not_upstream_transfer(queued) -> None:
    """The wait for a new grammar happens on the engine's server before the request's arrival in the engine,
    inside the gateway's answering attempt: it is the ``grammar compile`` cause (``structured_compile_s``),
    and upstream transfer is what is left."""
    record = _record({**queued, "structured_compile_s": 0.3}, PHASES)
    kv = record["kvscope"]
    kv["gateway"]["upstream_response_s"] += 0.3
    kv["e2e_s"] += 0.3
    kv["ttft_s"] += 0.3
    why = explain(record)
    causes = dict(why.causes)
    assert causes["grammar compile"] == 0.3
    assert causes["upstream transfer"] == pytest.approx(TRANSFER)
    assert sum(causes.values()) == pytest.approx(kv["e2e_s"], abs=1e-9)
    assert "grammar compile 0.300 s before the engine's queue" in why.text.splitlines()
    # the gateway's TTFT includes the wait: it leads the TTFT sentence
    assert why.text.splitlines()[0].startswith(f"TTFT {kv['ttft_s']:.3f} s: grammar compile 0.300 s, then ")
    cached = explain(_record({**queued, "structured_compile_s": 0.0}, PHASES))
    assert "grammar compile 0.000 s before the engine's queue (cached)" in cached.text.splitlines()
    assert "grammar compile" not in dict(cached.causes)
    assert dict(cached.causes)["upstream transfer"] == pytest.approx(TRANSFER)
    assert not any(
        line.startswith("grammar compile") for line in explain(_record(queued, PHASES)).text.splitlines()
    )


def test_upstream_transfer_is_measured_against_the_attributed_choice(queued) -> None:
    """For ``n > 1`` (or several prompts) the merged object's ``queue_s`` and ``prefill_s`` are the earliest
    choice's while the causes are those of the choice that finished last (KvscopeStats.merge), its queue
    ``attributed_queue_s``; upstream transfer is the attempt's time minus that choice's own time in the
    engine (break-it: an n=2 request's causes summed to 16.2 s against an e2e of 9.74 s, the difference
    counted again as upstream transfer; with three prompts the last one's 5-7 s in the queue was transfer)."""
    record = _record(dict(queued), PHASES)  # the attempt covers the attributed choice's engine time
    merged = record["kvscope"]["engine"]
    assert merged is not queued
    merged["attributed_queue_s"] = merged["queue_s"]
    merged["queue_s"], merged["prefill_s"] = 0.001, merged["prefill_s"] / 4  # another choice's, earlier
    causes = dict(explain(record).causes)
    assert causes["queue"] == queued["queue_s"]
    assert causes["upstream transfer"] == pytest.approx(TRANSFER)
    assert sum(causes.values()) == pytest.approx(record["kvscope"]["e2e_s"], abs=1e-9)


def test_why_counts_read_the_same_from_the_file_as_in_the_console(tmp_path) -> None:
    """The file's numbers come through DuckDB as doubles: the sampled counts said ``1.0 running, 0.0
    waiting`` where the console (the record as logged) said ``1 running, 0 waiting``."""
    record = make_record(1)
    record["kvscope"]["upstream"] = {
        "kind": "kvscope",
        "kind_source": "models",
        "sampled": {
            "arrival": {"requests_running": 1, "requests_waiting": 0, "kv_cache_usage": 0.25, "age_s": 0.5},
            "finish": {"requests_running": 4, "requests_waiting": 3, "kv_cache_usage": 0.5, "age_s": 0.25},
        },
    }
    log = tmp_path / "requests.jsonl"
    log.write_text(json.dumps(record) + "\n")
    phrase = (
        "at arrival 1 running, 0 waiting, KV usage 25% (sampled 0.5 s before); at finish 4 running, 3 "
        "waiting, KV usage 50% (sampled 0.2 s before)"
    )
    assert phrase in explain(record).text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert logs_main(["why", record["event"]["id"], "--source", str(log)], env={}) == 0
    assert phrase in out.getvalue()


def test_why_explains_an_admission_refusal_by_its_prediction() -> None:
    message = (
        "predicted time to first token 7.8 s exceeds the 2 s objective of tier default; 41 requests ahead"
    )
    record = {
        "http": {"request": {"id": "shed-1"}, "response": {"status_code": 503}},
        "error": {"type": "ttft_slo_exceeded", "message": message},
        "kvscope": {
            "e2e_s": 0.004,
            "engine": {"predicted_ttft_s": 7.8, "service_tier": "default", "queue_ahead": 41},
        },
    }
    why = explain(record)
    assert why.text.splitlines() == [
        f"refused at admission (503 ttft_slo_exceeded): {message}",
        "predicted TTFT 7.800 s in tier default with 41 requests ahead; never queued: no prefill, no decode "
        "(the client may retry after its Retry-After)",
        "verdict: admission refusal 0.004 s (100%)",
    ]
    assert (why.verdict, why.causes, why.request_id) == (
        "admission refusal",
        (("admission refusal", 0.004),),
        "shed-1",
    )


def test_why_explains_a_request_dropped_from_the_queue_by_its_wait() -> None:
    message = (
        "waited 58.2 s in the queue; predicted time to first token 60.4 s exceeds the 60 s objective of tier "
        "flex; 3 requests ahead"
    )
    record = {
        "http": {"request": {"id": "shed-2"}, "response": {"status_code": 503}},
        "error": {"type": "ttft_slo_exceeded", "message": message},
        "kvscope": {
            "e2e_s": 58.21,
            "engine": {"predicted_ttft_s": 60.4, "service_tier": "flex", "queue_ahead": 3, "queue_s": 58.2},
        },
    }
    why = explain(record)
    assert why.text.splitlines() == [
        f"dropped from the queue by admission (503 ttft_slo_exceeded): {message}",
        "queued 58.200 s in tier flex, then its first token could no longer come within the tier's objective "
        "(earliest 60.400 s; 3 requests ahead): no prefill, no decode (the client may retry after its "
        "Retry-After)",
        "verdict: dropped from the queue 58.210 s (100%)",
    ]
    assert (why.verdict, why.causes) == ("dropped from the queue", (("dropped from the queue", 58.21),))
