"""Two gateway processes sharing one real redis-server enforce one limit together."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from kvscope.gateway.auth import hash_key
from kvscope.gateway.tokenize import estimate_tokens
from kvscope.testing.harness import Proc, spawn_fake, spawn_gateway, spawn_redis, wait_http, wait_port
from tests.conftest import require_tool

pytestmark = pytest.mark.e2e
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, list[Proc]]]:
    """(the fake upstream, two gateways in front of it sharing one redis-server)."""
    require_tool("redis-server")
    tmp = tmp_path_factory.mktemp("redis-shared")
    redis, fake = spawn_redis(tmp), spawn_fake(tmp, "fake")
    procs = [redis, fake]
    try:
        wait_port(redis.port)
        wait_http(fake.url + "/health", proc=fake.popen)
        config = {
            "upstreams": [{"url": fake.url}],
            "redis_url": f"redis://127.0.0.1:{redis.port}/0",
            "api_keys": [
                {"name": "rpm", "sha256": hash_key("sk-rpm"), "limits": {"requests_per_minute": 5}},
                {"name": "conc", "sha256": hash_key("sk-conc"), "limits": {"max_concurrent": 2}},
                {"name": "tpm", "sha256": hash_key("sk-tpm"), "limits": {"tokens_per_minute": 1000}},
            ],
        }
        gws = [spawn_gateway(tmp, f"gw{i}", config) for i in range(2)]
        procs += gws
        for gw in gws:
            wait_http(gw.url + "/readyz", proc=gw.popen)
        yield fake, gws
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def gateways(cluster: tuple[Proc, list[Proc]]) -> list[Proc]:
    return cluster[1]


def test_requests_per_minute_is_shared(gateways: list[Proc]) -> None:
    statuses, remaining = [], []
    for i in range(8):
        resp = httpx.post(
            gateways[i % 2].url + "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI},
            headers={"authorization": "Bearer sk-rpm"},
        )
        statuses.append(resp.status_code)
        remaining.append(resp.headers.get("x-ratelimit-remaining-requests"))
    assert statuses == [200] * 5 + [429] * 3
    assert remaining == ["4", "3", "2", "1", "0", "0", "0", "0"]


def test_concurrency_cap_is_shared(cluster: tuple[Proc, list[Proc]]) -> None:
    """Four requests through both gateways, cap 2: the upstream holds every answer (gate ``conc/0``), so the
    two admitted ones keep their slots until the test has both refusals; then it opens the gate."""
    fake, gateways = cluster

    async def one(i: int) -> int:
        async with httpx.AsyncClient(timeout=60) as c:
            resp = await c.post(
                gateways[i % 2].url + "/v1/chat/completions",
                headers={"authorization": "Bearer sk-conc"},
                json={"model": "fake-model", "messages": HI, "fake": {"hold": "conc"}},
            )
            if resp.status_code == 429:
                assert resp.json()["error"]["message"].startswith(
                    "Rate limit reached for this API key (concurrency)"
                )
            return resp.status_code

    async def run() -> list[int]:
        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        pending, deadline = set(tasks), asyncio.get_running_loop().time() + 30
        while len(pending) > 2 and (left := deadline - asyncio.get_running_loop().time()) > 0:
            _, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        async with httpx.AsyncClient(
            timeout=10
        ) as c:  # the refusals are in (or 30 s passed): let the rest go
            assert (await c.post(fake.url + "/_fake/release", json={"name": "conc/0"})).status_code == 200
        return [await t for t in tasks]

    assert sorted(asyncio.run(run())) == [200, 200, 429, 429]
    after = httpx.post(
        gateways[0].url + "/v1/chat/completions",
        json={"model": "fake-model", "messages": HI},
        headers={"authorization": "Bearer sk-conc"},
    )
    assert after.status_code == 200


def test_n4_tokens_per_minute_holds_without_max_tokens_across_gateways(
    cluster: tuple[Proc, list[Proc]],
) -> None:
    """Serving case N4 on shared Redis limits: a TPM-1000 key sends 10 concurrent streams without
    max_tokens (``ignore_eos``: each would run to the fake's 2,048-token context) through both gateways.
    One is admitted, with the rest of the minute's budget after its prompt injected as max_tokens; nine get
    429. Before, each was charged its prompt alone and all ten ran to the end of the context."""
    fake, gateways = cluster
    httpx.post(fake.url + "/_fake/reset")
    body = {"model": "fake-model", "messages": HI, "stream": True, "ignore_eos": True}

    async def one(i: int) -> int:
        async with httpx.AsyncClient(timeout=120) as c:
            resp = await c.post(
                gateways[i % 2].url + "/v1/chat/completions",
                json=body,
                headers={"authorization": "Bearer sk-tpm"},
            )
            return resp.status_code

    async def run() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(10)))

    assert sorted(asyncio.run(run())) == [200] + [429] * 9
    upstream = [
        r for r in httpx.get(fake.url + "/_fake/requests").json() if r["path"] == "/v1/chat/completions"
    ]
    prompt = estimate_tokens(len(msgspec.json.encode(HI)))  # no tokenizer for fake-model: characters / 4
    assert [r["body"]["max_tokens"] for r in upstream] == [1000 - prompt]
    assert [r["sse"].count('"content":"t') for r in upstream] == [1000 - prompt]
