"""OTel GenAI attributes of one upstream call, shared by the gen_ai CLIENT span and the ``gen_ai.client.*``
metrics, so both describe the call with the same values.

Source: OpenTelemetry semantic conventions 1.41, "Semantic conventions for generative client AI spans"
(inference span) and "Semantic conventions for generative AI metrics":

- required: ``gen_ai.operation.name`` (``chat`` | ``text_completion``), ``gen_ai.provider.name``;
- conditionally required: ``gen_ai.request.model``, ``server.port`` (when ``server.address`` is set),
  ``error.type`` (when the call ended in an error);
- recommended: ``server.address`` (a host, never a URL), ``gen_ai.request.max_tokens|temperature|top_p``,
  ``gen_ai.response.id|model|finish_reasons``, ``gen_ai.usage.input_tokens|output_tokens``,
  ``gen_ai.usage.cache_read.input_tokens`` (when reported and non-zero), and on streams
  ``gen_ai.response.time_to_first_chunk`` (seconds from the call's start to the first output chunk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from kvscope.gateway.context import RequestContext

_DEFAULT_PORTS = {"http": 80, "https": 443}


def server_host_port(url: str | None) -> tuple[str, int] | None:
    """``(host, port)`` of an upstream base URL (the scheme's default port when the URL names none);
    ``None`` without a URL or host."""
    if not url:
        return None
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    return parts.hostname, parts.port or _DEFAULT_PORTS.get(parts.scheme, 80)


def base_attributes(ctx: RequestContext, provider: str, model: str) -> dict[str, Any]:
    """The attributes a call has from its start: operation, provider, request model and parameters."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": ctx.edge.operation or "chat",
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": model,
    }
    for key, value in (
        ("gen_ai.request.max_tokens", ctx.request.max_tokens),
        ("gen_ai.request.temperature", ctx.request.temperature),
        ("gen_ai.request.top_p", ctx.request.top_p),
    ):
        if value is not None:
            attrs[key] = value
    return attrs


def call_error_type(ctx: RequestContext) -> str | None:
    """``error.type`` of the call: the upstream's error code, a stream error reason or the status code;
    ``None`` for a success or when the client left (the call was cancelled, not failed)."""
    if ctx.outcome.client_disconnected and not ctx.outcome.stream_error:
        return None
    if ctx.outcome.stream_error:
        return ctx.outcome.error_type or ctx.outcome.stream_error
    status = ctx.outcome.status or 500
    return (ctx.outcome.error_type or str(status)) if status >= 400 else None


def server_attributes(ctx: RequestContext) -> dict[str, Any]:
    """``server.address`` (host) and ``server.port`` of the last upstream tried, if any."""
    hp = server_host_port(ctx.upstream.address)
    return {} if hp is None else {"server.address": hp[0], "server.port": hp[1]}


def end_attributes(ctx: RequestContext, call_start: float) -> dict[str, Any]:
    """What the call learnt by its end (``call_start``: ``perf_counter`` seconds when it began)."""
    attrs = server_attributes(ctx)
    if ctx.answer.response_id:
        attrs["gen_ai.response.id"] = ctx.answer.response_id
    if ctx.answer.response_model:
        attrs["gen_ai.response.model"] = ctx.answer.response_model
    if ctx.answer.finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = list(ctx.answer.finish_reasons)
    usage = ctx.answer.usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for key, value in (
        ("gen_ai.usage.input_tokens", usage.get("prompt_tokens")),
        ("gen_ai.usage.output_tokens", ctx.output_tokens),
    ):
        if isinstance(value, int):
            attrs[key] = value
    if isinstance(cached, int) and cached > 0:
        attrs["gen_ai.usage.cache_read.input_tokens"] = cached
    if ctx.answer.first_token_at is not None:
        attrs["gen_ai.response.time_to_first_chunk"] = max(0.0, ctx.answer.first_token_at - call_start)
    error_type = call_error_type(ctx)
    if error_type is not None:
        attrs["error.type"] = error_type
    return attrs
