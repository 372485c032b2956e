"""The per-step plan of :class:`kvscope.engine.attention.torch_backend.TorchAttentionBackend`: which rows are
solo prefills (their blocks, causal masks), which form the padded decode batch, or — when kvscope's C++ paged
op runs every token — each token's block table and context length. Built once per step (on the first layer)
from the step's ``AttentionMetadata``; the backend only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine.attention.backend import AttentionMetadata


@dataclass(frozen=True, slots=True)
class Prefill:
    """One request with query_len > 1, attended on its own."""

    start: int
    query_len: int
    seq_len: int
    blocks: torch.Tensor
    """int64 [ceil(seq_len / block_size)]: the request's blocks, in order."""
    mask: torch.Tensor | None
    """bool [query_len, seq_len] (True = attend) or None when query_len == seq_len (plain causal)."""


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """All requests with query_len == 1, attended together with keys padded to the longest sequence."""

    token_index: torch.Tensor | None
    """int64 [n]: position of each decode token in the packed query; None when the step is decodes only
    (token i is request i)."""
    blocks: torch.Tensor
    """int64 [n * max_blocks]: each request's block table padded to the longest (padding reads block 0)."""
    num_blocks: int
    """max_blocks: blocks gathered per request."""
    seq_len: int
    """Longest context; keys past it are not gathered."""
    mask: torch.Tensor | None
    """bool [n, 1, 1, seq_len]: True where the key position is < the request's seq_len; None for one
    request."""
    tables: torch.Tensor
    """int32 [n, max_num_blocks_per_req]: the decode rows' block tables (the paged op reads them as they
    are)."""
    seq_lens: torch.Tensor
    """int32 [n]: the decode rows' context lengths."""

    @property
    def token_count(self) -> int:
        """n: decode requests (one token each)."""
        return self.blocks.shape[0] // self.num_blocks


@dataclass(frozen=True, slots=True)
class Plan:
    """One step's attention work, built on its first layer and reused by the others."""

    prefills: tuple[Prefill, ...]
    decodes: DecodeBatch | None
    max_gathered_blocks: int
    """Largest number of blocks one gather of this step copies (sizes the reusable K/V buffers)."""
    paged_decode: bool = False
    """Decode rows run kvscope's C++ paged decode attention (no gather; see
    ``torch_backend.paged_decode_applies``)."""
    token_rows: TokenRows | None = None
    """Set when every token of a step with prefill rows runs that op (``paged_prefill``; then ``prefills`` and
    ``decodes`` are empty): one call per layer."""


@dataclass(frozen=True, slots=True)
class TokenRows:
    """Every query token of a step as a one-token query at its own position, for the paged op."""

    tables: torch.Tensor
    """int32 [num_tokens, ceil(max_seq_len / block_size)]: each token's request's block table, the columns
    this step can read."""
    seq_lens: torch.Tensor
    """int32 [num_tokens]: each token's position + 1 (it attends keys 0 … its own position, causal)."""


def token_rows(metadata: AttentionMetadata, block_size: int) -> TokenRows:
    """Per-token block tables and context lengths of a packed step: token j of request r (query length q_r,
    context s_r after the step) sits at position s_r − q_r + j and attends s_r − q_r + j + 1 keys. The tables
    keep the step's first ceil(max_seq_len / block_size) columns (the op reads no further)."""
    starts = metadata.query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]
    rows = torch.repeat_interleave(torch.arange(metadata.num_reqs, device=starts.device), query_lens)
    positions = (
        torch.arange(metadata.num_tokens, device=starts.device)
        + (metadata.seq_lens.long() - query_lens - starts[:-1])[rows]
    )
    width = -(-metadata.max_seq_len // block_size)
    tables = metadata.block_tables[:, :width].index_select(0, rows)
    return TokenRows(tables=tables.to(torch.int32).contiguous(), seq_lens=(positions + 1).to(torch.int32))


def build_plan(
    metadata: AttentionMetadata, block_size: int, paged_decode: bool = False, paged_prefill: bool = False
) -> Plan:
    """Split requests into solo prefills and one padded decode batch; precompute block lists and masks.
    With ``paged_decode`` and ``paged_prefill``, a step with prefill rows gets only the per-token rows of
    the paged op (it runs every token; nothing is gathered)."""
    if paged_decode and paged_prefill and metadata.max_query_len > 1:
        return Plan(
            prefills=(),
            decodes=None,
            max_gathered_blocks=0,
            paged_decode=True,
            token_rows=token_rows(metadata, block_size),
        )
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    prefills: list[Prefill] = []
    decode_rows: list[int] = []
    for row, seq_len in enumerate(seq_lens):
        q_len = starts[row + 1] - starts[row]
        if q_len == 1:
            decode_rows.append(row)
        elif q_len > 1:
            prefills.append(prefill_item(metadata, row, starts[row], q_len, seq_len, block_size))
    decodes = decode_batch(metadata, decode_rows, starts, seq_lens, block_size) if decode_rows else None
    largest = max([p.blocks.shape[0] for p in prefills] + [0 if decodes is None else decodes.blocks.shape[0]])
    return Plan(
        prefills=tuple(prefills), decodes=decodes, max_gathered_blocks=largest, paged_decode=paged_decode
    )


def prefill_item(
    metadata: AttentionMetadata, row: int, start: int, q_len: int, seq_len: int, block_size: int
) -> Prefill:
    device = metadata.block_tables.device
    blocks = metadata.block_tables[row, : -(-seq_len // block_size)].long()
    mask = None
    if q_len != seq_len:  # query j sits at position seq_len - q_len + j and sees keys 0 … that position
        key_pos = torch.arange(seq_len, device=device)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        mask = key_pos[None, :] <= query_pos[:, None]
    return Prefill(start=start, query_len=q_len, seq_len=seq_len, blocks=blocks, mask=mask)


def decode_batch(
    metadata: AttentionMetadata, rows: list[int], starts: list[int], seq_lens: list[int], block_size: int
) -> DecodeBatch:
    device = metadata.block_tables.device
    lens = [seq_lens[r] for r in rows]
    longest = max(lens)
    num_blocks = -(-longest // block_size)
    only_decodes = len(rows) == len(seq_lens)
    tables = metadata.block_tables if only_decodes else metadata.block_tables[rows]
    blocks = tables[:, :num_blocks].long().reshape(-1)
    mask = None
    if len(rows) > 1:
        key_pos = torch.arange(longest, device=device)
        mask = (key_pos[None, :] < torch.tensor(lens, device=device)[:, None])[:, None, None, :]
    token_index = (
        None if only_decodes else torch.tensor([starts[r] for r in rows], dtype=torch.int64, device=device)
    )
    row_lens = metadata.seq_lens if only_decodes else metadata.seq_lens[rows]
    return DecodeBatch(
        token_index=token_index,
        blocks=blocks,
        num_blocks=num_blocks,
        seq_len=longest,
        mask=mask,
        tables=tables,
        seq_lens=row_lens,
    )
