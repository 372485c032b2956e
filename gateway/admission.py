"""Edge checks of a generation request, in order, before any upstream sees it:

auth (401, the route's guard: gateway/guards.py) → body size (413) → JSON + schema (400) → the client's
``x-kvscope-timeout`` (400) → unknown model (404
``model_not_found``) → key's models (403) → key's ``max_tokens`` ceiling (400) → context length with the
model's tokenizer (400 ``context_length_exceeded``) → a healthy replica exists (503) → rate limits (429, the
lease of gateway/ratelimit_middleware.py). What passes becomes a
:class:`~kvscope.gateway.proxy.plan.ProxyPlan`.

A request without ``max_tokens`` gets one injected when its key has a ``max_tokens`` ceiling or a
tokens-per-minute limit: the upstream's own default (16 for completions, the rest of the context for chat)
capped at the ceiling and at what one minute's token budget leaves after the prompt (:func:`tpm_output_cap`).
The rate-limit charge is the prompt + that max_tokens per choice, so what a key may generate is bounded up
front.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request

from kvscope.common.deadline_header import TIMEOUT_HEADER, parse_timeout
from kvscope.common.openai_errors import clip, context_length_message
from kvscope.gateway.auth import Principal
from kvscope.gateway.body import read_body
from kvscope.gateway.context import RequestContext, context_of
from kvscope.gateway.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, UpstreamUnavailable
from kvscope.gateway.proxy.plan import ProxyPlan
from kvscope.gateway.ratelimit_middleware import lease_of
from kvscope.gateway.routing.prefix import (
    PromptPrefix,
    chat_text,
    completion_text,
    text_prefix,
    token_prefix,
)
from kvscope.gateway.schemas import ChatCompletionRequest, CompletionRequest, decode_object, validate_body
from kvscope.gateway.tokenize import estimate_tokens

if TYPE_CHECKING:
    from kvscope.gateway.state import GatewayState

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default ``max_tokens`` for /v1/completions."""

INLINE_PROMPT_BYTES = 512
"""A request body up to this many bytes has its prompt counted (chat template, tokenizer, prefix blocks) on
the event loop; a longer one in a worker thread, where the tokenizer releases the GIL while it encodes
(:meth:`kvscope.gateway.tokenize.ModelTokenizer.encode_texts`), so that a long prompt never stalls the other
streams (a 1 MB prompt: the loop's longest gap 9.5 ms). The thread's hand-off costs ~90 µs of the loop a
request plus the wake-ups of the thread and of the loop, more than the count of most short prompts (nothing
for a model without a tokenizer); counting 512 bytes with SmolLM2's tokenizer holds the loop 0.3–0.6 ms
(median over body shapes; the worst seen, 1.6 ms: a hundred one-character prompts) on a 2-vCPU AMD EPYC,
2 KiB 1.5–3.4 ms (docs/benchmarks.md "The gateway's CPU per request")."""


@dataclass(frozen=True, slots=True)
class Operation:
    name: str
    """``gen_ai.operation.name``."""
    path: str
    schema: type[ChatCompletionRequest] | type[CompletionRequest]


CHAT = Operation("chat", "/v1/chat/completions", ChatCompletionRequest)
COMPLETION = Operation("text_completion", "/v1/completions", CompletionRequest)


async def admit(gw: GatewayState, request: Request, op: Operation, principal: Principal) -> ProxyPlan:
    """Run the edge checks after authentication (module docstring order) for the caller ``principal``;
    returns the plan for the proxy or raises a GatewayError (400/403/404/413/429/503)."""
    ctx = context_of(request)
    body = await read_body(request, gw.settings.max_body_bytes)
    raw, req = _parse(gw, ctx, body, op)
    timeout_s = client_timeout(request.headers.get(TIMEOUT_HEADER))
    _check_model(gw, ctx, principal, req.model)
    ceiling = _check_ceiling(req, principal.limits.max_tokens)
    max_len = gw.pool.max_model_len(req.model)
    block_size = gw.pool.prefix_block_size(req.model)  # the pool is read here, on the loop, not in the thread
    started = time.perf_counter()
    try:
        if len(body) <= INLINE_PROMPT_BYTES:
            prompt_counts, prefix = _read_prompt(gw, raw, req, block_size, max_len)
        else:  # a long prompt must not stall the loop
            prompt_counts, prefix = await asyncio.to_thread(_read_prompt, gw, raw, req, block_size, max_len)
    finally:
        ctx.request.tokenize_s += time.perf_counter() - started  # kvscope.gateway.tokenize_s
    ctx.request.prompt_tokens = sum(prompt_counts) if prompt_counts is not None else None
    _check_context(max_len, prompt_counts, _completion_budget(req.requested_max_tokens, op), op)
    prompt_estimate = _prompt_estimate(raw, prompt_counts)
    ceiling = _lowest(
        ceiling, tpm_output_cap(principal.limits.tokens_per_minute, prompt_estimate, req.num_choices())
    )
    injected = _injected_max_tokens(ceiling, req, op, max_len, prompt_counts)
    ctx.request.max_tokens = max_tokens = req.requested_max_tokens or injected
    _check_replica(gw, req.model)
    estimate = _token_estimate(req, prompt_estimate, max_tokens)
    await lease_of(request).acquire(gw.limiter, principal, ctx, prompt_estimate, estimate)
    return ProxyPlan(
        path=op.path,
        body=_upstream_body(raw, body, req, injected),
        model=req.model,
        stream=req.streaming,
        include_usage=req.wants_usage,
        expected_choices=req.num_choices(),
        operation=op.name,
        prefix=prefix,
        timeout_s=timeout_s,
    )


def client_timeout(value: str | None) -> float | None:
    """The client's own ``x-kvscope-timeout`` (seconds from arrival; the engine's header, which a client may
    send the gateway too): the request's deadline when shorter than the gateway's total timeout (the engine
    then gets what is left of it and drops the request still queued when it passes). None without one.
    Raises InvalidRequest (400, ``param`` the header) for anything but a positive finite number, as the
    engine answers the same header (kvscope/common/deadline_header.py)."""
    try:
        return parse_timeout(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=TIMEOUT_HEADER) from None


def _parse(
    gw: GatewayState, ctx: RequestContext, body: bytes, op: Operation
) -> tuple[dict[str, Any], ChatCompletionRequest | CompletionRequest]:
    raw = decode_object(body)
    model = raw.get("model")
    ctx.request.model = model if isinstance(model, str) else None  # logged even when validation fails
    req = validate_body(raw, op.schema)
    ctx.request.model, ctx.request.stream = req.model, req.streaming
    ctx.request.max_tokens, ctx.request.temperature = req.requested_max_tokens, req.temperature
    top_p = raw.get("top_p")
    ctx.request.top_p = (
        float(top_p) if isinstance(top_p, int | float) and not isinstance(top_p, bool) else None
    )
    if gw.settings.logs.log_content:
        ctx.request.input_content = raw.get("messages", raw.get("prompt"))
    return raw, req


def _check_model(gw: GatewayState, ctx: RequestContext, principal: Principal, model: str) -> None:
    """404 ``model_not_found`` for a model no upstream serves; 503 with Retry-After instead while an upstream
    has never been reached to say what it serves (clients retry a 503, never a 404); 403 when the key may
    not use it."""
    if not gw.pool.is_served(model):
        if gw.pool.has_unknown_models():
            unreached = gw.pool.unreached()
            why = f" (health checks so far: {'; '.join(unreached)})" if unreached else ""
            raise UpstreamUnavailable(
                f"No upstream has answered yet to say whether it serves model "
                f"'{clip(model)}'; retry shortly.{why}",
                headers={"retry-after": gw.pool.retry_after()},
            )
        raise ModelNotFound(f"The model '{clip(model)}' does not exist or is not served here.", param="model")
    ctx.request.model_served = True
    gw.auth.check_model(principal, model)


def _check_replica(gw: GatewayState, model: str) -> None:
    """503 with Retry-After (the health-check period) when no healthy replica serves ``model``."""
    if not gw.pool.candidates(model):
        raise UpstreamUnavailable(
            f"No healthy upstream serves model '{model}' right now.",
            headers={"retry-after": gw.pool.retry_after()},
        )


def _check_ceiling(req: ChatCompletionRequest | CompletionRequest, ceiling: int | None) -> int | None:
    """400 when max_tokens exceeds the key's ceiling; returns the ceiling (None: the key has none)."""
    requested = req.requested_max_tokens
    if ceiling is not None and requested is not None and requested > ceiling:
        raise InvalidRequest(
            f"{req.max_tokens_param} is {requested}, above this API key's limit of {ceiling}.",
            param=req.max_tokens_param,
        )
    return ceiling


def _injected_max_tokens(
    ceiling: int | None,
    req: ChatCompletionRequest | CompletionRequest,
    op: Operation,
    max_len: int | None,
    counts: list[int] | None,
) -> int | None:
    """max_tokens to add to a request that has none, so the key's ceiling holds without changing what the
    client asked for: the upstream's own default capped at the ceiling — 16 for completions (OpenAI/vLLM),
    the rest of the context for chat (``max_len`` − the longest prompt; the ceiling when either is unknown).
    None when nothing is injected (no ceiling, or the client set max_tokens)."""
    if ceiling is None or req.requested_max_tokens is not None:
        return None
    default = _completion_budget(None, op)
    if default is None and max_len is not None and counts is not None:
        default = max_len - max(counts)
    return ceiling if default is None else max(1, min(ceiling, default))


def _read_prompt(
    gw: GatewayState,
    raw: dict[str, Any],
    req: ChatCompletionRequest | CompletionRequest,
    block_size: int | None,
    max_len: int | None,
) -> tuple[list[int] | None, PromptPrefix | None]:
    """The token count of each prompt (None without a tokenizer) and, with ``block_size`` (the model routes
    cache-aware), the prompt's blocks (gateway/routing/prefix.py: its token ids, else its text), none for a
    prompt longer than ``max_len`` (None: not known)."""
    ids = _prompt_ids(gw, raw, req)
    counts = None if ids is None else [len(i) for i in ids]
    if block_size is None:
        return counts, None
    limit = max_len or math.inf
    if ids:  # a prompt longer than the context is refused, by the context check or the upstream: never cached
        return counts, token_prefix(req.model, ids[0], block_size) if len(ids[0]) <= limit else None
    text = (
        chat_text(raw["messages"], raw.get("tools"))
        if isinstance(req, ChatCompletionRequest)
        else completion_text(raw["prompt"])
    )
    if text is None or estimate_tokens(len(text)) > limit:
        return counts, None
    return counts, text_prefix(req.model, text, block_size)


def _prompt_ids(
    gw: GatewayState, raw: dict[str, Any], req: ChatCompletionRequest | CompletionRequest
) -> list[list[int]] | None:
    if isinstance(req, ChatCompletionRequest):
        if _renders_tools(raw):
            return None  # the engine writes tool signatures/calls into the prompt its own way: it counts them
        ids = gw.counter.chat_ids(req.model, raw["messages"])
        return None if ids is None else [ids]
    return gw.counter.completion_ids(req.model, raw["prompt"])


def _renders_tools(raw: dict[str, Any]) -> bool:
    """Whether the engine renders tools into this chat prompt (tools offered and tool_choice not ``none``, or
    tool calls / tool results in the history): the plain chat template would undercount it, so the gateway
    does not trust its own count (as for a model without a tokenizer) and the engine's check decides."""
    if raw.get("tools") and raw.get("tool_choice") != "none":
        return True
    messages = raw.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages
    )


def _completion_budget(max_tokens: int | None, op: Operation) -> int | None:
    """Tokens the upstream will generate at most: ``max_tokens``, else 16 for completions (the OpenAI/vLLM
    default the upstream applies), else None (chat: the rest of the context)."""
    if max_tokens is None and op is COMPLETION:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return max_tokens


def _check_context(
    max_len: int | None, counts: list[int] | None, max_tokens: int | None, op: Operation
) -> None:
    """400 ``context_length_exceeded`` stating the context length, the prompt and the requested tokens."""
    if max_len is None or counts is None:
        return
    what, param = ("messages", "messages") if op is CHAT else ("prompt", "prompt")
    for prompt in counts:
        if prompt >= max_len if max_tokens is None else prompt + max_tokens > max_len:
            raise ContextLengthExceeded(
                context_length_message(max_len, prompt, max_tokens, what), param=param
            )


def _prompt_estimate(raw: dict[str, Any], counts: list[int] | None) -> int:
    """The request's prompt tokens: counted with the model's tokenizer (all prompts), else characters / 4 of
    the messages or prompt (and of the tools, which the engine renders into the prompt)."""
    if counts is not None:
        return sum(counts)
    chars = len(msgspec.json.encode(raw.get("messages", raw.get("prompt"))))
    if raw.get("tools"):
        chars += len(msgspec.json.encode(raw["tools"]))
    return estimate_tokens(chars)


def tpm_output_cap(tokens_per_minute: int | None, prompt_tokens: int, choices: int) -> int | None:
    """The most completion tokens per choice a request may generate within one minute's token budget:
    ``(tokens_per_minute - prompt_tokens) // choices``, at least 1 (a prompt that alone fills the budget is
    then refused by the limiter as larger than the limit); None when the key has no tokens-per-minute limit.

    Why: a request without ``max_tokens`` may generate up to the rest of the context (8,192 tokens for
    SmolLM2), so charging it only its prompt let a TPM-1000 key run any number of concurrent streams to the
    context's end. Admission injects this cap as ``max_tokens`` when the request names none (the key's
    ``max_tokens`` ceiling works the same way), so the charge taken up front bounds what it can generate."""
    if tokens_per_minute is None:
        return None
    return max(1, (tokens_per_minute - prompt_tokens) // max(1, choices))


def _lowest(*bounds: int | None) -> int | None:
    """The smallest of the bounds given (None: unbounded)."""
    present = [b for b in bounds if b is not None]
    return min(present) if present else None


def _token_estimate(
    req: ChatCompletionRequest | CompletionRequest, prompt: int, max_tokens: int | None
) -> int:
    """Tokens charged up front: the prompt + max_tokens per choice (completions: 16 when absent); settled
    with the real usage at the end. A chat request reaches here without max_tokens only when its key has
    neither a tokens-per-minute limit nor a max_tokens ceiling (otherwise admission injected one), so the
    tokens bucket it would be charged to does not exist."""
    if max_tokens is None and isinstance(req, CompletionRequest):
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    return prompt + (max_tokens or 0) * req.num_choices()


def _upstream_body(
    raw: dict[str, Any],
    body: bytes,
    req: ChatCompletionRequest | CompletionRequest,
    injected_max_tokens: int | None,
) -> bytes:
    """The client's body, plus ``stream_options.include_usage`` on streams and the key's max_tokens ceiling
    when the request had none; the original bytes when nothing changes."""
    changes: dict[str, Any] = {}
    if req.streaming and not req.wants_usage:
        changes["stream_options"] = {**(raw.get("stream_options") or {}), "include_usage": True}
    if injected_max_tokens is not None:
        changes["max_tokens"] = injected_max_tokens
    return msgspec.json.encode({**raw, **changes}) if changes else body
