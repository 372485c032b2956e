"""The request log record (docs/gateway.md, "Request log"): one nested JSON object per request, every outcome.

ECS field names where ECS has one, OpenTelemetry ``gen_ai.*`` for model fields, ``kvscope.*`` for the rest.
Every field below is always present (``null`` when it does not apply), so that sinks and index templates see
one stable shape. Never the API key; prompts and completions only with ``log_content`` (then under
``gen_ai.input.messages`` / ``gen_ai.output.messages`` in the OTel GenAI message schema, see
:mod:`kvscope.gateway.logs.genai_messages`).

``ecs.version`` is 9.1.0: the ``gen_ai.*`` field set the record uses is part of ECS from 9.1 (ECS reference,
"Gen AI fields"). ``log.level`` takes Python's level names (``info``, ``warning``, ``error``), the vocabulary
of the engine's log and of ecs-logging-python, so one Kibana filter matches both services.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kvscope.common.openai_errors import clip
from kvscope.gateway.engines.section import engine_section
from kvscope.gateway.logs.genai_messages import input_messages, output_messages
from kvscope.gateway.logs.sink import LogRecord

if TYPE_CHECKING:
    from kvscope.gateway.context import RequestContext

ECS_VERSION = "9.1.0"
MAX_LOGGED_USER_AGENT = 1024
"""Characters of ``user_agent.original`` kept (the ES template's keyword ``ignore_above`` is of this
order)."""
MAX_LOGGED_PATH = 2048
MAX_LOGGED_ERROR = 2048
LOG_LEVELS = ("info", "warning", "error")
"""Every ``log.level`` value a kvscope service writes (gateway and engine alike)."""


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    name: str
    version: str
    node: str
    pid: int | None = None
    """The gateway process that served the request (ECS ``process.pid``): one of the workers of
    ``kvscope gateway --workers N``, or the only one."""


def iso(epoch_s: float, timespec: str = "microseconds") -> str:
    """ISO-8601 UTC with a ``Z`` suffix."""
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


def outcome(ctx: RequestContext) -> str:
    """ECS ``event.outcome``: ``unknown`` for a client disconnect, else failure/success."""
    if ctx.outcome.client_disconnected:
        return "unknown"
    return "failure" if ctx.failed else "success"


def level(ctx: RequestContext) -> str:
    """``error`` for 5xx and broken streams, ``warning`` for 4xx and clients that left, else ``info``."""
    status = ctx.outcome.status or 500
    if status >= 500 or ctx.outcome.stream_error:
        return "error"
    return "warning" if status >= 400 or ctx.outcome.client_disconnected else "info"


class RecordBuilder:
    """Builds the record from a finished :class:`~kvscope.gateway.observe.RequestContext`."""

    def __init__(self, service: ServiceInfo, log_content: bool = False) -> None:
        self.service = service
        self.log_content = log_content

    def build(self, ctx: RequestContext) -> LogRecord:
        end = ctx.outcome.end_at if ctx.outcome.end_at is not None else ctx.start
        duration_s = end - ctx.start
        end_wall = ctx.start_wall + duration_s
        status = ctx.outcome.status or 500
        attempts, answer = ctx.upstream, ctx.answer
        engine, upstream = engine_section(
            attempts.kind,
            attempts.kind_source,
            answer.report,
            answer.engine,
            attempts.arrival_sample,
            attempts.finish_sample,
            ctx.ttft_source,
            ctx.tpot_source,
        )
        ttft, tpot = ctx.ttft_s, ctx.tpot_s
        return {
            "@timestamp": iso(end_wall, "milliseconds"),
            "ecs": {"version": ECS_VERSION},
            "log": {"level": level(ctx), "logger": "kvscope.gateway.access"},
            "message": f"{ctx.method} {clip(ctx.path, MAX_LOGGED_PATH)} {status} "
            f"{clip(ctx.request.model) or '-'} {duration_s:.3f}s",
            "event": {
                "id": ctx.event_id,
                "kind": "event",
                "category": ["web"],
                "type": ["access", "error"] if ctx.failed else ["access"],
                "outcome": outcome(ctx),
                "dataset": "kvscope.gateway",
                "duration": int(duration_s * 1e9),
                "start": iso(ctx.start_wall),
                "end": iso(end_wall),
            },
            "http": {
                "version": ctx.http_version,
                "request": {
                    "id": ctx.request_id,
                    "method": ctx.method,
                    "body": {"bytes": ctx.request.body_bytes},
                },
                "response": {"status_code": status, "body": {"bytes": ctx.outcome.response_bytes}},
            },
            "url": {"path": clip(ctx.path, MAX_LOGGED_PATH)},
            "client": {"ip": ctx.client_ip},
            "user_agent": {"original": clip(ctx.user_agent, MAX_LOGGED_USER_AGENT)},
            "user": {"id": ctx.edge.key_id},
            "server": {"address": ctx.upstream.address},
            "service": {
                "name": self.service.name,
                "version": self.service.version,
                "node": {"name": self.service.node},
            },
            "process": {"pid": self.service.pid},
            "trace": {"id": ctx.trace.trace_id},
            "span": {"id": ctx.trace.span_id},
            "error": {
                "type": ctx.outcome.error_type if ctx.failed or ctx.outcome.client_disconnected else None,
                "message": clip(ctx.outcome.error_message, MAX_LOGGED_ERROR)
                if ctx.failed or ctx.outcome.client_disconnected
                else None,
            },
            "gen_ai": self._gen_ai(ctx),
            "kvscope": {
                "route": ctx.route,
                "ttft_s": ttft if ttft is not None else ctx.reported_ttft_s,
                "tpot_s": tpot if tpot is not None else ctx.reported_tpot_s,
                "e2e_s": duration_s,
                "gateway_overhead_s": ctx.overhead_s,
                "upstream_s": ctx.upstream.total_s,
                "gateway": ctx.gateway_phases(duration_s).to_dict(),
                "engine": engine,
                "upstream": upstream,
                "attempts": ctx.upstream.attempts,
                "client_disconnected": ctx.outcome.client_disconnected,
                "disconnect_phase": ctx.outcome.disconnect_phase,
                "rate_limited": ctx.outcome.rate_limited is not None,
                "rate_limit_reason": ctx.outcome.rate_limited,
                "stream_error": ctx.outcome.stream_error,
                "prompt_tokens_counted": ctx.request.prompt_tokens,
                "routing": _routing(ctx),
            },
        }

    def _gen_ai(self, ctx: RequestContext) -> dict[str, Any]:
        usage = ctx.answer.usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        # without the upstream's usage (the client left, or the stream failed after its first token: the
        # prompt was read), the gateway's own prompt count stands in
        counted = ctx.outcome.client_disconnected or ctx.answer.first_token_at is not None
        input_tokens = usage.get("prompt_tokens", ctx.request.prompt_tokens if counted else None)
        out: dict[str, Any] = {
            "operation": {"name": ctx.edge.operation},
            "request": {
                "model": clip(ctx.request.model),
                "max_tokens": ctx.request.max_tokens,
                "temperature": ctx.request.temperature,
                "stream": ctx.request.stream,
            },
            "response": {
                "id": clip(ctx.answer.response_id),
                "model": ctx.answer.response_model,
                "finish_reasons": ctx.answer.finish_reasons or None,
            },
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": ctx.output_tokens,
                "cache_read": {"input_tokens": cached},
            },
        }
        if self.log_content:
            out["input"] = {"messages": input_messages(ctx.request.input_content)}
            out["output"] = {
                "messages": output_messages(ctx.answer.output_content, ctx.answer.finish_reasons)
            }
        return out


def _routing(ctx: RequestContext) -> dict[str, Any]:
    """``kvscope.routing``: how the last attempt's replica was chosen, and the prompt tokens the router
    predicted it holds in its prefix cache next to those the upstream reported (``cached_tokens``, as
    ``gen_ai.usage.cache_read.input_tokens``); every field null when no replica was chosen (a record has one
    shape whatever the outcome)."""
    routing = ctx.upstream.routing
    usage = ctx.answer.usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {
        "policy": routing and routing.policy,
        "reason": routing and routing.reason,
        "replica": routing and routing.replica,
        "predicted_cached_tokens": routing and routing.predicted_cached_tokens,
        "cached_tokens": cached if routing and isinstance(cached, int) else None,
        "prefix_unit": routing and routing.prefix_unit,
    }
