"""The Elasticsearch ``_id`` is the gateway's own ``event.id``, not the client's ``x-request-id`` (issue
15.1).

Two requests with the same ``x-request-id`` through the in-process gateway yield two documents in the
Elasticsearch double, both with that ``http.request.id``; replaying the same records from a spool (a crash
after shipping) yields no extra document and counts them as duplicates."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvscope.gateway.logs.elasticsearch import ElasticsearchSink
from kvscope.gateway.logs.spool import Spool
from kvscope.testing.es_double import EsDouble
from kvscope.testing.harness import LoopThread, read_log
from kvscope.testing.wait import wait_until
from tests.gateway.conftest import KEYS, build_stack
from tests.gateway.logs.helpers import fast_config


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.stop()


def docs(loop: LoopThread, es: EsDouble) -> dict[str, Any]:
    async def snapshot() -> dict[str, Any]:
        return dict(es.docs())

    return loop.run(snapshot())


def wait_docs(loop: LoopThread, es: EsDouble, n: int, timeout_s: float = 20.0) -> dict[str, Any]:
    def enough() -> dict[str, Any] | None:
        got = docs(loop, es)
        return got if len(got) >= n else None

    return wait_until(enough, timeout_s, f"{n} documents indexed")


def test_reused_request_id_gives_two_documents_and_a_replay_none_extra(
    tmp_path: Path, loop: LoopThread
) -> None:
    es = loop.run(EsDouble(major=9).__aenter__())
    logs = {
        "file": str(tmp_path / "requests.jsonl"),
        "elasticsearch": {"hosts": [es.url], "spool_dir": str(tmp_path / "spool"), "flush_interval_s": 0.02},
    }
    gateway, fakes, _ = build_stack(loop, tmp_path, logs=logs)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {KEYS['alice']}", "x-request-id": "same-id-1"}
    try:
        with gateway:
            for _ in range(2):
                resp = httpx.post(
                    gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=10
                )
                assert resp.status_code == 200 and resp.headers["x-request-id"] == "same-id-1"
            indexed = wait_docs(loop, es, 2)
        records = read_log(tmp_path / "requests.jsonl", 2)
        assert len(indexed) == 2
        assert sorted(indexed) == sorted(r["event"]["id"] for r in records)
        assert [d["http"]["request"]["id"] for d in indexed.values()] == ["same-id-1", "same-id-1"]
        assert loop.run(_count_statuses(es)) == {201: 2}

        # a crash after shipping: the same records are still in a spool and get replayed
        replay_dir = tmp_path / "replay"
        spool = Spool(fast_config(replay_dir, es.url).spool)
        assert spool.append(records).appended == 2
        spool.close()
        stats = asyncio.run(_replay(replay_dir, es.url))
        assert (stats.shipped, stats.duplicates, stats.replayed, stats.failed) == (2, 2, 2, 0)
        assert sorted(docs(loop, es)) == sorted(indexed)
        assert loop.run(_count_statuses(es)) == {201: 2, 409: 2}
    finally:
        for fake in fakes.values():
            loop.run(fake.close())
        loop.run(es.__aexit__(None, None, None))


async def _count_statuses(es: EsDouble) -> dict[int, int]:
    return dict(es.item_statuses)


async def _replay(spool_dir: Path, url: str) -> Any:
    sink = ElasticsearchSink(fast_config(spool_dir, url))
    await sink.start()
    assert await sink.wait_idle(20)
    await sink.aclose()
    return sink.stats
