"""The OpenAI error vocabulary both servers speak (a leaf: imports neither engine nor gateway).

Every error answer is ``{"error": {"message", "type", "param", "code"}}``. ``type`` is fixed by the HTTP
status (:func:`error_type`), as OpenAI's API sends it: an unknown route is a 404 ``invalid_request_error``
(``{"message": "Invalid URL (POST /v1/…)", "type": "invalid_request_error", …}``, e.g.
https://github.com/swordintent/chatgpt-web-api/issues/11 and
https://github.com/artificial-julien/docker-nginx-openai-api-cache/issues/2) and an overloaded service a 503
``server_error`` (``"That model is currently overloaded …", "type": "server_error"``,
https://github.com/agi-merge/waggle-dance/issues/53); OpenAI's 5xx bodies all say ``server_error``. The
``code`` says which error it was (``not_found``, ``upstream_timeout``, ``engine_unavailable`` …);
:func:`default_code` is the code of an error that names none (Litestar's own 404/405/413).

Kept from before, where both servers already agreed: 401 ``authentication_error``, 403 ``permission_error``,
429 ``rate_limit_error`` (the names of the openai SDK's exception classes for these statuses); 499 is
nginx's "client closed request", logged and never sent.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

_TYPES = MappingProxyType({
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "invalid_request_error", 405: "invalid_request_error", 408: "timeout_error",
    413: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
})  # fmt: skip
_CODES = MappingProxyType({
    404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 429: "rate_limit_exceeded",
    499: "client_disconnected", 500: "internal_error", 503: "service_unavailable",
})  # fmt: skip


def error_type(status: int) -> str:
    """The OpenAI ``type`` of an error answered with HTTP ``status``: ``server_error`` for every 5xx,
    ``invalid_request_error`` for a 4xx without its own type."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def default_code(status: int) -> str:
    """The ``code`` of an error with HTTP ``status`` that names no code itself, in both servers: the
    status's own (``not_found``, ``request_too_large`` …), ``invalid_value`` for a 400, else the status's
    ``type``. Never null: docs/gateway.md and docs/engine-server.md say ``code`` always names the error."""
    return _CODES.get(status) or (INVALID_VALUE if status == 400 else error_type(status))


CLIENT_CLOSED_REQUEST = 499
"""The status both servers log (and the engine answers) for a client that left before its answer (nginx's
499)."""
INVALID_VALUE = "invalid_value"
"""The ``code`` of a 400 whose body is JSON but a field is wrong (both servers)."""
INVALID_JSON = "invalid_json"
"""The ``code`` of a 400 whose body is not JSON (both servers)."""


MAX_ECHOED_CHARS = 256
"""Longest client-supplied string (a model name, a bad value) echoed in an error message or a log field."""


def clip(value: str | None, limit: int = MAX_ECHOED_CHARS) -> str | None:
    """``value`` cut to ``limit`` characters (marked with ``…[+N chars]``), so a client cannot make one log
    line or error body megabytes long by sending a huge model name, value or User-Agent."""
    if value is None or len(value) <= limit:
        return value
    return f"{value[:limit]}…[+{len(value) - limit} chars]"


def invalid_json_message(detail: str) -> str:
    """The message of a 400 ``invalid_json`` (``detail``: the decoder's own words)."""
    return f"The request body is not valid JSON: {detail}"


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The OpenAI error object ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def context_length_message(
    max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, what: str = "messages"
) -> str:
    """OpenAI's ``context_length_exceeded`` message. ``what`` names the prompt field (``messages`` or
    ``prompt``). Without ``max_tokens``: "However, your messages resulted in N tokens"; with it: "However, you
    requested P + M tokens (P in the messages, M in the completion)" (both OpenAI's wording)."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if max_tokens is None:
        return (
            f"{head}your {what} resulted in {num_prompt_tokens} tokens. "
            f"Please reduce the length of the {what}."
        )
    return (
        f"{head}you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, "
        f"{max_tokens} in the completion). Please reduce the length of the {what} or completion."
    )
