"""TritonAttentionBackend: the AttentionBackend protocol (engine/attention/backend.py) on the Triton kernels
of kernels/.

``write_kv`` is :func:`kvscope.kernels.reshape_and_cache.reshape_and_cache`; ``forward`` is one launch of
:func:`kvscope.kernels.paged_attention.paged_attention` for the whole step (prefill chunks and decodes mixed),
plus the split-KV merge when the launcher splits a pure-decode step. Importing this module is cheap and safe
without CUDA or triton: the kernels are imported when the backend is constructed (get_attention_backend does
so only on CUDA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvscope.engine.attention.backend import AttentionMetadata


def _load_kernels() -> tuple[Any, Any]:
    """Import the launchers; raise ImportError with an install hint when triton is missing."""
    try:
        from kvscope.kernels.paged_attention import paged_attention
        from kvscope.kernels.reshape_and_cache import reshape_and_cache
    except ImportError as exc:
        raise ImportError(
            f"the triton attention backend needs the 'triton' package ({exc}); "
            "install kvscope[kernels] or use --attention-backend torch"
        ) from exc
    return reshape_and_cache, paged_attention


class TritonAttentionBackend:
    """Paged attention with Triton kernels (CUDA; CPU only under ``TRITON_INTERPRET=1``, for tests).

    Args:
        num_segments: force the split-KV segment count (power of two <= 16); None lets the launcher choose
            (splits pure-decode steps that would leave SMs idle).

    Raises:
        ImportError: triton is not installed.
    """

    name = "triton"

    def __init__(self, num_segments: int | None = None) -> None:
        self._reshape_and_cache, self._paged_attention = _load_kernels()
        self._num_segments = num_segments

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """key/value ``[num_tokens, num_kv_heads, head_dim]`` -> ``kv_cache[0|1]`` at ``slot_mapping``
        (int64).

        Raises TypeError/ValueError from the launcher on a dtype, shape, device or layout mismatch.
        """
        self._reshape_and_cache(key, value, kv_cache, slot_mapping)

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal GQA attention: query ``[num_tokens, num_heads, head_dim]`` -> same shape and dtype.

        Reads ``query_start_loc``, ``seq_lens``, ``block_tables``, ``max_query_len`` and ``max_seq_len`` of
        ``metadata`` (docs/architecture.md, "AttentionMetadata"). Raises TypeError/ValueError from the
        launcher.
        """
        return self._paged_attention(
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            float(scale),
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            num_segments=self._num_segments,
        )

    def skip_step(self) -> None:
        """Nothing to drop: this backend keeps no state between steps (AttentionBackend protocol)."""
