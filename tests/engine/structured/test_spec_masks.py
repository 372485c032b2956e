"""Grammar masks for speculative verification: row j is the mask after draft[:j], the draft is cut at the
first token the grammar rejects, and the matcher is left where it was."""

from __future__ import annotations

import torch

from kvscope.engine.structured.bitmask import allocate_bitmask
from kvscope.engine.structured.params import StructuredOutputsParams


def _allowed(row: torch.Tensor, token_id: int) -> bool:
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def test_draft_masks_follow_the_draft_and_roll_back(llm):
    manager = llm.engine.structured
    matcher = manager.new_matcher(StructuredOutputsParams("regex", "[0-9]{4}"))
    digit = llm.tokenizer.encode("7")[0]
    letter = llm.tokenizer.encode("x")[0]
    draft = [digit, digit, letter, digit]  # the third token breaks the grammar
    rows = allocate_bitmask(len(draft) + 1, manager.vocab_size)
    matcher.fill_bitmasks(rows, draft)
    assert [_allowed(rows[j], digit) for j in range(3)] == [True, True, True]
    assert not _allowed(
        rows[2], letter
    )  # row 2: after two digits; the letter is forbidden, so it is rejected
    assert torch.equal(rows[3], rows[2]) and torch.equal(rows[4], rows[2])  # never reached
    assert matcher.num_consumed == 0
    single = allocate_bitmask(1, manager.vocab_size)
    matcher.fill_bitmask(single[0])
    assert torch.equal(single[0], rows[0])  # the matcher is back at its start state
    for _ in range(4):
        assert matcher.accept(digit)
    end = allocate_bitmask(2, manager.vocab_size)
    matcher.fill_bitmasks(end, [digit])  # four digits done: a fifth is not allowed
    assert not _allowed(end[0], digit)
