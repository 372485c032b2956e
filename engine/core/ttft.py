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

What it does not foresee (docs/engine-server.md "Admission"): requests that arrive later and overtake (a
higher tier, a tenant running fewer under the fairness rules, preempted requests going back to the front),
KV-cache preemption, requests that stop early or late, prefix-cache hits of the requests ahead beyond what
the cache held when each arrived.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
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


def replay_ttft(
    running: Sequence[SimSequence],
    ahead: Iterable[SimSequence],
    target_prefill: int,
    limits: StepLimits,
    step_time: StepTime,
) -> float | None:
    """Seconds until a request whose prompt needs ``target_prefill`` tokens computed samples its first token,
    if ``running`` run and the waiting requests ``ahead`` (admission order) are admitted first, step by step
    under ``limits``, each step costing ``step_time``. None when ``step_time`` has no estimate. The
    sequences are not modified."""
    run = [SimSequence(s.prefill_left, s.decode_left, s.context) for s in running]
    queue = deque(SimSequence(s.prefill_left, s.decode_left, s.context) for s in ahead)
    target = SimSequence(max(target_prefill, 1), 0, 0)
    queue.append(target)
    threshold = limits.long_prefill_token_threshold
    elapsed = 0.0
    for _ in range(MAX_SIMULATED_STEPS):
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


def running_sequence(request: Request, expected_output: int) -> SimSequence:
    """A running request as the replay sees it: its prompt chunk (or recompute) still to compute, else
    decoding with its expected tokens left (at least 1)."""
    left = request.num_tokens - request.num_computed_tokens
    if request.num_output_tokens == 0 or left > 1:
        return SimSequence(
            left, max(expected_output - request.num_output_tokens - 1, 0), request.num_computed_tokens
        )
    return SimSequence(0, max(expected_output - request.num_output_tokens, 1), request.num_computed_tokens)


def waiting_sequence(request: Request, expected_output: int, cached_tokens: int) -> SimSequence:
    """A waiting request (new or preempted) as the replay sees it: all its tokens but ``cached_tokens``
    (what the prefix cache held when it arrived) to compute."""
    prefill = max(request.num_tokens - cached_tokens, 1)
    return SimSequence(prefill, max(expected_output - request.num_output_tokens - 1, 0), cached_tokens)
