"""The console's request list (gateway/console/records.py): the ring of the newest records, its filters, a
row, and a request's waterfall from its log line."""

from __future__ import annotations

from typing import Any

import pytest

from kvscope.gateway.console.records import RecordFilter, RecordRing, facets, summary, waterfall
from kvscope.gateway.logs.sink import LogSink


def _record(i: int, **over: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "@timestamp": f"2026-01-01T00:00:0{i}.000Z",
        "event": {"id": f"ev-{i}"},
        "http": {"request": {"id": f"req-{i}", "method": "POST"}, "response": {"status_code": 200}},
        "url": {"path": "/v1/chat/completions"},
        "user": {"id": "alice"},
        "server": {"address": "127.0.0.1:8000"},
        "error": {"type": None, "message": None},
        "trace": {"id": "ab" * 16},
        "gen_ai": {
            "request": {"model": "m", "stream": True},
            "response": {"finish_reasons": ["stop"]},
            "usage": {"input_tokens": 10, "output_tokens": 4},
            "input": {"messages": [{"role": "user", "parts": [{"type": "text", "content": "secret"}]}]},
        },
        "kvscope": {
            "ttft_s": 0.05,
            "tpot_s": 0.01,
            "e2e_s": 0.2 + i,
            "stream_error": None,
            "gateway": {
                "auth_s": 0.001,
                "rate_limit_s": 0.002,
                "tokenize_s": 0.003,
                "retry_s": 0.0,
                "upstream_connect_s": 0.02,
                "upstream_response_s": 0.15,
                "other_s": 0.024,
            },
            "engine": {
                "queue_s": 0.004,
                "prefill_s": 0.03,
                "decode_s": 0.12,
                "spec_draft_tokens": 6,
                "spec_accepted_tokens": 4,
                "num_preemptions": 1,
            },
            "routing": {"replica": "r1"},
        },
    }
    for path, value in over.items():
        node = record
        *parents, leaf = path.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return record


def test_the_ring_keeps_the_newest_and_sums_what_only_records_say() -> None:
    ring = RecordRing(3)
    assert isinstance(ring, LogSink) and ring.name == "console"
    for i in range(5):
        ring.emit(_record(i))
    ring.emit({"kvscope": None})  # a record without the fields adds nothing and raises nothing
    assert [r.get("event", {}).get("id") for r in ring.records] == ["ev-3", "ev-4", None]
    assert (ring.spec_draft_tokens, ring.spec_accepted_tokens, ring.preemptions) == (30.0, 20.0, {"r1": 5.0})
    assert ring.find("ev-4") is ring.records[1] and ring.find("ev-0") is None


def test_filters() -> None:
    records = [
        _record(0),
        _record(1, http__response__status_code=404, user__id="bob"),
        _record(2, http__response__status_code=503, gen_ai__request__model="other"),
        _record(3, kvscope__stream_error="upstream_error", gen_ai__response__finish_reasons=["length"]),
    ]

    def ids(**kw: Any) -> list[str]:
        wanted = RecordFilter(**kw)
        return [r["event"]["id"] for r in records if wanted.matches(r)]

    assert ids() == ["ev-0", "ev-1", "ev-2", "ev-3"]
    assert ids(status="error") == ["ev-1", "ev-2", "ev-3"]
    assert ids(status="5xx") == ["ev-2"] and ids(status="404") == ["ev-1"]
    assert ids(model="other") == ["ev-2"] and ids(key="bob") == ["ev-1"]
    assert ids(finish_reason="length") == ["ev-3"]
    assert ids(slower_than_s=2.2) == ["ev-2", "ev-3"]
    assert ids(status="2xx", slower_than_s=1.0) == ["ev-3"]
    for bad in (
        {"status": "50"},
        {"status": "oops"},
        {"slower_than_s": -1.0},
        {"slower_than_s": float("nan")},
    ):
        with pytest.raises(ValueError):
            RecordFilter(**bad)
    assert facets(records) == {
        "models": ["m", "other"],
        "keys": ["alice", "bob"],
        "statuses": ["200", "404", "503"],
        "finish_reasons": ["length", "stop"],
    }


def test_a_row_never_carries_content() -> None:
    row = summary(_record(1))
    assert "secret" not in repr(row)
    assert row == {
        "event_id": "ev-1",
        "request_id": "req-1",
        "timestamp": "2026-01-01T00:00:01.000Z",
        "method": "POST",
        "path": "/v1/chat/completions",
        "model": "m",
        "key": "alice",
        "status": 200,
        "stream": True,
        "finish_reasons": ["stop"],
        "input_tokens": 10,
        "output_tokens": 4,
        "ttft_s": 0.05,
        "tpot_s": 0.01,
        "e2e_s": 1.2,
        "replica": "r1",
        "error_type": None,
        "stream_error": None,
    }


def test_the_waterfall_is_the_log_lines_numbers_on_one_axis() -> None:
    rows = waterfall(_record(0))
    assert [(r["field"], r["seconds"]) for r in rows] == [
        ("kvscope.e2e_s", 0.2),
        ("kvscope.gateway.auth_s", 0.001),
        ("kvscope.gateway.rate_limit_s", 0.002),
        ("kvscope.gateway.tokenize_s", 0.003),
        ("kvscope.gateway.retry_s", 0.0),
        ("kvscope.gateway.upstream_connect_s", 0.02),
        ("kvscope.gateway.upstream_response_s", 0.15),
        ("kvscope.engine.queue_s", 0.004),
        ("kvscope.engine.prefill_s", 0.03),
        ("kvscope.engine.decode_s", 0.12),
        ("kvscope.gateway.other_s", 0.024),
    ]
    starts = {r["field"]: r["start_s"] for r in rows}
    attempt = 0.001 + 0.002 + 0.003 + 0.0
    assert starts["kvscope.gateway.upstream_connect_s"] == attempt == starts["kvscope.engine.queue_s"]
    assert starts["kvscope.engine.prefill_s"] == attempt + 0.004
    assert starts["kvscope.gateway.other_s"] == attempt + 0.02 + 0.15
    # an upstream that reports no engine times, a request refused before any upstream
    no_engine = waterfall(_record(0, kvscope__engine=None))
    assert [r["field"] for r in no_engine if r["field"].startswith("kvscope.engine")] == []
    assert waterfall({"kvscope": {"e2e_s": 0.001, "gateway": None, "engine": None}}) == [
        {"name": "end to end (gateway)", "field": "kvscope.e2e_s", "start_s": 0.0, "seconds": 0.001}
    ]
