"""Typed gateway errors and their OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}``.

Errors are raised as exceptions inside the gateway and turned into responses only at the edge: by the
Litestar exception handlers below (before a response started) or in-band as an SSE ``data: {"error": …}``
event (after a stream started). Litestar's own errors (404, 405, 413, parse/validation) are mapped to the same
shape, so a client never sees plain text or a 500 for a bad request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from kvscope.common.openai_errors import INVALID_JSON, INVALID_VALUE, default_code, error_body, error_type

_log = logging.getLogger("kvscope.gateway")


class GatewayError(Exception):
    """An error with an HTTP status and an OpenAI error body. ``headers`` go on the response. Its ``type``
    follows from the status (:func:`kvscope.common.openai_errors.error_type`, the vocabulary the engine
    speaks too)."""

    status = 500
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        """The OpenAI error ``type`` of :attr:`status`."""
        return error_type(self.status)

    @property
    def error_type(self) -> str:
        """Value for the log's ``error.type``: the code when there is one, else the type."""
        return self.code or self.type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(GatewayError):
    """A 400 ``invalid_request_error``. ``code`` ``invalid_value`` unless it names another: a body the schema
    refuses, a bad prompt, a key's max_tokens ceiling; a body that is not JSON says ``invalid_json``
    (:class:`InvalidJson`), as the engine answers the same mistakes. Never a null code: docs/gateway.md says
    ``code`` always names the error. The log's ``error.type`` is the code (as for every gateway error)."""

    status, code = 400, INVALID_VALUE


class InvalidJson(InvalidRequest):
    """A body that is not JSON (or not UTF-8, or nested beyond reason): 400 ``invalid_json``."""

    code = INVALID_JSON


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(GatewayError):
    status, code = 401, "invalid_api_key"


class PermissionDenied(GatewayError):
    status, code = 403, "model_not_allowed"


class NotFound(GatewayError):
    status, code = 404, "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status, code = 405, "method_not_allowed"


class ClientClosedRequest(GatewayError):
    """The client left before the gateway had its request (e.g. during the body upload): logged and counted
    as 499, nginx's "client closed request"; the response is never seen."""

    status, code = 499, "client_disconnected"


class PayloadTooLarge(GatewayError):
    status, code = 413, "request_too_large"


class RateLimited(GatewayError):
    status, code = 429, "rate_limit_exceeded"

    def __init__(self, message: str, *, reason: str, headers: dict[str, str]) -> None:
        super().__init__(message, headers=headers)
        self.reason = reason
        """``requests``, ``tokens`` or ``concurrency`` (label of ``kvscope_gateway_rate_limited_total``)."""


class UpstreamUnavailable(GatewayError):
    status, code = 503, "upstream_unavailable"


class UpstreamFailed(GatewayError):
    status, code = 502, "upstream_error"


class UpstreamTimeout(GatewayError):
    status, code = 504, "upstream_timeout"


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    """A complete non-200 upstream response, relayed as is (its JSON error) when it is final."""

    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """The upstream's headers the client gets with it (``retry-after``, ``x-ratelimit-*``:
    gateway/proxy/call.py ``RELAYED_ANSWER_HEADERS``)."""


class RetryableFailure(Exception):
    """The attempt failed before any byte reached the client; another replica may take the request."""

    def __init__(
        self,
        error: GatewayError,
        answer: UpstreamAnswer | None = None,
        same_replica_ok: bool = False,
        shed: bool = False,
    ):
        super().__init__(error.message)
        self.error, self.answer, self.same_replica_ok = error, answer, same_replica_ok
        self.shed = shed
        """Our engine's admission refused it (503 ``ttft_slo_exceeded``): the replica is overloaded on
        purpose, so the attempt costs none of ``max_attempts`` and every other replica is asked."""

    def retry_after_s(self) -> float:
        """The answer's ``Retry-After`` in seconds (inf when it has none or it is no finite non-negative
        number, RFC 9110 §10.2.3 delta-seconds: ``nan`` or ``-4`` never outbids a real retry time)."""
        for name, value in self.answer.headers if self.answer is not None else ():
            if name.lower() == b"retry-after":
                try:
                    seconds = float(value)
                except ValueError:
                    return math.inf
                return seconds if 0.0 <= seconds < math.inf else math.inf
        return math.inf


def upstream_error_object(status: int, body: bytes) -> tuple[dict[str, Any], bool]:
    """(the OpenAI error object, whether the body already was one) of an upstream's non-2xx answer: its own
    ``error`` object when the body is JSON holding one, else the body's text (first 1,000 characters) wrapped
    with the type of its status (``server_error`` for a 5xx)."""
    try:
        error = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        return error, True
    text = body.decode("utf-8", "replace")[:1000] or f"upstream answered {status}"
    return error_body(text, error_type(status))["error"], False


def upstream_error_code(error: Mapping[str, Any]) -> str | None:
    """What names an upstream's error object in the log's ``error.type``: its ``code`` when that is a word
    (OpenAI's ``context_length_exceeded``), else its ``type`` (llama.cpp's ``exceed_context_size_error``,
    vLLM's ``BadRequestError``: both put the HTTP status, a number, in ``code``), else the code as text; None
    when it has neither."""
    code, kind = error.get("code"), error.get("type")
    for value in (code, kind):
        if isinstance(value, str) and value:
            return value
    return None if code is None else str(code)


def upstream_gateway_error(error: dict[str, Any]) -> GatewayError:
    """The GatewayError an upstream's error object stands for in the log (``error.type`` =
    :func:`upstream_error_code`)."""
    return GatewayError(str(error.get("message")), code=upstream_error_code(error))


def error_json(err: GatewayError) -> bytes:
    return msgspec.json.encode(err.body())


def from_http_exception(exc: HTTPException) -> GatewayError:
    """Litestar's HTTPException (404, 405, 413, validation …) as a GatewayError of the same status; its code
    is
    :func:`kvscope.common.openai_errors.default_code` (never null), as the engine's."""
    err = GatewayError(str(exc.detail))
    err.status = exc.status_code
    err.code = default_code(exc.status_code)
    return err


def _record(request: Request, err: GatewayError) -> None:
    ctx = request.scope.get("state", {}).get("kvscope_ctx")
    if ctx is not None:
        ctx.outcome.set_error(err)


def gateway_error_handler(request: Request, exc: GatewayError) -> Response:
    _record(request, exc)
    return Response(
        content=exc.body(), status_code=exc.status, headers=exc.headers, media_type="application/json"
    )


def http_exception_handler(request: Request, exc: HTTPException) -> Response:
    return gateway_error_handler(request, from_http_exception(exc))


def internal_error_handler(request: Request, exc: Exception) -> Response:
    _log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    err = GatewayError(f"internal gateway error ({type(exc).__name__})")
    return gateway_error_handler(request, err)


EXCEPTION_HANDLERS = {
    GatewayError: gateway_error_handler,
    HTTPException: http_exception_handler,
    Exception: internal_error_handler,
}
