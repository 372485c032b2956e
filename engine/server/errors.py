"""Typed errors → OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}`` at the HTTP edge.

Every failure path answers JSON with the proper status: our own :class:`OpenAIError`, engine errors
(:class:`kvscope.engine.errors.InvalidParameterError`, ``PromptTooLongError``, ``EngineDeadError``), msgspec
decode errors, and Litestar's own exceptions (404 route, 405 method, 413 body size, validation). Unknown
exceptions are a 500 ``server_error`` JSON body, never plain text.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from kvscope.common.openai_errors import (
    INVALID_JSON,
    INVALID_VALUE,
    clip,
    context_length_message,
    default_code,
    error_type,
    invalid_json_message,
)
from kvscope.engine.core.stats import KvscopeStats
from kvscope.engine.errors import EngineDeadError, InvalidParameterError, PromptTooLongError
from kvscope.engine.server.protocol import ErrorInfo, ErrorResponse, ErrorWithStats

logger = logging.getLogger(__name__)

_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


class OpenAIError(Exception):
    """An error answered as OpenAI error JSON with ``status``; raised by the serving code. Its ``type``
    follows from the status (:func:`kvscope.common.openai_errors.error_type`, the vocabulary the gateway
    speaks too)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
        kvscope: KvscopeStats | None = None,
    ) -> None:
        super().__init__(message)
        self.kvscope = kvscope
        """The request's ``kvscope`` object, sent beside ``error`` (admission's refusal); None: none."""
        self.status = status
        self.message = message
        self.type = error_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        if self.kvscope is not None:
            return ErrorWithStats(info, self.kvscope)
        return ErrorResponse(info)


def bad_request(message: str, param: str | None = None, code: str = INVALID_VALUE) -> OpenAIError:
    """A 400 ``invalid_request_error``; ``code`` ``invalid_value`` unless it names another."""
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(name: str) -> OpenAIError:
    """404 ``model_not_found`` naming the model asked for (its first ``MAX_ECHOED_CHARS`` characters)."""
    return OpenAIError(
        404, f"The model `{clip(name)}` does not exist.", param="model", code="model_not_found"
    )


def from_msgspec(exc: msgspec.MsgspecError) -> OpenAIError:
    """400 for a body that is not JSON (``code: invalid_json``) or does not match the schema; ``param`` is the
    JSON path of the offending field without ``$.`` (e.g. ``top_logprobs``, ``messages[0].content``)."""
    if isinstance(exc, msgspec.ValidationError):
        message = str(exc)
        found = [
            m.group(1).replace("[...]", "")
            for m in (_PATH.search(message), _MISSING.search(message))
            if m and m.group(1)
        ]
        return bad_request(_clipped(message), param=".".join(found) or None, code="invalid_value")
    return bad_request(invalid_json_message(str(exc)), code=INVALID_JSON)


def _clipped(message: str) -> str:
    """``message`` with what precedes its `` - at `$.path` `` tail cut by ``clip``."""
    head, sep, path = message.rpartition(" - at `")
    head, tail = (head, sep + path) if sep else (message, "")
    return f"{clip(head)}{tail}"


def from_engine(
    exc: Exception, *, prompt_param: str = "messages", renames: dict[str, str] | None = None
) -> OpenAIError:
    """Map engine exceptions: PromptTooLongError → 400 ``context_length_exceeded`` with the real numbers,
    InvalidParameterError → 400 with its ``param`` (renamed to the request's field name), EngineDeadError →
    503. The over-long ``param`` is always the prompt field (``messages``/``prompt``), as OpenAI and the
    gateway name it (kvscope.common.openai_errors.context_length_message words the numbers)."""
    if isinstance(exc, PromptTooLongError):
        message = context_length_message(
            exc.max_model_len,
            exc.num_prompt_tokens,
            exc.max_tokens,
            "messages" if prompt_param == "messages" else "prompt",
        )
        return bad_request(message, param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, InvalidParameterError):
        param = (renames or {}).get(exc.param, exc.param)
        return bad_request(str(exc), param=param, code="invalid_value")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), code="engine_unavailable")
    raise exc


def error_response(error: OpenAIError) -> Response:
    return Response(
        content=msgspec.json.encode(error.body()),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


def note_error(request: Request, error: OpenAIError) -> None:
    """Record the error on the request's access record (see kvscope.engine.server.access_log)."""
    record = request.scope.get("kvscope.access")
    if record is not None:
        record.set_error(error.type, error.message, error.code)


def handle_openai_error(request: Request, exc: OpenAIError) -> Response:
    note_error(request, exc)
    return error_response(exc)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    """Litestar's own exceptions (routing, size limits, its validation) as OpenAI error JSON."""
    status = exc.status_code
    message = exc.detail if isinstance(exc.detail, str) and exc.detail else f"HTTP {status}"
    if status == 404:
        message = f"{request.method} {request.url.path} is not a route of this server."
    error = OpenAIError(status, message, code=default_code(status), headers=dict(exc.headers or {}))
    _log_unrouted(request, error)
    return handle_openai_error(request, error)


def handle_engine_error(request: Request, exc: Exception) -> Response:
    return handle_openai_error(request, from_engine(exc))


def handle_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return handle_openai_error(
        request, OpenAIError(500, f"Internal server error: {type(exc).__name__}", code="internal_error")
    )


def _log_unrouted(request: Request, error: OpenAIError) -> None:
    """Requests that matched no route never pass the access-log middleware: log and count them here."""
    if "kvscope.access" in request.scope:
        return
    hook = request.app.state.get("unrouted_hook")
    if hook is not None:
        hook(request, error)


def exception_handlers() -> dict[Any, Any]:
    """The app's exception handlers (most specific first; Litestar resolves by MRO)."""
    return {
        OpenAIError: handle_openai_error,
        InvalidParameterError: handle_engine_error,
        EngineDeadError: handle_engine_error,
        HTTPException: handle_http_exception,
        Exception: handle_unexpected,
    }
