"""Fixtures for server tests against the scripted FakeEngine (no model, milliseconds per test)."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from kvscope.engine.server.app import create_app
from kvscope.engine.server.settings import ServerSettings
from kvscope.engine.server.tracing import Tracing
from tests.engine.server.fakes import FakeEngine


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def settings() -> ServerSettings:
    return ServerSettings(sse_keepalive_s=0.05, enable_fault_injection=True)


@pytest.fixture
def app(fake_engine: FakeEngine, spans: InMemorySpanExporter, settings: ServerSettings):
    return create_app(
        settings,
        engine=fake_engine,
        tracing=Tracing("test", spans, batch=False),
        registry=CollectorRegistry(),
    )


@pytest.fixture
def client(app):
    with TestClient(app) as test_client:
        yield test_client


def chat_body(content: str = "hi", **extra) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra}
