"""One OpenAI error vocabulary (kvscope/common/openai_errors.py): the engine server and the gateway answer
the same ``type`` for the same status, and word the context-length error with one function."""

from __future__ import annotations

import pytest
from litestar.exceptions import HTTPException

from kvscope.common.openai_errors import context_length_message, error_body, error_type
from kvscope.engine.errors import PromptTooLongError
from kvscope.engine.server.errors import OpenAIError, from_engine
from kvscope.gateway.errors import (
    AuthenticationFailed,
    ClientClosedRequest,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnavailable,
    from_http_exception,
    upstream_error_code,
    upstream_error_object,
    upstream_gateway_error,
)

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


@pytest.mark.parametrize(("status", "expected"), sorted(TYPES.items()))
def test_both_servers_give_a_status_the_same_type(status: int, expected: str) -> None:
    assert error_type(status) == expected
    assert OpenAIError(status, "x").type == expected
    assert from_http_exception(HTTPException(status_code=status, detail="x")).type == expected


def test_gateway_errors_take_their_type_from_their_status() -> None:
    errors = [
        InvalidRequest("x"),
        AuthenticationFailed("x"),
        PermissionDenied("x"),
        NotFound("x"),
        ModelNotFound("x"),
        MethodNotAllowed("x"),
        PayloadTooLarge("x"),
        RateLimited("x", reason="requests", headers={}),
        ClientClosedRequest("x"),
        GatewayError("x"),
        UpstreamFailed("x"),
        UpstreamUnavailable("x"),
        UpstreamTimeout("x"),
    ]
    assert [(e.status, e.body()["error"]["type"], e.code) for e in errors] == [
        (400, "invalid_request_error", "invalid_value"),
        (401, "authentication_error", "invalid_api_key"),
        (403, "permission_error", "model_not_allowed"),
        (404, "invalid_request_error", "not_found"),
        (404, "invalid_request_error", "model_not_found"),
        (405, "invalid_request_error", "method_not_allowed"),
        (413, "invalid_request_error", "request_too_large"),
        (429, "rate_limit_error", "rate_limit_exceeded"),
        (499, "client_closed_request", "client_disconnected"),
        (500, "server_error", "internal_error"),
        (502, "server_error", "upstream_error"),
        (503, "server_error", "upstream_unavailable"),
        (504, "server_error", "upstream_timeout"),
    ]
    assert GatewayError("x").error_type == "internal_error"  # the log's error.type: the code


def test_litestar_errors_get_the_same_default_code_in_both_servers() -> None:
    for status, code in (
        (404, "not_found"),
        (405, "method_not_allowed"),
        (413, "request_too_large"),
        (503, "service_unavailable"),
        (400, "invalid_value"),
        (408, "timeout_error"),
        (415, "invalid_request_error"),
    ):
        assert from_http_exception(HTTPException(status_code=status, detail="x")).code == code


def test_a_non_json_upstream_answer_gets_the_type_of_its_status() -> None:
    assert upstream_error_object(502, b"bad gateway") == (
        error_body("bad gateway", "server_error")["error"],
        False,
    )
    assert upstream_error_object(404, b"") == (
        error_body("upstream answered 404", "invalid_request_error")["error"],
        False,
    )


def test_one_context_length_message_in_openai_wording() -> None:
    assert context_length_message(128, 130, None) == (
        "This model's maximum context length is 128 tokens. However, your messages resulted in 130 tokens. "
        "Please reduce the length of the messages."
    )
    assert context_length_message(128, 100, 50, "prompt") == (
        "This model's maximum context length is 128 tokens. However, you requested 150 tokens (100 in the "
        "prompt, 50 in the completion). Please reduce the length of the prompt or completion."
    )
    engine = from_engine(
        PromptTooLongError(max_model_len=128, num_prompt_tokens=100, max_tokens=50), prompt_param="prompt"
    )
    assert (engine.status, engine.type, engine.code, engine.param, engine.message) == (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "prompt",
        context_length_message(128, 100, 50, "prompt"),
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "messages": [',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
        b"\xff\xfe",
    ],
)
def test_both_servers_answer_a_bad_body_with_the_same_type_code_and_param(body: bytes) -> None:
    """The same mistake gets the same OpenAI error from whichever layer refuses it (gateway at the edge, or
    the engine when called directly): type, code and param; the message starts the same way."""
    import msgspec

    from kvscope.engine.server.errors import from_msgspec
    from kvscope.engine.server.protocol import ChatCompletionRequest as EngineChat
    from kvscope.engine.server.protocol import decode_body
    from kvscope.gateway.errors import InvalidRequest
    from kvscope.gateway.schemas import ChatCompletionRequest as GatewayChat
    from kvscope.gateway.schemas import decode_object, validate_body

    with pytest.raises(InvalidRequest) as gw:
        validate_body(decode_object(body), GatewayChat)
    with pytest.raises(msgspec.MsgspecError) as eng:
        decode_body(body, EngineChat)
    engine, gateway = from_msgspec(eng.value), gw.value.body()["error"]
    assert (gateway["type"], gateway["code"], gateway["param"]) == (engine.type, engine.code, engine.param)
    assert gateway["code"] in ("invalid_json", "invalid_value")
    assert gateway["message"].split(":")[0] == engine.message.split(":")[0]


def test_an_upstream_error_is_logged_by_its_word_not_a_status_number() -> None:
    # OpenAI's code; llama.cpp's and vLLM's bodies (code = the HTTP status as a number); a bare code
    assert upstream_error_code({"code": "context_length_exceeded", "type": "invalid_request_error"}) == (
        "context_length_exceeded"
    )
    assert (
        upstream_error_code({"code": 400, "type": "exceed_context_size_error"}) == "exceed_context_size_error"
    )
    assert upstream_error_code({"code": 400, "type": "BadRequestError", "param": None}) == "BadRequestError"
    assert upstream_error_code({"code": 503}) == "503"
    assert upstream_error_code({"message": "x"}) is None
    assert upstream_gateway_error(
        {"code": 400, "type": "exceed_context_size_error", "message": "m"}
    ).error_type == ("exceed_context_size_error")
