"""EngineScraper: how often it scrapes (following load), when it gives up (404/501, nothing known, failures in
a row) and starts again (a health transition), the kind probes, and that a hanging /metrics never holds up a
request through the gateway."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvscope.gateway.app import create_app
from kvscope.gateway.engines import scraper as scraper_module
from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.gateway.engines.samples import EngineSample
from kvscope.gateway.engines.scraper import EngineScraper
from kvscope.gateway.metrics import GatewayMetrics
from kvscope.gateway.proxy.upstreams import Replica, UpstreamPool
from kvscope.gateway.settings import RoutingConfig, UpstreamConfig, UpstreamMetricsConfig, load_settings
from kvscope.testing.harness import GatewayThread, LoopThread, start_fake_thread
from kvscope.testing.wait import wait_until

URL = "http://10.0.0.1:8000"
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "upstreams"
VLLM = (FIXTURES / "vllm" / "metrics.txt").read_text()
VLLM_SAMPLE = dict(
    requests_running=5.0, requests_waiting=1.0, kv_cache_usage=0.4125, kv_capacity_tokens=203424
)
LLAMACPP_PROPS = {"default_generation_settings": {"n_ctx": 4096, "params": {}}, "total_slots": 4}
EVERY_TICK = UpstreamMetricsConfig(interval_s=1.0, idle_interval_s=1.0, timeout_s=0.05)

Route = tuple[int, str] | Callable[[httpx.Request], Awaitable[httpx.Response]]


class Clock:
    """The scraper's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Upstream:
    """An httpx MockTransport handler: path → (status, body) or an async answer; counts requests by path."""

    def __init__(self, routes: dict[str, Route]) -> None:
        self.routes = routes
        self.hits: Counter[str] = Counter()
        self.headers: list[httpx.Headers] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.hits[request.url.path] += 1
        self.headers.append(request.headers)
        route = self.routes.get(request.url.path, (404, "not found"))
        if callable(route):
            return await route(request)
        status, body = route
        return httpx.Response(status, text=body)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self))


def pool_of(config: UpstreamConfig | None = None) -> tuple[UpstreamPool, Replica]:
    pool = UpstreamPool(
        [config or UpstreamConfig(url=URL)], [], RoutingConfig(), GatewayMetrics(CollectorRegistry())
    )
    replica = pool.replicas[0]
    pool._set_health(replica, True)
    return pool, replica


def test_acquire_and_release_stamp_activity() -> None:
    pool, replica = pool_of()
    assert replica.last_active_at is None
    pool.acquire(replica)
    started = replica.last_active_at
    assert started is not None
    pool.release(replica)
    assert replica.last_active_at is not None and replica.last_active_at >= started


async def test_the_interval_follows_load() -> None:
    """Idle: every idle_interval_s (15). A request in flight, and for 10 s after the last one ended: every
    interval_s (1). Each scrape's sample replaces the last."""
    pool, replica = pool_of()
    clock = Clock()
    scraper = EngineScraper(UpstreamMetricsConfig(), lambda: pool.replicas, clock)
    upstream = Upstream({"/metrics": (200, VLLM)})
    scraped = []
    async with upstream.client() as client:
        for t in range(51):
            clock.now = 100.0 + t
            if t == 20:  # a request starts ...
                replica.outstanding, replica.last_active_at = 1, clock.now
            if t == 23:  # ... and ends
                replica.outstanding, replica.last_active_at = 0, clock.now
            before = upstream.hits["/metrics"]
            await scraper.scrape_due(client)
            if upstream.hits["/metrics"] > before:
                scraped.append(t)
    assert scraped == [0, 15, *range(20, 33), 47]
    assert replica.engine_sample == EngineSample(147.0, **VLLM_SAMPLE, kind_hint=UpstreamKind.VLLM)
    assert (replica.kind, replica.kind_source) == (UpstreamKind.VLLM, "metrics")


async def test_transient_failures_keep_the_last_sample_and_back_off_never_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 500, a hang past timeout_s and a 503 keep the last sample; from the third in a row the replica,
    though busy, is asked every idle_interval_s (15) instead of every interval_s (1), and a good answer
    brings the busy interval back."""
    pool, replica = pool_of()
    replica.outstanding = 1  # busy: every interval_s when healthy
    clock = Clock()
    scraper = EngineScraper(
        UpstreamMetricsConfig(interval_s=1.0, idle_interval_s=15.0, timeout_s=0.05),
        lambda: pool.replicas,
        clock,
    )
    answers = iter([(200, VLLM), (500, "oops"), "hang", (503, "busy")])
    never = asyncio.Event()

    async def metrics(request: httpx.Request) -> httpx.Response:
        answer = next(answers, (200, VLLM))
        if answer == "hang":
            await never.wait()
        status, body = answer
        return httpx.Response(status, text=body)

    upstream = Upstream({"/metrics": metrics})
    scraped = []
    async with upstream.client() as client:
        with caplog.at_level(logging.WARNING, "kvscope.gateway"):
            for t in range(22):
                clock.now = 100.0 + t
                before = upstream.hits["/metrics"]
                await scraper.scrape_due(client)
                if upstream.hits["/metrics"] > before:
                    scraped.append(t)
                if t == 3:
                    assert replica.engine_sample == EngineSample(
                        100.0, **VLLM_SAMPLE, kind_hint=UpstreamKind.VLLM
                    )
    assert scraped == [0, 1, 2, 3, 18, 19, 20, 21]
    assert replica.engine_sample == EngineSample(121.0, **VLLM_SAMPLE, kind_hint=UpstreamKind.VLLM)
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"upstream {replica.label}: 3 scrapes of /metrics failed in a row (last: ")
    assert message.endswith("); asking every 15s until one succeeds")


async def test_three_unreadable_answers_stop_until_a_health_change(caplog: pytest.LogCaptureFixture) -> None:
    pool, replica = pool_of()
    clock = Clock()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, clock)
    answers = iter(
        [
            (200, VLLM),
            (200, "vllm:num_requests_running{ 1\n"),
            (302, ""),
            (200, "vllm:num_requests_waiting{ 2\n"),
        ]
    )

    async def metrics(request: httpx.Request) -> httpx.Response:
        status, body = next(answers, (200, VLLM))
        return httpx.Response(status, text=body)

    upstream = Upstream({"/metrics": metrics})
    async with upstream.client() as client:
        await scraper.scrape_due(client)
        first = replica.engine_sample
        assert first == EngineSample(100.0, **VLLM_SAMPLE, kind_hint=UpstreamKind.VLLM)
        with caplog.at_level(logging.WARNING, "kvscope.gateway"):
            for t in (1, 2, 3, 4, 5):  # a malformed text, a 302, another malformed text: stopped after 3
                clock.now = 100.0 + t
                await scraper.scrape_due(client)
        assert upstream.hits["/metrics"] == 4 and replica.engine_sample is first
        (message,) = [r.getMessage() for r in caplog.records]
        assert message.startswith(
            f"upstream {replica.label}: 3 answers of /metrics in a row could not be read"
        )
        assert message.endswith("); stopped until its next health change or for 300s")
        pool._set_health(replica, False)  # down ...
        pool._set_health(replica, True)  # ... and up again: a new chance
        clock.now = 106.0
        await scraper.scrape_due(client)
        assert upstream.hits["/metrics"] == 5


@pytest.mark.parametrize("status", [404, 501])
async def test_no_endpoint_stops_at_once_and_the_kind_is_probed(status: int) -> None:
    """llama-server without --metrics answers 501: its /props says llama.cpp (asked once per health
    transition, and not again once something said the kind); from then on its /slots is read (without
    --slots: 501 too, asked once)."""
    pool, replica = pool_of()
    clock = Clock()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, clock)
    upstream = Upstream(
        {
            "/metrics": (status, "no"),
            "/props": (200, json.dumps(LLAMACPP_PROPS)),
            "/slots": (status, "no"),
        }
    )
    async with upstream.client() as client:
        for t in range(3):
            clock.now = 100.0 + t
            await scraper.scrape_due(client)
        assert upstream.hits == {"/metrics": 1, "/info": 1, "/props": 1, "/slots": 1}
        assert (replica.kind, replica.kind_source, replica.engine_sample) == (
            UpstreamKind.LLAMACPP,
            "props",
            None,
        )
        replica.restarted()  # a new instance: its /metrics and /slots are asked again, the kind is known
        clock.now = 110.0
        await scraper.scrape_due(client)
        assert upstream.hits == {"/metrics": 2, "/info": 1, "/props": 1, "/slots": 2}


async def test_a_path_still_missing_at_its_retry_is_not_announced_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain OpenAI server has no /metrics: said once at INFO, not again at every retry."""
    pool, replica = pool_of()
    clock = Clock()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, clock)
    upstream = Upstream({"/metrics": (404, "no")})
    async with upstream.client() as client:
        with caplog.at_level(logging.DEBUG, "kvscope.gateway"):
            for t in (0.0, 1.0, scraper_module.RETRY_STOPPED_S, 2 * scraper_module.RETRY_STOPPED_S):
                clock.now = 100.0 + t
                await scraper.scrape_due(client)
    assert upstream.hits["/metrics"] == 3
    stops = [(r.levelno, r.getMessage()) for r in caplog.records if "nothing to sample" in r.getMessage()]
    message = (
        f"upstream {replica.label}: nothing to sample at /metrics (GET /metrics answered 404); asking again "
        "after its next health change or in 300s"
    )
    assert stops == [(logging.INFO, message), (logging.DEBUG, message), (logging.DEBUG, message)]


LLAMACPP_CARD = {"smollm2-135m": {"id": "smollm2-135m", "owned_by": "llamacpp"}}
LLAMACPP_METRICS = (FIXTURES / "llamacpp" / "metrics_busy.txt").read_text()
LLAMACPP_SLOTS = (FIXTURES / "llamacpp" / "slots_busy.json").read_text()


def llamacpp_pool() -> tuple[UpstreamPool, Replica]:
    pool, replica = pool_of()
    replica.cards = dict(LLAMACPP_CARD)
    replica.evaluate_kind()
    return pool, replica


async def test_llamacpp_slots_fill_what_its_metrics_lack() -> None:
    """The recorded llama-server during a stream: /metrics says 1 busy slot, 0 deferred; /slots (read in the
    same tick) the KV usage (72 + 12 of 2 x 512 tokens) and capacity."""
    pool, replica = llamacpp_pool()
    upstream = Upstream({"/metrics": (200, LLAMACPP_METRICS), "/slots": (200, LLAMACPP_SLOTS)})
    async with upstream.client() as client:
        await EngineScraper(EVERY_TICK, lambda: pool.replicas, Clock()).scrape_due(client)
    assert upstream.hits == {"/metrics": 1, "/slots": 1}
    assert replica.engine_sample == EngineSample(100.0, 1.0, 0.0, 84 / 1024, 1024, UpstreamKind.LLAMACPP)
    assert replica.kv_cache_capacity("smollm2-135m") == (None, 1024)


async def test_llamacpp_without_metrics_is_sampled_from_its_slots() -> None:
    """llama-server's default: no --metrics (501), /slots on: busy slots, KV usage and capacity, no queue."""
    pool, replica = llamacpp_pool()
    clock = Clock()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, clock)
    upstream = Upstream({"/metrics": (501, "no"), "/slots": (200, LLAMACPP_SLOTS)})
    async with upstream.client() as client:
        for t in range(2):
            clock.now = 100.0 + t
            await scraper.scrape_due(client)
    assert upstream.hits == {"/metrics": 1, "/slots": 2}
    assert replica.engine_sample == EngineSample(101.0, 1.0, None, 84 / 1024, 1024)
    assert (replica.kind, replica.kind_source) == (UpstreamKind.LLAMACPP, "models")


async def test_a_failed_slots_read_keeps_its_old_values_and_age() -> None:
    """/metrics answers, /slots fails: the fresh /metrics values, the last KV usage and capacity, and the
    older stamp (the sample is as old as its oldest part)."""
    pool, replica = llamacpp_pool()
    clock = Clock()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, clock)
    slots = iter([(200, LLAMACPP_SLOTS), (500, "oops")])

    async def answer(request: httpx.Request) -> httpx.Response:
        status, body = next(slots)
        return httpx.Response(status, text=body)

    busy = LLAMACPP_METRICS.replace("llamacpp:requests_deferred 0", "llamacpp:requests_deferred 3")
    metrics = iter([(200, LLAMACPP_METRICS), (200, busy)])

    async def metrics_answer(request: httpx.Request) -> httpx.Response:
        status, body = next(metrics)
        return httpx.Response(status, text=body)

    upstream = Upstream({"/metrics": metrics_answer, "/slots": answer})
    async with upstream.client() as client:
        for t in range(2):
            clock.now = 100.0 + t
            await scraper.scrape_due(client)
    assert replica.engine_sample == EngineSample(100.0, 1.0, 3.0, 84 / 1024, 1024, UpstreamKind.LLAMACPP)


async def test_a_stopped_path_is_asked_again_after_a_while_without_a_health_change() -> None:
    """llama-server restarted between two health checks, now with --metrics: no health transition (its cards
    name no instance), and its /metrics stayed unread for good before, so the log lacked the queue depth."""
    pool, replica = llamacpp_pool()
    clock = Clock()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, clock)
    answers = {"/metrics": (501, "no"), "/slots": (200, LLAMACPP_SLOTS)}

    async def metrics(request: httpx.Request) -> httpx.Response:
        status, body = answers["/metrics"]
        return httpx.Response(status, text=body)

    upstream = Upstream({"/metrics": metrics, "/slots": answers["/slots"]})
    async with upstream.client() as client:
        await scraper.scrape_due(client)
        assert replica.engine_sample is not None and replica.engine_sample.requests_waiting is None
        answers["/metrics"] = (200, LLAMACPP_METRICS)  # restarted with --metrics, health never changed
        epoch = replica.health_epoch
        clock.now = 100.0 + scraper_module.RETRY_STOPPED_S - 1
        await scraper.scrape_due(client)
        assert upstream.hits["/metrics"] == 1
        clock.now = 100.0 + scraper_module.RETRY_STOPPED_S
        await scraper.scrape_due(client)
        assert upstream.hits["/metrics"] == 2 and replica.health_epoch == epoch
        assert replica.engine_sample.requests_waiting == 0.0
        clock.now += 1  # read again at the next tick
        await scraper.scrape_due(client)
        assert upstream.hits["/metrics"] == 3


async def test_tgi_info_probe() -> None:
    pool, replica = pool_of(UpstreamConfig(url=URL, metrics_path=None))
    info = {
        "model_id": "meta-llama/Llama-3.1-8B-Instruct",
        "router": "text-generation-router",
        "version": "3.3.6",
    }
    upstream = Upstream({"/info": (200, json.dumps(info))})
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, Clock())
    async with upstream.client() as client:
        await scraper.scrape_due(client)
    assert upstream.hits == {"/info": 1}  # metrics_path null: never /metrics; /info answered: no /props
    assert (replica.kind, replica.kind_source) == (UpstreamKind.TGI, "info")


async def test_an_answer_with_nothing_known_stops() -> None:
    """A plain OpenAI-compatible server answering /metrics with something else (here JSON) is asked once."""
    pool, replica = pool_of()
    clock = Clock()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, clock)
    upstream = Upstream({"/metrics": (200, '{"echo": "/metrics"}')})
    async with upstream.client() as client:
        for t in range(3):
            clock.now = 100.0 + t
            await scraper.scrape_due(client)
    assert upstream.hits == {"/metrics": 1, "/info": 1, "/props": 1}
    assert (replica.kind, replica.kind_source, replica.engine_sample) == (
        UpstreamKind.OPENAI,
        "default",
        None,
    )


async def test_configured_replicas_without_metrics_path_are_never_asked() -> None:
    pool, replica = pool_of(UpstreamConfig(url=URL, kind="openai", metrics_path=None))
    upstream = Upstream({})
    async with upstream.client() as client:
        await EngineScraper(EVERY_TICK, lambda: pool.replicas, Clock()).scrape_due(client)
    assert upstream.hits == {} and (replica.kind, replica.kind_source) == (UpstreamKind.OPENAI, "config")


async def test_unhealthy_replicas_are_not_scraped() -> None:
    pool, replica = pool_of()
    pool._set_health(replica, False)
    upstream = Upstream({"/metrics": (200, VLLM)})
    async with upstream.client() as client:
        await EngineScraper(EVERY_TICK, lambda: pool.replicas, Clock()).scrape_due(client)
    assert upstream.hits == {}


async def test_the_card_kind_picks_the_series_and_auth_is_sent() -> None:
    pool, replica = pool_of(UpstreamConfig(url=URL, api_key="sk-up", metrics_path="/prom"))
    replica.cards = {"m": {"id": "m", "owned_by": "vllm"}}
    replica.evaluate_kind()
    upstream = Upstream({"/prom": (200, VLLM)})
    async with upstream.client() as client:
        await EngineScraper(EVERY_TICK, lambda: pool.replicas, Clock()).scrape_due(client)
    assert upstream.hits == {"/prom": 1}
    assert upstream.headers[0]["authorization"] == "Bearer sk-up"
    assert replica.engine_sample is not None and replica.engine_sample.requests_running == 5.0
    assert replica.kv_cache_capacity("m") == (None, 203424)


async def test_a_configured_kind_its_metrics_contradict_is_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`kind: tgi` in front of a vLLM logged sampled fields that were all null, silently."""
    pool, replica = pool_of(UpstreamConfig(url=URL, name="gpu-a", kind="tgi"))
    clock = Clock()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, clock)
    upstream = Upstream({"/metrics": (200, VLLM)})
    async with upstream.client() as client:
        with caplog.at_level(logging.WARNING, "kvscope.gateway"):
            for t in range(3):
                clock.now = 100.0 + t
                await scraper.scrape_due(client)
    assert upstream.hits["/metrics"] == 3
    assert (replica.kind, replica.kind_source, replica.contradicted_by) == (
        UpstreamKind.TGI,
        "config",
        UpstreamKind.VLLM,
    )
    assert replica.engine_sample == EngineSample(102.0, kind_hint=UpstreamKind.VLLM)
    assert [r.getMessage() for r in caplog.records] == [
        "upstream gpu-a is tgi (from config) but its /metrics names are vllm's: its engine state is not read "
        "(is its kind: right?)"
    ]


async def test_parsing_a_scrape_leaves_the_event_loop_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8 MB /metrics took 0.2 s to scan on the event loop, at every tick, and every request in flight
    waited for it; the parse runs in a worker thread now (a 0.5 s parse here: the loop keeps ticking)."""

    def slow_parse(text: str, kind: object, at: float) -> EngineSample:
        time.sleep(0.5)
        return EngineSample(at, requests_running=1.0)

    monkeypatch.setattr(scraper_module, "sample_from_metrics", slow_parse)
    pool, replica = pool_of()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, Clock())
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            gaps.append(time.perf_counter() - before)

    task = asyncio.create_task(ticker())
    async with Upstream({"/metrics": (200, VLLM)}).client() as client:
        await scraper.scrape_due(client)
    done.set()
    await task
    assert replica.engine_sample == EngineSample(100.0, requests_running=1.0)
    assert len(gaps) >= 10 and max(gaps) < 0.25


async def test_a_pooled_connection_the_upstream_closed_is_tried_once_more() -> None:
    closed = iter([True])

    async def metrics(request: httpx.Request) -> httpx.Response:
        if next(closed, False):
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, text=VLLM)

    pool, replica = pool_of()
    upstream = Upstream({"/metrics": metrics})
    async with upstream.client() as client:
        await EngineScraper(EVERY_TICK, lambda: pool.replicas, Clock()).scrape_due(client)
    assert upstream.hits["/metrics"] == 2
    assert replica.engine_sample == EngineSample(100.0, **VLLM_SAMPLE, kind_hint=UpstreamKind.VLLM)


async def test_an_oversized_answer_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scraper_module, "MAX_BODY_BYTES", 100)
    pool, replica = pool_of()
    upstream = Upstream({"/metrics": (200, VLLM)})
    async with upstream.client() as client:
        await EngineScraper(EVERY_TICK, lambda: pool.replicas, Clock()).scrape_due(client)
    assert upstream.hits["/metrics"] == 1 and replica.engine_sample is None


async def test_replicas_that_left_are_forgotten() -> None:
    pool, replica = pool_of()
    scraper = EngineScraper(EVERY_TICK, lambda: pool.replicas, Clock())
    upstream = Upstream({"/metrics": (200, VLLM)})
    async with upstream.client() as client:
        await scraper.scrape_due(client)
        assert list(scraper._states) == [id(replica)]
        pool.set_upstreams("config", [])  # idle: it leaves at once
        await scraper.scrape_due(client)
    assert scraper._states == {} and upstream.hits["/metrics"] == 1


# --- through the gateway: a hanging /metrics ---------------------------------------------------------------
class HangingMetricsUpstream:
    """A vLLM-like upstream on a socket: /v1/models, a non-streamed chat answer, and a /metrics that answers
    the first scrape and hangs every later one (until the client gives up)."""

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self.scrapes = 0
        self.hanging = 0
        """Scrapes waiting for an answer that will not come."""
        self.hung = threading.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ", 2)
                length = next(
                    (int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length")), 0
                )
                await reader.readexactly(length)
                if path == "/metrics":
                    self.scrapes += 1
                    if self.scrapes > 1:
                        self.hanging += 1
                        self.hung.set()
                        try:
                            await reader.read()  # until the gateway closes the connection
                        finally:
                            self.hanging -= 1
                        return
                    await self._send(writer, 200, VLLM.encode(), "text/plain; version=0.0.4")
                elif path == "/v1/models":
                    body = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "vllm"}]}
                    await self._send(writer, 200, json.dumps(body).encode())
                elif method == "POST" and path == "/v1/chat/completions":
                    await self._send(writer, 200, json.dumps(CHAT_ANSWER).encode())
                else:
                    await self._send(writer, 404, b'{"error": {"message": "no"}}')
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _send(
        writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "application/json"
    ) -> None:
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()


CHAT_ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


@pytest.fixture
def hanging(tmp_path: Path) -> Iterator[tuple[GatewayThread, HangingMetricsUpstream]]:
    loop = LoopThread()
    upstream = HangingMetricsUpstream(loop)
    loop.run(upstream.start())
    settings = load_settings(
        None,
        {
            "upstreams": [{"url": f"http://127.0.0.1:{upstream.port}"}],
            "routing": {"health_interval_s": 60},
            "upstream_metrics": {"interval_s": 2, "idle_interval_s": 2, "timeout_s": 2},
            "logs": {"file": str(tmp_path / "requests.jsonl")},
        },
        env={},
    )
    with GatewayThread(create_app(settings)) as gateway:
        yield gateway, upstream
    loop.run(upstream.close())
    loop.stop()


def test_a_hanging_metrics_endpoint_never_holds_up_a_request(
    hanging: tuple[GatewayThread, HangingMetricsUpstream],
) -> None:
    gateway, upstream = hanging
    replica = gateway.state.pool.replicas[0]
    first = replica.engine_sample  # the startup scrape, before the first request
    assert first is not None and first.requests_running == 5.0 and replica.kind == UpstreamKind.VLLM
    assert replica.kv_cache_capacity("m") == (None, 203424)
    assert upstream.hung.wait(10), "the scraper never asked /metrics again"
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        for _ in range(2):
            resp = client.post(
                "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
            )
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "hi"
            assert upstream.hanging == 1  # answered while the scrape still hangs
    assert replica.engine_sample is first  # the hanging scrape changed nothing


# --- through the gateway: the fake upstream's kinds --------------------------------------------------------
@pytest.fixture
def kinds_loop() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.stop()


def test_each_fake_kind_is_detected_and_sampled_at_start(kinds_loop: LoopThread, tmp_path: Path) -> None:
    """Six protocol-faithful fakes (kvscope/testing/fake_upstream.py ``kind``), idle: each replica's kind, the
    signal that decided it and its first sample, all known before the first request."""
    kinds = ("kvscope", "vllm", "sglang", "llamacpp", "tgi", "openai")
    fakes = {k: start_fake_thread(kinds_loop, (f"m-{k}",), kind=k) for k in kinds}
    settings = load_settings(
        None,
        {
            "upstreams": [{"url": f.url, "name": k} for k, f in fakes.items()],
            "routing": {"health_interval_s": 60},
            "logs": {"file": str(tmp_path / "requests.jsonl")},
        },
        env={},
    )
    with GatewayThread(create_app(settings)) as gateway:
        got = {}
        for r in gateway.state.pool.replicas:
            s = r.engine_sample
            sampled = None if s is None else (s.requests_running, s.requests_waiting, s.kv_capacity_tokens)
            got[r.label] = (r.kind.value, r.kind_source, sampled)
    for fake in fakes.values():
        kinds_loop.run(fake.close())
    assert got == {
        "kvscope": ("kvscope", "models", (0.0, 0.0, None)),  # its card has no kvscope capacity here
        "vllm": ("vllm", "models", (0.0, 0.0, 1024)),  # 64 blocks x 16 tokens (vllm:cache_config_info)
        "sglang": ("sglang", "models", (0.0, 0.0, 1024)),
        "llamacpp": ("llamacpp", "models", (0.0, 0.0, 2048)),  # /slots: one slot of n_ctx 2048
        "tgi": ("tgi", "metrics", (0.0, 0.0, 1024)),  # its card's owned_by is the model id
        "openai": ("openai", "default", None),  # /metrics, /info, /props: 404
    }
    # what each was asked (counted apart from the requests the fakes record: none here)
    assert {k: (dict(f.scrapes), len(f.records)) for k, f in fakes.items()} == {
        "kvscope": ({"/metrics": 1}, 1),  # the one record: the health check's GET /v1/models
        "vllm": ({"/metrics": 1}, 1),
        "sglang": ({"/metrics": 1}, 1),
        "llamacpp": ({"/metrics": 1, "/slots": 1}, 1),
        "tgi": ({"/metrics": 1}, 1),
        "openai": ({"/metrics": 1, "/info": 1, "/props": 1}, 1),
    }


def test_the_sample_follows_the_upstreams_load(kinds_loop: LoopThread, tmp_path: Path) -> None:
    """A vLLM-kind fake with one slot: one request holds it, a second waits; the busy replica is scraped
    every interval_s and its sample says running 1, waiting 1, then 0 and 0 once both finished."""
    fake = start_fake_thread(kinds_loop, ("m",), kind="vllm", slots=1, hold="h")
    settings = load_settings(
        None,
        {
            "upstreams": [{"url": fake.url}],
            "routing": {"health_interval_s": 60},
            "upstream_metrics": {"interval_s": 0.1, "idle_interval_s": 30, "timeout_s": 0.1},
            "logs": {"file": str(tmp_path / "requests.jsonl")},
        },
        env={},
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}

    def sample_becomes(replica: Replica, running: float, waiting: float) -> bool:
        def seen() -> bool:
            s = replica.engine_sample
            return s is not None and (s.requests_running, s.requests_waiting) == (running, waiting)

        return wait_until(seen, 10, f"a sample of {running} running, {waiting} waiting")

    with GatewayThread(create_app(settings)) as gateway, httpx.Client(base_url=gateway.url, timeout=20) as c:
        replica = gateway.state.pool.replicas[0]
        assert replica.engine_sample is not None and replica.engine_sample.requests_running == 0.0
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(c.post, "/v1/chat/completions", json=body) for _ in range(2)]
            assert sample_becomes(replica, 1.0, 1.0)
            fake.release("h/0", "h/1")
            assert [a.result().status_code for a in answers] == [200, 200]
        assert sample_becomes(replica, 0.0, 0.0)
    kinds_loop.run(fake.close())
