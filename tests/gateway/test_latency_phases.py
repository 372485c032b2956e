"""The gateway's part of a request's latency (issue 18, point 4): ``kvscope.gateway`` in the request log line,
phase by phase (auth, rate limit, tokenize, retry, the answering attempt's connect/response, other), adding up
to the ``kvscope.e2e_s`` the gateway logs. Real gateway (in a thread) in front of fake upstreams; the only
timing bounds are lower bounds the test imposes through the fakes' delays."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvscope.gateway.app import create_app
from kvscope.gateway.auth import hash_key
from kvscope.gateway.context import GATEWAY_PHASES, RequestContext
from kvscope.gateway.logs.es_setup import record_properties
from kvscope.gateway.logs.record import RecordBuilder, ServiceInfo
from kvscope.gateway.settings import load_settings
from kvscope.testing.harness import GatewayThread, make_tokenizer_dir, records_by_id, start_fake_thread
from tests.gateway.conftest import LoopThread

REFUSE_DELAY_S = 0.2
"""The failing replica waits this long before its 503."""
ANSWER_DELAY_S = 0.1
"""Per-request delay of the answering replica before its first token (``fake.first_token_delay_s``)."""
HEADERS_SEEN_LATE_S = 0.01
"""A phase that starts when the gateway reads the upstream's headers starts after the fake sent them, by as
much as the gateway's thread waits to run (fake and gateway share this process): 0.3 ms of such a wait once
made a streamed answer's ``upstream_response_s`` 0.0997 s against the fake's 0.1 s. Bounds on such phases
allow this."""
HI = [{"role": "user", "content": "hi there"}]
ZERO_UPSTREAM = {"retry_s": 0.0, "upstream_connect_s": 0.0, "upstream_response_s": 0.0}


@dataclass
class Phased:
    url: str
    log: Path

    def post(self, rid: str, key: str = "sk-alice", **body) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/chat/completions",
            json={"messages": HI, **body},
            timeout=10,
            headers={"authorization": f"Bearer {key}", "x-request-id": rid},
        )

    def record(self, rid: str) -> dict:
        return records_by_id(self.log, [rid])[rid][0]


@pytest.fixture(scope="module")
def phased(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phased]:
    """``retry-model`` on a replica that answers 503 after REFUSE_DELAY_S and on a healthy one (which alone
    serves ``fake-model``); key ``sk-one`` may send one request a minute."""
    tmp = tmp_path_factory.mktemp("phases")
    failing = start_fake_thread(loop, ("retry-model",), status=503, headers_delay_s=REFUSE_DELAY_S)
    healthy = start_fake_thread(loop, ("retry-model", "fake-model"))
    config = {
        "upstreams": [{"url": failing.url}, {"url": healthy.url}],
        "models": [{"name": "retry-model", "tokenizer": str(make_tokenizer_dir(tmp))}],
        "api_keys": [
            {"name": "alice", "sha256": hash_key("sk-alice")},
            {"name": "one", "sha256": hash_key("sk-one"), "limits": {"requests_per_minute": 1}},
        ],
        "routing": {"health_interval_s": 60},
        "logs": {"file": str(tmp / "requests.jsonl")},
    }
    with GatewayThread(create_app(load_settings(None, config, env={}))) as gateway:
        deadline = (
            time.monotonic() + 30
        )  # both replicas health-checked, so round robin reaches the failing one
        while not all(r.healthy for r in gateway.state.pool.replicas) and time.monotonic() < deadline:
            time.sleep(0.02)
        yield Phased(gateway.url, tmp / "requests.jsonl")
    for fake in (failing, healthy):
        loop.run(fake.close())


def _phases(record: dict) -> dict:
    phases = record["kvscope"]["gateway"]
    assert tuple(phases) == GATEWAY_PHASES
    assert sum(phases.values()) == pytest.approx(record["kvscope"]["e2e_s"], abs=1e-9)
    return phases


def test_a_retried_request_has_its_failed_attempt_in_retry_and_the_answer_apart(phased: Phased) -> None:
    # round robin over the two replicas: of two requests, one at least starts on the failing replica
    records = []
    for i in range(2):
        resp = phased.post(f"retried-{i}", model="retry-model", fake={"first_token_delay_s": ANSWER_DELAY_S})
        assert resp.status_code == 200
        records.append(phased.record(f"retried-{i}"))
    record = next(r for r in records if r["kvscope"]["attempts"] == 2)
    p, kv = _phases(record), record["kvscope"]
    assert p["retry_s"] >= REFUSE_DELAY_S  # the 503 took that long, before the answering attempt began
    # a JSON answer: the upstream's headers come with its body, after the generation
    assert p["upstream_connect_s"] >= ANSWER_DELAY_S
    # upstream_s has both attempts: the answering one (connect + response) and the failed one (in retry_s)
    failed_attempt_s = kv["upstream_s"] - p["upstream_connect_s"] - p["upstream_response_s"]
    assert REFUSE_DELAY_S <= failed_attempt_s <= p["retry_s"] + 1e-9
    assert p["rate_limit_s"] == 0.0  # alice has no limits: nothing acquired
    assert p["tokenize_s"] > 0.0 and p["auth_s"] > 0.0 and p["other_s"] > 0.0


def test_a_stream_spends_the_engine_time_after_the_response_headers(phased: Phased) -> None:
    resp = phased.post(
        "streamed", model="fake-model", stream=True, fake={"first_token_delay_s": ANSWER_DELAY_S}
    )
    assert resp.status_code == 200
    record = phased.record("streamed")
    p = _phases(record)
    assert record["kvscope"]["attempts"] == 1 and p["retry_s"] == 0.0
    assert (
        p["upstream_response_s"] >= ANSWER_DELAY_S - HEADERS_SEEN_LATE_S
    )  # the fake sent its headers, then waited
    assert p["upstream_connect_s"] + p["upstream_response_s"] == pytest.approx(
        record["kvscope"]["upstream_s"], abs=1e-9
    )


def test_a_request_refused_at_auth_has_only_auth_and_other(phased: Phased) -> None:
    resp = phased.post("bad-key", key="sk-nobody", model="fake-model")
    assert resp.status_code == 401
    p = _phases(phased.record("bad-key"))
    assert {k: p[k] for k in ("rate_limit_s", "tokenize_s", *ZERO_UPSTREAM)} == {
        "rate_limit_s": 0.0,
        "tokenize_s": 0.0,
        **ZERO_UPSTREAM,
    }
    assert p["auth_s"] > 0.0


def test_a_rate_limited_request_has_its_rate_limit_time(phased: Phased) -> None:
    assert phased.post("one-first", key="sk-one", model="fake-model").status_code == 200
    resp = phased.post("one-second", key="sk-one", model="fake-model")
    assert resp.status_code == 429
    record = phased.record("one-second")
    p = _phases(record)
    assert record["kvscope"]["rate_limited"] is True
    assert p["rate_limit_s"] > 0.0 and p["auth_s"] > 0.0 and p["tokenize_s"] > 0.0
    assert {k: p[k] for k in ZERO_UPSTREAM} == ZERO_UPSTREAM
    assert _phases(phased.record("one-first"))["rate_limit_s"] > 0.0


def _ctx() -> RequestContext:
    return RequestContext(
        request_id="r",
        method="POST",
        path="/v1/chat/completions",
        route="/v1/chat/completions",
        start=100.0,
        start_wall=time.time(),
    )


def test_the_phases_partition_the_e2e_exactly() -> None:
    ctx = _ctx()
    ctx.edge.auth_s, ctx.edge.rate_limit_s, ctx.request.tokenize_s = 0.25, 0.5, 0.125
    ctx.attempt_ended(101.0, None, 102.0)  # a connect failure: no headers
    ctx.attempt_ended(102.5, 103.0, 105.0)  # the answer
    ctx.outcome.end_at = 106.0
    phases = ctx.gateway_phases(6.0)
    assert phases.to_dict() == {
        "auth_s": 0.25,
        "rate_limit_s": 0.5,
        "tokenize_s": 0.125,
        "retry_s": 1.5,
        "upstream_connect_s": 0.5,
        "upstream_response_s": 2.0,
        "other_s": 1.125,
    }
    assert phases.total_s == 6.0


def test_an_attempt_ending_after_the_response_counts_up_to_the_end() -> None:
    ctx = _ctx()
    ctx.outcome.end_at = 104.0
    ctx.attempt_ended(101.0, 102.0, 104.5)  # the upstream's last byte read after the client's response ended
    assert ctx.gateway_phases(4.0).to_dict() == {
        "auth_s": 0.0,
        "rate_limit_s": 0.0,
        "tokenize_s": 0.0,
        "retry_s": 0.0,
        "upstream_connect_s": 1.0,
        "upstream_response_s": 2.0,
        "other_s": 1.0,
    }


def test_upstream_s_counts_attempts_up_to_the_requests_end_as_the_phases_do() -> None:
    """A failed attempt, then an answer whose last byte is read after the request ended: upstream_s minus the
    answer's phases is exactly the failed attempt, within retry_s (an unclamped end inflated it, CI flake)."""
    ctx = _ctx()
    ctx.attempt_ended(101.0, None, 101.25)  # a 503: 0.25 s
    ctx.outcome.end_at = 104.0
    assert ctx.attempt_ended(101.5, 102.0, 104.5) == 104.0
    phases = ctx.gateway_phases(4.0)
    assert ctx.upstream.total_s == 2.75
    assert (
        ctx.upstream.total_s - phases.upstream_connect_s - phases.upstream_response_s
        == 0.25
        <= phases.retry_s
    )


def test_the_record_and_the_mapping_list_the_same_phases() -> None:
    ctx = _ctx()
    ctx.outcome.status, ctx.outcome.end_at = 200, 100.5
    record = RecordBuilder(ServiceInfo("kvscope-gateway", "0.1.0", "gw")).build(ctx)
    mapped = record_properties()["kvscope"]["properties"]["gateway"]["properties"]
    assert mapped == dict.fromkeys(GATEWAY_PHASES, {"type": "double"})
    assert record["kvscope"]["gateway"] == {
        "auth_s": 0.0,
        "rate_limit_s": 0.0,
        "tokenize_s": 0.0,
        "retry_s": 0.0,
        "upstream_connect_s": 0.0,
        "upstream_response_s": 0.0,
        "other_s": 0.5,
    }
