"""Upstream kinds: which inference server a replica is, set in the config or detected.

Decision order (:func:`decide_kind`; docs/gateway.md "What each upstream kind can and cannot tell"): the
config's ``kind`` when it is not ``auto`` > the ``owned_by`` of its ``/v1/models`` cards
(:func:`kind_from_card`, read at every health check) > the metric names of its Prometheus endpoint
(:func:`kind_from_metric_names`, from the engine scraper) > a probe of TGI's ``/info`` or llama.cpp's
``/props`` (:func:`kind_from_info`) > ``openai`` (a plain OpenAI-compatible server: nothing beyond the
OpenAI response). The first signal that names a kind decides; ``Replica.kind_source`` says which one
(:data:`KIND_SOURCES`).

What each signal is, in the servers' own sources:

- ``owned_by`` of a ``/v1/models`` entry: vLLM ``vllm/entrypoints/openai/engine/protocol.py`` (earlier
  ``vllm/entrypoints/openai/protocol.py``) ``ModelCard.owned_by: str = "vllm"``; SGLang
  ``python/sglang/srt/entrypoints/openai/protocol.py`` ``ModelCard.owned_by: str = "sglang"``; llama.cpp
  ``tools/server/server-context.cpp`` (the ``/v1/models`` handler) ``{"owned_by", "llamacpp"}``; our engine
  engine/server/protocol.py ``owned_by: str = "kvscope"``. TGI writes the model id there
  (``router/src/server.rs`` ``openai_get_model_info``: ``owned_by: info.0.model_id``), so its card says
  nothing; nor does OpenAI's own API (``openai``, ``system``, an organisation), which is why only these four
  values are read as a kind.
- Metric names: vLLM ``vllm:*`` (``vllm/v1/metrics/loggers.py``), SGLang ``sglang:*``
  (``python/sglang/srt/observability/metrics_collector.py``, earlier ``srt/metrics/collector.py``), llama.cpp
  ``llamacpp:*`` (``tools/server/server-context.cpp`` ``/metrics``, only with ``--metrics``), TGI ``tgi_*``
  (``backends/v3/src/backend.rs``, ``queue.rs``, ``router/src/server.rs``: ``metrics::gauge!`` /
  ``counter!`` names), ours ``kvscope_engine_*`` (engine/server/metrics.py); the series the gateway samples:
  kvscope/common/upstream_metrics.py.
- TGI ``GET /info`` (``router/src/server.rs`` ``get_model_info``; ``router/src/lib.rs`` ``struct Info``):
  ``model_id``, ``router`` = ``"text-generation-router"`` (the router crate's ``CARGO_PKG_NAME``),
  ``version``. llama.cpp ``GET /props`` (``tools/server/server-context.cpp`` ``get_props``):
  ``default_generation_settings`` (``{params, n_ctx}``) and ``total_slots``. vLLM's ``/version``
  (``{"version": …}``) is not used: any server may answer that shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any, Literal

from kvscope.common.upstream_metrics import METRIC_PREFIXES as UPSTREAM_METRIC_PREFIXES


class UpstreamKind(StrEnum):
    """The inference server behind an upstream replica (the ``kind`` label and log field)."""

    KVSCOPE = "kvscope"
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    TGI = "tgi"
    OPENAI = "openai"
    """A plain OpenAI-compatible server: nothing beyond the OpenAI response."""


KindSource = Literal["config", "models", "metrics", "info", "props", "default"]
"""Which signal decided a replica's kind (``Replica.kind_source``; the log's
``kvscope.upstream.kind_source``)."""
KIND_SOURCES: tuple[KindSource, ...] = ("config", "models", "metrics", "info", "props", "default")
"""Every :data:`KindSource`, in the decision order."""

OWNED_BY: Mapping[str, UpstreamKind] = {
    "kvscope": UpstreamKind.KVSCOPE,
    "vllm": UpstreamKind.VLLM,
    "sglang": UpstreamKind.SGLANG,
    "llamacpp": UpstreamKind.LLAMACPP,
}
"""``/v1/models`` ``owned_by`` values that name their server (module docstring: where each is written)."""

METRIC_PREFIXES: tuple[tuple[str, UpstreamKind], ...] = tuple(
    (prefix, UpstreamKind(kind)) for kind, prefix in UPSTREAM_METRIC_PREFIXES.items()
)
"""Metric name prefix → the server that exports it (kvscope/common/upstream_metrics.py, shared with the
dashboards)."""

TGI_ROUTER = "text-generation-router"
"""TGI's ``/info`` ``router`` value (the router crate's name, ``router/Cargo.toml``)."""
INFO_PATH, PROPS_PATH = "/info", "/props"
"""The probes for upstreams whose card and metrics say nothing: TGI's and llama.cpp's."""


def parse_kind(value: object) -> UpstreamKind | None:
    """``value`` as an :class:`UpstreamKind` (the kind itself or its name), None for anything else."""
    try:
        return UpstreamKind(value)
    except ValueError:
        return None


def kind_from_card(card: Mapping[str, Any]) -> UpstreamKind | None:
    """The kind a ``/v1/models`` entry's ``owned_by`` names (:data:`OWNED_BY`); None for any other value
    (TGI's model id, OpenAI's ``system``) or none."""
    owned_by = card.get("owned_by")
    return OWNED_BY.get(owned_by) if isinstance(owned_by, str) else None


def kind_from_cards(cards: Iterable[Mapping[str, Any]]) -> UpstreamKind | None:
    """The kind the first card that names one names (a server lists its models with one ``owned_by``)."""
    for card in cards:
        if (kind := kind_from_card(card)) is not None:
            return kind
    return None


def kind_from_metric_names(names: Iterable[str]) -> UpstreamKind | None:
    """The kind whose prefix (:data:`METRIC_PREFIXES`) most of ``names`` carry (ties: the earlier prefix);
    None when none does. Names are metric family or sample names as a Prometheus text exposition spells
    them."""
    counts = dict.fromkeys((kind for _, kind in METRIC_PREFIXES), 0)
    for name in names:
        for prefix, kind in METRIC_PREFIXES:
            if name.startswith(prefix):
                counts[kind] += 1
                break
    best = max(counts.values())
    return next((kind for kind, n in counts.items() if n == best), None) if best else None


def kind_from_info(path: str, body: Any) -> UpstreamKind | None:
    """The kind an answer to a probe of ``path`` says: TGI for a ``/info`` object with ``model_id`` and
    ``router`` = ``text-generation-router``; llama.cpp for a ``/props`` object with a
    ``default_generation_settings`` object and ``total_slots``; else None (a 404, another server's shape)."""
    if not isinstance(body, dict):
        return None
    if path == INFO_PATH and isinstance(body.get("model_id"), str) and body.get("router") == TGI_ROUTER:
        return UpstreamKind.TGI
    if (
        path == PROPS_PATH
        and isinstance(body.get("default_generation_settings"), dict)
        and "total_slots" in body
    ):
        return UpstreamKind.LLAMACPP
    return None


def probe_source(path: str) -> KindSource:
    """The :data:`KindSource` of a probe of ``path`` (``/info`` → ``info``, ``/props`` → ``props``).
    Raises ValueError for another path."""
    if path == INFO_PATH:
        return "info"
    if path == PROPS_PATH:
        return "props"
    raise ValueError(f"not a kind probe path: {path!r}")


def decide_kind(
    configured: UpstreamKind | None,
    *,
    models: UpstreamKind | None = None,
    metrics: UpstreamKind | None = None,
    probe: tuple[UpstreamKind, KindSource] | None = None,
) -> tuple[UpstreamKind, KindSource]:
    """(kind, source) by the decision order: ``configured`` (None: ``auto``) > ``models`` (the cards'
    ``owned_by``) > ``metrics`` (the metric names) > ``probe`` ((kind, ``info`` | ``props``)) >
    (``openai``, ``default``)."""
    if configured is not None:
        return configured, "config"
    if models is not None:
        return models, "models"
    if metrics is not None:
        return metrics, "metrics"
    if probe is not None:
        return probe
    return UpstreamKind.OPENAI, "default"
