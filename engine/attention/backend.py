"""The attention contract: per-step :class:`AttentionMetadata` and the :class:`AttentionBackend` protocol.
Implemented by the torch backend (engine/attention/torch_backend.py: SDPA over gathered K/V, and kvscope's
C++ paged attention on CPU where it applies) and the Triton kernels (engine/attention/triton_backend.py);
engine/attention/selector.py picks one.

KV cache layout (docs/architecture.md "KV cache layout"): one tensor per layer
``[2, num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s = block_id * block_size + offset``.
Token ``i`` of a request lives at ``block_table[i // block_size] * block_size + i % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


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
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
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
            slots.extend(
                blocks[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)
            )
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
    """What the model's attention layers and the model runner call on a backend."""

    name: str
    """The ``--attention-backend`` name that selects it (``torch``, ``triton``)."""

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """key/value [num_tokens, num_kv_heads, head_dim] → kv_cache[0|1] at ``slot_mapping``."""
        ...

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] → [num_tokens, num_heads, head_dim]; GQA by head groups."""
        ...

    def skip_step(self) -> None:
        """A step ran without this backend (the fused CPU decode step wrote the KV cache itself): drop any
        state carried from one step to the next. The model runner calls it after such a step."""
        ...
