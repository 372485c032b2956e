"""``kvscope logs why`` and the console's request page (gateway/console/): one request's latency explained
from its log record's ``kvscope.engine`` attribution (the engine scheduler's step records,
engine/core/attribution.py; fields in docs/logs.md) and the gateway's own timings (``kvscope.gateway``, the
phases of gateway/context.py's GatewayPhases; older records: ``kvscope.gateway_overhead_s``,
``kvscope.upstream_s``).

Causes, in seconds (each a sum of record fields, so the ranking is reproducible from the record): ``queue``
(arrival → first scheduled), ``own prefill`` / ``own decode`` (the token-proportional share of the steps that
computed the request's own tokens), ``other prefills`` / ``batched decodes`` (the share of those steps spent
on other requests' prefill tokens / decode tokens), ``preemption`` (time preempted), ``engine host time``
(what the phases' wall time leaves: work between steps, steps that did not schedule it), ``grammar compile``
(structured output: the wait for its compiled grammar before it reached the engine's queue), the gateway's own
phases ``auth``, ``rate limit``, ``tokenize``, ``retry`` (failed attempts before the one that answered) and
``gateway other`` (the rest of the gateway's time) — one ``gateway`` cause (``gateway_overhead_s``) for
records older than ``kvscope.gateway`` — and ``upstream transfer``: the answering attempt's time
(``upstream_connect_s + upstream_response_s``; older records: ``upstream_s``) the engine did not account for
(connect, HTTP, network, output streaming; the grammar compile is its own cause). The answering attempt's
time to response headers is not a cause of its own: the engine's queue, prefill and decode lie inside that
attempt (a non-streamed answer's headers come after the whole generation), so it is printed, and ranked only
as part of ``upstream transfer``.

A record from another upstream kind (``kvscope.upstream.kind``: vLLM, SGLang, llama.cpp, TGI, a plain
OpenAI server) has no step attribution: it is explained from what its line holds (:func:`explain_reported`),
each number with its source (``per_request``: the upstream's own report on this request; ``sampled``: its
``/metrics`` (llama.cpp: and ``/slots``) scraped near the request, with the sample's age; ``gateway``:
measured by the gateway), and a
line saying what that kind cannot tell. Its causes are ``queue``, ``prefill`` and ``decode`` where the
upstream reported them, the gateway's phases, and ``upstream unattributed``: the answering attempt's time
its report does not cover (connect and transfer, and whatever the upstream did not time: llama.cpp's wait
for a free slot, a whole generation whose upstream reports nothing).

It lives beside the record it reads (gateway/logs/), not in gateway/analytics/: the console serves it from the
running gateway, whose modules may not import the offline analytics (an import-linter contract); it imports
nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CAUSE_FIELDS: dict[str, tuple[str, ...]] = {
    "queue": ("queue_s",),
    "own prefill": ("prefill_own_s",),
    "other prefills": ("prefill_interference_prefill_s", "decode_interference_prefill_s"),
    "batched decodes": ("prefill_interference_s", "decode_interference_s"),
    "preemption": ("prefill_preempted_s", "decode_preempted_s"),
    "own decode": ("decode_own_s",),
    "engine host time": ("prefill_other_s", "decode_other_s"),
    "grammar compile": ("structured_compile_s",),
}
"""Engine causes → the ``kvscope.engine`` fields (seconds) they add up; ``batched decodes`` is the
interference minus its ``other prefills`` part (the other requests' decode tokens in the same steps)."""
GATEWAY_CAUSES = {
    "auth": "auth_s",
    "rate limit": "rate_limit_s",
    "tokenize": "tokenize_s",
    "retry": "retry_s",
    "gateway other": "other_s",
}
"""Gateway causes → their ``kvscope.gateway`` field (seconds)."""
REPORTED_CAUSES = {"queue": "queue_s", "prefill": "prefill_s", "decode": "decode_s"}
"""Causes of a record without step attribution → the ``kvscope.engine`` fields (seconds) the upstream
reported."""
STEP_ATTRIBUTION = "per-step attribution (other requests' prefills, batched decodes, preemption)"
"""What only our engine reports (engine/core/attribution.py)."""


def _seconds(engine: dict[str, Any], cause: str) -> float:
    if cause == "queue" and engine.get("attributed_queue_s") is not None:
        return engine["attributed_queue_s"]  # several choices: the attributed one's own queue
    total = sum(engine.get(f) or 0.0 for f in CAUSE_FIELDS[cause])
    return total - _seconds(engine, "other prefills") if cause == "batched decodes" else total


def rank_causes(engine: dict[str, Any], gateway: dict[str, Any] | None = None) -> list[tuple[str, float]]:
    """Causes and their seconds, largest first (those under a microsecond left out). ``engine`` is the
    ``kvscope`` object (the record's ``kvscope.engine``); ``gateway`` the record's ``kvscope`` (adds the
    gateway's phases of :data:`GATEWAY_CAUSES`, or ``gateway`` for an older record, and ``upstream
    transfer``: the answering attempt's seconds minus the engine's arrival → last token). An ``engine``
    without step attribution (another upstream kind: no ``prefill_steps``) gives the causes of
    :data:`REPORTED_CAUSES` instead, and ``upstream unattributed`` for the rest of the attempt."""
    attributed = engine.get("prefill_steps") is not None
    if attributed:
        seconds = {cause: _seconds(engine, cause) for cause in CAUSE_FIELDS}
    else:
        seconds = {cause: engine.get(f) or 0.0 for cause, f in REPORTED_CAUSES.items()}
    rest = "upstream transfer" if attributed else "upstream unattributed"
    if gateway is not None:
        if attributed:
            # the attributed choice's own arrival -> last token (its causes add up to it exactly), and the
            # grammar's compile before that arrival: both inside the answering attempt. Not the merged
            # queue_s + prefill_s + decode_s, which for n > 1 or several prompts mixes choices (the earliest
            # first token's, the latest end's) while the causes are those of the choice that finished last
            engine_e2e = sum(seconds.values())
        else:
            engine_e2e = sum(engine.get(f) or 0.0 for f in ("queue_s", "prefill_s", "decode_s"))
        phases = gateway.get("gateway")
        if isinstance(phases, dict):
            seconds.update({cause: phases.get(field) or 0.0 for cause, field in GATEWAY_CAUSES.items()})
            answered = (phases.get("upstream_connect_s") or 0.0) + (phases.get("upstream_response_s") or 0.0)
            seconds[rest] = max(answered - engine_e2e, 0.0)
        else:  # a record from before kvscope.gateway
            seconds["gateway"] = gateway.get("gateway_overhead_s") or 0.0
            if gateway.get("upstream_s") is not None:
                seconds[rest] = max(gateway["upstream_s"] - engine_e2e, 0.0)
    return sorted(((c, s) for c, s in seconds.items() if s > 1e-6), key=lambda item: -item[1])


@dataclass(frozen=True, slots=True)
class Why:
    """The answer for one record."""

    request_id: str | None
    trace_id: str | None
    text: str
    """The human sentences, one per line."""
    causes: tuple[tuple[str, float], ...]
    verdict: str
    engine: dict[str, Any]
    upstream: dict[str, Any] | None = None
    """The record's ``kvscope.upstream`` (None: a record from before upstream kinds)."""

    def to_dict(self) -> dict[str, Any]:
        """The ``--format json`` object."""
        total = sum(s for _, s in self.causes) or 1.0
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "verdict": self.verdict,
            "text": self.text,
            "causes": [{"cause": c, "seconds": s, "share": s / total} for c, s in self.causes],
            "engine": self.engine,
            "upstream": self.upstream,
        }


def _dotted(record: dict[str, Any], *path: str) -> Any:
    node: Any = record
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _n(value: float | int | None) -> str:
    """A count: ``?`` when unknown; a whole float as an integer (a JSONL log read through DuckDB hands
    counts over as doubles: ``1.0 running`` would differ from the console's ``1 running``)."""
    if value is None:
        return "?"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:,}"


def _ttft_line(e: dict[str, Any], ttft: float | None, at_gateway: bool) -> str:
    """The TTFT sentence; ``at_gateway``: ``ttft`` is the gateway's, which (unlike the engine's, counted from
    its arrival) includes the wait for a new grammar before the engine's queue, so that wait leads it."""
    limit = e.get("queue_limit")
    held = f", {limit} reached" if limit else ""
    prefill = (
        f"prefill {e.get('prefill_s') or 0:.3f} s over {_n(e.get('prefill_steps'))} steps shared with "
        f"{_n(e.get('prefill_other_prefill_tokens'))} prompt and {_n(e.get('prefill_other_decode_tokens'))} "
        f"decode tokens of up to {_n(e.get('prefill_other_requests_max'))} other requests (own "
        f"{_n(e.get('prefill_tokens'))} tokens of a {_n(e.get('prompt_tokens'))}-token prompt, "
        f"{_n(e.get('cached_tokens'))} from the prefix cache)"
    )
    compile_s = e.get("structured_compile_s") or 0.0
    compiled = f"grammar compile {compile_s:.3f} s, then " if at_gateway and compile_s > 0 else ""
    return (
        f"TTFT {ttft if ttft is not None else 0:.3f} s: {compiled}{e.get('queue_s') or 0:.3f} s queued "
        f"({_n(e.get('queue_ahead'))} requests ahead, {_n(e.get('running_on_arrival'))} running{held}); "
        f"{prefill}"
    )


def _decode_line(e: dict[str, Any], tpot: float | None) -> str:
    steps = e.get("decode_steps") or 0
    per_token = f"{tpot * 1000:.1f} ms/token" if tpot else "-"
    batch = e.get("batch_size_mean")
    return (
        f"decode {e.get('decode_s') or 0:.3f} s at {per_token} over {steps} steps in batches of "
        f"{batch:.1f} (max {_n(e.get('batch_size_max'))}); other requests' prefill tokens in those steps: "
        f"{_n(e.get('decode_other_prefill_tokens'))} ({e.get('decode_interference_prefill_s') or 0:.3f} s)"
        if batch is not None
        else f"decode {e.get('decode_s') or 0:.3f} s"
    )


def _gateway_line(kv: dict[str, Any]) -> str:
    head = f"e2e {kv.get('e2e_s') or 0:.3f} s at the gateway: "
    p = kv.get("gateway")
    if not isinstance(p, dict):  # a record from before kvscope.gateway
        return (
            head
            + f"{kv.get('gateway_overhead_s') or 0:.3f} s in the gateway (auth, limits, tokenize, connect, "
            f"{_n(kv.get('attempts'))} attempt(s)), {kv.get('upstream_s') or 0:.3f} s upstream"
        )
    s = {
        k: p.get(k) or 0.0
        for k in (
            "auth_s",
            "rate_limit_s",
            "tokenize_s",
            "retry_s",
            "upstream_connect_s",
            "upstream_response_s",
            "other_s",
        )
    }
    return (
        head + f"auth {s['auth_s']:.3f} s, rate limit {s['rate_limit_s']:.3f} s, "
        f"tokenize {s['tokenize_s']:.3f} s, "
        f"retry {s['retry_s']:.3f} s ({_n(kv.get('attempts'))} attempt(s)), other {s['other_s']:.3f} s; "
        f"the answering upstream {s['upstream_connect_s'] + s['upstream_response_s']:.3f} s "
        f"({s['upstream_connect_s']:.3f} s to its response headers)"
    )


def _outcome_line(record: dict[str, Any]) -> str | None:
    """How the request ended when it did not succeed: the status, the error type and message, a stream that
    broke after its 200, a client that left (None for a success)."""
    kv = record.get("kvscope") or {}
    status = _dotted(record, "http", "response", "status_code")
    error = record.get("error") or {}
    parts = []
    if isinstance(status, int) and status >= 400:
        parts.append(f"status {status}")
    if kv.get("stream_error"):
        parts.append(f"the stream broke after its 200 ({kv['stream_error']})")
    if kv.get("client_disconnected"):
        parts.append(f"the client left ({kv.get('disconnect_phase') or '?'})")
    if not parts:
        return None
    detail = ": ".join(str(x) for x in (error.get("type"), error.get("message")) if x)
    return "failed: " + ", ".join(parts) + (f" — {detail}" if detail else "")


ADMISSION_REFUSED = "ttft_slo_exceeded"
"""``error.type`` of a request the engine's admission refused (engine/server/scheduling.py SHED_CODE)."""


def _explain_refusal(record: dict[str, Any]) -> Why:
    """A request admission refused (503 ``ttft_slo_exceeded``): it never reached a prefill, so there is no
    step to attribute; the prediction it was refused on (``kvscope.engine``: ``predicted_ttft_s``,
    ``service_tier``, ``queue_ahead``) is what explains it, and for a request dropped from the queue after
    its admission (``queue_s`` set) its wait there."""
    kv = record.get("kvscope") or {}
    engine = kv.get("engine") or {}
    message = (record.get("error") or {}).get("message")
    predicted, tier, ahead = (
        engine.get("predicted_ttft_s"),
        engine.get("service_tier"),
        engine.get("queue_ahead"),
    )
    waited = engine.get("queue_s")
    if waited is None:
        lines = [
            f"refused at admission (503 {ADMISSION_REFUSED}): "
            + (message or "predicted TTFT over the objective"),
            f"predicted TTFT {_seconds_or(predicted, '?')} in tier {tier or '?'} with {_n(ahead)} requests "
            "ahead; never queued: no prefill, no decode (the client may retry after its Retry-After)",
        ]
        verdict = "admission refusal"
    else:
        lines = [
            f"dropped from the queue by admission (503 {ADMISSION_REFUSED}): "
            + (message or "its first token could no longer come within the objective"),
            f"queued {_seconds_or(waited, '?')} in tier {tier or '?'}, then its first token could no longer "
            f"come within the tier's objective (earliest {_seconds_or(predicted, '?')}; {_n(ahead)} "
            "requests ahead): no prefill, no decode (the client may retry after its Retry-After)",
        ]
        verdict = "dropped from the queue"
    is_gateway = "gateway_overhead_s" in kv
    if is_gateway:
        lines.append(_gateway_line(kv))
    seconds = kv.get("e2e_s") or 0.0
    lines.append(f"verdict: {verdict} {seconds:.3f} s (100%)")
    return Why(
        request_id=_dotted(record, "http", "request", "id") or _dotted(record, "gen_ai", "response", "id"),
        trace_id=_dotted(record, "trace", "id"),
        text="\n".join(lines),
        causes=((verdict, seconds),),
        verdict=verdict,
        engine=engine,
        upstream=kv.get("upstream") if isinstance(kv.get("upstream"), dict) else None,
    )


def explain(record: dict[str, Any]) -> Why:
    """The answer for one request-log record (the gateway's or the engine's line): from our engine's step
    attribution when ``kvscope.engine`` has it, else from what the line holds about the upstream
    (:func:`explain_reported`). Raises ValueError when the record has neither (a request refused before any
    upstream, or an older record without attribution)."""
    kv = record.get("kvscope") or {}
    engine = kv.get("engine") or {}
    upstream = kv.get("upstream") if isinstance(kv.get("upstream"), dict) else None
    if (record.get("error") or {}).get("type") == ADMISSION_REFUSED:
        return _explain_refusal(record)
    if engine.get("prefill_steps") is None:
        if upstream is not None and upstream.get("kind") is not None:
            return explain_reported(record)
        raise ValueError(
            "the record has no kvscope.engine attribution: the request was refused before the "
            "engine, the client left before the engine answered, or an older engine served it"
        )
    ttft = (
        kv.get("ttft_s") if kv.get("ttft_s") is not None else engine.get("ttft_s")
    )  # non-streamed: engine's
    is_gateway = "gateway_overhead_s" in kv
    lines = [_ttft_line(engine, ttft, is_gateway and kv.get("ttft_s") is not None)]
    outcome = _outcome_line(record)
    if outcome:
        lines.insert(0, outcome)
    if engine.get("decode_steps"):
        lines.append(
            _decode_line(engine, kv.get("tpot_s") if kv.get("tpot_s") is not None else engine.get("tpot_s"))
        )
    preempt = engine.get("num_preemptions") or 0
    if preempt:
        lines.append(
            f"preempted {preempt}x for "
            f"{(engine.get('prefill_preempted_s') or 0) + (engine.get('decode_preempted_s') or 0):.3f} s, "
            f"{_n(engine.get('recomputed_tokens'))} tokens recomputed"
        )
    if engine.get("structured_compile_s") is not None:
        compile_s = engine["structured_compile_s"]
        lines.append(
            f"grammar compile {compile_s:.3f} s before the engine's queue"
            + (" (cached)" if compile_s == 0 else "")
        )
    if engine.get("structured_mask_s") is not None:
        lines.append(
            f"grammar masks {engine['structured_mask_s']:.3f} s (overlapped with the forward pass), "
            f"sampling waited {engine.get('structured_wait_s') or 0:.3f} s for them"
        )
    if is_gateway:
        lines.append(_gateway_line(kv))
    causes = tuple(rank_causes(engine, kv if is_gateway else None))
    total = sum(s for _, s in causes) or 1.0
    verdict = ", ".join(f"{c} {s:.3f} s ({s / total:.0%})" for c, s in causes[:4])
    lines.append(f"verdict: {verdict}")
    return Why(
        request_id=_dotted(record, "http", "request", "id") or _dotted(record, "gen_ai", "response", "id"),
        trace_id=_dotted(record, "trace", "id"),
        text="\n".join(lines),
        causes=causes,
        verdict=causes[0][0] if causes else "?",
        engine=engine,
        upstream=upstream,
    )


def _seconds_or(value: Any, missing: str) -> str:
    return missing if value is None else f"{value:.3f} s"


def _sample_phrase(moment: str, sample: dict[str, Any] | None) -> str | None:
    if not isinstance(sample, dict):
        return None
    usage = sample.get("kv_cache_usage")
    kv_usage = "KV usage ?" if usage is None else f"KV usage {usage:.0%}"
    return (
        f"at {moment} {_n(sample.get('requests_running'))} running, {_n(sample.get('requests_waiting'))} "
        f"waiting, {kv_usage} (sampled {sample.get('age_s') or 0:.1f} s before)"
    )


def _unknowns(kind: str, upstream: dict[str, Any], ttft_s: float | None) -> list[str]:
    """What the record's upstream kind did not tell about this request (by ``kvscope.upstream.sources``)."""
    sources = upstream.get("sources") or {}
    missing = [
        what
        for key, what in (
            ("queue_s", "queue time"),
            ("prefill_s", "prefill time"),
            ("decode_s", "decode time"),
            ("cached_tokens", "cached tokens"),
        )
        if sources.get(key) is None
    ]
    if ttft_s is None:
        missing.insert(0, "TTFT")
    sampled = upstream.get("sampled") or {}
    if sampled.get("arrival") is None and sampled.get("finish") is None:
        missing.append("batch size, KV usage and queue depth (not sampled)")
    else:
        missing += [
            what
            for key, what in (("batch_size", "batch size"), ("kv_cache_usage", "KV usage"))
            if sources.get(key) is None
        ]
    if kind != "kvscope":
        missing.append(STEP_ATTRIBUTION)
    return missing


def explain_reported(record: dict[str, Any]) -> Why:
    """The answer for a record without step attribution: the upstream's kind and what its line holds
    (``kvscope.engine`` in the stable shape of gateway/engines/section.py, ``kvscope.upstream``), each number
    with its source, then what that kind cannot tell, the gateway's phases and the verdict over
    :func:`rank_causes`' reported causes."""
    kv = record.get("kvscope") or {}
    engine = kv.get("engine") or {}
    upstream = kv.get("upstream") or {}
    kind = str(upstream.get("kind"))
    sources = upstream.get("sources") or {}

    def src(key: str) -> str:
        return sources.get(key) or "?"

    ttft = kv.get("ttft_s")
    head = f"upstream {kind} (kind from {upstream.get('kind_source') or '?'})"
    ttft_part = "TTFT unknown" if ttft is None else f"TTFT {ttft:.3f} s ({src('ttft_s')})"
    queue = engine.get("queue_s")
    prefill = engine.get("prefill_s")
    lines = [
        f"{head}: {ttft_part}; "
        + (f"{queue:.3f} s queued ({src('queue_s')}); " if queue is not None else "")
        + f"prefill {_seconds_or(prefill, '?')}"
        + (f" ({src('prefill_s')})" if prefill is not None else "")
        + f" of a {_n(engine.get('prompt_tokens'))}-token prompt, {_n(engine.get('cached_tokens'))} from the "
        "prefix cache"
    ]
    decode, tpot = engine.get("decode_s"), kv.get("tpot_s")
    per_token = f" at {tpot * 1000:.1f} ms/token" if tpot else ""
    if decode is not None:
        lines.append(f"decode {decode:.3f} s{per_token} ({src('decode_s')})")
    elif tpot:
        lines.append(f"decode{per_token} (gateway)")
    sampled = upstream.get("sampled") or {}
    phrases = [
        p
        for p in (
            _sample_phrase("arrival", sampled.get("arrival")),
            _sample_phrase("finish", sampled.get("finish")),
        )
        if p
    ]
    if phrases:
        batch = engine.get("batch_size_mean")
        batch_part = (
            "" if batch is None else f"batch of {batch:.1f} (max {_n(engine.get('batch_size_max'))}); "
        )
        lines.append(f"{kind} sampled: {batch_part}" + "; ".join(phrases))
    outcome = _outcome_line(record)
    answered = bool(engine) or _dotted(record, "gen_ai", "usage", "output_tokens") is not None
    if outcome:
        lines.insert(0, outcome)
    missing = _unknowns(kind, upstream, ttft)
    if missing and answered:
        lines.append(f"{kind} does not tell: " + ", ".join(missing))
    elif not answered:
        lines.append(f"the {kind} upstream sent no answer to read, so nothing of its engine is known")
    is_gateway = "gateway_overhead_s" in kv
    if is_gateway:
        lines.append(_gateway_line(kv))
    causes = tuple(rank_causes(engine, kv if is_gateway else None))
    total = sum(s for _, s in causes) or 1.0
    lines.append("verdict: " + ", ".join(f"{c} {s:.3f} s ({s / total:.0%})" for c, s in causes[:4]))
    return Why(
        request_id=_dotted(record, "http", "request", "id") or _dotted(record, "gen_ai", "response", "id"),
        trace_id=_dotted(record, "trace", "id"),
        text="\n".join(lines),
        causes=causes,
        verdict=causes[0][0] if causes else "?",
        engine=engine,
        upstream=upstream,
    )
