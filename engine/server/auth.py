"""Optional API key of the engine server (``--api-key`` or ``$KVSCOPE_ENGINE_API_KEY``), vLLM-style.

With a key set, every route except ``GET /health`` (liveness, for supervisors and load balancers) needs
``Authorization: Bearer <key>``; anything else is a 401 OpenAI error (``authentication_error`` /
``invalid_api_key``) before the body is read. The presented and the expected key are both hashed with
sha256 and compared with :func:`hmac.compare_digest`, so the time taken depends on neither the key's
length nor on how much of it matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from kvscope.engine.server.errors import OpenAIError

OPEN_PATHS = frozenset({"/health"})
"""Paths served without the key."""


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def key_matches(authorization: str | None, expected_digest: bytes) -> bool:
    """True when ``authorization`` is ``Bearer <key>`` and sha256(key) equals ``expected_digest`` (compared
    in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    presented = _digest(token.strip()) if scheme.lower() == "bearer" and token.strip() else b"\0" * 32
    return hmac.compare_digest(presented, expected_digest)


def api_key_guard(api_key: str) -> Callable[[ASGIConnection, BaseRouteHandler], None]:
    """A Litestar guard: raises a 401 OpenAIError unless the request carries ``api_key`` (or its path is in
    :data:`OPEN_PATHS`)."""
    expected = _digest(api_key)

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if connection.scope["path"] in OPEN_PATHS:
            return
        if not key_matches(connection.headers.get("authorization"), expected):
            raise OpenAIError(
                401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )

    return guard
