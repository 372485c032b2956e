"""Tiers, priorities, deadlines and admission's 503 at the engine server (issue 42;
engine/server/scheduling.py), against the scripted FakeEngine: the request's place in the scheduler from its
body and headers, the refusal's exact answer, log line and shed counter, and the prediction-error
histogram."""

from __future__ import annotations

import json
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

import kvscope.engine.server.serving_chat as serving_chat
from kvscope.engine.core.admission import AdmissionConfig, Refusal
from kvscope.engine.server.access_log import ACCESS_LOGGER
from kvscope.engine.server.scheduling import SERVICE_TIER_HEADER, TIMEOUT_HEADER
from kvscope.engine.server.stat_logger import SequenceTimings, ServerMetrics
from tests.engine.server.conftest import chat_body
from tests.engine.server.helpers import metric_samples, sample

REFUSAL = Refusal("default", 7.8, 2.0, 41)


@pytest.fixture
def refusing(fake_engine):
    fake_engine.admission = AdmissionConfig({"default": 2.0})
    fake_engine.refusal = REFUSAL
    return fake_engine


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_request_gets_503_with_retry_after_and_the_prediction(
    client, refusing, caplog, stream: bool
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    response = client.post("/v1/chat/completions", json=chat_body(stream=stream))
    assert response.status_code == 503  # before any stream starts: never a 200 with an in-band error
    assert response.headers["retry-after"] == "6"  # ceil(7.8 - 2)
    body = response.json()
    assert body["error"] == {
        "message": "predicted time to first token 7.8 s exceeds the 2 s objective of tier default; "
        "41 requests ahead",
        "type": "server_error",
        "param": None,
        "code": "ttft_slo_exceeded",
    }
    kvscope = {k: v for k, v in body["kvscope"].items() if v is not None}
    assert kvscope == {"predicted_ttft_s": 7.8, "service_tier": "default", "queue_ahead": 41}
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    assert line["http"]["response"]["status_code"] == 503
    assert {k: v for k, v in line["kvscope"]["engine"].items() if v is not None} == kvscope
    assert line["kvscope"]["outcome"] == "error"
    assert line["error"]["message"] == body["error"]["message"]
    metrics = metric_samples(client.get("/metrics").text)
    shed = "kvscope_engine_requests_shed_total"
    assert sample(metrics, shed, model="fake-model", tier="default", reason="ttft_slo") == 1.0
    assert sample(metrics, shed, model="fake-model", tier="flex", reason="ttft_slo") == 0.0


def test_a_refusal_that_reaches_the_stream_is_answered_the_same_way(client, fake_engine) -> None:
    fake_engine.refusal = REFUSAL  # admission off: the server waits for no queueing, the stream fails
    response = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "6"
    assert response.json()["error"]["code"] == "ttft_slo_exceeded"


@pytest.mark.parametrize(
    ("body_tier", "key_tier", "served"),
    [
        (None, None, "default"),
        ("auto", None, "default"),
        ("scale", None, "default"),
        ("flex", None, "flex"),
        ("priority", None, "priority"),
        (None, "flex", "flex"),  # the key's tier is the default …
        ("priority", "default", "default"),  # … and the best its requests get
        ("flex", "priority", "flex"),  # a worse tier may always be asked for
    ],
)
def test_the_tier_comes_from_the_body_and_the_keys_header(
    client, fake_engine, body_tier: str | None, key_tier: str | None, served: str
) -> None:
    fake_engine.queued_requests.clear()  # the start-up generation
    body = chat_body(max_tokens=1, **({"service_tier": body_tier} if body_tier else {}))
    headers = {SERVICE_TIER_HEADER: key_tier} if key_tier else {}
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert [r.service_tier for r in fake_engine.queued_requests] == [served]


def test_priority_and_timeout_reach_the_engine_request(client, fake_engine) -> None:
    fake_engine.queued_requests.clear()  # the start-up generation
    response = client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": ["a", "b"], "max_tokens": 1, "priority": -3},
        headers={TIMEOUT_HEADER: "2.5"},
    )
    assert response.status_code == 200, response.text
    first, second = fake_engine.queued_requests
    assert (first.priority, second.priority) == (-3, -3)
    assert first.deadline is not None and first.deadline == second.deadline  # arrival + 2.5 s, both prompts
    client.post("/v1/completions", json={"model": "fake-model", "prompt": "a", "max_tokens": 1})
    assert (fake_engine.queued_requests[-1].priority, fake_engine.queued_requests[-1].deadline) == (0, None)


def test_the_deadline_counts_from_the_servers_receipt(client, fake_engine, monkeypatch) -> None:
    """``x-kvscope-timeout`` counts from the server's receipt of the request, not from its queueing after a
    grammar compile and the chat template (break-it: a 0.2 s timeout on a request whose compile took 0.63 s
    was still answered): the deadline minus the timeout is before the chat template ran."""
    templated: list[float] = []
    template = serving_chat.chat_prompt

    def timed(*args, **kwargs):
        templated.append(time.monotonic())
        return template(*args, **kwargs)

    monkeypatch.setattr(serving_chat, "chat_prompt", timed)
    fake_engine.queued_requests.clear()  # the start-up generation
    sent = time.monotonic()
    response = client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=1), headers={TIMEOUT_HEADER: "30"}
    )
    assert response.status_code == 200, response.text
    (queued,) = fake_engine.queued_requests
    assert queued.deadline is not None and sent <= queued.deadline - 30 <= templated[0]


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({SERVICE_TIER_HEADER: "gold"}, {}, SERVICE_TIER_HEADER),
        ({TIMEOUT_HEADER: "0"}, {}, TIMEOUT_HEADER),
        ({TIMEOUT_HEADER: "soon"}, {}, TIMEOUT_HEADER),
        ({}, {"service_tier": "gold"}, "service_tier"),
    ],
)
def test_bad_scheduling_inputs_are_400_naming_them(client, fake_engine, headers, body, param) -> None:
    fake_engine.queued_requests.clear()  # the start-up generation
    response = client.post("/v1/chat/completions", json=chat_body(**body), headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert fake_engine.queued_requests == []


def test_the_prediction_error_histogram_observes_the_relative_error() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, "m")
    for predicted, actual in ((1.5, 1.0), (0.9, 1.0), (None, 1.0)):
        metrics.on_sequence_finished(
            SequenceTimings("stop", 3, e2e_s=2.0, ttft_s=actual, predicted_ttft_s=predicted)
        )
    name = "kvscope_engine_ttft_prediction_error_ratio"
    assert registry.get_sample_value(f"{name}_count", {"model": "m"}) == 2.0
    assert registry.get_sample_value(f"{name}_sum", {"model": "m"}) == pytest.approx(0.6)
    assert registry.get_sample_value(f"{name}_bucket", {"model": "m", "le": "0.1"}) == 1.0
    assert registry.get_sample_value(f"{name}_bucket", {"model": "m", "le": "0.5"}) == 2.0


def test_the_ttft_slo_flag_turns_admission_on() -> None:
    from kvscope.engine.llm import build_engine_config
    from kvscope.engine.server.cli import build_parser, engine_config_kwargs

    off = build_parser().parse_args(["--model", "smollm2-135m"])
    assert not build_engine_config(off.model, **engine_config_kwargs(off)).admission.enabled
    on = build_parser().parse_args(["--model", "smollm2-135m", "--ttft-slo", "priority=1,default=2"])
    config = build_engine_config(on.model, **engine_config_kwargs(on))
    assert dict(config.admission.ttft_slo_s) == {"priority": 1.0, "default": 2.0}
    bad = build_parser().parse_args(["--ttft-slo", "gold=1"])
    with pytest.raises(ValueError, match="TIER=SECONDS"):
        build_engine_config(bad.model, **engine_config_kwargs(bad))


def test_queue_time_and_ttft_are_observed_per_tier() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, "m")
    for tier, queue, ttft in (
        ("priority", 0.2, 0.5),
        ("flex", 30.0, 42.0),
        ("flex", 3.0, None),
        (None, 1.0, 1.5),
    ):
        metrics.on_sequence_finished(
            SequenceTimings("stop", 3, e2e_s=50.0, ttft_s=ttft, queue_s=queue, service_tier=tier)
        )
    queue_name, ttft_name = (
        "kvscope_engine_tier_queue_time_seconds",
        "kvscope_engine_tier_time_to_first_token_seconds",
    )
    counts = {
        tier: (
            registry.get_sample_value(f"{queue_name}_count", {"model": "m", "tier": tier}),
            registry.get_sample_value(f"{ttft_name}_count", {"model": "m", "tier": tier}),
        )
        for tier in ("priority", "default", "flex")
    }
    assert counts == {"priority": (1.0, 1.0), "default": (0.0, 0.0), "flex": (2.0, 1.0)}
    assert registry.get_sample_value(f"{queue_name}_sum", {"model": "m", "tier": "flex"}) == 33.0
    assert registry.get_sample_value(f"{ttft_name}_sum", {"model": "m", "tier": "flex"}) == 42.0


def test_a_served_request_is_counted_in_its_tier(client, fake_engine) -> None:
    before = metric_samples(client.get("/metrics").text)
    body = chat_body(max_tokens=1, service_tier="flex")
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    after = metric_samples(client.get("/metrics").text)
    name = "kvscope_engine_tier_time_to_first_token_seconds_count"
    delta = {
        tier: sample(after, name, model="fake-model", tier=tier)
        - sample(before, name, model="fake-model", tier=tier)
        for tier in ("priority", "default", "flex")
    }
    assert delta == {"priority": 0.0, "default": 0.0, "flex": 1.0}


@pytest.mark.parametrize(
    ("body_tier", "key_tier", "shown"),
    [
        (None, None, None),  # nothing named: no service_tier, as OpenAI
        ("auto", None, "default"),
        ("flex", None, "flex"),
        ("priority", "default", "default"),  # the tier that served it, not the one asked for
        (None, "flex", "flex"),
    ],
)
def test_chat_responses_say_the_tier_that_served_them(
    client, body_tier: str | None, key_tier: str | None, shown: str | None
) -> None:
    extra = {"service_tier": body_tier} if body_tier else {}
    headers = {SERVICE_TIER_HEADER: key_tier} if key_tier else {}
    response = client.post("/v1/chat/completions", json=chat_body(max_tokens=2, **extra), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json().get("service_tier", "absent") == (shown or "absent")
    body = chat_body(max_tokens=2, stream=True, stream_options={"include_usage": True}, **extra)
    streamed = client.post("/v1/chat/completions", json=body, headers=headers)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert len(chunks) >= 3  # role, content, usage
    assert {chunk.get("service_tier", "absent") for chunk in chunks} == {shown or "absent"}


DROPPED = Refusal("flex", 60.4, 60.0, 3, waited_s=58.2, retry_basis_s=71.3)
"""Admitted, then dropped from the queue: its first token could no longer come within 60 s."""


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_dropped_from_the_queue_gets_the_refusals_503(
    client, fake_engine, caplog, stream: bool
) -> None:
    """With admission on, a stream's 200 waits for its first output, so a request admission drops from the
    queue is answered like a refusal at admission: a 503 with Retry-After (from the prediction of the same
    request arriving now: ceil(71.3 - 60)), never an error event inside a 200."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    fake_engine.admission = AdmissionConfig({"flex": 60.0})
    fake_engine.dropped = DROPPED
    response = client.post("/v1/chat/completions", json=chat_body(stream=stream, service_tier="flex"))
    assert response.status_code == 503
    assert response.headers["retry-after"] == "12"
    body = response.json()
    assert body["error"] == {
        "message": "waited 58.2 s in the queue; predicted time to first token 60.4 s exceeds the 60 s "
        "objective of tier flex; 3 requests ahead",
        "type": "server_error",
        "param": None,
        "code": "ttft_slo_exceeded",
    }
    kvscope = {k: v for k, v in body["kvscope"].items() if v is not None}
    assert kvscope == {"predicted_ttft_s": 60.4, "service_tier": "flex", "queue_ahead": 3, "queue_s": 58.2}
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    assert line["http"]["response"]["status_code"] == 503
    assert line["kvscope"]["outcome"] == "error"
    assert {k: v for k, v in line["kvscope"]["engine"].items() if v is not None} == kvscope
    metrics = metric_samples(client.get("/metrics").text)
    shed = "kvscope_engine_requests_shed_total"
    assert sample(metrics, shed, model="fake-model", tier="flex", reason="ttft_slo_queued") == 1.0
    assert sample(metrics, shed, model="fake-model", tier="flex", reason="ttft_slo") == 0.0
    assert sample(metrics, "kvscope_engine_stream_errors_total", model="fake-model") in (None, 0.0)


def test_a_held_stream_sends_what_an_unheld_one_sends(client, fake_engine) -> None:
    """The 200 of a stream whose tier has an objective waits for the first output, then the stream is the
    same, chunk for chunk, as with admission off (ids and timestamps aside)."""

    def chunks() -> list[dict]:
        body = chat_body(
            max_tokens=5, stream=True, stream_options={"include_usage": True}, service_tier="flex"
        )
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.text.endswith("data: [DONE]\n\n")
        parsed = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        return [{k: v for k, v in c.items() if k not in ("id", "created", "kvscope")} for c in parsed]

    unheld = chunks()
    fake_engine.admission = AdmissionConfig({"flex": 60.0})
    assert chunks() == unheld and len(unheld) >= 3


def test_a_held_stream_gets_its_200_once_its_objective_has_passed(client, fake_engine, caplog) -> None:
    """A request admission no longer drops (one preempted after its first chunk) may wait past its objective:
    its 200 then goes out with a keep-alive once the objective and HOLD_GRACE_S have passed since arrival
    (0.2 + 1 s, before the fake's 3 s in the queue: timers of one event loop fire in deadline order), and
    the stream goes on as any other (keep-alives at the test server's interval until the first token)."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    fake_engine.admission = AdmissionConfig({"flex": 0.2})
    fake_engine.queue_s = 3.0
    body = chat_body(max_tokens=2, stream=True, service_tier="flex")
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.text.startswith(": keep-alive\n\n")  # held without bound: the 200 would come with data
    assert response.text.endswith("data: [DONE]\n\n")
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    assert (line["http"]["response"]["status_code"], line["kvscope"]["outcome"]) == (200, "success")
