"""Per-request latency attribution from the scheduler's own step records (issue 18). Pure Python.

Every step the scheduler already knows, for each request it scheduled, the request's own tokens, the step's
prefill and decode token totals, the number of requests in it, and (from its own clock, read once when the
step is scheduled and once when its output is applied) the step's duration. :class:`StepAttribution` sums
those per request — a few integer and float adds per scheduled request per step, no sampling and no second
clock — and :meth:`StepAttribution.fields` turns them into the attribution fields of
:class:`~kvscope.engine.core.stats.KvscopeStats`.

The split of one step's seconds between its requests is token-proportional: a request that scheduled ``own``
of the step's ``total`` tokens is charged ``dt * own / total`` as its own compute and ``dt * (total - own) /
total`` as interference (the other requests' prefill and decode tokens that shared the step). The phase is
*prefill* until the request's first token is sampled (recomputation after a preemption before the first token
included) and *decode* after it. Time a request spent preempted (from the step that preempted it to the step
that re-admitted it) is counted separately per phase; what a phase's wall time leaves after its steps and its
preempted time (host work between steps, steps that did not schedule it) is ``*_other_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscope.engine.core.stats import KvscopeStats

QUEUE_LIMITS: tuple[str, ...] = ("max_num_seqs", "kv_cache", "token_budget", "preemption")
"""Why a step admitted no further waiting request (``queue_limit``), indexed as in
``Scheduler._blocked_steps``: the running list held ``max_num_seqs``; the head of the queue got no KV
blocks; the step's ``max_num_batched_tokens`` were spent; the step preempted (vLLM v1 admits nobody in such
a step)."""


LATENCY_CAUSES: dict[str, tuple[str, ...]] = {
    "ttft": ("queue", "own", "other_prefills", "batched_decodes", "preemption", "host"),
    "decode": ("own", "other_prefills", "batched_decodes", "preemption", "host"),
}
"""Phase → causes of ``kvscope_engine_latency_cause_seconds_total`` (docs/metrics.md;
:func:`cause_seconds`)."""


def cause_seconds(stats: KvscopeStats) -> dict[tuple[str, str], float]:
    """(phase, cause) → seconds of one request, from its attribution fields: ``ttft`` = queue + the prefill
    phase, ``decode`` = first → last token. ``own``: its own tokens' share of its steps; ``other_prefills`` /
    ``batched_decodes``: the share of other requests' prefill / decode tokens; ``preemption``: time preempted;
    ``host``: the phase's wall time not covered by its steps. Empty without attribution (no step yet)."""
    if stats.prefill_steps is None:
        return {}
    out: dict[tuple[str, str], float] = {("ttft", "queue"): stats.queue_s or 0.0}
    for phase, prefix in (("ttft", "prefill"), ("decode", "decode")):
        interference = getattr(stats, f"{prefix}_interference_s") or 0.0
        by_prefill = getattr(stats, f"{prefix}_interference_prefill_s") or 0.0
        out[(phase, "own")] = getattr(stats, f"{prefix}_own_s") or 0.0
        out[(phase, "other_prefills")] = by_prefill
        out[(phase, "batched_decodes")] = max(interference - by_prefill, 0.0)
        out[(phase, "preemption")] = getattr(stats, f"{prefix}_preempted_s") or 0.0
        out[(phase, "host")] = getattr(stats, f"{prefix}_other_s") or 0.0
    return out


@dataclass(slots=True)
class _Phase:
    """Sums over the steps of one phase (prefill or decode) that scheduled the request."""

    steps: int = 0
    own_tokens: int = 0
    other_prefill_tokens: int = 0
    other_decode_tokens: int = 0
    other_requests_max: int = 0
    step_s_sum: float = 0.0
    step_s_max: float = 0.0
    own_s: float = 0.0
    interference_s: float = 0.0
    interference_prefill_s: float = 0.0
    preempted_s: float = 0.0

    def add(
        self, own: int, other_prefill: int, other_decode: int, others: int, dt: float, share: float
    ) -> None:
        """One step: ``own`` of its tokens, the others' tokens and count, ``dt`` seconds, ``share`` = dt / the
        step's tokens."""
        self.steps += 1
        self.own_tokens += own
        self.other_prefill_tokens += other_prefill
        self.other_decode_tokens += other_decode
        if others > self.other_requests_max:
            self.other_requests_max = others
        self.step_s_sum += dt
        if dt > self.step_s_max:
            self.step_s_max = dt
        self.own_s += share * own
        self.interference_s += share * (other_prefill + other_decode)
        self.interference_prefill_s += share * other_prefill

    def fields(self, prefix: str, wall_s: float | None) -> dict[str, Any]:
        """The phase's KvscopeStats fields; ``wall_s`` is the phase's measured wall time (None: not
        reached)."""
        explained = self.own_s + self.interference_s + self.preempted_s
        return {
            f"{prefix}_steps": self.steps,
            f"{prefix}_tokens": self.own_tokens,
            f"{prefix}_other_prefill_tokens": self.other_prefill_tokens,
            f"{prefix}_other_decode_tokens": self.other_decode_tokens,
            f"{prefix}_other_requests_max": self.other_requests_max,
            f"{prefix}_step_s_mean": self.step_s_sum / self.steps if self.steps else None,
            f"{prefix}_step_s_max": self.step_s_max if self.steps else None,
            f"{prefix}_own_s": self.own_s,
            f"{prefix}_interference_s": self.interference_s,
            f"{prefix}_interference_prefill_s": self.interference_prefill_s,
            f"{prefix}_preempted_s": self.preempted_s,
            f"{prefix}_other_s": None if wall_s is None else max(wall_s - explained, 0.0),
        }


@dataclass(slots=True)
class StepAttribution:
    """One request's step records (see the module docstring); the scheduler calls the ``on_*`` methods."""

    queue_ahead: int = 0
    """Requests waiting ahead of it when it arrived."""
    running_on_arrival: int = 0
    blocked_at_arrival: list[int] = field(default_factory=list)
    """The scheduler's per-limit blocked-step counters when the request arrived (see QUEUE_LIMITS)."""
    blocked_while_queued: list[int] = field(default_factory=list)
    """Steps, per limit, that admitted nobody else while the request first waited."""
    prefill: _Phase = field(default_factory=_Phase)
    decode: _Phase = field(default_factory=_Phase)
    preempted_at: float | None = None
    recomputed_tokens: int = 0

    def on_arrival(self, queue_ahead: int, running: int, blocked_steps: list[int]) -> None:
        self.queue_ahead, self.running_on_arrival = queue_ahead, running
        self.blocked_at_arrival = list(blocked_steps)

    def on_first_admission(self, blocked_steps: list[int]) -> None:
        self.blocked_while_queued = [
            now - then for now, then in zip(blocked_steps, self.blocked_at_arrival, strict=True)
        ]

    def on_readmitted(self, now: float, before_first_token: bool) -> None:
        if self.preempted_at is not None:
            (self.prefill if before_first_token else self.decode).preempted_s += now - self.preempted_at
            self.preempted_at = None

    def fields(self, prefill_wall_s: float | None, decode_wall_s: float | None) -> dict[str, Any]:
        """The attribution fields of KvscopeStats (names and units documented there)."""
        blocked = self.blocked_while_queued
        worst = max(range(len(blocked)), key=blocked.__getitem__) if blocked and max(blocked) > 0 else None
        return {
            "queue_ahead": self.queue_ahead,
            "running_on_arrival": self.running_on_arrival,
            "queue_limit": None if worst is None else QUEUE_LIMITS[worst],
            "queue_blocked_steps": sum(blocked),
            **self.prefill.fields("prefill", prefill_wall_s),
            **self.decode.fields("decode", decode_wall_s),
            "recomputed_tokens": self.recomputed_tokens,
        }
