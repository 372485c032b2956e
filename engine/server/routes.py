"""HTTP routes of the engine server.

Each request body is decoded once, strictly, straight from the bytes into its Struct (:class:`StrictBody`, the
handlers' Litestar DTO): wrong types and values out of range answer 400 naming ``param`` before the handler
runs. The OpenAPI schema documents ``data`` as the Struct itself.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, get, post
from litestar.dto import AbstractDTO
from litestar.dto.data_structures import DTOFieldDefinition
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody
from litestar.typing import FieldDefinition
from prometheus_client.exposition import choose_encoder

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.server.errors import OpenAIError, from_engine, from_msgspec
from kvscope.engine.server.logprobs import token_text
from kvscope.engine.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelFormatInfo,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    decode_body,
)
from kvscope.engine.server.serving import check_model, server_state
from kvscope.engine.server.serving_chat import chat_prompt, create_chat_completion
from kvscope.engine.server.serving_completions import create_completion

T = TypeVar("T", bound=msgspec.Struct)


class StrictBody(AbstractDTO[T]):
    """Litestar DTO that decodes the body once with :func:`~kvscope.engine.server.protocol.decode_body`
    (strict msgspec, bytes → Struct) and answers a bad body with the 400 of
    :func:`~kvscope.engine.server.errors.from_msgspec`. It has no transfer model: the OpenAPI schema is the
    Struct's own."""

    @classmethod
    def generate_field_definitions(cls, model_type: type[Any]) -> Generator[DTOFieldDefinition, None, None]:
        yield from ()

    @classmethod
    def detect_nested_field(cls, field_definition: FieldDefinition) -> bool:
        return False

    @classmethod
    def create_for_field_definition(
        cls, field_definition: FieldDefinition, handler_id: str, backend_cls: Any = None
    ) -> None:
        """Nothing to build: :meth:`decode_bytes` decodes into the Struct directly."""

    @classmethod
    def create_openapi_schema(
        cls, field_definition: FieldDefinition, handler_id: str, schema_creator: Any
    ) -> Any:
        return schema_creator.for_field_definition(
            FieldDefinition.from_annotation(
                cls.model_type, kwarg_definition=field_definition.kwarg_definition
            )
        )

    def decode_bytes(self, value: bytes) -> T:
        return _decode(value, self.model_type)


def _decode(body: bytes, request_type: type[Any]) -> Any:
    try:
        return decode_body(body, request_type)
    except msgspec.MsgspecError as exc:
        raise from_msgspec(exc) from exc


async def require_body(request: Request) -> None:
    """before_request hook: Litestar hands no DTO an empty body, so answer it here as what it is, a body that
    is not JSON (400 ``invalid_json``, the same answer as any other undecodable body)."""
    if not await request.body():
        _decode(b"", dict)


def _documented(body: type[msgspec.Struct], chunk: str) -> dict[int, ResponseSpec]:
    """OpenAPI responses of a generation route (the handlers return raw Responses)."""
    error = "OpenAI error JSON: {error: {message, type, param, code}}"
    return {
        200: ResponseSpec(
            body,
            description=f"JSON body; with stream=true an SSE stream of {chunk} chunks "
            "ending with data: [DONE]",
        ),
        400: ResponseSpec(ErrorResponse, description=error),
        404: ResponseSpec(ErrorResponse, description=error),
        429: ResponseSpec(ErrorResponse, description=error),
        503: ResponseSpec(ErrorResponse, description=error),
    }


def body_route(path: str, request_type: type[msgspec.Struct], **kwargs: Any) -> Any:
    """``@post`` for a route whose JSON body is ``request_type``, decoded once by :class:`StrictBody`."""
    return post(
        path,
        status_code=200,
        before_request=require_body,
        dto=StrictBody[request_type],
        return_dto=None,
        **kwargs,
    )


@body_route(
    "/v1/chat/completions",
    ChatCompletionRequest,
    summary="Chat completion (JSON or SSE)",
    responses=_documented(ChatCompletionResponse, "chat.completion.chunk"),
)
async def chat_completions(request: Request, data: JSONBody[ChatCompletionRequest]) -> Response:
    return await create_chat_completion(server_state(request), request, data)


@body_route(
    "/v1/completions",
    CompletionRequest,
    summary="Text completion (JSON or SSE)",
    responses=_documented(CompletionResponse, "text_completion"),
)
async def completions(request: Request, data: JSONBody[CompletionRequest]) -> Response:
    return await create_completion(server_state(request), request, data)


@get("/v1/models", summary="The served model and the context length it enforces")
async def models(request: Request) -> ModelList:
    state = server_state(request)
    info = state.engine.info
    card = ModelCard(
        id=state.model_name,
        created=state.created,
        max_model_len=state.max_model_len,
        root=info.model_dir,
        kvscope=ModelFormatInfo(
            dtype=info.dtype,
            quantization=info.quantization,
            weights_bytes=info.weights_bytes,
            kv_cache_bytes=info.kv_cache_bytes,
            rss_bytes=info.rss_bytes,
            reason=info.format_reason,
            cpu_kernels=info.cpu_kernels,
            block_size=info.block_size,
            num_gpu_blocks=info.num_blocks,
            instance_id=state.instance_id,
        ),
    )
    return ModelList(data=[card])


@body_route("/tokenize", TokenizeRequest, summary="Text or chat → ids")
async def tokenize(request: Request, data: JSONBody[TokenizeRequest]) -> TokenizeResponse:
    state, req = server_state(request), data
    check_model(state, req.model)
    if req.messages is not None and req.prompt is None:
        chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
        ids = chat_prompt(state.tokenizer, chat)
    elif req.prompt is not None and req.messages is None:
        ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        raise OpenAIError(400, "Give exactly one of prompt or messages.", param="prompt")
    strs = [token_text(state.tokenizer, i)[0] for i in ids] if req.return_token_strs else msgspec.UNSET
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


@body_route("/detokenize", DetokenizeRequest, summary="Ids → text")
async def detokenize(request: Request, data: JSONBody[DetokenizeRequest]) -> DetokenizeResponse:
    state, req = server_state(request), data
    check_model(state, req.model)
    vocab = state.tokenizer.vocab_size
    if any(t >= vocab for t in req.tokens):
        raise from_engine(InvalidParameterError("tokens", f"Token ids must be in [0, {vocab - 1}]."))
    return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens))


@get("/health", summary="200 once the model is loaded and warmed up; 503 while stopping or after a failure")
async def health(request: Request) -> Response:
    state = server_state(request)
    if state.draining or not state.engine.is_running:
        raise OpenAIError(503, "The engine is not running.", code="engine_unavailable")
    return Response(content={"status": "ok", "model": state.model_name}, status_code=200)


@get("/metrics", summary="Prometheus metrics (kvscope_engine_*)")
async def metrics(request: Request) -> Response:
    registry = server_state(request).metrics.registry
    encode, content_type = choose_encoder(request.headers.get("accept", ""))  # OpenMetrics when asked for
    # Litestar appends "; charset=utf-8" to text/* media types itself: do not send it twice
    media_type = (
        content_type.removesuffix("; charset=utf-8") if content_type.startswith("text/") else content_type
    )
    return Response(content=encode(registry), media_type=media_type, status_code=200)


ROUTES = [chat_completions, completions, models, tokenize, detokenize, health, metrics]
