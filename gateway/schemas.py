"""Request bodies at the HTTP boundary (msgspec Structs), validated lightly.

The gateway checks only what it acts on — model, messages/prompt, max_tokens, n, temperature, stream,
stream_options — and forwards the client's JSON otherwise untouched (extra fields such as ``top_k`` or
``ignore_eos`` reach the upstream). Errors become 400 ``invalid_request_error`` with ``param`` set to the
offending field's path (``messages[0].content``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from kvscope.common.openai_errors import INVALID_VALUE, invalid_json_message
from kvscope.gateway.errors import InvalidJson, InvalidRequest

PositiveInt = Annotated[int, Meta(ge=1)]
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_FIELD = re.compile(r"field `([^`]+)`")
T = TypeVar("T")


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: PositiveInt | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def wants_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def num_choices(self) -> int:
        return self.n or 1


class CompletionRequest(_Common):
    prompt: str | list[Any]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def num_choices(self) -> int:
        prompts = 1 if isinstance(self.prompt, str) or _is_ids(self.prompt) else max(1, len(self.prompt))
        return prompts * (self.n or 1)


def _is_ids(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


EMPTY_PROMPT_LIST = "prompt must not be an empty list."
"""The engine's message for ``prompt: []`` (engine/server/serving_completions.py)."""
EMPTY_PROMPT = "The prompt is empty: it encodes to zero tokens."
"""The engine's message for a prompt of zero tokens (engine/input_processor.py), e.g. ``prompt: [[]]``."""


def check_prompt(prompt: str | list[Any]) -> None:
    """A prompt is a string, a list of strings, a list of token ids or a list of such lists, none of them
    empty. Raises InvalidRequest (400 ``invalid_value``, param ``prompt``) worded as the engine answers the
    same mistake: an empty list (``[]``), an empty token-id array (``[[]]``, ``[[1], []]``), a mix of
    kinds. An empty string (``""``, ``[""]``) is the upstream's to judge (whether it encodes to zero tokens
    is its tokenizer's business; kvscope's engine answers 400 ``invalid_value`` with :data:`EMPTY_PROMPT`)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return
    if not prompt:
        raise InvalidRequest(EMPTY_PROMPT_LIST, param="prompt", code=INVALID_VALUE)
    if all(isinstance(p, str) for p in prompt):
        return
    if all(isinstance(p, list) and (not p or _is_ids(p)) for p in prompt):
        if not all(prompt):
            raise InvalidRequest(EMPTY_PROMPT, param="prompt", code=INVALID_VALUE)
        return
    raise InvalidRequest(
        "prompt must be a string, an array of strings, an array of token ids or an array of "
        "token-id arrays (not a mix).",
        param="prompt",
        code=INVALID_VALUE,
    )


def error_param(message: str) -> str | None:
    """The field path of a msgspec validation message (``messages[0].role``), None for the whole body."""
    path = _PATH.search(message)
    missing = _FIELD.search(message) if "missing required field" in message else None
    parts = [p for p in (path.group(1) if path else "", missing.group(1) if missing else "") if p]
    return ".".join(parts) or None


def decode_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object. Raises InvalidRequest (400) for anything else."""
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        # invalid UTF-8 and absurd nesting are malformed bodies too (400, never 500)
        raise InvalidJson(invalid_json_message(str(exc) or type(exc).__name__)) from None
    if not isinstance(raw, dict):
        raise InvalidRequest("The request body must be a JSON object.", code=INVALID_VALUE)
    return raw


def validate_body(raw: dict[str, Any], schema: type[T]) -> T:
    """The validated Struct of a decoded body. Raises InvalidRequest (400) naming the bad field."""
    try:
        parsed = msgspec.convert(raw, schema)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc), param=error_param(str(exc)), code=INVALID_VALUE) from None
    if isinstance(parsed, CompletionRequest):
        check_prompt(parsed.prompt)
    return parsed
