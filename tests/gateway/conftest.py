"""In-process fixtures: fake upstreams on a background loop and the gateway under uvicorn in a thread, with an
in-memory span exporter and a JSONL request log in a temp folder."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvscope.gateway.app import create_app
from kvscope.gateway.auth import hash_key
from kvscope.gateway.settings import load_settings
from kvscope.testing.fake_upstream import FakeUpstream
from kvscope.testing.harness import GatewayThread, LoopThread, make_tokenizer_dir, start_fake_thread

KEYS = {"alice": "sk-alice", "limited": "sk-limited"}
CONTEXT_LEN = 64


@dataclass
class Stack:
    gateway: GatewayThread
    fakes: dict[str, FakeUpstream]
    exporter: InMemorySpanExporter
    log: Path

    @property
    def url(self) -> str:
        return self.gateway.url

    def client(self, key: str = "alice", **kw: Any) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {KEYS[key]}"}, timeout=10, **kw
        )

    def metrics(self) -> str:
        """The gateway's /metrics, read with alice's key (keys are configured: it needs one that may use every
        model)."""
        return httpx.get(self.url + "/metrics", headers={"authorization": f"Bearer {KEYS['alice']}"}).text


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.stop()


def build_stack(
    loop: LoopThread, tmp: Path, **overrides: Any
) -> tuple[GatewayThread, dict, InMemorySpanExporter]:
    fakes = {
        "main": start_fake_thread(loop, ("fake-model",)),
        "tok": start_fake_thread(loop, ("tok-model",), max_model_len=CONTEXT_LEN),
        "broken": start_fake_thread(loop, ("broken-model",), status=500),
    }
    config = {
        "upstreams": [{"url": f.url} for f in fakes.values()],
        "models": [{"name": "tok-model", "tokenizer": str(make_tokenizer_dir(tmp))}],
        "api_keys": [
            {"name": "alice", "sha256": hash_key(KEYS["alice"])},
            {
                "name": "limited",
                "sha256": hash_key(KEYS["limited"]),
                "models": ["fake-model"],
                "limits": {"max_tokens": 10},
            },
        ],
        "timeouts": {"keepalive_s": 0.3},
        "routing": {"health_interval_s": 60},
        "logs": {"file": str(tmp / "requests.jsonl")},
    }
    exporter = InMemorySpanExporter()
    settings = load_settings(None, {**config, **overrides}, env={})
    return GatewayThread(create_app(settings, span_exporter=exporter)), fakes, exporter


@pytest.fixture
def own_stack(loop: LoopThread, tmp_path: Path) -> Iterator[Stack]:
    """A stack of its own, for a test that changes it (ejects a replica, counts from zero): the module's
    ``stack`` stays as the other tests expect it."""
    gateway, fakes, exporter = build_stack(loop, tmp_path)
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp_path / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    gateway, fakes, exporter = build_stack(loop, tmp)
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())
