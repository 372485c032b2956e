"""Sampled engine state from an upstream's Prometheus endpoint (``GET /metrics``), reduced to what the request
log stamps on each request at its arrival and finish (gateway/engines/section.py): requests running and
waiting, KV-cache usage, and the KV capacity routing sizes its prefix index with.

Which series each kind of server exports, and where that was read in its source: :data:`METRIC_NAMES`
(kvscope/common/upstream_metrics.py, shared with the dashboards generator). The text is parsed with
prometheus_client's parser, after a line filter that keeps only those series (a vLLM ``/metrics`` is mostly
histogram buckets the gateway never reads): the parser sees a dozen lines, the filter one split per line.

Values no server can report are dropped as if the series were absent (a buggy or hostile ``/metrics`` must
not put a negative queue, a "KV usage" of 85 or a 300-digit batch size into the request log, whose
Elasticsearch mapping has ``long`` fields): requests running and waiting outside 0 .. :data:`MAX_COUNT`, a KV
usage outside 0 .. 1, a capacity outside 1 .. :data:`MAX_CAPACITY_TOKENS`, NaN and infinities. A scrape
with more than :data:`MAX_SAMPLED_LINES` lines of sampled series is refused (ValueError): prometheus_client's
parser costs about 25 µs a line, and it runs at every scrape.

Several label sets of one series (data-parallel engines, several models, SGLang's DP ranks) are combined:
requests running and waiting and the KV capacity are summed, the KV usage is the largest (the fullest engine
is the one that preempts or queues first); series that differ only in a kind's ``replica_labels`` (SGLang's
TP/PP/EP ranks, each a copy of one scheduler's state) count once.

llama.cpp's current ``llama-server`` exports no KV-usage series; its ``GET /slots`` (on by default, unlike
``/metrics``) says what each slot holds, and :func:`sample_from_slots` reads the KV usage, the capacity and
the busy slots from it (its docstring: what those fields count, and the approximation).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from kvscope.common.upstream_metrics import UPSTREAM_METRIC_NAMES, SampleNames, sampled_names
from kvscope.gateway.engines.kinds import UpstreamKind, kind_from_metric_names

METRIC_NAMES: Mapping[UpstreamKind, SampleNames] = MappingProxyType(
    {UpstreamKind(kind): names for kind, names in UPSTREAM_METRIC_NAMES.items()}
)
"""Kind → the series the gateway samples from it (``openai``: none)."""

_SAMPLED = sampled_names()

MAX_COUNT = 1e9
"""Requests running or waiting above this are no server's state (the value is dropped, module docstring)."""
MAX_CAPACITY_TOKENS = 2**40
"""A KV capacity above this many tokens is no server's (dropped)."""
MAX_SAMPLED_LINES = 2048
"""Lines of sampled series (with their ``# HELP`` / ``# TYPE``) a scrape may hold: an SGLang with
``--enable-metrics-for-all-schedulers`` at TP 8 x DP 8 sends about 600; 160,000 lines (8 MB) took 4 s to
parse, at every tick (in the scraper's worker thread, which still holds the GIL most of that time)."""

Series = list[tuple[dict[str, str], float]]
"""One series' (labels, value) pairs in a scrape."""


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape of an upstream's ``/metrics``, reduced to what the request log stamps."""

    at: float
    """``time.monotonic()`` when the scrape's answer arrived."""
    requests_running: float | None = None
    """Requests in the upstream's running batch (summed over its engines); None: not exported."""
    requests_waiting: float | None = None
    """Requests queued at the upstream, not yet scheduled; None: not exported."""
    kv_cache_usage: float | None = None
    """Fraction of the KV cache in use, 0-1 (the fullest engine's); None: not exported."""
    kv_capacity_tokens: int | None = None
    """KV-cache capacity in tokens (summed over its engines); None: not exported."""
    kind_hint: UpstreamKind | None = None
    """The kind the metric names say (None: none of the known prefixes)."""

    @property
    def empty(self) -> bool:
        """Whether the scrape held nothing the gateway reads: no known series, no kind signal."""
        return self.kind_hint is None and all(
            v is None
            for v in (
                self.requests_running,
                self.requests_waiting,
                self.kv_cache_usage,
                self.kv_capacity_tokens,
            )
        )

    def age_s(self, now: float) -> float:
        """Seconds from this scrape to ``now`` (a ``time.monotonic()`` value), at least 0."""
        return max(0.0, now - self.at)

    def filled(self, other: EngineSample) -> EngineSample:
        """This sample with ``other``'s values where this one has None (``/metrics`` first, then llama.cpp's
        ``/slots``, scraped in the same tick); ``at`` is the older of the two."""
        values = {
            f.name: getattr(other, f.name)
            for f in fields(self)
            if f.name != "at" and getattr(self, f.name) is None
        }
        return replace(self, **values, at=min(self.at, other.at))


def sample_from_metrics(text: str, kind: UpstreamKind | None = None, at: float | None = None) -> EngineSample:
    """The :class:`EngineSample` in a Prometheus text exposition (format 0.0.4, what every peer serves).

    ``kind``: read the series of that kind (the replica's configured or card-given kind); None: those of
    the kind the metric names say (``kind_from_metric_names``), nothing when they say none. ``at``: the
    sample's ``time.monotonic()`` stamp (default: now). Values out of range are dropped (module docstring).
    vLLM's capacity is the ``kv_cache_size_tokens`` label
    of ``vllm:cache_config_info``, else ``num_gpu_blocks`` x ``block_size`` (vllm/config/cache.py), summed
    over its engines. Raises ValueError when a line of a sampled series is malformed (prometheus_client's
    parser), or when there are more than :data:`MAX_SAMPLED_LINES` of them; lines of other series are not
    parsed."""
    at = time.monotonic() if at is None else at
    names, kept = _scan(text)
    hint = kind_from_metric_names(names)
    chosen = kind if kind in METRIC_NAMES else hint
    entry = METRIC_NAMES.get(chosen) if chosen is not None else None
    if entry is None:
        return EngineSample(at, kind_hint=hint)
    series = _parse(kept)
    skip = frozenset(entry.replica_labels)
    capacity = _combine(_first(series, entry.kv_capacity_tokens), skip, "sum", MAX_CAPACITY_TOKENS)
    if capacity is None and entry.cache_config_info:
        capacity = _info_capacity(series.get(entry.cache_config_info, []))
    return EngineSample(
        at,
        requests_running=_combine(_first(series, entry.requests_running), skip, "sum", MAX_COUNT),
        requests_waiting=_combine(_first(series, entry.requests_waiting), skip, "sum", MAX_COUNT),
        kv_cache_usage=_combine(_first(series, entry.kv_cache_usage), skip, "max", 1.0),
        kv_capacity_tokens=round(capacity) if capacity is not None and capacity >= 1 else None,
        kind_hint=hint,
    )


def sample_from_slots(body: Any, at: float | None = None) -> EngineSample:
    """The :class:`EngineSample` in llama.cpp's ``GET /slots`` answer (a JSON array, one object per slot;
    ``tools/server/server-context.cpp`` ``server_slot::to_json``): ``requests_running`` = slots with
    ``is_processing``, ``kv_capacity_tokens`` = the sum of the slots' ``n_ctx``, ``kv_cache_usage`` = the sum
    of their ``n_prompt_tokens`` / that capacity (at most 1); no ``requests_waiting`` (``/slots`` does not
    list the tasks waiting for a slot: ``llamacpp:requests_deferred`` in ``/metrics`` does).

    What the fields count, in the server's source: ``n_prompt_tokens`` is ``prompt.tokens.size()``, the
    tokens of the slot's KV sequence: the prompt, and each sampled token as it goes into the next batch (so
    it already counts ``next_token[0].n_decoded``; recorded: 37 prompt + 35 decoded = 72). An idle slot shows
    its last task (``task_prev``) and keeps its cache cells for the next prompt with that prefix, so its
    ``n_prompt_tokens`` is counted too (a slot that never ran has none); with a unified cache the server
    frees idle slots' cells when it needs room (``try_clear_idle_slots``), so those are in use but
    reclaimable. ``n_ctx`` is ``n_ctx_slot()`` = ``llama_n_ctx_seq``: with a split cache (``-np N``
    without ``--kv-unified``) the context divided among the slots, so the sum is the whole KV cache; with a
    unified cache (``--kv-unified``, and llama-server's default when ``-np`` is not given: 4 slots) every
    slot reports the whole cache, so the sum overstates the capacity, and understates the usage, by the
    number of slots. Nothing in ``/slots``, ``/props`` or ``/metrics`` says which (``total_slots`` is the
    number of slots either way), so this is exact for a split cache only. A capacity over
    :data:`MAX_CAPACITY_TOKENS` is dropped. Raises ValueError when ``body`` is
    not a non-empty array of slot objects with a positive integer ``n_ctx``."""
    at = time.monotonic() if at is None else at
    if not isinstance(body, list) or not body:
        raise ValueError("/slots: not a non-empty JSON array")
    capacity = used = running = 0
    for slot in body:
        n_ctx = slot.get("n_ctx") if isinstance(slot, dict) else None
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0:
            raise ValueError(f"/slots: a slot without a positive n_ctx: {str(slot)[:200]}")
        tokens = slot.get("n_prompt_tokens")
        capacity += n_ctx
        used += tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 0
        running += slot.get("is_processing") is True
    return EngineSample(
        at,
        requests_running=float(running),
        kv_cache_usage=min(1.0, used / capacity),
        kv_capacity_tokens=capacity if capacity <= MAX_CAPACITY_TOKENS else None,
    )


def _scan(text: str) -> tuple[set[str], list[str]]:
    """(every series name in ``text``, its lines of sampled series with their ``# HELP``/``# TYPE``).
    Raises ValueError past :data:`MAX_SAMPLED_LINES` such lines."""
    names: set[str] = set()
    kept: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in _SAMPLED:
                kept.append(line)
            continue
        name = line.split("{", 1)[0].split(None, 1)[0] if line[0] != "{" else ""
        names.add(name)
        if name in _SAMPLED:
            kept.append(line)
            if len(kept) > MAX_SAMPLED_LINES:
                raise ValueError(f"more than {MAX_SAMPLED_LINES} lines of sampled series")
    names.discard("")
    return names, kept


def _parse(lines: list[str]) -> dict[str, Series]:
    """Series name → its (labels, value) pairs, from exposition lines. Raises ValueError."""
    series: dict[str, Series] = {}
    if not lines:
        return series
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            series.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return series


def _first(series: Mapping[str, Series], names: Iterable[str]) -> Series:
    """The first of ``names`` that the scrape holds (newer name first), else none."""
    for name in names:
        if series.get(name):
            return series[name]
    return []


def _combine(
    pairs: Series, replica_labels: frozenset[str], how: Literal["sum", "max"], upper: float
) -> float | None:
    """One value from a series' label sets: label sets that differ only in ``replica_labels`` are copies
    (their largest counts), the rest are combined by ``how``. Values outside 0 .. ``upper`` (NaN and
    infinities too) are ignored; None when none is left."""
    groups: dict[frozenset[tuple[str, str]], float] = {}
    for labels, value in pairs:
        if not 0.0 <= value <= upper:  # False for NaN
            continue
        key = frozenset((k, v) for k, v in labels.items() if k not in replica_labels)
        groups[key] = max(groups.get(key, value), value)
    if not groups:
        return None
    return float(sum(groups.values())) if how == "sum" else max(groups.values())


def _info_capacity(pairs: Series) -> float | None:
    """KV capacity in tokens from vLLM's ``vllm:cache_config_info`` label sets, summed over its engines:
    ``kv_cache_size_tokens`` (group-aware, current releases) else ``num_gpu_blocks`` x ``block_size``; a set
    that says neither (``None`` before profiling) counts nothing. None when no set says it."""
    total = 0
    for labels, _ in pairs:
        tokens = _positive_int(labels.get("kv_cache_size_tokens"))
        if tokens is None:
            blocks, size = (
                _positive_int(labels.get("num_gpu_blocks")),
                _positive_int(labels.get("block_size")),
            )
            tokens = blocks * size if blocks and size else None
        total += tokens or 0
    return float(total) if 0 < total <= MAX_CAPACITY_TOKENS else None


def _positive_int(text: str | None) -> int | None:
    """``"6000"`` → 6000; None for a missing, non-integer (``"None"``) or non-positive label value."""
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None
