"""Service tiers and the admission decision of issue 42 (docs/engine-server.md "Priorities and admission").
Pure Python.

Tiers (OpenAI's ``service_tier`` vocabulary): ``priority`` (interactive, latency first), ``default`` and
``flex`` (batch: cheaper, slower, deferred behind the others and preempted for them). The scheduler admits
waiting requests by tier first, then by the request's ``priority`` (vLLM's field: lower is earlier), then by
the fairness rules of engine/core/fairness.py between the tenants and requests of one tier (FCFS inside a
request).

Admission (off unless a tier has a TTFT objective): a request whose predicted time to first token
(engine/core/ttft.py) exceeds its tier's objective is refused before it is queued, with the prediction in
the reason and a Retry-After of the seconds the queue would need to drain to meet it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

TIERS = ("priority", "default", "flex")
"""Service tiers, best first (the scheduler's order)."""
TIER_RANK = {tier: rank for rank, tier in enumerate(TIERS)}
DEFAULT_TIER = "default"
DEFERRABLE_TIERS = frozenset({"flex"})
"""Tiers whose running requests are preempted (by recompute) when a better tier's waiting requests find no
free running slot."""
SERVICE_TIERS = {
    "auto": "default",
    "default": "default",
    "scale": "default",
    "flex": "flex",
    "priority": "priority",
}
"""OpenAI's ``service_tier`` values → kvscope's tier (``auto`` and ``scale`` are served as ``default``)."""
SHED_REASONS = ("ttft_slo", "deadline")
"""Why a request was refused or dropped before its prefill: its predicted TTFT exceeded its tier's objective
(a 503 at admission), or its deadline passed while it waited (dropped from the queue)."""


def tier_rank(tier: str) -> int:
    """0 for the best tier; raises KeyError for an unknown tier."""
    return TIER_RANK[tier]


def parse_slos(text: str) -> dict[str, float]:
    """TTFT objectives from ``"2"`` (every tier) or ``"priority=1,default=2,flex=30"`` (seconds; tiers left
    out have none); ``""`` = none (admission off). Raises ValueError naming the bad part."""
    text = text.strip()
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(TIERS, _seconds(text))
    slos: dict[str, float] = {}
    for part in text.split(","):
        tier, sep, value = part.partition("=")
        tier = tier.strip()
        if not sep or tier not in TIER_RANK:
            raise ValueError(
                f"a TTFT objective is TIER=SECONDS with TIER one of {', '.join(TIERS)}, got {part!r}"
            )
        slos[tier] = _seconds(value)
    return slos


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise ValueError(f"a TTFT objective is a number of seconds, got {text!r}") from exc
    if not value > 0 or math.isinf(value):
        raise ValueError(f"a TTFT objective must be a positive number of seconds, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why one request was refused at admission."""

    tier: str
    predicted_ttft_s: float
    slo_s: float
    requests_ahead: int

    @property
    def retry_after_s(self) -> int:
        """Whole seconds until the queue would have drained enough to meet the objective (at least 1)."""
        return max(1, math.ceil(self.predicted_ttft_s - self.slo_s))

    @property
    def message(self) -> str:
        """The refusal in words, e.g. ``predicted time to first token 7.8 s exceeds the 2 s objective of tier
        default; 41 requests ahead``."""
        return (
            f"predicted time to first token {self.predicted_ttft_s:.1f} s exceeds the {self.slo_s:g} s "
            f"objective of tier {self.tier}; {self.requests_ahead} "
            f"{'request' if self.requests_ahead == 1 else 'requests'} ahead"
        )


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Admission by predicted TTFT (engine ``--ttft-slo``). Raises ValueError for an unknown tier or an
    objective that is not a positive number of seconds."""

    ttft_slo_s: Mapping[str, float] = field(default_factory=dict)
    """Tier → TTFT objective (seconds); a tier without one is never refused; empty: admission off."""

    def __post_init__(self) -> None:
        for tier, slo in self.ttft_slo_s.items():
            if tier not in TIER_RANK:
                raise ValueError(f"unknown tier {tier!r}; tiers are {', '.join(TIERS)}")
            if not slo > 0 or math.isinf(slo):
                raise ValueError(f"the TTFT objective of tier {tier} must be positive, got {slo}")

    @property
    def enabled(self) -> bool:
        return bool(self.ttft_slo_s)

    def decide(self, tier: str, predicted_ttft_s: float | None, requests_ahead: int) -> Refusal | None:
        """The refusal of a request of ``tier`` predicted to wait ``predicted_ttft_s`` for its first token
        (None: no prediction yet, never refused), or None to admit it."""
        slo = self.ttft_slo_s.get(tier)
        if slo is None or predicted_ttft_s is None or predicted_ttft_s <= slo:
            return None
        return Refusal(tier, predicted_ttft_s, slo, requests_ahead)
