"""Fixtures for the request-log tests: an Elasticsearch double per test, quiet client loggers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from kvscope.testing.es_double import EsDouble


@pytest.fixture(autouse=True)
def _quiet_http_loggers() -> None:
    for name in ("elastic_transport", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)


@pytest.fixture
async def es() -> AsyncIterator[EsDouble]:
    """An Elasticsearch 9 double (accepts compatible-with=8 and 9)."""
    async with EsDouble(major=9) as double:
        yield double
