"""Service tiers and the admission decision of issue 42 (docs/engine-server.md "Priorities and admission").
Pure Python.

Tiers (OpenAI's ``service_tier`` vocabulary): ``priority`` (interactive, latency first), ``default`` and
``flex`` (batch: cheaper, slower, deferred behind the others and preempted for them). The scheduler admits
waiting requests by tier first, then by the request's ``priority`` (vLLM's field: lower is earlier), then by
the fairness rules of engine/core/fairness.py between the tenants and requests of one tier (FCFS inside a
request).

Admission (off unless a tier has a TTFT objective): a request whose predicted time to first token
(engine/core/ttft.py) exceeds its tier's objective is refused before it is queued, with the prediction in
the reason and a Retry-After of the seconds the queue would need to drain to meet it; never on an engine with
nothing running and nothing ahead of it (no wait to avoid: refusing could not help it). With admission on, a
tier's objective is also its queue's timeout (HAProxy's ``timeout queue``, the Gateway API Inference
Extension's sheddable requests): an admitted request that still waits for its first prefill when its first
token can no longer come within the objective is dropped from the queue with the same 503
(engine/core/scheduler.py ``shed_overdue``), so no prefill is spent on an answer already late and the requests
behind it get its place.
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
SHED_REASONS = ("ttft_slo", "ttft_slo_queued", "deadline")
"""Why a request was refused or dropped before its prefill: its predicted TTFT exceeded its tier's objective
(a 503 at admission), its first token could no longer come within that objective while it waited (a 503 when
it is dropped from the queue), or its client's deadline passed while it waited (dropped from the queue)."""


def tier_rank(tier: str) -> int:
    """0 for the best tier; raises KeyError for an unknown tier."""
    return TIER_RANK[tier]


def parse_slos(text: str) -> dict[str, float]:
    """TTFT objectives from ``"2"`` (every tier) or ``"priority=1,default=2,flex=30"`` (seconds; tiers left
    out have none); ``""`` = none (admission off). Raises ValueError naming the bad part (a tier named twice
    too)."""
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
        if tier in slos:
            raise ValueError(f"a TTFT objective per tier: tier {tier} is named twice in {text!r}")
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
    bound_s: float | None = None
    """The prediction scaled by its tier's recent errors at admission's quantile (``quantile``), what was
    held against the objective; None: the prediction itself was (too few first tokens of the tier yet)."""
    quantile: float | None = None
    waited_s: float | None = None
    """Set when the request was dropped from the queue (admitted, then overdue): the seconds it had waited;
    ``predicted_ttft_s`` is then that wait plus its own first step. None: refused at admission."""
    retry_basis_s: float | None = None
    """Set with ``waited_s``: the (scaled) prediction of the same request arriving at the drop, which
    Retry-After is computed from (the dropped request's own figure says only that it was late)."""

    @property
    def reason(self) -> str:
        """``ttft_slo`` (refused at admission) or ``ttft_slo_queued`` (dropped from the queue): the
        ``reason`` label of ``kvscope_engine_requests_shed_total`` (:data:`SHED_REASONS`)."""
        return "ttft_slo" if self.waited_s is None else "ttft_slo_queued"

    @property
    def decided_on_s(self) -> float:
        """The seconds held against the objective: :attr:`bound_s`, else the prediction."""
        return self.predicted_ttft_s if self.bound_s is None else self.bound_s

    @property
    def retry_after_s(self) -> int:
        """Whole seconds until the queue would have drained enough to meet the objective (at least 1): from
        :attr:`retry_basis_s` for a request dropped from the queue, else from :attr:`decided_on_s`."""
        basis = self.decided_on_s if self.retry_basis_s is None else self.retry_basis_s
        return max(1, math.ceil(basis - self.slo_s))

    @property
    def message(self) -> str:
        """The refusal in words, e.g. ``predicted time to first token 7.8 s exceeds the 2 s objective of tier
        default; 41 requests ahead``, or with calibration ``predicted time to first token 41.0 s (58.3 s at
        the 90th percentile of recent errors) exceeds the 45 s objective of tier flex; 12 requests
        ahead``; dropped from the queue ``waited 58.2 s in the queue; predicted time to first token 60.4 s
        exceeds the 60 s objective of tier flex; 3 requests ahead``."""
        calibrated = ""
        if self.bound_s is not None and self.quantile is not None:
            calibrated = (
                f" ({_over(self.bound_s, self.slo_s)} s at the {_ordinal(self.quantile)} percentile of "
                "recent errors)"
            )
        predicted = _over(self.predicted_ttft_s, self.slo_s)
        waited = "" if self.waited_s is None else f"waited {self.waited_s:.1f} s in the queue; "
        return (
            f"{waited}predicted time to first token {predicted} s{calibrated} exceeds the "
            f"{self.slo_s:g} s objective of tier {self.tier}; {self.requests_ahead} "
            f"{'request' if self.requests_ahead == 1 else 'requests'} ahead"
        )


def _over(seconds: float, slo: float) -> str:
    """``seconds`` with one decimal, or as many more (up to 3) as it takes not to read as ``slo`` or less
    when it is above it (0.5004 against 0.5: ``0.5004``, not ``0.5``)."""
    for digits in range(1, 4):
        if seconds <= slo or round(seconds, digits) > slo:
            return f"{seconds:.{digits}f}"
    return f"{seconds:.4f}"


def _ordinal(quantile: float) -> str:
    """0.9 → ``90th``, 0.5 → ``50th``, 0.99 → ``99th``, 0.995 → ``99.5th``, 0.01 → ``1st``."""
    percent = f"{quantile * 100:.10g}"
    if "." not in percent and percent[-2:] not in ("11", "12", "13") and percent[-1] in "123":
        return percent + {"1": "st", "2": "nd", "3": "rd"}[percent[-1]]
    return percent + "th"


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Admission by predicted TTFT (engine ``--ttft-slo``). Raises ValueError for an unknown tier or an
    objective that is not a positive number of seconds."""

    ttft_slo_s: Mapping[str, float] = field(default_factory=dict)
    """Tier → TTFT objective (seconds); a tier without one is never refused; empty: admission off."""
    quantile: float = 0.9
    """The share of admitted requests meant to meet their objective (``--ttft-slo-quantile``): a prediction
    is scaled by its tier's recent actual/predicted ratio at this quantile before it is held against the
    objective (engine/core/ttft.py TtftCalibration), once the tier has had enough first tokens."""

    def __post_init__(self) -> None:
        for tier, slo in self.ttft_slo_s.items():
            if tier not in TIER_RANK:
                raise ValueError(f"unknown tier {tier!r}; tiers are {', '.join(TIERS)}")
            if not slo > 0 or math.isinf(slo):
                raise ValueError(f"the TTFT objective of tier {tier} must be positive, got {slo}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"the admission quantile must be in (0, 1], got {self.quantile}")

    @property
    def enabled(self) -> bool:
        return bool(self.ttft_slo_s)

    def decide(
        self,
        tier: str,
        predicted_ttft_s: float | None,
        requests_ahead: int,
        error_ratio: float | None = None,
        running: int | None = None,
    ) -> Refusal | None:
        """The refusal of a request of ``tier`` predicted to wait ``predicted_ttft_s`` for its first token
        (None: no prediction yet, never refused), or None to admit it. ``error_ratio``: the tier's recent
        actual/predicted ratio at :attr:`quantile` (TtftCalibration.ratio; None: too few yet); the
        prediction times it is held against the objective. ``running``: requests running now (None: not
        known); with none running and none ahead the request is admitted whatever its prediction: that is its
        own prefill, which no retry shortens (a prompt too long for the objective would otherwise be refused
        forever, with a Retry-After that cannot come true)."""
        slo = self.ttft_slo_s.get(tier)
        if slo is None or predicted_ttft_s is None or (running == 0 and requests_ahead == 0):
            return None
        bound = None if error_ratio is None else predicted_ttft_s * error_ratio
        if (predicted_ttft_s if bound is None else bound) <= slo:
            return None
        quantile = None if bound is None else self.quantile
        return Refusal(tier, predicted_ttft_s, slo, requests_ahead, bound, quantile)
