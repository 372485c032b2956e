"""Decode K/V kept gathered across steps, so that a decode step does not copy every layer's K/V again.

The torch backend attends a decode batch over K/V gathered from the paged cache into a padded ``[2, n ·
max_blocks, block_size, KVH, d]`` layout. From one decode-only step to the next, a steady batch (the same
requests in the same order, each one token longer, the same padded width) changes that layout in exactly one
position per request: the new token. :class:`ResidentDecodeKV` keeps one such gathered copy per layer and,
when the step continues the previous one, copies only the new tokens' K/V from the cache (one ``index_select``
of n slots + one ``index_copy_``) instead of re-gathering every block. Anything else (a request added,
finished or preempted, a row crossing into a block beyond the padded width, a step with prefill or multi-token
rows, a cache it has not seen) re-gathers in full. The copy holds values read from the cache only, so padding
positions (masked) are cache values too, never uninitialised memory.

Memory: one copy per layer, at most ``max_bytes`` in all (layers beyond it gather per step as before); used
only where one layer's gather is at least ``min_bytes`` (below that a full gather costs about what the
incremental update's extra calls do).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

MAX_RESIDENT_BYTES = 256 << 20
"""Default cap on all layers' resident K/V copies together (SmolLM2-135M, bfloat16: 32 requests of ~250
tokens; a longer batch keeps its first layers resident and gathers the rest per step)."""
MIN_RESIDENT_BYTES = 256 << 10
"""Default smallest per-layer gather (bytes, K and V) worth keeping resident."""


@dataclass(frozen=True, slots=True)
class _StepState:
    step: int
    tables: torch.Tensor
    """int64 [n, num_blocks]: the padded block table gathered."""
    seq_lens: torch.Tensor
    """int64 [n]."""


@dataclass(slots=True)
class _Layer:
    cache: weakref.ReferenceType
    buffer: torch.Tensor
    """Flat, in the attention compute dtype; the first ``2 · m · block numel`` elements hold the gather."""
    filled_step: int


class ResidentDecodeKV:
    """Per-layer gathered decode K/V, updated in place from step to step (module doc). Not thread-safe: one
    per backend, used by one engine thread."""

    def __init__(self, max_bytes: int = MAX_RESIDENT_BYTES, min_bytes: int = MIN_RESIDENT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._layers: dict[int, _Layer] = {}
        self._step = 0
        self._prev: _StepState | None = None
        self._continues = False
        self._slots: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._blocks: torch.Tensor | None = None
        self.full_gathers = 0
        """Layer gathers of every block (for tests and profiles); ``incremental_updates`` counts the
        others."""
        self.incremental_updates = 0

    def begin_step(
        self,
        tables: torch.Tensor | None,
        seq_lens: torch.Tensor | None,
        slots: torch.Tensor | None,
        block_size: int,
    ) -> None:
        """Start a step. For a decode-only step pass its padded tables (int64 [n, num_blocks]), seq_lens
        (after the step) and the new tokens' cache slots (int64 [n]); for any other step pass None (the
        next decode step then gathers in full)."""
        self._step += 1
        if tables is None or seq_lens is None or slots is None:
            self._prev = None
            self._continues = False
            return
        seq_lens = seq_lens.long()
        prev = self._prev
        self._continues = (
            prev is not None
            and prev.step == self._step - 1
            and _continues(prev, tables, seq_lens, block_size)
        )
        width = tables.shape[1] * block_size
        self._slots = slots
        self._positions = (
            torch.arange(tables.shape[0], dtype=torch.int64, device=tables.device) * width + seq_lens - 1
        )
        self._blocks = tables.reshape(-1)
        self._prev = _StepState(step=self._step, tables=tables, seq_lens=seq_lens)

    def gathered(self, kv_cache: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor | None:
        """This layer's gathered K/V ``[2, n · num_blocks, block_size, KVH, d]`` in ``compute_dtype``, up
        to date for this step (the new tokens must already be written to ``kv_cache``); None where this
        layer does not keep a resident copy (too small, over the cap, or not a decode-only step)."""
        if self._blocks is None or self._prev is None or self._prev.step != self._step:
            return None
        m = self._blocks.shape[0]
        block_shape = kv_cache.shape[2:]
        numel = 2 * m * block_shape.numel()
        nbytes = numel * torch.empty((), dtype=compute_dtype).element_size()
        if nbytes < self.min_bytes:
            return None
        key = kv_cache.data_ptr()
        layer = self._layers.get(key)
        if layer is not None and (layer.cache() is not kv_cache or layer.buffer.dtype != compute_dtype):
            del self._layers[key]
            layer = None
        if layer is None or layer.buffer.numel() < numel:
            if self._resident_bytes(exclude=key) + nbytes > self.max_bytes:
                self._layers.pop(key, None)
                return None
            self._layers.pop(key, None)  # exact size: a x1.5 headroom per layer would hit the cap early
            layer = _Layer(
                cache=weakref.ref(kv_cache),
                buffer=torch.empty(numel, dtype=compute_dtype, device=kv_cache.device),
                filled_step=-1,
            )
            self._layers[key] = layer
        out = layer.buffer[:numel].view(2, m, *block_shape)
        if self._continues and layer.filled_step == self._step - 1:
            num_kv_heads, head_dim = kv_cache.shape[3:]
            new = kv_cache.view(2, -1, num_kv_heads, head_dim).index_select(1, self._slots)  # [2, n, KVH, d]
            out.view(2, -1, num_kv_heads, head_dim).index_copy_(1, self._positions, new.to(compute_dtype))
            self.incremental_updates += 1
        else:
            if compute_dtype == kv_cache.dtype:
                torch.index_select(kv_cache, 1, self._blocks, out=out)
            else:
                out.copy_(kv_cache.index_select(1, self._blocks))
            self.full_gathers += 1
        layer.filled_step = self._step
        return out

    def _resident_bytes(self, exclude: int) -> int:
        return sum(
            layer.buffer.numel() * layer.buffer.element_size()
            for key, layer in self._layers.items()
            if key != exclude
        )

    @property
    def nbytes(self) -> int:
        """Bytes of all resident copies."""
        return self._resident_bytes(exclude=-1)


def _continues(prev: _StepState, tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> bool:
    """Whether this decode step extends ``prev`` by one token per row: same rows and padded width, every
    row one longer, and the blocks holding each row's previous tokens unchanged."""
    if tables.shape != prev.tables.shape or not torch.equal(seq_lens, prev.seq_lens + 1):
        return False
    held = -(-prev.seq_lens // block_size)  # blocks that held tokens last step, per row
    valid = torch.arange(tables.shape[1], device=tables.device)[None, :] < held[:, None]
    return not bool(((tables != prev.tables) & valid).any())
