"""Typed engine errors. The server maps them to OpenAI error JSON at the edge (never here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.common.openai_errors import context_length_message

if TYPE_CHECKING:
    from kvscope.engine.core.admission import Refusal


class InvalidParameterError(ValueError):
    """A request parameter is invalid. ``param`` names it in OpenAI style (e.g. ``"top_logprobs"``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidParameterError):
    """Prompt tokens (+ requested completion tokens) exceed the context length actually enforced. The
    message is OpenAI's (:func:`kvscope.common.openai_errors.context_length_message`); the server words it
    again with the request's field name (``messages`` or ``prompt``)."""

    def __init__(self, *, max_model_len: int, num_prompt_tokens: int, max_tokens: int | None) -> None:
        msg = context_length_message(max_model_len, num_prompt_tokens, max_tokens)
        super().__init__("messages" if max_tokens is None else "max_tokens", msg)
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens


class EngineDeadError(RuntimeError):
    """The engine step loop died; every in-flight request fails with this."""


class AdmissionRefusedError(RuntimeError):
    """Admission (``--ttft-slo``) refused a request before it was queued (its predicted time to first token
    exceeds its tier's objective), or dropped it from the queue later (its first token could no longer come
    within it: ``refusal.waited_s`` is set); engine/core/admission.py. The server answers 503 with
    ``Retry-After``."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal
