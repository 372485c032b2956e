"""When drafting pays: per request (its acceptance rate) and per step (measured step times at this batch
size).

Per request (:class:`AcceptanceTracker`): an exponential moving average of the accepted fraction of each
verified draft; once it stays below ``LOW_ACCEPTANCE`` the request stops proposing for ``backoff`` decode
steps, then tries again (the backoff doubles on each failed retry, up to ``MAX_BACKOFF``, and resets when a
retry is accepted). Text that never repeats its context then costs a draft only now and then.

Per step (:class:`StepCostModel`): for each batch-size bucket the engine keeps the EMA of the seconds of a
decode step without drafts (``t0``) and of the extra seconds per draft token (``m``) measured on steps with
drafts. Drafts of ``D`` tokens over ``B`` decode rows with ``E`` expected accepted tokens pay when
``(B + E) / (t0 + m·D) > B / t0``, i.e. ``m·D·B < t0·E``. Before both are known the model lets drafts run
(exploration) and forces one step without drafts after ``PROBE_EVERY`` unmeasured steps; where drafts do
not pay it still lets one step in ``PROBE_EVERY`` draft so a change (a lighter machine) is noticed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

EMA_ALPHA = 0.3
"""Weight of the newest draft in the acceptance EMA."""
LOW_ACCEPTANCE = 0.2
"""Accepted fraction below which a request pauses its drafts."""
MIN_DRAFTS = 2
"""Drafts verified before the EMA may pause a request."""
INITIAL_EMA = 0.5
"""A new request's acceptance EMA: three fully rejected drafts (.5 → .35 → .25 → .17) pause it, one accepted
draft keeps it proposing."""
RETRY_EMA = 0.25
"""The EMA a paused request resumes with: its one retry draft pauses it again when fully rejected
(.25 → .175), and continues when at least a quarter of it is accepted."""
FIRST_BACKOFF = 8
MAX_BACKOFF = 256
"""Decode steps a paused request waits before proposing again (doubling from FIRST_BACKOFF)."""
TIME_ALPHA = 0.2
"""Weight of the newest step in the step-time EMAs."""
PROBE_EVERY = 32
"""Steps between measurement probes of the step-cost model."""


@dataclass(slots=True)
class AcceptanceTracker:
    """One request's drafting state (see the module docstring)."""

    ema: float = INITIAL_EMA
    num_drafts: int = 0
    paused_steps: int = 0
    backoff: int = FIRST_BACKOFF

    def should_propose(self) -> bool:
        """Called once per decode step of the request; False while paused."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return False
        return True

    def on_verified(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one verified draft (``num_draft_tokens`` ≥ 1 proposed, ``num_accepted_tokens`` accepted)."""
        rate = num_accepted_tokens / num_draft_tokens
        self.ema = (1 - EMA_ALPHA) * self.ema + EMA_ALPHA * rate
        self.num_drafts += 1
        if self.num_drafts >= MIN_DRAFTS and self.ema < LOW_ACCEPTANCE:
            self.paused_steps = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
            self.ema = RETRY_EMA  # one retry draft: fully rejected, it pauses again (twice as long)
            self.num_drafts = MIN_DRAFTS - 1
        elif rate >= 0.5:
            self.backoff = FIRST_BACKOFF


def rows_bucket(num_rows: int) -> int:
    """Batch-size bucket: exact up to 4, then powers of two (5-8 → 8, 9-16 → 16, …)."""
    return num_rows if num_rows <= 4 else 1 << (num_rows - 1).bit_length()


@dataclass(slots=True)
class _Bucket:
    t0: float | None = None
    """EMA seconds of a decode step without drafts."""
    per_token: float | None = None
    """EMA extra seconds per draft token."""
    steps: int = 0
    pays: bool | None = None


class StepCostModel:
    """Measured decode-step cost per batch-size bucket, and the decision whether drafts pay (module
    docstring)."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    def record(self, num_rows: int, num_draft_tokens: int, seconds: float) -> None:
        """One decode-only step over ``num_rows`` requests with ``num_draft_tokens`` draft tokens in total
        took ``seconds`` (wall or CPU; only ratios matter)."""
        bucket = self._buckets.setdefault(rows_bucket(num_rows), _Bucket())
        if num_draft_tokens == 0:
            bucket.t0 = seconds if bucket.t0 is None else (1 - TIME_ALPHA) * bucket.t0 + TIME_ALPHA * seconds
        elif bucket.t0 is not None:
            extra = max(seconds - bucket.t0, 0.0) / num_draft_tokens
            bucket.per_token = (
                extra
                if bucket.per_token is None
                else ((1 - TIME_ALPHA) * bucket.per_token + TIME_ALPHA * extra)
            )

    def costs(self) -> dict[int, tuple[float | None, float | None, bool | None]]:
        """Per batch-size bucket (:func:`rows_bucket`): the step without drafts and the extra per draft token
        as measured (EMA seconds; None until measured), and the last decision (None before the first) — what
        bench/spec_decode.py reports."""
        return {key: (b.t0, b.per_token, b.pays) for key, b in sorted(self._buckets.items())}

    def allows(self, num_rows: int, num_draft_tokens: int, expected_accepted: float) -> bool:
        """Whether a step over ``num_rows`` decode rows with ``num_draft_tokens`` drafts, of which
        ``expected_accepted`` are expected to be accepted, is expected to emit more tokens per second than the
        step without them. Logs each change of the decision per bucket."""
        key = rows_bucket(num_rows)
        bucket = self._buckets.setdefault(key, _Bucket())
        bucket.steps += 1
        if bucket.t0 is None or bucket.per_token is None:
            return bucket.t0 is not None or bucket.steps % PROBE_EVERY != 0  # measure t0 now and then
        pays = bucket.per_token * num_draft_tokens * num_rows < bucket.t0 * expected_accepted
        if pays != bucket.pays:
            logger.info(
                "speculative decoding %s at batch size %s: step %.2f ms without drafts, +%.3f ms per "
                "draft token, %d drafts expecting %.1f accepted",
                "on" if pays else "off",
                key,
                bucket.t0 * 1e3,
                bucket.per_token * 1e3,
                num_draft_tokens,
                expected_accepted,
            )
            bucket.pays = pays
        if not pays and bucket.steps % PROBE_EVERY == 0:
            return True  # re-measure the cost of drafts now and then
        if pays and bucket.steps % PROBE_EVERY == 0:
            return False  # and the cost without them
        return pays

    def decision(self, num_rows: int) -> bool | None:
        """The last logged decision for this batch size (None before one was made)."""
        bucket = self._buckets.get(rows_bucket(num_rows))
        return None if bucket is None else bucket.pays
