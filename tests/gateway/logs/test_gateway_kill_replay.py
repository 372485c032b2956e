"""The real gateway process, SIGKILLed while Elasticsearch is down, and a second gateway replaying its spool.

Phases (``x-request-id`` set per request, every other one streamed):

1. Elasticsearch up: ``N`` requests, every record indexed directly, nothing spooled.
2. Elasticsearch down (the double stops listening: connection refused): ``N - TAIL`` requests, then a wait
   until the sink reports all of them spooled (its own ``spooled`` counter: the outage is noticed and those
   records were handed to disk); then ``TAIL`` more at once, and right after the last response the first
   gateway is SIGKILLed while the outage goes on.
3. Elasticsearch back; a second gateway on the same spool directory replays it while serving ``N`` more.

The guarantee, as docs/logs.md ("Spool and fsync policy") states it: a SIGKILLed gateway loses only the
records still in its memory queue. So no record the sink had reported spooled before the tail is lost (the
loss is within the tail), no more are lost than the memory queue held at the last metrics scrape, and every
other request id is indexed exactly once (no 409 either: nothing was sent twice), no spool segment is left,
and ``kvscope_gateway_log_records_total{sink="elasticsearch"}`` of both gateways adds up. Events, not clocks:
how long the memory queue lasts (``SPOOLED_HANDOFF_S``) is checked on the sink's schedule in
test_es_sink.py, and the loss window in milliseconds is measured by ``python bench/spool_loss_window.py``.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvscope.testing.es_double import EsDouble
from kvscope.testing.harness import (
    LoopThread,
    Proc,
    metric_samples,
    sample,
    spawn_fake,
    spawn_gateway,
    wait_http,
)
from kvscope.testing.wait import wait_until
from tests.gateway.logs.helpers import segment_files

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

N = 200
CONCURRENCY = 8
TAIL = 40
"""Outage requests sent after the sink reported the others spooled, just before the SIGKILL: the only ones
that may be lost."""
RECORDS = "kvscope_gateway_log_records_total"


@pytest.fixture
def es_loop() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.stop()


def request_ids(phase: str) -> list[str]:
    return [f"{phase}-{i:04d}" for i in range(N)]


async def _one(client: httpx.AsyncClient, rid: str, stream: bool) -> None:
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": f"hello {rid}"}],
        "max_tokens": 4,
        "stream": stream,
    }
    headers = {"x-request-id": rid}
    if not stream:
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "t0 t1 t2 t3 "
        return
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        raw = await resp.aread()
    assert resp.status_code == 200
    assert raw.endswith(b"data: [DONE]\n\n")


async def send_all(base: str, ids: list[str]) -> None:
    """One request per id (odd positions streamed), ``CONCURRENCY`` at a time."""
    todo = list(enumerate(ids))
    async with httpx.AsyncClient(
        base_url=base, timeout=20, limits=httpx.Limits(max_connections=CONCURRENCY)
    ) as c:

        async def worker() -> None:
            while todo:
                i, rid = todo.pop(0)
                await _one(c, rid, stream=i % 2 == 1)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def sink_metrics(gateway: Proc) -> dict[str, float]:
    """The Elasticsearch sink's outcome counters and the spool-bytes gauge of ``gateway``."""
    samples = metric_samples(httpx.get(gateway.url + "/metrics", timeout=5).text)
    out = {
        o: sample(samples, RECORDS, sink="elasticsearch", outcome=o) for o in ("shipped", "failed", "dropped")
    }
    out["spooled"] = sample(samples, "kvscope_gateway_log_records_spooled_total", sink="elasticsearch")
    out["spool_bytes"] = sample(samples, "kvscope_gateway_log_spool_bytes")
    return out


def wait_metric(gateway: Proc, outcome: str, want: float, timeout_s: float) -> dict[str, float]:
    """:func:`sink_metrics` once ``outcome`` reached ``want``."""
    return wait_until(
        lambda: got if (got := sink_metrics(gateway))[outcome] >= want else None,
        timeout_s,
        f"{outcome} reaching {want:g}",
    )


def read_spool(spool: Path) -> tuple[list[str], int, int]:
    """(request ids of the complete lines, in spool order; lines cut short; bytes) of the spool segments."""
    ids, cut, size = [], 0, 0
    for name in segment_files(spool):
        data = (spool / name).read_bytes()
        size += len(data)
        lines = data.split(b"\n")
        cut += lines[-1] != b""
        ids += [json.loads(line)["http"]["request"]["id"] for line in lines[:-1]]
    return ids, cut, size


def es_state(loop: LoopThread, es: EsDouble) -> tuple[set[str], Counter[str], Counter[int]]:
    """(``http.request.id`` of the indexed documents, successful creates per ``_id``, bulk item statuses),
    read on the double's loop."""

    async def snapshot() -> tuple[set[str], Counter[str], Counter[int]]:
        indexed = {doc["http"]["request"]["id"] for doc in es.docs().values()}
        return indexed, Counter(es.created), Counter(es.item_statuses)

    return loop.run(snapshot())


def wait_indexed(loop: LoopThread, es: EsDouble, ids: set[str], timeout_s: float) -> set[str]:
    """The indexed request ids once they include ``ids``."""
    return wait_until(
        lambda: indexed if ids <= (indexed := es_state(loop, es)[0]) else None,
        timeout_s,
        f"{len(ids)} request ids indexed",
        interval_s=0.05,
    )


def gateway_config(upstream: str, es_url: str, spool: Path) -> dict[str, Any]:
    """Production sink settings (1 s flush, 500-record batches, 0.5 → 30 s backoff); only where it ships."""
    return {
        "upstreams": [{"url": upstream}],
        "routing": {"health_interval_s": 60},
        "logs": {"elasticsearch": {"hosts": [es_url], "spool_dir": str(spool)}},
    }


def test_gateway_sigkilled_mid_outage_replays_every_record_once(tmp_path: Path, es_loop: LoopThread) -> None:
    spool = tmp_path / "spool"
    up, down, after = request_ids("up"), request_ids("down"), request_ids("after")
    es = es_loop.run(EsDouble(major=9).__aenter__())
    procs = [fake := spawn_fake(tmp_path, "upstream")]
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        config = gateway_config(fake.url, es.url, spool)
        procs.append(first := spawn_gateway(tmp_path, "gateway-1", config))
        wait_http(first.url + "/readyz", proc=first.popen)

        asyncio.run(send_all(first.url, up))  # 1. cluster up
        assert wait_indexed(es_loop, es, set(up), 10) == set(up)
        assert wait_metric(first, "shipped", N, 5) == {
            "shipped": N,
            "failed": 0,
            "spooled": 0,
            "dropped": 0,
            "spool_bytes": 0,
        }

        es_loop.run(es.go_down())  # 2. cluster down: the sink notices and spools, then a tail and SIGKILL
        asyncio.run(send_all(first.url, down[:-TAIL]))
        confirmed = wait_metric(first, "spooled", N - TAIL, 30)
        assert confirmed["spooled"] == N - TAIL, confirmed
        asyncio.run(send_all(first.url, down[-TAIL:]))
        at_scrape = sink_metrics(first)
        first.popen.send_signal(signal.SIGKILL)
        assert first.popen.wait(5) == -signal.SIGKILL
        on_disk, cut, spool_bytes = read_spool(spool)

        es_loop.run(es.come_up())  # 3. cluster back, a second gateway on the same spool
        procs.append(second := spawn_gateway(tmp_path, "gateway-2", config))
        wait_http(second.url + "/readyz", proc=second.popen)
        asyncio.run(send_all(second.url, after))
        survivors = set(up) | set(on_disk) | set(after)
        indexed = wait_indexed(es_loop, es, survivors, 15)
        final = wait_metric(second, "shipped", len(on_disk) + N, 5)
        _, created, statuses = es_state(es_loop, es)
    finally:
        for proc in procs:
            proc.stop()
        es_loop.run(es.go_down())

    lost = set(down) - set(on_disk)
    print(
        f"\nSIGKILL mid-outage: {len(lost)} of the last {TAIL} outage records lost (in memory); "
        f"{N - at_scrape['spooled']:.0f} in memory at the last scrape; {len(on_disk)} on disk, "
        f"{cut} line cut short"
    )
    # the first gateway: phase 1 shipped; each outage record on disk at most once
    assert at_scrape["shipped"] == N and at_scrape["failed"] == at_scrape["dropped"] == 0
    assert at_scrape["spooled"] <= len(on_disk) and at_scrape["spool_bytes"] <= spool_bytes
    assert len(on_disk) == len(set(on_disk)) and set(on_disk) <= set(down)
    # the loss is the documented window, the memory queue: nothing the sink had reported spooled is lost, and
    # no more than the queue held at the last scrape
    assert set(down[:-TAIL]) <= set(on_disk)
    assert lost <= set(down[-TAIL:])
    assert len(lost) <= N - at_scrape["spooled"]
    # every other record indexed exactly once, never sent twice; the spool is empty
    assert indexed == set(up + down + after) - lost
    assert set(created.values()) == {1} and len(created) == 3 * N - len(lost)
    assert statuses == Counter({201: 3 * N - len(lost)})
    assert segment_files(spool) == []
    # the second gateway: replayed every complete spooled line plus its own N; a line cut short is `failed`
    assert (final["shipped"], final["failed"], final["dropped"], final["spool_bytes"]) == (
        len(on_disk) + N,
        cut,
        0,
        0,
    )
    assert final["spooled"] <= N  # its own records that arrived during the replay went through the spool
