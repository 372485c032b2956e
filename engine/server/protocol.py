"""OpenAI request/response bodies as msgspec Structs (the HTTP boundary).

Requests are decoded strictly (:func:`decode_body`): unknown fields are ignored, wrong types and values
outside the ``Meta`` ranges raise :class:`msgspec.ValidationError`, which the server answers with 400 naming
``param``. Field names and ranges follow the OpenAI API reference, plus vLLM's sampling extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from kvscope.engine.core.stats import KvscopeStats
from kvscope.engine.sampling_params import MAX_LOGPROBS

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
N = Annotated[int, Meta(ge=1, le=128)]


class StreamOptions(Struct):
    include_usage: bool | None = False


class JsonSchemaFormat(Struct):
    """OpenAI ``response_format.json_schema``."""

    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    """OpenAI ``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(Struct):
    """vLLM's ``structured_outputs`` (one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(Struct):
    """Constrained decoding (engine/server/structured.py turns these into one StructuredOutputsParams):
    OpenAI ``response_format``, vLLM ``structured_outputs`` and vLLM's legacy ``guided_*`` fields."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class SamplingFields(StructuredFields):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    n: N | None = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Unit | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    logit_bias: dict[str, Bias] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    max_tokens: PosInt | None = None
    min_tokens: NonNegInt | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    """OpenAI's processing tier (engine/server/scheduling.py: flex is batch work, priority interactive)."""
    priority: int | None = None
    """vLLM's scheduling priority: inside a tier, lower is earlier (default 0)."""


class TextPart(Struct, tag_field="type", tag="text"):
    text: str


class FunctionCall(Struct):
    name: str
    arguments: str
    """JSON text of the arguments object (OpenAI sends a string)."""


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's calls (conversation input)."""
    tool_call_id: str | None = None
    """A ``role: tool`` message answers this call."""


class FunctionDefinition(Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Struct):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the deprecated ``max_tokens``;
    without either the completion may use the rest of the context."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool | None = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    """None (absent) = one call for ``tool_choice: "required"`` (engine/server/tools.py says why)."""


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids or a list of token-id
    lists. ``max_tokens`` defaults to 16 as in the OpenAI API."""

    prompt: str | list[str | int | list[int]]
    logprobs: NumLogprobs | None = None
    echo: bool | None = False
    best_of: int | None = None
    """Refused above ``n`` (server-side best-of-n is not implemented; vLLM v1 refuses it too), never
    ignored."""
    suffix: str | None = None
    """Refused when non-empty (insertion after a suffix is not implemented), never ignored."""


class TokenizeRequest(Struct):
    """``POST /tokenize`` (vLLM): either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Struct):
    model: str | None = None
    tokens: list[NonNegInt] = msgspec.field(default_factory=list)


# --- responses ----------------------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    service_tier: str | UnsetType = UNSET
    """The tier that served it (``priority``, ``default``, ``flex``), when the request named one (OpenAI's
    field)."""
    kvscope: KvscopeStats | UnsetType = UNSET


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(Struct, omit_defaults=True):
    """A streamed tool call: the first delta has ``index``, ``id``, ``type`` and ``function.name``; later ones
    ``index`` and ``function.arguments`` fragments (OpenAI's streaming shape)."""

    index: int
    function: DeltaFunctionCall
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class DeltaMessage(Struct, omit_defaults=True):
    role: str | UnsetType = UNSET
    content: str | None | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    service_tier: str | UnsetType = UNSET
    """As ChatCompletionResponse.service_tier, on every chunk."""
    usage: Usage | None | UnsetType = UNSET
    kvscope: KvscopeStats | UnsetType = UNSET


class CompletionLogprobs(Struct):
    """OpenAI's legacy completions logprobs (parallel lists; the first echoed prompt token has None)."""

    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "text_completion"
    kvscope: KvscopeStats | UnsetType = UNSET


class ModelFormatInfo(Struct):
    """The ``kvscope`` field of a model card: the weight format served and its memory (an extension, as vLLM
    adds ``max_model_len``/``root`` to OpenAI's card)."""

    dtype: str
    """Weights/activations dtype as loaded (float32, bfloat16)."""
    quantization: str
    """none, int8, int4 or gguf."""
    weights_bytes: int
    """Bytes of weights held (compact and dense packed copies)."""
    kv_cache_bytes: int
    rss_bytes: int
    """Process resident set size when the engine was built."""
    reason: str
    """Why this format (the start-up probe's scores and the verification source, or the flags)."""
    cpu_kernels: str = ""
    """Which CPU kernels run the compact weights (``kvscope (fused decode up to N rows)``, ``torch``…)."""
    block_size: int = 0
    """Tokens per KV-cache block (vLLM's ``cache_config.block_size``): the gateway's cache-aware routing
    hashes prompts in it."""
    num_gpu_blocks: int = 0
    """KV-cache blocks (vLLM's ``cache_config.num_gpu_blocks``, whatever the device): the prefix capacity the
    gateway's routing index remembers per replica."""
    instance_id: str = ""
    """New at every server start: a change tells the gateway the replica restarted with an empty cache."""


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    """The context length the server enforces (prompt + completion tokens)."""
    object: str = "model"
    owned_by: str = "kvscope"
    root: str | None = None
    kvscope: ModelFormatInfo | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET


class DetokenizeResponse(Struct):
    prompt: str


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


class ErrorWithStats(ErrorResponse):
    """An error body with the request's ``kvscope`` object beside ``error`` (admission's 503: the
    prediction that refused it)."""

    kvscope: KvscopeStats


def decode_body(body: bytes, request_type: type[Struct]) -> Any:
    """Strictly decode a JSON body into ``request_type``.

    Raises msgspec.DecodeError (not JSON, invalid UTF-8, nesting too deep) or msgspec.ValidationError (wrong
    type, out of range, missing field).
    """
    try:
        return msgspec.json.decode(body, type=request_type, strict=True)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise msgspec.DecodeError(f"{type(exc).__name__}: {exc}") from None
