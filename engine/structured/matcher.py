"""One request's grammar state: the llguidance matcher, kept in step with the request's output tokens."""

from __future__ import annotations

import re
from collections.abc import Sequence

import llguidance
import torch

_SOURCE_LINE = re.compile(r"^\d+ \| ")
"""llguidance's echo of the grammar source under an error (``1 | start: foo |``)."""
MAX_ERROR_CHARS = 300


def one_line(message: str) -> str:
    """llguidance's error ``message`` in one line of at most MAX_ERROR_CHARS characters: its parser-state
    dump (``<state>…``), the ``<non-verbose/>`` marker, the grammar-source echo and caret lines dropped,
    the rest joined with spaces (``unknown name: "foo"``, ``regex parse error: [a-z error: unclosed
    character class``)."""
    head = message.split("<state>", 1)[0]
    kept = [line.strip() for line in head.splitlines()]
    kept = [
        line
        for line in kept
        if line and line != "<non-verbose/>" and not _SOURCE_LINE.match(line) and set(line) - {"^", "~", " "}
    ]
    text = " ".join(kept) or "unknown error"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


class RequestMatcher:
    """Wraps an ``llguidance.LLMatcher``; :meth:`sync` realigns it with the output tokens the scheduler
    kept (after a preemption by recompute the tokens stay, so it is a no-op; anything else rolls back or
    replays)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int | None) -> None:
        self._matcher = matcher
        self._eos = eos_token_id
        self.num_consumed = 0
        """Output tokens the matcher has consumed."""

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher's state that after exactly ``output_token_ids``."""
        num = len(output_token_ids)
        if num == self.num_consumed:
            return
        if num < self.num_consumed and self._matcher.rollback(self.num_consumed - num):
            self.num_consumed = num
            return
        if num < self.num_consumed:
            self._matcher.reset()
            self.num_consumed = 0
        self._matcher.consume_tokens(list(output_token_ids[self.num_consumed :]))
        self.num_consumed = num

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into ``row`` (int32 ``[words]``, contiguous, CPU). A matcher in
        its error state (a limit of llguidance hit while computing the mask or consuming a token) gets a
        row allowing only EOS (token 0 without one), so the sampler still has a token to draw; the engine
        fails the request (MatcherTable.take_errors) and drops that token."""
        if not self._matcher.is_error():
            self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self._matcher.is_error():
            eos = self._eos if self._eos is not None else 0
            row.zero_()
            row[eos // 32] = _bit(eos % 32)

    def fill_bitmasks(self, rows: torch.Tensor, draft: Sequence[int]) -> None:
        """Row j of ``rows`` (int32 ``[1 + len(draft), words]``) gets the mask after consuming ``draft[:j]``
        (speculative verification). The draft is cut at its first token the grammar rejects
        (``LLMatcher.validate_tokens``): that row's mask forbids the token, so verification stops there, and
        the rows after it repeat it (never reached). The matcher is rolled back, so its state is unchanged."""
        valid = self._matcher.validate_tokens(list(draft)) if draft and not self._matcher.is_error() else 0
        consumed = 0
        for j in range(rows.shape[0]):
            if j <= valid:
                self.fill_bitmask(rows[j])
                if j < valid and self._matcher.consume_token(draft[j]):
                    consumed += 1
                elif j < valid:  # validate_tokens said it fits: cannot happen; stop drafting here
                    valid = j
            else:
                rows[j].copy_(rows[valid])
        if consumed:
            self._matcher.rollback(consumed)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar rejects it (the matcher enters its error
        state)."""
        self.num_consumed += 1
        return self._matcher.consume_token(token_id)

    @property
    def is_error(self) -> bool:
        return self._matcher.is_error()

    @property
    def error(self) -> str:
        """The matcher's error in one line ("" when it is not in its error state)."""
        return one_line(self._matcher.get_error()) if self._matcher.is_error() else ""

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and accepts nothing but EOS."""
        return self._matcher.is_stopped()


def _bit(index: int) -> int:
    """int32 value with only bit ``index`` set (bit 31 is the sign bit)."""
    value = 1 << index
    return value - (1 << 32) if value >= 1 << 31 else value
