"""HTTP routes of the engine server.

Request bodies are decoded strictly by a ``before_request`` hook (:func:`strict_body`): wrong types and values
out of range answer 400 naming ``param`` before the handler runs. The handlers still declare ``data`` with
the request Struct so the OpenAPI schema documents every body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody
from prometheus_client.exposition import choose_encoder

from engine.errors import InvalidParameterError
from engine.server.errors import OpenAIError, from_engine, from_msgspec
from engine.server.logprobs import token_text
from engine.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    decode_body,
)
from engine.server.serving import check_model, server_state
from engine.server.serving_chat import chat_prompt, create_chat_completion
from engine.server.serving_completions import create_completion

BODY_KEY = "kvscope.body"


def strict_body(request_type: type[msgspec.Struct]) -> Callable[[Request], Awaitable[None]]:
    """A before_request hook that decodes the body into ``request_type`` (strict) or raises a 400."""
    async def hook(request: Request) -> None:
        try:
            request.scope[BODY_KEY] = decode_body(await request.body(), request_type)  # type: ignore[literal-required]
        except msgspec.MsgspecError as exc:
            raise from_msgspec(exc) from exc

    return hook


def _documented(body: type[msgspec.Struct], chunk: str) -> dict[int, ResponseSpec]:
    """OpenAPI responses of a generation route (the handlers return raw Responses)."""
    error = "OpenAI error JSON: {error: {message, type, param, code}}"
    return {200: ResponseSpec(body, description=f"JSON body; with stream=true an SSE stream of {chunk} chunks "
                              "ending with data: [DONE]"),
            400: ResponseSpec(ErrorResponse, description=error), 404: ResponseSpec(ErrorResponse, description=error),
            429: ResponseSpec(ErrorResponse, description=error), 503: ResponseSpec(ErrorResponse, description=error)}


@post("/v1/chat/completions", status_code=200, before_request=strict_body(ChatCompletionRequest),
      summary="Chat completion (JSON or SSE)",
      responses=_documented(ChatCompletionResponse, "chat.completion.chunk"))
async def chat_completions(request: Request, data: JSONBody[ChatCompletionRequest]) -> Response:
    return await create_chat_completion(server_state(request), request, request.scope[BODY_KEY])  # type: ignore[literal-required]


@post("/v1/completions", status_code=200, before_request=strict_body(CompletionRequest),
      summary="Text completion (JSON or SSE)", responses=_documented(CompletionResponse, "text_completion"))
async def completions(request: Request, data: JSONBody[CompletionRequest]) -> Response:
    return await create_completion(server_state(request), request, request.scope[BODY_KEY])  # type: ignore[literal-required]


@get("/v1/models", summary="The served model and the context length it enforces")
async def models(request: Request) -> ModelList:
    state = server_state(request)
    card = ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len,
                     root=getattr(state.engine.info, "model_dir", None))
    return ModelList(data=[card])


@post("/tokenize", status_code=200, before_request=strict_body(TokenizeRequest), summary="Text or chat → ids")
async def tokenize(request: Request, data: JSONBody[TokenizeRequest]) -> TokenizeResponse:
    state = server_state(request)
    req: TokenizeRequest = request.scope[BODY_KEY]  # type: ignore[literal-required]
    check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "Give exactly one of prompt or messages.", param="prompt")
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
        ids = chat_prompt(state.tokenizer, chat)
    else:
        ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [token_text(state.tokenizer, i)[0] for i in ids] if req.return_token_strs else msgspec.UNSET
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


@post("/detokenize", status_code=200, before_request=strict_body(DetokenizeRequest), summary="Ids → text")
async def detokenize(request: Request, data: JSONBody[DetokenizeRequest]) -> DetokenizeResponse:
    state = server_state(request)
    req: DetokenizeRequest = request.scope[BODY_KEY]  # type: ignore[literal-required]
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
    encode, content_type = choose_encoder(request.headers.get("accept"))  # OpenMetrics when asked for
    # Litestar appends "; charset=utf-8" to text/* media types itself: do not send it twice
    media_type = content_type.removesuffix("; charset=utf-8") if content_type.startswith("text/") else content_type
    return Response(content=encode(registry), media_type=media_type, status_code=200)


ROUTES = [chat_completions, completions, models, tokenize, detokenize, health, metrics]
