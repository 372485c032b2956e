"""The gateway as a real process in front of real fake-upstream processes: byte-exact SSE relay, client
disconnects reaching the upstream, 401/403/413/429, an upstream killed mid-stream, replica failover and
all-down 503, and the request log checked against the client's own measurements and the metrics. Tests that
kill upstreams get a cluster of their own; the others share one."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from kvscope.gateway.auth import hash_key
from kvscope.gateway.engines.section import ENGINE_KEYS, SAMPLE_KEYS, SOURCE_KEYS
from kvscope.testing.harness import (
    Proc,
    metric_samples,
    records_by_id,
    sample,
    spawn_fake,
    spawn_gateway,
    wait_http,
)
from kvscope.testing.wait import wait_until

pytestmark = pytest.mark.e2e
KEYS = {"alice": "sk-alice", "limited": "sk-limited", "capped": "sk-capped", "burst": "sk-burst"}
HI = [{"role": "user", "content": "hi"}]


@dataclass
class Cluster:
    gateway: Proc
    a: Proc
    b: Proc
    victim: Proc
    log: Path

    def client(self, key: str = "alice", **kw: object) -> httpx.Client:
        return httpx.Client(
            base_url=self.gateway.url, headers={"authorization": f"Bearer {KEYS[key]}"}, timeout=10, **kw
        )

    def upstream_record(self, request_id: str) -> dict:
        for fake in (self.a, self.b, self.victim):
            if fake.popen.poll() is None:
                for rec in httpx.get(fake.url + "/_fake/requests").json():
                    if rec["headers"].get("x-request-id") == request_id:
                        return rec
        raise KeyError(request_id)

    def metrics(self) -> dict:
        with self.client() as c:  # keys are configured: /metrics needs one that may use every model
            return metric_samples(c.get("/metrics").text)


@contextmanager
def _start_cluster(tmp: Path) -> Iterator[Cluster]:
    a, b = spawn_fake(tmp, "a"), spawn_fake(tmp, "b")
    victim = spawn_fake(tmp, "victim", models="victim-model", token_delay_s=0.1)
    procs = [a, b, victim]
    try:
        for fake in procs:
            wait_http(fake.url + "/health", proc=fake.popen)
        config = {
            "upstreams": [
                {"url": p.url, "name": name} for p, name in ((a, "a"), (b, "b"), (victim, "victim"))
            ],
            "api_keys": [
                {"name": "alice", "sha256": hash_key(KEYS["alice"])},
                {"name": "limited", "sha256": hash_key(KEYS["limited"]), "models": ["fake-model"]},
                {"name": "capped", "sha256": hash_key(KEYS["capped"]), "limits": {"requests_per_minute": 2}},
                {"name": "burst", "sha256": hash_key(KEYS["burst"]), "limits": {"requests_per_minute": 1}},
            ],
            "max_body_bytes": 4096,
            "timeouts": {"first_token_s": 1.0},
            "routing": {"health_interval_s": 60},
            "logs": {"file": str(tmp / "requests.jsonl")},
        }
        gateway = spawn_gateway(tmp, "gateway", config)
        procs.append(gateway)
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        yield Cluster(gateway, a, b, victim, tmp / "requests.jsonl")
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Shared by the tests that leave every process running."""
    with _start_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of its own, for a test that kills upstreams."""
    with _start_cluster(tmp_path) as running:
        yield running


def _without_usage_event(sse: bytes) -> bytes:
    events = sse.replace(b"\r\n", b"\n").split(b"\n\n")
    sep = b"\r\n\r\n" if b"\r\n" in sse else b"\n\n"
    raw_events = [e + sep for e in sse.split(sep) if e]
    keep = []
    for raw, e in zip(raw_events, [e for e in events if e], strict=True):
        obj = json.loads(e[6:]) if e.startswith(b"data: {") else None
        if obj is None or "usage" not in obj:
            keep.append(raw)  # exact bytes
        elif obj.get("choices") != []:  # "usage": null removed, the chunk re-encoded; the usage chunk dropped
            keep.append(
                b"data: " + msgspec.json.encode({k: v for k, v in obj.items() if k != "usage"}) + b"\n\n"
            )
    return b"".join(keep)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("include_usage", [False, True])
def test_sse_bytes_equal_the_upstream_under_random_rechunking(
    cluster: Cluster, seed: int, include_usage: bool
) -> None:
    rid = f"bytes-{seed}-{include_usage}"
    body = {
        "model": "fake-model",
        "messages": HI,
        "stream": True,
        "max_tokens": 12,
        "n": 2,
        "fake": {"rechunk_seed": seed, "crlf": seed == 3},
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with (
        cluster.client() as c,
        c.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": rid}) as r,
    ):
        received = b"".join(r.iter_raw())
    upstream = cluster.upstream_record(rid)["sse"].encode("latin-1")
    assert len(upstream) > 1000
    expected = upstream if include_usage else _without_usage_event(upstream)
    assert received == expected
    if not include_usage:
        assert len(expected) < len(upstream)
    # the events went to the client past the ASGI send chain (gateway/server.py write_body_chunk), and the log
    # line still counts every body byte the client got
    records = wait_until(
        lambda: (found := records_by_id(cluster.log, [rid]))[rid] and found, 10, "its log line"
    )
    assert records[rid][0]["http"]["response"]["body"]["bytes"] == len(received)


def _token_events(data: bytes) -> int:
    return data.count(b'"content":"t')


def _disconnected(cluster: Cluster, rid: str, timeout_s: float = 30.0) -> dict:
    """The upstream's record of ``rid`` once it saw the client leave (``timeout_s`` bounds a broken run)."""
    return wait_until(
        lambda: (rec := cluster.upstream_record(rid))["disconnected_at"] is not None and rec,
        timeout_s,
        f"the upstream seeing {rid}'s client leave",
    )


def test_client_disconnect_reaches_the_upstream(cluster: Cluster) -> None:
    """L1/L2 at the gateway: a stream closed after 5 tokens (the upstream holds token 5 for good, gate
    ``dc-stream/5``), and a non-streaming request abandoned after 0.5 s (the upstream holds its answer, gate
    ``dc-json/0``): the upstream sees each disconnect while it still waits, never before the client left; one
    log line each names the phase. (Both clocks are CLOCK_MONOTONIC, shared by the processes.)"""
    for i in range(5):
        httpx.post(cluster.victim.url + "/_fake/release", json={"name": f"dc-stream/{i}"}).raise_for_status()
    with cluster.client() as c:
        with c.stream(
            "POST",
            "/v1/chat/completions",
            headers={"x-request-id": "dc-stream"},
            json={
                "model": "victim-model",
                "messages": HI,
                "stream": True,
                "max_tokens": 4000,
                "fake": {"hold": "dc-stream"},
            },
        ) as resp:
            seen = b""
            for piece in resp.iter_raw():
                seen += piece
                if _token_events(seen) >= 5:
                    # taken before the break: leaving the loop finalises iter_raw's generator, which already
                    # closes the connection (httpcore closes on GeneratorExit), before any line after the loop
                    closing_at = time.monotonic()
                    break
        sent_at = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            c.post(
                "/v1/chat/completions",
                headers={"x-request-id": "dc-json"},
                timeout=0.5,
                json={"model": "fake-model", "messages": HI, "fake": {"hold": "dc-json"}},
            )
    # the stream is closed after closing_at (the 5th token's arrival); the read timeout cannot give up before
    # sent_at + 0.5 s (1 ms: rounding)
    for rid, left_at in (("dc-stream", closing_at), ("dc-json", sent_at + 0.5 - 1e-3)):
        rec = _disconnected(cluster, rid)
        assert rec["disconnected_at"] is not None and not rec["completed"], (rid, rec)
        assert rec["disconnected_at"] > left_at, (rid, rec["disconnected_at"], left_at)
    records = records_by_id(cluster.log, ["dc-stream", "dc-json"])
    stream_rec, json_rec = records["dc-stream"], records["dc-json"]
    assert len(stream_rec) == 1 and len(json_rec) == 1, records
    assert (
        stream_rec[0]["kvscope"]["client_disconnected"]
        and stream_rec[0]["kvscope"]["disconnect_phase"] == "decode"
    )
    assert stream_rec[0]["gen_ai"]["usage"]["output_tokens"] == 5
    assert (
        stream_rec[0]["http"]["response"]["status_code"] == 200
        and stream_rec[0]["event"]["outcome"] == "unknown"
    )
    assert json_rec[0]["kvscope"]["disconnect_phase"] == "response"
    assert json_rec[0]["http"]["response"]["status_code"] == 499
    assert json_rec[0]["error"]["type"] == "client_disconnected"


def test_auth_and_limit_errors(cluster: Cluster) -> None:
    base = cluster.gateway.url + "/v1"
    limited_before = sample(cluster.metrics(), "kvscope_gateway_rate_limited_total", reason="requests")
    with (
        openai.OpenAI(base_url=base, api_key="sk-nope", max_retries=0) as nope,
        pytest.raises(openai.AuthenticationError) as unauth,
    ):
        nope.chat.completions.create(model="fake-model", messages=HI)
    assert unauth.value.status_code == 401 and unauth.value.body["code"] == "invalid_api_key"
    with (
        openai.OpenAI(base_url=base, api_key=KEYS["limited"], max_retries=0) as limited,
        pytest.raises(openai.PermissionDeniedError) as denied,
    ):
        limited.chat.completions.create(model="victim-model", messages=HI)
    assert denied.value.body["param"] == "model"
    with cluster.client() as c:
        big = c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": [{"role": "user", "content": "x" * 5000}]},
        )
        assert big.status_code == 413 and big.json()["error"]["message"].endswith("the limit is 4096 bytes.")
    with openai.OpenAI(base_url=base, api_key=KEYS["capped"], max_retries=0) as capped:
        ok = [
            capped.chat.completions.with_raw_response.create(model="fake-model", messages=HI)
            for _ in range(2)
        ]
        assert [r.headers["x-ratelimit-remaining-requests"] for r in ok] == ["1", "0"]
        with pytest.raises(openai.RateLimitError) as limited_err:
            capped.chat.completions.create(model="fake-model", messages=HI)
    headers = limited_err.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 30 and headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert limited_err.value.body["type"] == "rate_limit_error"
    assert (
        sample(cluster.metrics(), "kvscope_gateway_rate_limited_total", reason="requests")
        == limited_before + 1
    )


FIRST_TOKEN_DELAY_S = 0.2
"""Imposed on the measured requests (``fake.first_token_delay_s``): a floor under TTFT and e2e."""


def _measure_stream(c: httpx.Client, rid: str, tokens: int) -> dict[str, float]:
    """One stream to the victim (0.1 s between tokens), timed by the client: ``start`` (before sending),
    ``token1`` (the piece holding the second token arrived), ``tokens``."""
    start, token1 = time.monotonic(), None
    with c.stream(
        "POST",
        "/v1/chat/completions",
        headers={"x-request-id": rid},
        json={
            "model": "victim-model",
            "messages": HI,
            "stream": True,
            "max_tokens": tokens,
            "fake": {"first_token_delay_s": FIRST_TOKEN_DELAY_S},
        },
    ) as r:
        seen = b""
        for piece in r.iter_raw():
            seen += piece
            if token1 is None and _token_events(seen) >= 2:
                token1 = time.monotonic()
    return {"start": start, "token1": token1, "tokens": tokens}


def _logged(cluster: Cluster, rid: str) -> tuple[dict, float]:
    """The log record of ``rid`` and the client's time once it was found (after the gateway's end stamp)."""
    record = records_by_id(cluster.log, [rid])[rid][0]
    return record, time.monotonic()


def test_log_lines_match_client_measurements_and_metrics(cluster: Cluster) -> None:
    """One line per request for each outcome; every field present; TTFT/e2e inside what the client measured
    around the same request, and exactly what went into the histograms.

    Bounds that load can only widen: TTFT is at least the imposed first-token delay and less than the client's
    send → second token (the gateway stamps the first token before it forwards the next); e2e is at least the
    imposed delays (first token + 0.1 s per later token) and at most the client's send → log line found."""
    with cluster.client("burst") as burst:  # its one request per minute, so the next one is refused
        assert (
            burst.post("/v1/chat/completions", json={"model": "fake-model", "messages": HI}).status_code
            == 200
        )
    before = cluster.metrics()
    measured: dict[str, dict[str, float]] = {}
    with cluster.client() as c, cluster.client("burst") as burst:
        c.get("/healthz")  # the connection is open before timing starts
        for i in range(4):
            rid = f"log-stream-{i}"
            measured[rid] = _measure_stream(c, rid, 3 + i)
            measured[rid]["logged"] = _logged(cluster, rid)[1]
        start = time.monotonic()
        c.post(
            "/v1/chat/completions",
            json={
                "model": "fake-model",
                "messages": HI,
                "fake": {"first_token_delay_s": FIRST_TOKEN_DELAY_S},
            },
            headers={"x-request-id": "log-json"},
        )
        measured["log-json"] = {"start": start, "logged": _logged(cluster, "log-json")[1]}
        outcomes = {
            "log-400": (c, {"model": "fake-model", "messages": "hi"}, 400),
            "log-404": (c, {"model": "nope", "messages": HI}, 404),
            "log-429": (burst, {"model": "fake-model", "messages": HI}, 429),
            "log-504": (
                c,
                {"model": "fake-model", "prompt": "x", "stream": True, "fake": {"hold": "log-504"}},
                504,
            ),
        }
        for rid, (client, body, status) in outcomes.items():
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            assert client.post(path, json=body, headers={"x-request-id": rid}).status_code == status
        assert (
            httpx.post(
                cluster.gateway.url + "/v1/chat/completions", json={}, headers={"x-request-id": "log-401"}
            ).status_code
            == 401
        )
    ids = [*measured, *outcomes, "log-401"]
    records = records_by_id(cluster.log, ids)
    assert {rid: len(records[rid]) for rid in ids} == dict.fromkeys(ids, 1)
    shape = _key_paths(records["log-json"][0])
    for rid in ids:
        assert _key_paths(records[rid][0]) == shape, rid
        upstream = records[rid][0]["kvscope"]["upstream"]
        for moment in ("arrival", "finish"):  # each sample: null, or always the same keys
            assert upstream["sampled"][moment] is None or set(upstream["sampled"][moment]) == set(SAMPLE_KEYS)
        engine = records[rid][0]["kvscope"]["engine"]  # not our engine's object: null or ENGINE_KEYS
        assert engine is None or list(engine) == list(ENGINE_KEYS), rid
    assert records["log-400"][0]["kvscope"]["upstream"] == {  # refused before it reached an upstream
        "kind": None,
        "kind_source": None,
        "sources": dict.fromkeys(SOURCE_KEYS),
        "sampled": {"arrival": None, "finish": None},
    }
    assert {rid: records[rid][0]["http"]["response"]["status_code"] for rid in [*outcomes, "log-401"]} == {
        "log-400": 400,
        "log-404": 404,
        "log-429": 429,
        "log-504": 504,
        "log-401": 401,
    }
    assert records["log-429"][0]["kvscope"]["rate_limited"] is True
    assert records["log-401"][0]["user"]["id"] is None and records["log-json"][0]["user"]["id"] == "alice"
    streams = [records[rid][0] for rid in measured if rid.startswith("log-stream")]
    for rid, m in measured.items():
        k = records[rid][0]["kvscope"]
        assert k["gateway_overhead_s"] == pytest.approx(k["e2e_s"] - k["upstream_s"], abs=1e-9)
        assert 0 < k["upstream_s"] < k["e2e_s"]
        floor = FIRST_TOKEN_DELAY_S + 0.1 * (m.get("tokens", 1) - 1)
        assert floor <= k["e2e_s"] <= m["logged"] - m["start"], (rid, k, m)
        if "tokens" in m:
            assert FIRST_TOKEN_DELAY_S <= k["ttft_s"] < m["token1"] - m["start"], (rid, k, m)
            tokens = m["tokens"]
            assert records[rid][0]["gen_ai"]["usage"]["output_tokens"] == tokens
            assert k["tpot_s"] == pytest.approx((k["e2e_s"] - k["ttft_s"]) / (tokens - 1), abs=1e-9)
    after = cluster.metrics()

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    victim, chat = {"model": "victim-model"}, {"route": "/v1/chat/completions"}
    assert delta("kvscope_gateway_time_to_first_token_seconds_count", **victim) == len(streams)
    assert delta("kvscope_gateway_time_to_first_token_seconds_sum", **victim) == pytest.approx(
        sum(s["kvscope"]["ttft_s"] for s in streams), abs=1e-9
    )
    assert delta("kvscope_gateway_time_per_output_token_seconds_sum", **victim) == pytest.approx(
        sum(s["kvscope"]["tpot_s"] for s in streams), abs=1e-9
    )
    assert delta("kvscope_gateway_request_duration_seconds_sum", **victim, **chat) == pytest.approx(
        sum(s["kvscope"]["e2e_s"] for s in streams), abs=1e-9
    )
    assert delta("kvscope_gateway_requests_total", **victim, **chat, status="200") == len(streams)
    assert delta("kvscope_gateway_tokens_total", **victim, type="output") == sum(
        s["gen_ai"]["usage"]["output_tokens"] for s in streams
    )
    for status, model, route in (
        ("400", "unknown", "/v1/chat/completions"),
        ("404", "unknown", "/v1/chat/completions"),
        ("429", "fake-model", "/v1/chat/completions"),
        ("504", "fake-model", "/v1/completions"),
        ("401", "unknown", "/v1/chat/completions"),
    ):
        assert delta("kvscope_gateway_requests_total", model=model, route=route, status=status) == 1, status


NULLABLE_OBJECTS = frozenset(
    {"kvscope.engine", "kvscope.upstream.sampled.arrival", "kvscope.upstream.sampled.finish"}
)
"""Record fields that are an object or null (docs/gateway.md "Request log"): one leaf of the shape, whatever
they hold; their own keys are checked apart."""


def _key_paths(obj: dict, prefix: str = "") -> set[str]:
    """Every key path of a log record, :data:`NULLABLE_OBJECTS` as leaves."""
    paths = set()
    for key, value in obj.items():
        path = prefix + key
        nested = isinstance(value, dict) and path not in NULLABLE_OBJECTS
        paths |= _key_paths(value, path + ".") if nested else {path}
    return paths


def test_upstream_killed_mid_stream(own_cluster: Cluster) -> None:
    """S3 at the gateway: the client gets an in-band error and no [DONE]; the log says why."""
    cluster = own_cluster
    with (
        cluster.client() as c,
        c.stream(
            "POST",
            "/v1/chat/completions",
            headers={"x-request-id": "killed"},
            json={"model": "victim-model", "messages": HI, "stream": True, "max_tokens": 1000},
        ) as resp,
    ):
        seen = b""
        for piece in resp.iter_raw():
            seen += piece
            if _token_events(seen) == 3 and cluster.victim.popen.poll() is None:
                cluster.victim.kill()
    events = [e for e in seen.split(b"\n\n") if e.startswith(b"data: ")]
    assert b"[DONE]" not in seen and _token_events(seen) == 3
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_disconnected"
    record = records_by_id(cluster.log, ["killed"])["killed"][0]
    assert (
        record["event"]["outcome"] == "failure"
        and record["kvscope"]["stream_error"] == "upstream_disconnected"
    )
    assert record["gen_ai"]["usage"]["output_tokens"] == 3 and record["log"]["level"] == "error"
    assert record["kvscope"]["attempts"] == 1  # no retry once bytes reached the client
    assert (
        sample(
            cluster.metrics(),
            "kvscope_gateway_stream_errors_total",
            model="victim-model",
            reason="upstream_disconnected",
        )
        == 1
    )


def test_one_replica_down_then_both(own_cluster: Cluster) -> None:
    cluster = own_cluster
    cluster.b.kill()
    with cluster.client() as c:
        ids = [f"failover-{i}" for i in range(8)]
        for rid in ids:
            r = c.post(
                "/v1/chat/completions",
                json={"model": "fake-model", "messages": HI},
                headers={"x-request-id": rid},
            )
            assert (
                r.status_code == 200
                and r.json()["choices"][0]["message"]["content"] == "t0 t1 t2 t3 t4 t5 t6 t7 "
            )
        records = records_by_id(cluster.log, ids)
        assert {records[rid][0]["server"]["address"] for rid in ids} == {cluster.a.url}
        # the health check is slow (60 s): the one request that tried b first was retried on a
        assert sorted(records[rid][0]["kvscope"]["attempts"] for rid in ids) == [1] * 7 + [2]
        up = {
            dict(k[1])["upstream"]: (dict(k[1])["kind"], v)
            for k, v in cluster.metrics().items()
            if k[0] == "kvscope_gateway_upstream_up"
        }
        assert (up["a"], up["b"]) == (("kvscope", 1), ("kvscope", 0))
        cluster.a.kill()
        down = c.post("/v1/chat/completions", json={"model": "fake-model", "messages": HI})
        assert down.status_code == 503 and down.json()["error"]["code"] == "upstream_unavailable"
        assert down.headers["retry-after"] == "60"
        ready = c.get("/readyz")  # with a key: the per-model map is shown to key holders only
        assert ready.status_code == 503 and ready.json()["models"]["fake-model"] is False


@pytest.mark.parametrize("keepalive_s", [0.25, 10.0])
def test_keepalives_and_the_idle_timeout_after_tokens_relayed_directly(
    tmp_path: Path, keepalive_s: float
) -> None:
    """Through a real uvicorn the relay writes token events from the upstream connection's callback
    (gateway/proxy/relay.py ``_offer``), with one timer per quiet spell instead of one per chunk: fifteen
    tokens 0.1 s apart (1.5 s, longer than the idle timeout: a deadline taken before they came must not end
    the stream), then a stall: keep-alive comments every 0.25 s (none when the interval is 10 s) and the idle
    timeout (0.8 s after the last chunk) ends the stream in-band, no earlier and — although the relay task
    last set its timer while waiting for the first token (first-token timeout 5 s) — not later either."""
    fake = spawn_fake(tmp_path, "idle", token_delay_s=0.1)
    procs = [fake]
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        gateway = spawn_gateway(
            tmp_path,
            "gateway",
            {
                "upstreams": [{"url": fake.url}],
                "logs": {"file": str(tmp_path / "requests.jsonl")},
                "timeouts": {"first_token_s": 5.0, "idle_s": 0.8, "keepalive_s": keepalive_s},
            },
        )
        procs.append(gateway)
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        for i in range(15):  # fifteen tokens; the next is held for good
            httpx.post(fake.url + "/_fake/release", json={"name": f"idle/{i}"}).raise_for_status()
        arrivals: list[tuple[float, bytes]] = []
        with (
            httpx.Client(base_url=gateway.url, timeout=30) as c,
            c.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": "fake-model",
                    "messages": HI,
                    "stream": True,
                    "max_tokens": 50,
                    "fake": {"hold": "idle"},
                },
            ) as r,
        ):
            buffer = b""
            for piece in r.iter_raw():
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    arrivals.append((time.monotonic(), event))
        tokens = [t for t, e in arrivals if b'"content":"t' in e]
        keepalives = [t for t, e in arrivals if e == b": keep-alive" and t > tokens[-1]]
        error = json.loads(arrivals[-1][1][len(b"data: ") :])["error"]
        assert len(tokens) == 15 and error["code"] == "upstream_timeout"
        assert error["message"] == "upstream sent nothing for 0.8s"
        if keepalive_s < 1:
            assert (
                2 <= len(keepalives) <= 4
            )  # at 0.25, 0.5, 0.75 s after the last token (scheduling may merge)
        else:
            assert keepalives == []
        assert 0.8 - 0.01 <= arrivals[-1][0] - tokens[-1] < 3.0
    finally:
        for proc in procs:
            proc.stop()
