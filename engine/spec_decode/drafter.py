"""The scheduler's draft source (``kvscope.engine.core.scheduler.Drafter``): n-gram proposals, gated per
request by its acceptance and per step by the measured step cost (engine/spec_decode/adaptive.py)."""

from __future__ import annotations

from collections.abc import Sequence

from kvscope.engine.config import SpeculativeConfig
from kvscope.engine.core.request import Request
from kvscope.engine.spec_decode.adaptive import AcceptanceTracker, StepCostModel
from kvscope.engine.spec_decode.ngram import NgramProposer


class NgramDrafter:
    """Proposes drafts for decode-phase requests and learns from their verification."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.cost = StepCostModel()
        self._trackers: dict[str, AcceptanceTracker] = {}

    def propose(self, request: Request, max_draft: int) -> list[int]:
        """Up to ``max_draft`` (≤ k) draft tokens for a decode step of ``request``; [] while it is paused."""
        if max_draft < 1:
            return []
        if self.config.adaptive:
            tracker = self._trackers.setdefault(request.request_id, AcceptanceTracker())
            if not tracker.should_propose():
                return []
        return self.proposer.propose(request.all_token_ids, max_draft)

    def allows(self, num_decode_rows: int, drafts: Sequence[tuple[Request, list[int]]]) -> bool:
        """Whether this step's drafts (``drafts``: the requests that proposed and their drafts) should run,
        given ``num_decode_rows`` decode requests in the step (StepCostModel.allows)."""
        if not self.config.measure_batch_cost or not drafts:
            return True
        num_draft = sum(len(draft) for _, draft in drafts)
        expected = sum(self._expected_rate(request) * len(draft) for request, draft in drafts)
        return self.cost.allows(num_decode_rows, num_draft, expected)

    def on_verified(self, request: Request, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if self.config.adaptive:
            self._trackers.setdefault(request.request_id, AcceptanceTracker()).on_verified(
                num_draft_tokens, num_accepted_tokens
            )

    def record_step(self, num_decode_rows: int, num_draft_tokens: int, seconds: float) -> None:
        """A decode-only step's duration (StepCostModel.record)."""
        if self.config.measure_batch_cost:
            self.cost.record(num_decode_rows, num_draft_tokens, seconds)

    def drop(self, request_id: str) -> None:
        self._trackers.pop(request_id, None)

    def _expected_rate(self, request: Request) -> float:
        tracker = self._trackers.get(request.request_id)
        return 0.5 if tracker is None or tracker.num_drafts == 0 else tracker.ema
