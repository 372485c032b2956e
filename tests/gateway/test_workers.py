"""``kvscope gateway --workers 2`` as real processes in front of a fake upstream (gateway/workers.py): under
concurrent load over 32 connections every request is counted once in the merged ``/metrics`` (counters and
histogram counts added up over the workers) and logged once, whole, in the one request log; both workers
served (``process.pid`` of the records are the supervisor's two children); SIGHUP replaces the workers and
SIGTERM stops them, each time letting an open stream finish; a killed worker is replaced and its counts stay
in the sum; two workers share one Redis rate limit exactly; a taken port and in-memory rate limits are
refused before anything starts."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from kvscope.gateway.auth import hash_key
from kvscope.gateway.settings import load_settings
from kvscope.testing.harness import (
    Proc,
    metric_samples,
    read_log,
    sample,
    spawn_fake,
    spawn_gateway,
    spawn_redis,
    sse_events,
    wait_http,
    wait_port,
)
from kvscope.testing.wait import wait_until
from tests.conftest import require_tool

pytestmark = pytest.mark.e2e
HI = [{"role": "user", "content": "hi"}]
ROUTE = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """The stub upstream (a request's ``fake.hold`` holds its tokens until the test releases them)."""
    proc = spawn_fake(tmp_path_factory.mktemp("fake"), "fake")
    try:
        wait_http(proc.url + "/health", proc=proc.popen)
        yield proc
    finally:
        proc.stop()


def _start(tmp: Path, fake: Proc, **extra: object) -> tuple[Proc, Path]:
    log = tmp / "requests.jsonl"
    config = {"upstreams": [{"url": fake.url, "name": "fake"}], "workers": 2, "logs": {"file": str(log)}}
    gateway = spawn_gateway(tmp, "gateway", {**config, **extra})
    wait_http(gateway.url + "/readyz", proc=gateway.popen)
    # /readyz answers once one worker serves; the supervisor acts on signals once every worker is ready
    wait_until(lambda: " 2 workers on " in gateway.log.read_text(), 60, "every worker ready")
    return gateway, log


def _workers(supervisor: int) -> set[int]:
    """The supervisor's child processes (its workers)."""
    return {int(pid) for pid in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()}


def _stop(gateway: Proc) -> int:
    gateway.popen.send_signal(signal.SIGTERM)
    return gateway.popen.wait(30)


async def _load(url: str, requests: int) -> list[tuple[str, bool, int, int]]:
    """``requests`` requests over up to 32 connections at once, every third one streamed and every fifth one
    for a model nobody serves (404); (request id, streamed, status, completion tokens) of each."""

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, bool, int, int]:
        rid, stream = f"load-{i:03d}", i % 3 == 0
        model = "no-such-model" if i % 5 == 0 else "fake-model"
        body = {"model": model, "messages": HI, "max_tokens": 1 + i % 4, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = await client.post(ROUTE, json=body, headers={"x-request-id": rid})
        if r.status_code != 200:
            return rid, stream, r.status_code, 0
        if not stream:
            return rid, stream, 200, r.json()["usage"]["completion_tokens"]
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        return rid, stream, 200, msgspec.json.decode(events[-2])["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        return await asyncio.gather(*(one(client, i) for i in range(requests)))


def test_two_workers_count_and_log_every_request_once(tmp_path: Path, fake: Proc) -> None:
    gateway, log = _start(tmp_path, fake)
    try:
        workers = _workers(gateway.popen.pid)
        assert len(workers) == 2
        sent = asyncio.run(_load(gateway.url, 150))
        ok = [r for r in sent if r[2] == 200]
        assert len(ok) == 120 and {r[2] for r in sent} == {200, 404}
        records = read_log(log, len(sent))
        m = metric_samples(httpx.get(gateway.url + "/metrics").text)
    finally:
        assert _stop(gateway) == 0
    # the log: one whole record per request, every request, from both workers
    assert sorted(r["http"]["request"]["id"] for r in records) == sorted(r[0] for r in sent)
    status = {r["http"]["request"]["id"]: r["http"]["response"]["status_code"] for r in records}
    assert status == {r[0]: r[2] for r in sent}
    by_worker = Counter(r["process"]["pid"] for r in records)
    assert set(by_worker) == workers  # both served (32 connections hashed over 2 sockets)
    assert sum(by_worker.values()) == 150
    assert log.read_bytes().count(b"\n") == 150
    # /metrics: every worker's counters and histograms added up
    assert sample(m, "kvscope_gateway_requests_total", model="fake-model", route=ROUTE, status="200") == 120
    assert sample(m, "kvscope_gateway_requests_total", model="unknown", route=ROUTE, status="404") == 30
    count = "kvscope_gateway_request_duration_seconds_count"
    assert sample(m, count, model="fake-model", route=ROUTE) == 120
    assert sample(m, count, model="unknown", route=ROUTE) == 30
    streams = sum(1 for r in ok if r[1])
    assert sample(m, "kvscope_gateway_time_to_first_token_seconds_count", model="fake-model") == streams == 40
    inf = sample(
        m, "kvscope_gateway_request_duration_seconds_bucket", model="fake-model", route=ROUTE, le="+Inf"
    )
    assert inf == 120
    output = sum(r[3] for r in ok)
    assert sample(m, "kvscope_gateway_tokens_total", model="fake-model", type="output") == output
    assert output == sum(r["gen_ai"]["usage"]["output_tokens"] or 0 for r in records)
    assert sample(m, "kvscope_gateway_log_records_total", sink="file", outcome="shipped") == 150
    # gauges: in flight added up (0 now), the upstream's up and info once each, not once per worker
    assert sample(m, "kvscope_gateway_in_flight_requests") == 0
    assert sample(m, "kvscope_gateway_upstream_up", upstream="fake", kind="kvscope") == 1
    info = [k for k in m if k[0] == "kvscope_gateway_upstream_info"]
    assert info == [
        (
            "kvscope_gateway_upstream_info",
            (("kind", "kvscope"), ("kind_source", "models"), ("upstream", "fake")),
        )
    ]
    assert m[info[0]] == 1
    assert sample(m, "kvscope_gateway_upstream_outstanding_requests", upstream="fake", kind="kvscope") == 0
    assert m[("process_cpu_seconds_total", ())] > 0


def _release(fake: Proc, gate: str, tokens: range) -> None:
    for i in tokens:
        httpx.post(fake.url + "/_fake/release", json={"name": f"{gate}/{i}"}).raise_for_status()


class HeldStream:
    """A 10-token stream (usage chunk asked for) whose token ``i`` the fake writes only once the test released
    gate ``"{rid}/{i}"``: open while the test signals the gateway."""

    def __init__(self, client: httpx.Client, fake: Proc, rid: str) -> None:
        body = {
            "model": "fake-model",
            "messages": HI,
            "max_tokens": 10,
            "stream": True,
            "stream_options": {"include_usage": True},
            "fake": {"hold": rid},
        }
        self.fake, self.rid = fake, rid
        _release(fake, rid, range(1))
        request = client.build_request("POST", ROUTE, json=body, headers={"x-request-id": rid})
        self.response = client.send(request, stream=True)
        self.lines = self.response.iter_lines()
        self.events = [next(line for line in self.lines if line.startswith("data: "))[6:]]

    def finish(self) -> int:
        """Release the other tokens, read to the end; the completion tokens the usage chunk reports."""
        _release(self.fake, self.rid, range(1, 10))
        self.events += [line[6:] for line in self.lines if line.startswith("data: ")]
        self.response.close()
        assert self.events[-1] == "[DONE]"
        return msgspec.json.decode(self.events[-2])["usage"]["completion_tokens"]


def _refused(url: str) -> bool:
    """Whether a new request to ``url`` goes unserved: the connection refused, or accepted into a listening
    socket's queue that closed before any worker took it (the server disconnects without a response)."""
    try:
        httpx.get(url, timeout=2)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False


def test_reload_and_stop_let_an_open_stream_finish(tmp_path: Path, fake: Proc) -> None:
    gateway, log = _start(tmp_path, fake)
    try:
        before = _workers(gateway.popen.pid)
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            held = HeldStream(client, fake, "reloaded")
            gateway.popen.send_signal(signal.SIGHUP)  # new workers on the same sockets; the old ones drain

            def replaced() -> set[int] | None:
                now = _workers(gateway.popen.pid)
                return now - before if len(now - before) == 2 else None

            after = wait_until(replaced, 60, "two new workers")

            def one_old() -> set[int] | None:  # the old worker that holds the stream; the other exits
                old = _workers(gateway.popen.pid) & before
                return old if len(old) == 1 else None

            draining = wait_until(one_old, 30, "one old worker left")
            assert held.finish() == 10
            wait_until(lambda: _workers(gateway.popen.pid) == after, 30, "the old worker gone")
            # SIGTERM: the workers stop accepting at once, finish the open stream, then all exit with 0
            held = HeldStream(client, fake, "stopped")
            gateway.popen.send_signal(signal.SIGTERM)
            wait_until(lambda: _refused(gateway.url + "/readyz"), 30, "the port closed")
            assert gateway.popen.poll() is None
            assert held.finish() == 10
        assert gateway.popen.wait(30) == 0
    finally:
        gateway.stop()
    records = {r["http"]["request"]["id"]: r for r in read_log(log, 2)}
    assert sorted(records) == ["reloaded", "stopped"]
    assert records["reloaded"]["process"]["pid"] in draining
    assert records["stopped"]["process"]["pid"] in after
    for record in records.values():
        assert record["http"]["response"]["status_code"] == 200
        assert record["gen_ai"]["usage"]["output_tokens"] == 10
        assert record["kvscope"]["client_disconnected"] is False


def test_a_taken_port_fails_before_any_worker_starts(tmp_path: Path, fake: Proc) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-P",
                "-m",
                "kvscope.gateway",
                "--port",
                str(port),
                "--upstream",
                fake.url,
                "--workers",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr


@pytest.mark.parametrize(
    ("limits", "refused"),
    [
        ({"requests_per_minute": 60}, True),
        ({"tokens_per_minute": 1000}, True),
        ({"max_concurrent": 4}, True),
        ({"max_tokens": 100}, False),  # a per-request ceiling: no shared state
    ],
)
def test_workers_refuse_in_memory_rate_limits(limits: dict[str, int], refused: bool) -> None:
    base = {"upstreams": [{"url": "http://127.0.0.1:1"}], "workers": 2}
    if refused:
        with pytest.raises(ValueError, match=r"workers=2 with rate limits needs redis_url \(--redis-url"):
            load_settings(overrides={**base, "default_limits": limits}, env={})
        key = {"name": "k", "sha256": "0" * 64, "limits": limits}
        with pytest.raises(ValueError, match="in-memory limiter is per process"):
            load_settings(overrides={**base, "api_keys": [key]}, env={})
    else:
        assert load_settings(overrides={**base, "default_limits": limits}, env={}).workers == 2
    shared = load_settings(
        overrides={**base, "default_limits": limits, "redis_url": "redis://h:6379/0"}, env={}
    )
    assert (shared.workers, shared.redis_url) == (2, "redis://h:6379/0")
    assert load_settings(overrides={**base, "workers": 1, "default_limits": limits}, env={}).workers == 1


def test_workers_flag_and_env(tmp_path: Path) -> None:
    env = {"KVSCOPE_GATEWAY_WORKERS": "3"}
    assert load_settings(overrides={"upstreams": [{"url": "http://127.0.0.1:1"}]}, env=env).workers == 3
    with pytest.raises(ValueError, match="workers"):
        load_settings(overrides={"upstreams": [{"url": "http://127.0.0.1:1"}], "workers": 0}, env={})


def test_a_killed_worker_is_replaced_and_its_counts_stay(tmp_path: Path, fake: Proc) -> None:
    gateway, log = _start(tmp_path, fake)
    try:
        first = asyncio.run(_load(gateway.url, 40))
        assert len(read_log(log, 40)) == 40  # written before the kill (a killed worker's queue is lost)
        victim = min(_workers(gateway.popen.pid))
        os.kill(victim, signal.SIGKILL)

        def replaced() -> set[int] | None:
            now = _workers(gateway.popen.pid)
            return now if len(now) == 2 and victim not in now else None

        wait_until(replaced, 60, "the killed worker replaced")
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        second = asyncio.run(_load(gateway.url, 40))
        m = metric_samples(httpx.get(gateway.url + "/metrics").text)
        records = read_log(log, 80)
    finally:
        assert _stop(gateway) == 0
    # every request before and after: the dead worker's counters stay in the sum, its gauges leave it
    ok = sum(1 for r in [*first, *second] if r[2] == 200)
    assert ok == 64
    assert sample(m, "kvscope_gateway_requests_total", model="fake-model", route=ROUTE, status="200") == 64
    assert sample(m, "kvscope_gateway_requests_total", model="unknown", route=ROUTE, status="404") == 16
    assert sample(m, "kvscope_gateway_in_flight_requests") == 0
    assert sample(m, "kvscope_gateway_upstream_up", upstream="fake", kind="kvscope") == 1
    assert len(records) == 80 and victim in {r["process"]["pid"] for r in records}


def test_two_workers_share_one_redis_limit(tmp_path: Path, fake: Proc) -> None:
    require_tool("redis-server")
    redis = spawn_redis(tmp_path)
    try:
        wait_port(redis.port)
        key = {"name": "rpm", "sha256": hash_key("sk-rpm"), "limits": {"requests_per_minute": 5}}
        gateway, log = _start(
            tmp_path, fake, redis_url=f"redis://127.0.0.1:{redis.port}/0", api_keys=[key], metrics_public=True
        )
        try:

            async def burst() -> list[int]:
                limits = httpx.Limits(max_connections=12)
                headers = {"authorization": "Bearer sk-rpm"}
                async with httpx.AsyncClient(base_url=gateway.url, limits=limits, headers=headers) as c:
                    body = {"model": "fake-model", "messages": HI, "max_tokens": 1}
                    answers = await asyncio.gather(*(c.post(ROUTE, json=body) for _ in range(12)))
                return [r.status_code for r in answers]

            statuses = asyncio.run(burst())
            m = metric_samples(httpx.get(gateway.url + "/metrics").text)
            records = read_log(log, 12)
        finally:
            assert _stop(gateway) == 0
    finally:
        redis.stop()
    assert sorted(statuses) == [200] * 5 + [429] * 7  # one bucket of 5 for both workers
    assert sample(m, "kvscope_gateway_rate_limited_total", reason="requests") == 7
    assert sorted(r["kvscope"]["rate_limited"] for r in records) == [False] * 5 + [True] * 7


def test_a_reload_that_would_break_the_limits_keeps_the_workers(tmp_path: Path, fake: Proc) -> None:
    gateway, _ = _start(tmp_path, fake)
    try:
        before = _workers(gateway.popen.pid)
        config = tmp_path / "gateway.yaml"
        # in-memory limits with two workers: refused, whatever `workers` the file now says
        text = config.read_text().replace("workers: 2", "workers: 1")
        config.write_text(text + "default_limits: {requests_per_minute: 5}\n")
        gateway.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: "reload refused" in gateway.log.read_text(), 30, "the reload refused")
        assert "workers=2 with rate limits needs redis_url" in gateway.log.read_text()
        assert _workers(gateway.popen.pid) == before
        assert httpx.get(gateway.url + "/readyz").status_code == 200
    finally:
        assert _stop(gateway) == 0
