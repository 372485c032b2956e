"""Paged attention: per-step metadata, the backend protocol and the PyTorch reference backend.

KV cache layout (docs/architecture.md "KV cache layout"): one tensor per layer
``[2, num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s = block_id * block_size + offset``.
Token ``i`` of a request lives at ``block_table[i // block_size] * block_size + i % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

BACKEND_NAMES = ("auto", "torch", "triton")


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's attention inputs. Tokens are packed request after request, no padding."""

    query_start_loc: torch.Tensor
    """int32 [num_reqs + 1]: cumulative query lengths, ``query_start_loc[0] == 0``."""
    seq_lens: torch.Tensor
    """int32 [num_reqs]: context length after this step (cached + new tokens)."""
    block_tables: torch.Tensor
    """int32 [num_reqs, max_num_blocks_per_req]: block ids; padding entries are 0 and never read."""
    slot_mapping: torch.Tensor
    """int64 [num_tokens]: cache slot where each new token's K/V is written."""
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int], block_ids: Sequence[Sequence[int]],
              block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for requests whose new tokens sit at positions ``seq_len - query_len … seq_len - 1``.

        ``block_ids[r]`` is request r's block table (must cover ``seq_lens[r]`` tokens). Raises ValueError
        on inconsistent lengths or a block table too short for its sequence.
        """
        if not len(query_lens) == len(seq_lens) == len(block_ids):
            raise ValueError("query_lens, seq_lens and block_ids must have one entry per request")
        slots: list[int] = []
        for q_len, seq_len, blocks in zip(query_lens, seq_lens, block_ids, strict=True):
            if not 0 < q_len <= seq_len or len(blocks) * block_size < seq_len:
                raise ValueError(f"bad request: query_len={q_len} seq_len={seq_len} num_blocks={len(blocks)}")
            slots.extend(blocks[p // block_size] * block_size + p % block_size
                         for p in range(seq_len - q_len, seq_len))
        width = max(len(b) for b in block_ids)
        table = [list(b) + [0] * (width - len(b)) for b in block_ids]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(table, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """key/value [num_tokens, num_kv_heads, head_dim] → kv_cache[0|1] at ``slot_mapping``."""
        ...

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] → [num_tokens, num_heads, head_dim]; GQA by head groups."""
        ...


@dataclass(frozen=True, slots=True)
class _Prefill:
    """One request with query_len > 1, attended on its own."""

    start: int
    query_len: int
    slots: torch.Tensor
    """int64 [seq_len]: cache slots of positions 0 … seq_len - 1."""
    mask: torch.Tensor | None
    """bool [query_len, seq_len] (True = attend) or None when query_len == seq_len (plain causal)."""


@dataclass(frozen=True, slots=True)
class _DecodeBatch:
    """All requests with query_len == 1, attended together with keys padded to the longest sequence."""

    token_index: torch.Tensor
    """int64 [n]: position of each decode token in the packed query."""
    slots: torch.Tensor
    """int64 [n, max_seq_len]: cache slots (padding points at valid memory and is masked out)."""
    mask: torch.Tensor
    """bool [n, 1, 1, max_seq_len]: True where the key position is < seq_len."""


@dataclass(frozen=True, slots=True)
class _Plan:
    prefills: tuple[_Prefill, ...]
    decodes: _DecodeBatch | None


def _request_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of ``positions`` (int64, any shape […, P]) given block tables ([…, max_blocks])."""
    blocks = torch.gather(block_table.long(), -1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


def _build_plan(metadata: AttentionMetadata, block_size: int) -> _Plan:
    """Split requests into solo prefills and one padded decode batch; precompute slots and masks."""
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    prefills: list[_Prefill] = []
    decode_rows: list[int] = []
    for row, seq_len in enumerate(seq_lens):
        q_len = starts[row + 1] - starts[row]
        if q_len == 1:
            decode_rows.append(row)
        elif q_len > 1:
            prefills.append(_prefill(metadata, row, starts[row], q_len, seq_len, block_size))
    decodes = _decode_batch(metadata, decode_rows, starts, seq_lens, block_size) if decode_rows else None
    return _Plan(prefills=tuple(prefills), decodes=decodes)


def _prefill(metadata: AttentionMetadata, row: int, start: int, q_len: int, seq_len: int,
             block_size: int) -> _Prefill:
    device = metadata.block_tables.device
    key_pos = torch.arange(seq_len, device=device)
    slots = _request_slots(metadata.block_tables[row], key_pos, block_size)
    mask = None
    if q_len != seq_len:  # query j sits at position seq_len - q_len + j and sees keys 0 … that position
        query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        mask = key_pos[None, :] <= query_pos[:, None]
    return _Prefill(start=start, query_len=q_len, slots=slots, mask=mask)


def _decode_batch(metadata: AttentionMetadata, rows: list[int], starts: list[int], seq_lens: list[int],
                  block_size: int) -> _DecodeBatch:
    device = metadata.block_tables.device
    longest = max(seq_lens[r] for r in rows)
    key_pos = torch.arange(longest, device=device)
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)
    tables = metadata.block_tables.index_select(0, row_index)
    slots = _request_slots(tables, key_pos.expand(len(rows), longest), block_size)
    lens = torch.tensor([seq_lens[r] for r in rows], device=device)
    mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]
    token_index = torch.tensor([starts[r] for r in rows], dtype=torch.int64, device=device)
    return _DecodeBatch(token_index=token_index, slots=slots, mask=mask)


class TorchAttentionBackend:
    """Reference paged attention in plain PyTorch (any device; the CPU default).

    Prefill chunks (query_len > 1) run one request at a time; decode tokens of all requests run as one
    batch padded to the longest sequence. Both call ``F.scaled_dot_product_attention`` with
    ``enable_gqa`` (query head h uses KV head ``h // (num_heads // num_kv_heads)``, as HF ``repeat_kv``).
    The per-step plan (slots, masks) is built on the first layer and reused by the others.
    """

    name = "torch"

    def __init__(self) -> None:
        self._plan_for: tuple[AttentionMetadata, int] | None = None
        self._plan: _Plan | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter key/value [num_tokens, num_kv_heads, head_dim] into the flattened slot view of the cache."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Causal attention of packed ``query`` [num_tokens, num_heads, head_dim] over the paged cache.

        Returns [num_tokens, num_heads, head_dim] in the query's dtype.
        """
        plan = self._get_plan(metadata, kv_cache.shape[2])
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        keys = kv_cache[0].view(-1, num_kv_heads, head_dim)
        values = kv_cache[1].view(-1, num_kv_heads, head_dim)
        out = torch.empty_like(query)
        for item in plan.prefills:
            q = query[item.start: item.start + item.query_len].transpose(0, 1)[None]  # [1, H, q, d]
            k = keys[item.slots].transpose(0, 1)[None]  # [1, KVH, S, d]
            v = values[item.slots].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=item.mask, is_causal=item.mask is None,
                                               scale=scale, enable_gqa=True)
            out[item.start: item.start + item.query_len] = o[0].transpose(0, 1)
        if plan.decodes is not None:
            batch = plan.decodes
            q = query[batch.token_index][:, :, None, :]  # [n, H, 1, d]
            k = keys[batch.slots].transpose(1, 2)  # [n, KVH, S, d]
            v = values[batch.slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=scale, enable_gqa=True)
            out[batch.token_index] = o[:, :, 0, :]
        return out

    def _get_plan(self, metadata: AttentionMetadata, block_size: int) -> _Plan:
        """Memoized per (metadata object, block_size): every layer of one forward shares the plan."""
        cached = self._plan_for
        if self._plan is None or cached is None or cached[0] is not metadata or cached[1] != block_size:
            self._plan = _build_plan(metadata, block_size)
            self._plan_for = (metadata, block_size)
        return self._plan


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """``torch`` → TorchAttentionBackend; ``triton`` → TritonAttentionBackend (CUDA only, imported lazily);
    ``auto`` → Triton on CUDA, torch elsewhere. Raises ValueError for an unknown name or Triton off CUDA."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "torch" or (name == "auto" and not on_cuda):
        return TorchAttentionBackend()
    if not on_cuda:
        raise ValueError(f"the triton attention backend needs a CUDA device, got {device}")
    from engine.attention_triton import TritonAttentionBackend

    return TritonAttentionBackend()
