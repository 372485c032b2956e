"""Per-request latency attribution from the scheduler's own step records. Pure Python.

Every step the scheduler already knows, for each request it scheduled, the request's own tokens, the step's
prefill and decode token totals, the number of requests in it, and (from its own clock, read once when the
step is scheduled and once when its output is applied) the step's duration. :class:`StepAttribution` sums
those per request — a few integer and float adds per scheduled request per step, no sampling and no second
clock — and :meth:`StepAttribution.summary` turns them into a :class:`RequestAttribution`, whose fields
:meth:`kvscope.engine.core.request.RequestStats.summary` copies into
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

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvscope.engine.core.stats import PhaseAttribution

if TYPE_CHECKING:
    from kvscope.engine.core.stats import KvscopeStats


class QueueLimit(enum.StrEnum):
    """Why a step admitted no further waiting request; the value is the ``queue_limit`` field's. Declared in
    tie-break order (:meth:`BlockedSteps.most`)."""

    MAX_NUM_SEQS = "max_num_seqs"
    """The running list held ``max_num_seqs`` (or only groups that gave up a slot this step were left)."""
    KV_CACHE = "kv_cache"
    """The head of the queue got no KV blocks."""
    TOKEN_BUDGET = "token_budget"
    """The step's ``max_num_batched_tokens`` were spent."""
    PREEMPTION = "preemption"
    """The step preempted for KV blocks (vLLM v1 admits nobody in such a step)."""


@dataclass(slots=True)
class BlockedSteps:
    """Steps that left requests waiting, counted per :class:`QueueLimit` (the scheduler holds one running
    count; a request keeps a copy from its arrival)."""

    counts: dict[QueueLimit, int] = field(default_factory=lambda: dict.fromkeys(QueueLimit, 0))

    def count(self, limit: QueueLimit) -> None:
        """One more step held by ``limit``."""
        self.counts[limit] += 1

    def copy(self) -> BlockedSteps:
        return BlockedSteps(dict(self.counts))

    def since(self, earlier: BlockedSteps) -> BlockedSteps:
        """The steps counted after ``earlier`` (a copy of this count taken before)."""
        return BlockedSteps({limit: n - earlier.counts[limit] for limit, n in self.counts.items()})

    def total(self) -> int:
        return sum(self.counts.values())

    def most(self) -> QueueLimit | None:
        """The limit that held the most steps (the first in declaration order on a tie); None: no step."""
        limit = max(QueueLimit, key=self.counts.__getitem__)
        return limit if self.counts[limit] > 0 else None


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
    for label, phase in (("ttft", stats.prefill_phase), ("decode", stats.decode_phase)):
        interference = phase.interference_s or 0.0
        by_prefill = phase.interference_prefill_s or 0.0
        out[(label, "own")] = phase.own_s or 0.0
        out[(label, "other_prefills")] = by_prefill
        out[(label, "batched_decodes")] = max(interference - by_prefill, 0.0)
        out[(label, "preemption")] = phase.preempted_s or 0.0
        out[(label, "host")] = phase.other_s or 0.0
    return out


@dataclass(slots=True)
class PhaseSteps:
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

    def summary(self, wall_s: float | None) -> PhaseAttribution:
        """The phase's attribution; ``wall_s`` is the phase's measured wall time (None: not reached)."""
        explained = self.own_s + self.interference_s + self.preempted_s
        return PhaseAttribution(
            steps=self.steps,
            tokens=self.own_tokens,
            other_prefill_tokens=self.other_prefill_tokens,
            other_decode_tokens=self.other_decode_tokens,
            other_requests_max=self.other_requests_max,
            step_s_mean=self.step_s_sum / self.steps if self.steps else None,
            step_s_max=self.step_s_max if self.steps else None,
            own_s=self.own_s,
            interference_s=self.interference_s,
            interference_prefill_s=self.interference_prefill_s,
            preempted_s=self.preempted_s,
            other_s=None if wall_s is None else max(wall_s - explained, 0.0),
        )


@dataclass(frozen=True, slots=True)
class RequestAttribution:
    """One request's attribution (the KvscopeStats fields of the same names; units documented there)."""

    queue_ahead: int
    running_on_arrival: int
    queue_limit: QueueLimit | None
    queue_blocked_steps: int
    prefill: PhaseAttribution
    decode: PhaseAttribution
    recomputed_tokens: int


@dataclass(slots=True)
class StepAttribution:
    """One request's step records (see the module docstring); the scheduler calls the ``on_*`` methods."""

    queue_ahead: int = 0
    """Requests waiting ahead of it when it arrived."""
    running_on_arrival: int = 0
    blocked_at_arrival: BlockedSteps = field(default_factory=BlockedSteps)
    """The scheduler's blocked-step counts when the request arrived."""
    blocked_while_queued: BlockedSteps = field(default_factory=BlockedSteps)
    """Steps, per limit, that admitted nobody else while the request first waited."""
    prefill: PhaseSteps = field(default_factory=PhaseSteps)
    decode: PhaseSteps = field(default_factory=PhaseSteps)
    preempted_at: float | None = None
    recomputed_tokens: int = 0

    def on_arrival(self, queue_ahead: int, running: int, blocked_steps: BlockedSteps) -> None:
        self.queue_ahead, self.running_on_arrival = queue_ahead, running
        self.blocked_at_arrival = blocked_steps.copy()

    def on_first_admission(self, blocked_steps: BlockedSteps) -> None:
        self.blocked_while_queued = blocked_steps.since(self.blocked_at_arrival)

    def on_readmitted(self, now: float, before_first_token: bool) -> None:
        if self.preempted_at is not None:
            (self.prefill if before_first_token else self.decode).preempted_s += now - self.preempted_at
            self.preempted_at = None

    def summary(self, prefill_wall_s: float | None, decode_wall_s: float | None) -> RequestAttribution:
        """The request's attribution; the wall times are its measured prefill and decode seconds (None: not
        reached)."""
        return RequestAttribution(
            queue_ahead=self.queue_ahead,
            running_on_arrival=self.running_on_arrival,
            queue_limit=self.blocked_while_queued.most(),
            queue_blocked_steps=self.blocked_while_queued.total(),
            prefill=self.prefill.summary(prefill_wall_s),
            decode=self.decode.summary(decode_wall_s),
            recomputed_tokens=self.recomputed_tokens,
        )
