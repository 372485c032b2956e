"""One streamed OpenAI-compatible request, timed on the client side (httpx, asyncio).

Timing follows ``vllm bench serve`` (vllm/benchmarks/lib/endpoint_request_func.py): the clock starts just
before the request is sent; a *token chunk* is an SSE event whose first choice carries non-empty ``text``
(completions) or ``delta.content`` / ``delta.reasoning_content`` (chat). TTFT = first token chunk − start; ITL
= gaps between consecutive token chunks; e2e latency = end of the stream (``[DONE]``) − start. Output tokens
are counted from the stream (token chunks) and cross-checked against ``usage.completion_tokens``
(``stream_options.include_usage``), which wins when present, as in vLLM. Unlike vLLM, empty chunks (a bare
role delta, a final ``finish_reason`` chunk) are not token chunks, so a server that sends a role chunk before
prefill does not get a tiny TTFT.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from kvscope.bench.dataset import SampleRequest

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """Where and how to send requests. ``extra_body`` is merged last into every request body."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]


@dataclass(slots=True)
class RequestOutput:
    """Client-side record of one request. Times in seconds; ``start_time`` on the benchmark's clock."""

    success: bool = False
    prompt_len: int = 0
    expected_output_len: int = 0
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    stream_tokens: int = 0  # token chunks seen in the stream
    usage_output_tokens: int | None = None  # usage.completion_tokens, if the server sent usage
    usage_prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    generated_text: str = ""
    finish_reason: str | None = None
    error: str = ""
    error_type: str = ""

    @property
    def output_tokens(self) -> int:
        """``usage.completion_tokens`` when present, else the stream's token-chunk count."""
        return self.usage_output_tokens if self.usage_output_tokens is not None else self.stream_tokens

    @property
    def input_tokens(self) -> int:
        """The dataset's prompt length, or the server's ``usage.prompt_tokens`` when the dataset had none."""
        return self.prompt_len or (self.usage_prompt_tokens or 0)

    @property
    def tpot(self) -> float | None:
        """(e2e − TTFT) / (output tokens − 1) in seconds; None for failed or single-token requests (vLLM) and
        for a stream whose tokens carried no text (nothing streamed to time)."""
        if not self.success or self.output_tokens < 2 or self.stream_tokens == 0:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def build_body(cfg: EndpointConfig, sample: SampleRequest, max_tokens: int | None = None) -> dict[str, Any]:
    """The JSON body: greedy unless ``temperature`` > 0, streamed with usage; with ``ignore_eos`` also
    ``min_tokens`` = ``max_tokens`` so servers that honour either produce exactly the expected length."""
    max_tokens = sample.expected_output_len if max_tokens is None else max_tokens
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    body.update(cfg.extra_body)
    return body


async def send_request(
    client: httpx.AsyncClient,
    cfg: EndpointConfig,
    sample: SampleRequest,
    clock: Callable[[], float] = time.perf_counter,
    max_tokens: int | None = None,
) -> RequestOutput:
    """Send one streamed request and time it. Never raises for a failed request: ``error_type`` says why
    (``http_<status>``, ``stream_error:<type>``, ``incomplete_stream``, ``no_output``, ``invalid_json``,
    ``timeout``, ``connect_error``, ``protocol_error``, ``http_error:<class>``)."""
    out = RequestOutput(
        prompt_len=sample.prompt_len,
        expected_output_len=sample.expected_output_len if max_tokens is None else max_tokens,
    )
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    body = build_body(cfg, sample, max_tokens)
    out.start_time = clock()
    try:
        async with client.stream("POST", cfg.url, json=body, headers=headers) as response:
            if response.status_code != 200:
                await _fail_http(out, response)
                return out
            await _read_stream(out, response, cfg.endpoint, clock)
    except httpx.TimeoutException as exc:
        _fail(out, "timeout", repr(exc))
    except httpx.ConnectError as exc:
        _fail(out, "connect_error", repr(exc))
    except httpx.RemoteProtocolError as exc:
        _fail(out, "protocol_error", repr(exc))
    except httpx.HTTPError as exc:
        _fail(out, f"http_error:{type(exc).__name__}", repr(exc))
    return out


async def _read_stream(
    out: RequestOutput, response: httpx.Response, endpoint: Endpoint, clock: Callable[[], float]
) -> None:
    last_token_at = out.start_time
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, event:/id: fields
        payload = line[5:].strip()
        now = clock()
        if payload == "[DONE]":
            done = True
            out.latency = now - out.start_time
            break
        try:
            data = json.loads(payload)
        except json.JSONDecodeError:
            _fail(out, "invalid_json", payload[:200])
            return
        if isinstance(data.get("error"), dict):
            error = data["error"]
            _fail(
                out,
                f"stream_error:{error.get('type') or error.get('code') or 'unknown'}",
                str(error.get("message", "")),
            )
            return
        _read_usage(out, data.get("usage"))
        choices = data.get("choices") or [{}]
        out.finish_reason = choices[0].get("finish_reason") or out.finish_reason
        text = _chunk_text(choices[0], endpoint)
        if text:
            if out.stream_tokens == 0:
                out.ttft = now - out.start_time
            else:
                out.itl.append(now - last_token_at)
            last_token_at = now
            out.stream_tokens += 1
            out.generated_text += text
    if not done:
        _fail(out, "incomplete_stream", f"stream ended without [DONE] after {out.stream_tokens} token chunks")
    elif out.stream_tokens == 0 and not out.usage_output_tokens:
        _fail(out, "no_output", "the stream carried no text")
    else:
        if out.stream_tokens == 0:
            # tokens the server generated and counted, none of them text: byte tokens that never formed a
            # character (the detokenizer holds them back, as vLLM's does) or skipped special tokens. The
            # request completed; its output reached the client only with the end, so that is its TTFT (no
            # TPOT, no ITL)
            out.ttft = out.latency
        out.success = True


def _chunk_text(choice: dict[str, Any], endpoint: Endpoint) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _read_usage(out: RequestOutput, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    if usage.get("completion_tokens") is not None:
        out.usage_output_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        out.usage_prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        out.cached_tokens = int(details["cached_tokens"])


async def _fail_http(out: RequestOutput, response: httpx.Response) -> None:
    raw = (await response.aread()).decode("utf-8", "replace")
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw[:200]
    _fail(out, f"http_{response.status_code}", str(message))


def _fail(out: RequestOutput, error_type: str, message: str) -> None:
    out.success = False
    out.error_type = error_type
    out.error = message
