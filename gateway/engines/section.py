"""The request log's engine part: ``kvscope.engine`` and ``kvscope.upstream`` (docs/gateway.md "Request
log", "What each upstream kind can and cannot tell"), from the upstream's per-request report
(reports.py) and the engine samples stamped at the request's arrival and finish (samples.py, scraper.py).

``kvscope.engine``: our engine's ``kvscope`` object unchanged when the answer carried one; otherwise one
stable shape, :data:`ENGINE_KEYS` (the kvscope object's names for the same quantities), null where unknown;
null as a whole when nothing beyond the prompt's token count is known (a plain OpenAI upstream without
samples). ``kvscope.upstream``: the replica's kind and where each quantity came from (:data:`SOURCE_KEYS`:
``per_request`` = the upstream's report on this request, ``sampled`` = its ``/metrics`` scraped near the
request, ``gateway`` = measured by the gateway, null = unknown), and the samples themselves with their ages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvscope.gateway.engines.reports import UpstreamReport
from kvscope.gateway.engines.samples import EngineSample

Source = Literal["per_request", "sampled", "gateway"]
"""Where a logged quantity came from."""
ENGINE_KEYS = (
    "queue_s",
    "ttft_s",
    "prefill_s",
    "decode_s",
    "tpot_s",
    "prompt_tokens",
    "cached_tokens",
    "batch_size_mean",
    "batch_size_max",
    "kv_cache_usage",
    "queue_ahead",
    "running_on_arrival",
)
"""``kvscope.engine``'s keys for an upstream that is not our engine (a subset of the kvscope object's)."""
SOURCE_KEYS = (
    "ttft_s",
    "tpot_s",
    "queue_s",
    "prefill_s",
    "decode_s",
    "cached_tokens",
    "batch_size",
    "kv_cache_usage",
    "queue_ahead",
)
"""``kvscope.upstream.sources``' keys: ``ttft_s`` and ``tpot_s`` are ``kvscope.ttft_s`` and ``kvscope.tpot_s``
(measured by the gateway for streams, from the upstream's report for JSON answers); the others
``kvscope.engine``'s (``batch_size``: ``batch_size_mean``/``_max``; ``queue_ahead`` with
``running_on_arrival``). ``kvscope.engine``'s ``ttft_s``, ``tpot_s`` and ``prompt_tokens`` have no key of
their own: in front of a kind other than ours they come only from the upstream's report (``per_request``)."""
SAMPLE_KEYS = ("requests_running", "requests_waiting", "kv_cache_usage", "age_s")
"""``kvscope.upstream.sampled.{arrival,finish}``' keys."""


@dataclass(frozen=True, slots=True)
class SampleStamp:
    """The replica's latest engine sample at one moment of a request, and how old it was then."""

    sample: EngineSample
    age_s: float
    """Seconds from the sample's scrape to that moment (``time.monotonic()`` difference)."""


def stamp(sample: EngineSample | None, now: float) -> SampleStamp | None:
    """``sample`` stamped at ``now`` (``time.monotonic()``); None without a sample."""
    return None if sample is None else SampleStamp(sample, sample.age_s(now))


def _sampled(s: SampleStamp | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        "requests_running": _int(s.sample.requests_running),
        "requests_waiting": _int(s.sample.requests_waiting),
        "kv_cache_usage": s.sample.kv_cache_usage,
        "age_s": s.age_s,
    }


def _int(value: float | None) -> int | float | None:
    """A gauge's value as an int when integral (requests running/waiting), else as it is."""
    return int(value) if value is not None and float(value).is_integer() else value


def _per_request(obj: dict[str, Any], key: str) -> Source | None:
    return "per_request" if obj.get(key) is not None else None


def _engine(
    report: UpstreamReport | None,
    kvscope_obj: dict[str, Any] | None,
    arrival: SampleStamp | None,
    finish: SampleStamp | None,
) -> tuple[dict[str, Any] | None, dict[str, Source | None]]:
    """(``kvscope.engine``, ``kvscope.upstream.sources`` but ``ttft_s``) for one request.

    With our engine's ``kvscope`` object: the object unchanged, every quantity it holds ``per_request``.
    Otherwise, :data:`ENGINE_KEYS`: the timings and token counts of ``report`` (``per_request``);
    ``batch_size_mean`` / ``batch_size_max`` the mean / max of ``requests_running`` over the arrival and
    finish samples that have it, ``kv_cache_usage`` the finish sample's (else the arrival's),
    ``queue_ahead`` / ``running_on_arrival`` the arrival sample's ``requests_waiting`` /
    ``requests_running`` (``sampled``). The engine part is None when none of its values but
    ``prompt_tokens`` is known."""
    if kvscope_obj is not None:
        sources: dict[str, Source | None] = {
            "queue_s": _per_request(kvscope_obj, "queue_s"),
            "prefill_s": _per_request(kvscope_obj, "prefill_s"),
            "decode_s": _per_request(kvscope_obj, "decode_s"),
            "cached_tokens": _per_request(kvscope_obj, "cached_tokens"),
            "batch_size": _per_request(kvscope_obj, "batch_size_mean"),
            "kv_cache_usage": _per_request(kvscope_obj, "kv_cache_usage"),
            "queue_ahead": _per_request(kvscope_obj, "queue_ahead"),
        }
        return kvscope_obj, sources
    r = report or UpstreamReport()
    engine: dict[str, Any] = dict.fromkeys(ENGINE_KEYS)
    for key in ("queue_s", "ttft_s", "prefill_s", "decode_s", "tpot_s", "prompt_tokens", "cached_tokens"):
        engine[key] = getattr(r, key)
    sources = {
        key: _per_request(engine, key) for key in ("queue_s", "prefill_s", "decode_s", "cached_tokens")
    }
    running = [
        s.sample.requests_running for s in (arrival, finish) if s and s.sample.requests_running is not None
    ]
    if running:
        engine["batch_size_mean"] = sum(running) / len(running)
        engine["batch_size_max"] = _int(max(running))
    latest = finish if finish is not None and finish.sample.kv_cache_usage is not None else arrival
    if latest is not None:
        engine["kv_cache_usage"] = latest.sample.kv_cache_usage
    if arrival is not None:
        engine["queue_ahead"] = _int(arrival.sample.requests_waiting)
        engine["running_on_arrival"] = _int(arrival.sample.requests_running)
    sources["batch_size"] = "sampled" if running else None
    sources["kv_cache_usage"] = "sampled" if engine["kv_cache_usage"] is not None else None
    sources["queue_ahead"] = "sampled" if engine["queue_ahead"] is not None else None
    known = any(engine[key] is not None for key in ENGINE_KEYS if key != "prompt_tokens")
    return (engine if known else None), sources


def engine_section(
    kind: str | None,
    kind_source: str | None,
    report: UpstreamReport | None,
    kvscope_obj: dict[str, Any] | None,
    arrival: SampleStamp | None,
    finish: SampleStamp | None,
    ttft_source: Source | None,
    tpot_source: Source | None = None,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(``kvscope.engine``, ``kvscope.upstream``) of one request's log record: the replica's ``kind`` and
    ``kind_source`` (None: no replica was reached), the upstream's ``report``, our engine's ``kvscope``
    object, the samples stamped at the answering attempt's start and end, and where ``kvscope.ttft_s`` and
    ``kvscope.tpot_s`` came from. ``kvscope.upstream`` is ``{kind, kind_source, sources: {SOURCE_KEYS},
    sampled: {arrival, finish}}``, every key present; each sample ``{SAMPLE_KEYS}`` or None."""
    engine, sources = _engine(report, kvscope_obj, arrival, finish)
    sources = {**sources, "ttft_s": ttft_source, "tpot_s": tpot_source}
    upstream = {
        "kind": kind,
        "kind_source": kind_source,
        "sources": {key: sources.get(key) for key in SOURCE_KEYS},
        "sampled": {"arrival": _sampled(arrival), "finish": _sampled(finish)},
    }
    return engine, upstream
