"""The scheduler's view of a speculative draft source. Pure Python (kvscope.engine.core)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvscope.engine.core.request import Request


class Drafter(Protocol):
    """Where speculative drafts come from (kvscope.engine.spec_decode.drafter.NgramDrafter); injected so
    this module stays pure Python."""

    def propose(self, request: Request, max_draft: int) -> list[int]:
        """Up to ``max_draft`` draft tokens continuing ``request`` (possibly none)."""
        ...

    def allows(self, num_decode_rows: int, drafts: Sequence[tuple[Request, list[int]]]) -> bool:
        """Whether the step's drafts should run at all."""
        ...

    def on_verified(self, request: Request, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One verified draft of ``request``."""

    def drop(self, request_id: str) -> None:
        """Forget a finished request."""
