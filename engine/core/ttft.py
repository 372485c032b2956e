"""Time to first token predicted from the engine's live state (issue 42). Pure Python.

Two parts:

* :class:`StepTimeModel`: one engine step's seconds as a linear function of what the step computes — its
  prefill tokens, its decode rows and the context its rows attend to (tokens in the KV cache after the step,
  summed over the step's requests) — fitted online by least squares over the scheduler's own step records
  (the records ``kvscope logs why``'s attribution reads: ``Scheduler.update_from_output`` hands each step's
  token counts and measured seconds to both), with exponential forgetting so that it follows the machine
  (another process taking a core, a different prompt mix). The model is whatever the weights' format and the
  device make of those three numbers: one engine serves one format.
* :func:`replay_ttft`: replays the scheduler's rules (engine/core/scheduler.py) on a copy of its queues:
  running requests first with one decode row each or their next prefill chunk, then the waiting requests
  ahead of the new one in admission order (tier, priority, queue order), within ``max_num_seqs`` and
  ``max_num_batched_tokens``, each step priced by the step-time model, until the new request's last prompt
  token is computed — its first token. Running and waiting requests are expected to generate what
  :class:`OutputLengths` says from the requests finished lately. Stretches of steps that only
  decode and admit nobody are priced at once (until the next running request finishes), so the cost is
  linear in the requests ahead, not in their tokens.
* Later arrivals of better tiers (:class:`RecentArrivals`, :class:`ArrivalStream`): requests of a tier
  scheduled before the new request's that arrive while it waits are admitted before it. The scheduler
  counts each tier's arrivals over the last ``window_s`` (60 s) with their mean prompt (less what the prefix
  cache held) and ``max_tokens``; the replay injects, for every tier better than the new request's, one
  request of that mean size every ``1 / rate`` seconds of simulated time (the first one ``1 / rate`` from
  now), which joins the replayed queue ahead of every queued request of a worse tier (so ahead of the new
  request) once the simulated clock has passed its arrival; at most :data:`MAX_INJECTED_ARRIVALS` of them.
  A flex request's prediction thus grows with the interactive arrival rate; a request of the best tier, or
  one with no better tier's traffic in the window, is predicted exactly as without this.

What it does not foresee (docs/engine-server.md "Priorities and admission"): bursts and lulls of the better
tiers (their arrivals are replayed evenly spaced at the window's mean rate), later arrivals of its own tier
that overtake it (a lower ``priority`` value, a tenant running fewer under the fairness rules), the
preemption of running flex requests by those injected arrivals (they wait for a free slot in the replay),
preempted requests going back to the front, KV-cache preemption, requests that stop early or late,
prefix-cache hits of the requests ahead beyond what the cache held when each arrived.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvscope.engine.core.request import Request

NUM_FEATURES = 4
"""Intercept, prefill tokens, decode rows, context tokens."""
_SCALES = (1.0, 256.0, 16.0, 4096.0)
"""Each feature divided by this before the fit, so the normal equations are well conditioned."""
MAX_SIMULATED_STEPS = 4096
"""A prediction replays at most this many steps (it is then a lower bound)."""
MAX_REPLAYED_AHEAD = 256
"""The scheduler replays at most this many waiting requests ahead; a longer queue's time is extrapolated
linearly from theirs (Scheduler.predict_ttft)."""
MAX_INJECTED_ARRIVALS = 256
"""A replay injects at most this many expected arrivals of better tiers (:class:`ArrivalStream`); past
them the prediction is a lower bound."""


class StepTime(Protocol):
    """A step-time model: learns from measured steps, prices a step by its shape (:class:`StepTimeModel`;
    tests script one)."""

    def observe(self, prefill_tokens: int, decode_rows: int, context_tokens: int, seconds: float) -> None:
        """One measured step."""
        ...

    def predict(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float | None:
        """Seconds of a step of this shape; None while unknown (no fit yet)."""
        ...


@dataclass(slots=True)
class StepTimeModel:
    """Online least-squares fit of ``seconds ≈ c0 + c1 * prefill_tokens + c2 * decode_rows + c3 *
    context_tokens`` with every coefficient >= 0 (a feature whose fitted coefficient comes out negative is
    dropped from that solve), over the steps observed so far weighted by ``forgetting ** age``.

    ``forgetting``: the weight kept per newer step (0.99: the last ~100 steps dominate). ``min_steps``:
    steps observed before :meth:`predict` answers. Raises ValueError for a forgetting factor outside (0, 1]
    or ``min_steps`` < 1."""

    forgetting: float = 0.99
    min_steps: int = 8
    ridge: float = 1e-6
    """Added to the diagonal of the normal equations (keeps a feature that never varied solvable)."""
    steps: int = 0
    """Steps observed."""
    _xtx: list[list[float]] = field(
        default_factory=lambda: [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
    )
    _xty: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    _coef: list[float] | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        if self.min_steps < 1:
            raise ValueError(f"min_steps must be at least 1, got {self.min_steps}")

    def observe(self, prefill_tokens: int, decode_rows: int, context_tokens: int, seconds: float) -> None:
        """Add one measured step (``seconds`` from its scheduling to its output applied)."""
        if seconds < 0:
            return
        x = _features(prefill_tokens, decode_rows, context_tokens)
        keep = self.forgetting
        for i in range(NUM_FEATURES):
            row = self._xtx[i]
            for j in range(NUM_FEATURES):
                row[j] = row[j] * keep + x[i] * x[j]
            self._xty[i] = self._xty[i] * keep + x[i] * seconds
        self.steps += 1
        self._coef = None

    def coefficients(self) -> list[float] | None:
        """The fitted coefficients on the scaled features (seconds per unit of each); None before
        ``min_steps`` steps."""
        if self.steps < self.min_steps:
            return None
        if self._coef is None:
            self._coef = _nonnegative_solve(self._xtx, self._xty, self.ridge)
        return self._coef

    def predict(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float | None:
        """Seconds of a step of this shape; None before ``min_steps`` steps were observed."""
        coef = self.coefficients()
        if coef is None:
            return None
        x = _features(prefill_tokens, decode_rows, context_tokens)
        return sum(c * v for c, v in zip(coef, x, strict=True))


def _features(prefill_tokens: int, decode_rows: int, context_tokens: int) -> tuple[float, ...]:
    raw = (1.0, float(prefill_tokens), float(decode_rows), float(context_tokens))
    return tuple(v / s for v, s in zip(raw, _SCALES, strict=True))


def _nonnegative_solve(xtx: list[list[float]], xty: list[float], ridge: float) -> list[float]:
    """Least squares on the normal equations with non-negative coefficients: solve over the active
    features, drop the most negative one (never the intercept), repeat."""
    active = list(range(NUM_FEATURES))
    while True:
        a = [[xtx[i][j] + (ridge if i == j else 0.0) for j in active] for i in active]
        b = [xty[i] for i in active]
        solved = _gauss(a, b)
        coef = [0.0] * NUM_FEATURES
        for index, value in zip(active, solved, strict=True):
            coef[index] = value
        negative = [i for i in active[1:] if coef[i] < 0]
        if not negative:
            coef[0] = max(coef[0], 0.0)
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve ``a x = b`` (small, dense) by Gaussian elimination with partial pivoting; a singular column
    gets 0."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col] != 0.0:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-18 else 0.0 for i in range(n)]


@dataclass(slots=True)
class SimSequence:
    """One request as the prediction replays it."""

    prefill_left: int
    """Tokens still to compute before its next token is sampled (prompt not yet computed, or a recompute
    after preemption); 0 for a request decoding."""
    decode_left: int
    """Tokens it is still expected to generate after the one its prefill samples; decoding (prefill_left
    0): still to generate, at least 1."""
    context: int
    """Tokens in its KV cache now."""
    tier: int = 0
    """Rank of its tier (0 the best, engine/core/admission.py TIERS): an injected arrival of a better tier
    joins the replayed queue ahead of it."""


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The scheduler limits the replay obeys (SchedulerConfig)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0


@dataclass(frozen=True, slots=True)
class TtftPrediction:
    """What the scheduler predicted for one new request (Scheduler.predict_ttft)."""

    seconds: float | None
    """Seconds from its arrival to its first token (the time it already waited to be queued plus
    :func:`replay_ttft`); None while the step-time model has no fit."""
    requests_ahead: int
    """Waiting requests admitted before it (admission order)."""
    tokens_ahead: int
    """Prompt tokens those and the running requests still have to compute before it."""
    running: int
    """Requests running now."""
    cached_tokens: int
    """Of its own prompt, tokens the prefix cache holds now (not computed again)."""


@dataclass(frozen=True, slots=True)
class ArrivalStream:
    """Requests of one better tier expected to arrive while the predicted request waits: one every
    ``interval_s`` seconds of simulated time from the replay's start (the first at ``interval_s``), each with
    ``prefill`` prompt tokens to compute and ``decode`` tokens expected after its first."""

    tier: int
    """Rank of their tier (0 the best)."""
    interval_s: float
    """Seconds between two of them (1 / the tier's arrival rate); > 0."""
    prefill: int
    decode: int


def injected_arrivals(
    streams: Sequence[ArrivalStream], limit: int = MAX_INJECTED_ARRIVALS
) -> Iterator[tuple[float, SimSequence]]:
    """The arrivals of ``streams`` in time order (ties: the better tier first), as (seconds from the replay's
    start, the request), at most ``limit`` in all."""
    heap = [(s.interval_s, s.tier, index, 1) for index, s in enumerate(streams) if s.interval_s > 0]
    heapq.heapify(heap)
    for _ in range(limit):
        if not heap:
            return
        at, tier, index, count = heapq.heappop(heap)
        stream = streams[index]
        yield at, SimSequence(max(stream.prefill, 1), max(stream.decode, 0), 0, tier)
        heapq.heappush(heap, ((count + 1) * stream.interval_s, tier, index, count + 1))


def replay_ttft(
    running: Sequence[SimSequence],
    ahead: Iterable[SimSequence],
    target_prefill: int,
    limits: StepLimits,
    step_time: StepTime,
    arrivals: Sequence[ArrivalStream] = (),
) -> float | None:
    """Seconds until a request whose prompt needs ``target_prefill`` tokens computed samples its first token,
    if ``running`` run and the waiting requests ``ahead`` (admission order) are admitted first, step by step
    under ``limits``, each step costing ``step_time``. ``arrivals``: better tiers' requests expected to arrive
    meanwhile (:func:`injected_arrivals`): at the start of the first simulated step that begins at or after
    its arrival, each joins the queue ahead of the new request and of every queued request of a worse tier
    (``SimSequence.tier``); none: the queue as it is. None when ``step_time`` has no estimate. The sequences
    are not modified."""
    run = [SimSequence(s.prefill_left, s.decode_left, s.context, s.tier) for s in running]
    queue = deque(SimSequence(s.prefill_left, s.decode_left, s.context, s.tier) for s in ahead)
    target = SimSequence(max(target_prefill, 1), 0, 0)
    queue.append(target)
    coming = injected_arrivals(arrivals)
    upcoming = next(coming, None)
    threshold = limits.long_prefill_token_threshold
    elapsed = 0.0
    for _ in range(MAX_SIMULATED_STEPS):
        while upcoming is not None and upcoming[0] <= elapsed:
            _enqueue(queue, upcoming[1], target)
            upcoming = next(coming, None)
        budget = limits.max_num_batched_tokens
        prefill = decode = context = 0
        sampled_target = False
        for seq in run:
            if budget <= 0:
                break
            if seq.prefill_left > 0:
                chunk = _chunk(seq.prefill_left, budget, threshold)
                seq.prefill_left -= chunk
                seq.context += chunk
                prefill += chunk
                budget -= chunk
                sampled_target |= seq is target and seq.prefill_left == 0
            else:
                seq.decode_left -= 1
                seq.context += 1
                decode += 1
                budget -= 1
            context += seq.context
        admitted = False
        while queue and budget > 0 and len(run) < limits.max_num_seqs:
            seq = queue.popleft()
            chunk = _chunk(seq.prefill_left, budget, threshold)
            seq.prefill_left -= chunk
            seq.context += chunk
            prefill += chunk
            budget -= chunk
            context += seq.context
            run.append(seq)
            admitted = True
            sampled_target |= seq is target and seq.prefill_left == 0
        seconds = step_time.predict(prefill, decode, context)
        if seconds is None:
            return None
        if sampled_target:
            return elapsed + seconds
        if not prefill and not admitted and budget > 0:
            # a pure decode stretch: every step alike until the first running request finishes
            more = min(seq.decode_left for seq in run)
            for seq in run:
                seq.decode_left -= more
                seq.context += more
            elapsed += seconds * (1 + more)
        else:
            elapsed += seconds
        run = [seq for seq in run if seq.prefill_left > 0 or seq.decode_left > 0]  # the others finished
    return elapsed


def _enqueue(queue: deque[SimSequence], seq: SimSequence, target: SimSequence) -> None:
    """Queue an injected arrival behind the queued requests of its tier or a better one, ahead of the
    others and of ``target`` (the queue is in admission order: tiers never get better towards its end)."""
    index = len(queue)
    while index > 0 and (queue[index - 1] is target or queue[index - 1].tier > seq.tier):
        index -= 1
    queue.insert(index, seq)


def _chunk(left: int, budget: int, threshold: int) -> int:
    chunk = min(left, budget)
    return min(chunk, threshold) if threshold > 0 else chunk


@dataclass(slots=True)
class OutputLengths:
    """The output length the replay expects of a request, from the last ``window`` requests that finished
    by a stop or by their length: with ``p`` the share of them that ran to their ``max_tokens`` and ``m``
    the mean output of the others (ended by EOS or a stop), a request allowed ``max_tokens`` is expected to
    generate ``p * max_tokens + (1 - p) * min(max_tokens, m)`` tokens (``ignore_eos`` traffic: exactly its
    ``max_tokens``; chat: the usual answer's length). Before any finished: ``min(max_tokens, initial)``."""

    initial: int = 256
    window: int = 128
    _recent: deque[tuple[int, bool]] = field(default_factory=deque)
    _length_hits: int = 0
    _stopped_tokens: int = 0

    def observe(self, num_output_tokens: int, reached_max_tokens: bool) -> None:
        """One finished request: its output tokens, and whether its ``max_tokens`` ended it."""
        self._recent.append((num_output_tokens, reached_max_tokens))
        self._count(num_output_tokens, reached_max_tokens, 1)
        if len(self._recent) > self.window:
            self._count(*self._recent.popleft(), -1)

    def _count(self, num_output_tokens: int, reached_max_tokens: bool, sign: int) -> None:
        if reached_max_tokens:
            self._length_hits += sign
        else:
            self._stopped_tokens += sign * num_output_tokens

    def expected(self, max_tokens: int) -> int:
        """Tokens a request allowed ``max_tokens`` is expected to generate (at least 1)."""
        finished = len(self._recent)
        if not finished:
            return max(1, min(max_tokens, self.initial))
        stopped = finished - self._length_hits
        mean_stopped = self._stopped_tokens / stopped if stopped else max_tokens
        share = self._length_hits / finished
        return max(1, round(share * max_tokens + (1 - share) * min(max_tokens, mean_stopped)))


@dataclass(slots=True)
class RecentArrivals:
    """The requests queued lately, per tier, for the expected arrivals of :func:`replay_ttft`: a tier's
    arrival rate is the number of its requests queued in the last ``window_s`` seconds divided by
    ``window_s`` (when more than ``max_kept`` came, by the seconds the last ``max_kept`` of them span),
    their size the means of their prompt tokens to compute and their ``max_tokens``. Timestamps come from
    the caller (the scheduler's clock, monotonic seconds). Raises ValueError for a window that is not
    positive or ``max_kept`` < 1."""

    window_s: float = 60.0
    max_kept: int = 1024
    _tiers: dict[int, deque[tuple[float, int, int]]] = field(default_factory=dict)
    """Tier rank → (queued at, prompt tokens to compute, max_tokens) of its kept arrivals, oldest first."""
    _sums: dict[int, list[int]] = field(default_factory=dict)
    """Tier rank → [sum of prompt tokens, sum of max_tokens] over its kept arrivals (O(1) means)."""

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")
        if self.max_kept < 1:
            raise ValueError(f"max_kept must be at least 1, got {self.max_kept}")

    def observe(self, tier: int, now: float, prompt_tokens: int, max_tokens: int) -> None:
        """A request of tier rank ``tier`` queued at ``now`` (s) with ``prompt_tokens`` to compute."""
        recent = self._tiers.setdefault(tier, deque())
        sums = self._sums.setdefault(tier, [0, 0])
        recent.append((now, prompt_tokens, max_tokens))
        sums[0] += prompt_tokens
        sums[1] += max_tokens
        if len(recent) > self.max_kept:
            self._forget(tier)

    def _forget(self, tier: int) -> None:
        _, prompt_tokens, max_tokens = self._tiers[tier].popleft()
        sums = self._sums[tier]
        sums[0] -= prompt_tokens
        sums[1] -= max_tokens

    def rate(self, tier: int, now: float) -> tuple[float, float, float] | None:
        """(arrivals per second, mean prompt tokens to compute, mean ``max_tokens``) of tier rank ``tier``
        at ``now``; None when none was queued in the window. Forgets the arrivals that left the window;
        O(1) amortised."""
        recent = self._tiers.get(tier)
        if not recent:
            return None
        while recent and recent[0][0] <= now - self.window_s:
            self._forget(tier)
        if not recent:
            return None
        span = self.window_s
        if len(recent) == self.max_kept and now - recent[0][0] > 0:
            span = now - recent[0][0]
        count = len(recent)
        prompt_tokens, max_tokens = self._sums[tier]
        return count / span, prompt_tokens / count, max_tokens / count


def running_sequence(request: Request, expected_output: int) -> SimSequence:
    """A running request as the replay sees it: its prompt chunk (or recompute) still to compute, else
    decoding with its expected tokens left (at least 1)."""
    left = request.num_tokens - request.num_computed_tokens
    if request.num_output_tokens == 0 or left > 1:
        return SimSequence(
            left, max(expected_output - request.num_output_tokens - 1, 0), request.num_computed_tokens
        )
    return SimSequence(0, max(expected_output - request.num_output_tokens, 1), request.num_computed_tokens)


def waiting_sequence(
    request: Request, expected_output: int, cached_tokens: int, tier: int = 0
) -> SimSequence:
    """A waiting request (new or preempted) as the replay sees it: all its tokens but ``cached_tokens``
    (what the prefix cache held when it arrived) to compute; ``tier``: its tier's rank."""
    prefill = max(request.num_tokens - cached_tokens, 1)
    return SimSequence(prefill, max(expected_output - request.num_output_tokens - 1, 0), cached_tokens, tier)


@dataclass(slots=True)
class TtftCalibration:
    """How far the actual times to first token ran from their predictions lately, per tier: the ratios
    actual / predicted (both from arrival) of the last ``window`` first tokens of each tier whose request had
    a prediction. Admission multiplies a new prediction by its tier's ratio at a ``quantile``
    (:meth:`ratio`) — split conformal calibration with the ratio as the score (Angelopoulos & Bates, "A
    Gentle Introduction to Conformal Prediction", 2021, §1): if the recent errors are representative, that
    share of the requests admitted on the scaled prediction meet it. It covers what the replay does not
    foresee (module docstring: bursts, preemption, early stops) by how much those moved the recent
    requests of that tier. A tier with no first token for ``max_age_s`` starts afresh (its ratios are
    dropped): only admitted requests add ratios, so a tier whose ratios refuse every request (an idle
    engine's included) would otherwise be refused forever. Raises ValueError for a window below
    ``min_samples``, ``min_samples`` < 1 or ``max_age_s`` <= 0."""

    window: int = 256
    min_samples: int = 32
    """First tokens of a tier observed before :meth:`ratio` answers for it."""
    max_age_s: float = 60.0
    """Seconds without a first token of a tier after which its ratios are dropped (``time.monotonic()``
    clock)."""
    _ratios: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)
    """Tier rank → (monotonic seconds of the first token, actual / predicted), oldest first."""

    def __post_init__(self) -> None:
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ValueError(
                f"need 1 <= min_samples <= window, got min_samples {self.min_samples}, window {self.window}"
            )
        if not self.max_age_s > 0:
            raise ValueError(f"max_age_s must be positive, got {self.max_age_s}")

    def observe(self, tier: int, predicted_s: float, actual_s: float, now: float | None = None) -> None:
        """One first token of tier rank ``tier`` at ``now`` (``time.monotonic()`` when None): predicted and
        actual seconds from arrival; ignored when either is not positive."""
        if not (predicted_s > 0 and actual_s > 0):
            return
        ratios = self._ratios.setdefault(tier, deque(maxlen=self.window))
        ratios.append((time.monotonic() if now is None else now, actual_s / predicted_s))

    def samples(self, tier: int) -> int:
        """Ratios kept for tier rank ``tier``."""
        return len(self._ratios.get(tier, ()))

    def ratio(self, tier: int, quantile: float, now: float | None = None) -> float | None:
        """The ``quantile`` of tier rank ``tier``'s kept ratios (the ceil((n + 1) x quantile)-th smallest of
        n, at most the largest: the split-conformal rank); None with fewer than ``min_samples``, or when the
        tier's newest ratio is more than ``max_age_s`` before ``now`` (``time.monotonic()`` when None: they
        are all dropped then). Raises ValueError for a quantile outside (0, 1]."""
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        ratios = self._ratios.get(tier)
        if ratios is None:
            return None
        if ratios and ratios[-1][0] < (time.monotonic() if now is None else now) - self.max_age_s:
            ratios.clear()
        if len(ratios) < self.min_samples:
            return None
        ordered = sorted(ratio for _, ratio in ratios)
        rank = min(math.ceil((len(ordered) + 1) * quantile), len(ordered))
        return ordered[rank - 1]
