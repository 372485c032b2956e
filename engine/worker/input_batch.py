"""Build one step's model inputs (packed tokens, positions, AttentionMetadata) from a SchedulerOutput.

Tokens of all scheduled requests are packed back to back with no padding (vLLM v1 "varlen" layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.core.scheduler_output import SchedulerOutput


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    """int64 [num_tokens]"""
    positions: torch.Tensor
    """int64 [num_tokens]"""
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    """int64 [sum(num_logits)]: index into the packed tokens of each sampled request's last token, or for a
    request with drafts of its last 1 + len(spec_token_ids) tokens (in order)."""
    sampled_rows: list[int]
    """Index into ``scheduler_output.scheduled`` of each sampled request."""
    num_logits: list[int]
    """Per sampled request (aligned with sampled_rows): its rows in logits_indices, 1 +
    len(spec_token_ids)."""

    @property
    def has_drafts(self) -> bool:
        return any(n > 1 for n in self.num_logits)


def build_model_inputs(
    scheduler_output: SchedulerOutput, block_size: int, device: torch.device
) -> ModelInputs:
    """Pack the scheduled chunks into flat tensors.

    slot of token at position p = block_ids[p // block_size] * block_size + p % block_size
    (docs/architecture.md, "KV cache layout"). Raises ValueError when the output schedules nothing.
    """
    scheduled = scheduler_output.scheduled
    if not scheduled:
        raise ValueError("scheduler output is empty")
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampled_rows: list[int] = []
    num_logits: list[int] = []
    for row, item in enumerate(scheduled):
        start = item.num_computed_tokens
        end = start + item.num_scheduled_tokens
        input_ids.extend(item.token_ids)
        positions.extend(range(start, end))
        blocks = item.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(query_start_loc[-1] + item.num_scheduled_tokens)
        seq_lens.append(end)
        if item.sample:
            count = 1 + len(item.spec_token_ids)
            logits_indices.extend(range(query_start_loc[-1] - count, query_start_loc[-1]))
            sampled_rows.append(row)
            num_logits.append(count)
    max_blocks = max(len(item.block_ids) for item in scheduled)
    table_rows = [list(item.block_ids) + [0] * (max_blocks - len(item.block_ids)) for item in scheduled]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(table_rows, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(item.num_scheduled_tokens for item in scheduled),
        max_seq_len=max(seq_lens),
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attn_metadata=metadata,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sampled_rows=sampled_rows,
        num_logits=num_logits,
    )
