"""What an upstream reports about one request, per kind: read from its answer's body (the non-streamed JSON,
or a stream's final chunks) and its response headers, never measured by the gateway.

One :class:`UpstreamReport` per answer (seconds and tokens; None = not reported). What each kind sends, in
its own source:

- **kvscope** (our engine): the ``kvscope`` object (engine/core/stats.py ``KvscopeStats``;
  docs/engine-server.md "The ``kvscope`` object") on the JSON body and on a stream's final usage chunk:
  queue, TTFT, prefill, decode, TPOT, prompt and cached tokens, all measured by the engine's scheduler.
- **llamacpp** (llama.cpp's ``llama-server``): ``timings`` (``tools/server/server-task.cpp``
  ``result_timings::to_json``: ``cache_n``, ``prompt_n``, ``prompt_ms``, ``prompt_per_token_ms``,
  ``prompt_per_second``, ``predicted_n``, ``predicted_ms``, ``predicted_per_token_ms``,
  ``predicted_per_second``, and ``draft_n`` / ``draft_n_accepted`` with speculative decoding; ``cache_n`` is
  absent in older servers). ``server_task_result_cmpl_final::to_json_oaicompat_chat`` puts it on the JSON
  body, ``to_json_oaicompat_chat_stream`` on the stream's last chunk (the usage chunk when
  ``stream_options.include_usage`` was asked, which the gateway always asks; with ``timings_per_token``
  every partial chunk carries a running copy too). The times (``tools/server/server-context.cpp``, slot
  update loop): ``t_start_process_prompt`` is taken when a slot starts on the task (after the HTTP handler,
  tokenization and waiting for a free slot, none of which is reported); when the first token is sampled
  (``n_decoded == 1``) ``t_start_generation`` is taken and ``prompt_ms = t_start_generation −
  t_start_process_prompt``; after every sampled token ``predicted_ms = now − t_start_generation``. So
  ``prompt_ms`` is the prefill up to and including the first token's sampling, ``predicted_ms`` spans the
  first sampled token → the last (``predicted_n − 1`` intervals, although ``predicted_n`` counts the first
  token, so llama.cpp's own ``predicted_per_token_ms`` divides by one too many). Cached tokens: ``cache_n``,
  also ``usage.prompt_tokens_details.cached_tokens`` (``usage_json_oaicompat``: ``n_prompt_tokens_cache``).
- **tgi** (Text Generation Inference): response headers of the non-streamed answer only
  (``router/src/server.rs`` ``generate_internal``, which ``chat_completions`` and ``completions`` call;
  ``generate_stream_internal`` sets ``x-compute-type`` and ``x-compute-characters`` only, and the chat
  stream's chunks carry no timing): ``x-validation-time``, ``x-queue-time``, ``x-inference-time``,
  ``x-time-per-token`` (milliseconds, truncated to integers by ``as_millis``), ``x-total-time``,
  ``x-prompt-tokens``, ``x-generated-tokens``. ``queue_time = start − queued`` (the batcher took the request)
  and ``inference_time = now − start`` (prefill and decode together); ``time_per_token = inference_time /
  generated_tokens``, the prefill included. TGI reports no prefill/decode split: splitting its inference time
  with its mean per-token time (prefill = inference − time_per_token·(n−1)) would always give the prefill one
  mean token's time, whatever the prompt, so prefill, decode and TPOT stay unreported, and only the queue
  time and the token counts are read.
- **vllm**, **sglang**, **openai**: ``usage.prompt_tokens_details.cached_tokens``. vLLM
  (``vllm/entrypoints/openai/engine/protocol.py`` ``UsageInfo``/``PromptTokenUsageInfo``) sends it only
  when started with ``--enable-prompt-tokens-details``; SGLang
  (``python/sglang/srt/entrypoints/openai/usage_processor.py``) only with ``--enable-cache-report`` (some
  versions only when non-zero); OpenAI always. No per-request timing in their OpenAI responses: an absent
  ``cached_tokens`` is "not reported", never 0.

Prompt and output token counts come from ``usage`` (else llama.cpp's ``prompt_n + cache_n`` /
``predicted_n``, TGI's ``x-prompt-tokens`` / ``x-generated-tokens``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kvscope.gateway.engines.kinds import UpstreamKind

TGI_HEADERS = (
    "x-validation-time",
    "x-queue-time",
    "x-inference-time",
    "x-time-per-token",
    "x-prompt-tokens",
    "x-generated-tokens",
)
"""TGI's per-request headers (module docstring); the gateway reads ``x-queue-time`` and the token counts."""


@dataclass(frozen=True, slots=True)
class UpstreamReport:
    """What the upstream said about one request (seconds, tokens; None = not reported)."""

    queue_s: float | None = None
    """Arrival at the upstream's scheduler → scheduled."""
    ttft_s: float | None = None
    """Arrival at the upstream → its first token (kvscope only: the others do not report their arrival)."""
    prefill_s: float | None = None
    """Scheduled → first token."""
    decode_s: float | None = None
    """First token → last token at the upstream."""
    tpot_s: float | None = None
    """``decode_s / (output tokens − 1)`` (kvscope's own, or computed from llama.cpp's timings)."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """Prompt tokens served from the upstream's prefix cache."""
    output_tokens: int | None = None
    source_fields: tuple[str, ...] = ()
    """The answer's fields the values came from (``timings.prompt_ms``, ``x-queue-time``, …), in the order
    read."""

    def merged(self, other: UpstreamReport | None) -> UpstreamReport:
        """This report with ``other``'s values where this one has None (its source fields appended)."""
        if other is None:
            return self
        values = {
            f.name: getattr(other, f.name)
            for f in fields(self)
            if f.name != "source_fields" and getattr(self, f.name) is None
        }
        return replace(self, **values, source_fields=self.source_fields + other.source_fields)

    @property
    def empty(self) -> bool:
        """Nothing reported."""
        return not self.source_fields


def _seconds(value: Any, per_second: float = 1.0) -> float | None:
    """A non-negative JSON number (not a bool) divided by ``per_second`` (1000 for milliseconds); None
    otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value) / per_second


def _count(value: Any) -> int | None:
    """A non-negative integer (an integral float too: some servers write ``12.0``); None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return int(value) if float(value).is_integer() else None


def _usage_fields(usage: Any) -> tuple[dict[str, Any], list[str]]:
    """(report values, source fields) from an OpenAI ``usage`` object."""
    if not isinstance(usage, dict):
        return {}, []
    values: dict[str, Any] = {}
    used: list[str] = []
    for key, name in (("prompt_tokens", "prompt_tokens"), ("completion_tokens", "output_tokens")):
        if (n := _count(usage.get(key))) is not None:
            values[name] = n
            used.append(f"usage.{key}")
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and (cached := _count(details.get("cached_tokens"))) is not None:
        values["cached_tokens"] = cached
        used.append("usage.prompt_tokens_details.cached_tokens")
    return values, used


def report_from_kvscope(obj: Mapping[str, Any]) -> UpstreamReport:
    """The report of our engine's ``kvscope`` object (its own field names, docs/engine-server.md)."""
    values: dict[str, Any] = {}
    used: list[str] = []
    for key in ("queue_s", "ttft_s", "prefill_s", "decode_s", "tpot_s"):
        if (s := _seconds(obj.get(key))) is not None:
            values[key] = s
            used.append(f"kvscope.{key}")
    for key in ("prompt_tokens", "cached_tokens"):
        if (n := _count(obj.get(key))) is not None:
            values[key] = n
            used.append(f"kvscope.{key}")
    return UpstreamReport(**values, source_fields=tuple(used))


def report_from_timings(timings: Mapping[str, Any]) -> UpstreamReport:
    """The report of llama.cpp's ``timings`` object (module docstring): ``prefill_s = prompt_ms / 1000``,
    ``decode_s = predicted_ms / 1000``, ``tpot_s = predicted_ms / (predicted_n − 1) / 1000`` (None below 2
    tokens), ``cached_tokens = cache_n``, ``prompt_tokens = prompt_n + cache_n`` (both needed),
    ``output_tokens = predicted_n``."""
    values: dict[str, Any] = {}
    used: list[str] = []
    if (prefill := _seconds(timings.get("prompt_ms"), 1000)) is not None:
        values["prefill_s"] = prefill
        used.append("timings.prompt_ms")
    decode = _seconds(timings.get("predicted_ms"), 1000)
    predicted = _count(timings.get("predicted_n"))
    if decode is not None:
        values["decode_s"] = decode
        used.append("timings.predicted_ms")
        if predicted is not None and predicted >= 2:
            values["tpot_s"] = decode / (predicted - 1)
    if predicted is not None:
        values["output_tokens"] = predicted
        used.append("timings.predicted_n")
    cached = _count(timings.get("cache_n"))
    if cached is not None:
        values["cached_tokens"] = cached
        used.append("timings.cache_n")
    processed = _count(timings.get("prompt_n"))
    if processed is not None and cached is not None:
        values["prompt_tokens"] = processed + cached
        used.append("timings.prompt_n")
    return UpstreamReport(**values, source_fields=tuple(used))


def report_from_body(kind: UpstreamKind | None, body: Mapping[str, Any]) -> UpstreamReport | None:
    """What ``body`` (a non-streamed JSON answer, or a stream's final state as ``{"usage", "kvscope",
    "timings"}``) reports for a replica of ``kind`` (None: not known yet); None when it reports nothing.

    Our engine's ``kvscope`` object and llama.cpp's ``timings`` (an object with ``prompt_ms`` and
    ``predicted_ms``) are read whatever ``kind`` says: only those servers write them, and a replica whose
    kind is not detected yet (``openai`` until its first health check) still logs them. Then ``usage``
    (token counts, cached tokens) fills what those left None. Each kind's fields: module docstring. ``kind``
    changes nothing in a body today (every field read names its server itself); headers need it
    (:func:`report_from_headers`)."""
    report = UpstreamReport()
    obj, timings = body.get("kvscope"), body.get("timings")
    if isinstance(obj, dict):
        report = report_from_kvscope(obj)
    elif isinstance(timings, dict) and "prompt_ms" in timings and "predicted_ms" in timings:
        report = report_from_timings(timings)
    values, used = _usage_fields(body.get("usage"))
    report = report.merged(UpstreamReport(**values, source_fields=tuple(used)))
    return None if report.empty else report


def _header_number(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def report_from_headers(kind: UpstreamKind | None, headers: Mapping[str, str]) -> UpstreamReport | None:
    """What the response ``headers`` (case-insensitive, as httpx's ``Headers``; or a lower-case dict) report
    for a replica of ``kind``: TGI's ``queue_s = x-queue-time / 1000``, ``prompt_tokens = x-prompt-tokens``,
    ``output_tokens = x-generated-tokens`` (module docstring: why its inference time and time per token are
    not split into prefill and decode); None for other kinds or without those headers."""
    if kind is not UpstreamKind.TGI:
        return None
    values: dict[str, Any] = {}
    used: list[str] = []
    if (queue := _header_number(headers, "x-queue-time")) is not None:
        values["queue_s"] = queue / 1000
        used.append("x-queue-time")
    for name, key in (("x-prompt-tokens", "prompt_tokens"), ("x-generated-tokens", "output_tokens")):
        if (n := _count(_header_number(headers, name))) is not None:
            values[key] = n
            used.append(name)
    return UpstreamReport(**values, source_fields=tuple(used)) if used else None


def upstream_report(
    kind: UpstreamKind | None, body: Mapping[str, Any], headers: Mapping[str, str] | None
) -> UpstreamReport | None:
    """:func:`report_from_body` with :func:`report_from_headers` filling what the body left None; None when
    neither reports anything."""
    from_body = report_from_body(kind, body)
    from_headers = report_from_headers(kind, headers) if headers is not None else None
    if from_body is None:
        return from_headers
    return from_body.merged(from_headers)
