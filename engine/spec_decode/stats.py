"""What one engine step's speculative verification did (``StepResult.spec_decoding``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecDecodingStats:
    """Counters of one step's verified drafts (vLLM v1 ``SpecDecodingStats``); None on steps without drafts.

    ``accepted_per_draft[i]`` is the number of draft tokens accepted for the i-th verified draft of the step
    (0 ≤ accepted ≤ its proposed tokens); ``num_accepted_tokens == sum(accepted_per_draft)``. The bonus or
    correction token the target model adds after the accepted run is not counted.
    """

    num_drafts: int
    """Requests whose draft was verified this step (each proposed ≥ 1 token)."""
    num_draft_tokens: int
    """Draft tokens proposed over those requests."""
    num_accepted_tokens: int
    """Draft tokens accepted (each equals the token the target model itself emitted at that position)."""
    accepted_per_draft: tuple[int, ...]

    @classmethod
    def from_drafts(cls, drafts: list[tuple[int, int]]) -> SpecDecodingStats | None:
        """From ``(num_draft_tokens, num_accepted_tokens)`` pairs, one per verified draft; None when empty."""
        if not drafts:
            return None
        return cls(
            num_drafts=len(drafts),
            num_draft_tokens=sum(k for k, _ in drafts),
            num_accepted_tokens=sum(a for _, a in drafts),
            accepted_per_draft=tuple(a for _, a in drafts),
        )
