"""The torch attention backend (``--attention-backend torch``; any device, the CPU default). Not a
plain-PyTorch reference: it runs torch's scaled_dot_product_attention over each request's K/V blocks gathered
into reused buffers (a per-step plan), and on CPU, with a bfloat16 cache and kvscope's CPU kernels loaded, it
dispatches to kvscope's C++ ops (kernels/csrc/cpu_attention.cpp): the K/V cache write, and the paged decode
attention, which reads K/V from the paged cache in place (no gather, no resident copy), for decode tokens and
prefill tokens (each as a one-token query at its own position, its context the tokens up to it), all tokens
of a step in one call per layer.

KV cache layout: engine/attention/backend.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.resident_kv import ResidentDecodeKV
from kvscope.engine.attention.torch_plan import DecodeBatch, Plan, Prefill, build_plan
from kvscope.kernels.cpu_decode import is_loaded as cpu_kernels_loaded

MAX_RETAINED_GATHER_BYTES = 64 << 20
"""TorchAttentionBackend keeps its K (and V) gather buffer across steps up to this size each."""


@dataclass(frozen=True, slots=True)
class _DecodeViews:
    """Where one step's decode gather lands and what SDPA reads (see
    ``TorchAttentionBackend._decode_views_for``)."""

    gathered: torch.Tensor
    """[2, n * max_blocks, block_size, KVH, d] in the cache dtype: the ``index_select`` target."""
    upcast: torch.Tensor | None
    """The same shape in the compute dtype when it differs from the cache's (a copy per layer), else None."""
    keys: torch.Tensor
    """[n, KVH, seq_len, d] view of the gathered (or upcast) keys."""
    values: torch.Tensor
    mask: torch.Tensor | None
    """The decode batch's key mask as SDPA's additive form (0 / -inf in the compute dtype), or None."""


def paged_decode_applies(kv_cache: torch.Tensor) -> bool:
    """Whether decode tokens over ``kv_cache`` run ``torch.ops.kvscope_cpu.paged_decode_attention``: a CPU
    bfloat16 cache, head_dim 16, 32, 64 or 128, and kvscope's CPU kernels loaded (kernels/cpu_decode.py).

    Chosen where it was faster than SDPA (bench/decode_attention_ab.py; docs/benchmarks.md "Batched decode").
    float32 caches keep SDPA: the op sums in another order than SDPA, and the float32 path stays
    token-identical to transformers."""
    return (
        kv_cache.device.type == "cpu"
        and kv_cache.dtype == torch.bfloat16
        and kv_cache.shape[-1] in (16, 32, 64, 128)
        and cpu_kernels_loaded()
    )


def _rows_ok(x: torch.Tensor, head_dim: int) -> bool:
    """x [T, KVH, d] holds each token's heads contiguously (what ``kvscope_cpu.write_kv`` copies per
    token)."""
    return x.dim() == 3 and x.stride(2) == 1 and (x.stride(1) == head_dim or x.shape[1] == 1)


def cpu_has_amx() -> bool:
    """Whether this CPU runs AMX tiles (and the kernel granted them to the process): torch's own check,
    ``torch._C._cpu._init_amx`` (False where this torch build lacks it)."""
    try:
        return bool(torch._C._cpu._init_amx())
    except (AttributeError, RuntimeError):
        return False


def attention_compute_dtype(kv_cache: torch.Tensor, native_bf16: bool = False) -> torch.dtype:
    """dtype the torch backend attends in: the cache's dtype, except on CPU for float16 always and for
    bfloat16 unless ``native_bf16``, which attend in float32.

    Why: with AMX tiles torch's bfloat16 CPU attention beats float32, without them (AVX512_BF16 only) it is
    slower than float32, so :class:`TorchAttentionBackend` sets ``native_bf16`` where :func:`cpu_has_amx`
    and upcasts elsewhere (docs/benchmarks.md)."""
    if kv_cache.device.type == "cpu" and kv_cache.dtype in (torch.bfloat16, torch.float16):
        return torch.bfloat16 if kv_cache.dtype == torch.bfloat16 and native_bf16 else torch.float32
    return kv_cache.dtype


class TorchAttentionBackend:
    """Paged attention through torch's SDPA, with kvscope's C++ CPU ops where they apply (any device; the CPU
    default; the name users pass is ``torch``).

    Prefill chunks (query_len > 1) run one request at a time; decode tokens of all requests run as one batch
    padded to the longest sequence. K/V are gathered a whole block at a time (``index_select`` over the block
    dimension, into buffers reused by every layer and step), then ``F.scaled_dot_product_attention`` runs with
    ``enable_gqa`` (query head h uses KV head ``h // (num_heads // num_kv_heads)``, as HF ``repeat_kv``). The
    per-step plan (block lists, masks) is built on the first layer and reused by the others. On CPU, float16
    caches are attended in float32, bfloat16 ones too unless ``native_bf16`` (default: where the CPU has AMX;
    see :func:`attention_compute_dtype`). Decode tokens over a CPU bfloat16 cache run kvscope's C++ paged
    decode attention instead where :func:`paged_decode_applies` (``paged_decode=False`` keeps SDPA), and so do
    prefill tokens (``paged_prefill``; default: where SDPA would attend in float32, i.e. no AMX): the whole
    step in one call per layer, each token a one-token query over the keys up to its position, read from the
    cache after :meth:`write_kv`.

    Why prefill too: where SDPA would attend in float32 (no AMX), the op was faster than the float32 upcast
    and SDPA at every prompt and chunk size tried (bench/prefill_attention_ab.py; docs/benchmarks.md). Not
    compared with AMX's bfloat16 SDPA (``native_bf16``), which therefore keeps SDPA for prefill rows.
    """

    name = "torch"

    def __init__(
        self, native_bf16: bool | None = None, paged_decode: bool = True, paged_prefill: bool | None = None
    ) -> None:
        self.native_bf16 = cpu_has_amx() if native_bf16 is None else native_bf16
        self.paged_decode = paged_decode
        """Use the C++ paged decode attention where it applies (False: always SDPA over gathered K/V)."""
        self.paged_prefill = not self.native_bf16 if paged_prefill is None else paged_prefill
        """With ``paged_decode`` where it applies, run prefill tokens through the same op (False: SDPA)."""
        self._plan_for: tuple[AttentionMetadata, int] | None = None
        self._plan: Plan | None = None
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._views: tuple[tuple[object, ...], _DecodeViews] | None = None
        self.resident = ResidentDecodeKV()
        """Decode K/V kept gathered across decode-only steps (engine/attention/resident_kv.py)."""
        self._written: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """(kv_cache, slot_mapping, K, V as written [T, KVH, d] each) of the last :meth:`write_kv`: a fresh
        prefill (no cached prefix) attends these instead of gathering its blocks back from the cache."""

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Scatter key/value [num_tokens, num_kv_heads, head_dim] to the cache slots ``slot_mapping``
        (int64 [num_tokens]): with kvscope's CPU kernels, one ``torch.ops.kvscope_cpu.write_kv`` (a row
        copy per token, no temporary) where key and value already have the cache's dtype and each token's
        heads are contiguous; otherwise one ``index_copy_`` of K and V stacked. Either way the cache holds
        the same bits."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        if (
            kv_cache.device.type == "cpu"
            and key.dtype == value.dtype == kv_cache.dtype
            and _rows_ok(key, head_dim)
            and _rows_ok(value, head_dim)
            and kv_cache.is_contiguous()
            and cpu_kernels_loaded()
        ):
            torch.ops.kvscope_cpu.write_kv(key, value, kv_cache, slot_mapping)
            self._written = (kv_cache, slot_mapping, key, value)
            return
        both = torch.stack((key, value))  # [2, T, KVH, d]
        if both.dtype != kv_cache.dtype:
            both = both.to(kv_cache.dtype)
        kv_cache.view(2, -1, num_kv_heads, head_dim).index_copy_(1, slot_mapping, both)
        self._written = (kv_cache, slot_mapping, both[0], both[1])

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of packed ``query`` [num_tokens, num_heads, head_dim] over the paged cache.

        Returns [num_tokens, num_heads, head_dim] in the query's dtype.
        """
        plan = self._get_plan(metadata, kv_cache)
        written, self._written = self._written, None
        if plan.token_rows is not None:  # every token, read from the cache in place
            rows = plan.token_rows  # the query as it is: bfloat16, like the cache (float32 arithmetic)
            return torch.ops.kvscope_cpu.paged_decode_attention(
                query, kv_cache, rows.tables, rows.seq_lens, scale
            )
        decodes = plan.decodes
        dtype = query.dtype
        compute_dtype = attention_compute_dtype(kv_cache, self.native_bf16)
        if compute_dtype != dtype:  # no-op casts skipped: their dispatch, twice per layer (docs/benchmarks.md
            # "Per-step cost and where the time goes")
            query = query.to(compute_dtype)
        if decodes is not None and decodes.token_index is None:  # decode-only step: no scatter needed
            out = self._decode(query, kv_cache, decodes, plan, scale)
            return out if compute_dtype == dtype else out.to(dtype)
        out = None
        if written is not None and (written[0] is not kv_cache or written[1] is not metadata.slot_mapping):
            written = None
        for item in plan.prefills:
            if written is not None and item.mask is None:  # fresh prefill: its K/V are what was just written
                keys, values = self._fresh(written[2], written[3], item, compute_dtype)
            else:
                keys, values = self._gather(kv_cache, item.blocks, plan)
            q = query[item.start : item.start + item.query_len].transpose(0, 1)[None]  # [1, H, q, d]
            k = keys[: item.seq_len].transpose(0, 1)[None]  # [1, KVH, S, d]
            v = values[: item.seq_len].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=item.mask, is_causal=item.mask is None, scale=scale, enable_gqa=True
            )[0].transpose(0, 1)  # [q, H, d]
            if item.query_len == query.shape[0] and o.is_contiguous():  # the step is this one prompt: SDPA's
                # CPU output is laid out [q, H, d] already, so no copy (docs/benchmarks.md "Per-step cost")
                out = o
                break
            if out is None:
                out = torch.empty_like(query)
            out[item.start : item.start + item.query_len] = o
        if out is None:
            out = torch.empty_like(query)
        if decodes is not None:
            out[decodes.token_index] = self._decode(
                query[decodes.token_index], kv_cache, decodes, plan, scale
            )
        return out if compute_dtype == dtype else out.to(dtype)

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, plan: Plan, scale: float
    ) -> torch.Tensor:
        """query [n, H, d] (one token per request) → [n, H, d]."""
        if plan.paged_decode:  # K/V read from the paged cache in place (kernels/csrc/cpu_attention.cpp)
            return torch.ops.kvscope_cpu.paged_decode_attention(
                query, kv_cache, batch.tables, batch.seq_lens, scale
            )
        views = self._decode_views_for(kv_cache, batch, plan)
        resident = None
        if batch.token_index is None:
            resident = self.resident.gathered(kv_cache, attention_compute_dtype(kv_cache, self.native_bf16))
        if (
            resident is not None
        ):  # this layer's K/V kept gathered across steps (kvscope.engine.attention.resident_kv)
            kv = (
                resident.flatten(1, 2)
                .view(2, batch.token_count, batch.num_blocks * kv_cache.shape[2], *kv_cache.shape[3:])[
                    :, :, : batch.seq_len
                ]
                .transpose(2, 3)
            )
            keys, values = kv[0], kv[1]
        else:
            torch.index_select(kv_cache, 1, batch.blocks, out=views.gathered)
            if views.upcast is not None:
                views.upcast.copy_(views.gathered)
            keys, values = views.keys, views.values
        o = F.scaled_dot_product_attention(
            query[:, :, None, :], keys, values, attn_mask=views.mask, scale=scale, enable_gqa=True
        )  # [n, H, 1, d]
        return o[:, :, 0, :]

    def skip_step(self) -> None:
        """A step ran without this backend (the fused CPU decode step wrote the cache itself): the next decode
        step re-gathers its K/V instead of continuing the resident copy."""
        self._plan = None
        self._plan_for = None
        self._views = None
        self.resident.begin_step(None, None, None, 0)

    def _decode_views_for(self, kv_cache: torch.Tensor, batch: DecodeBatch, plan: Plan) -> _DecodeViews:
        """The gather target and the K/V views SDPA reads for this step's decode batch, built on the first
        layer and reused by the others: every layer gathers into the same buffer (sized for the step on its
        first use), so ~12 view/slice/transpose calls per layer become one ``index_select`` (and one upcast
        copy)."""
        key = (plan, kv_cache.dtype, kv_cache.shape[1:])
        cached = self._views
        if cached is not None and cached[0][0] is plan and cached[0][1:] == key[1:]:
            return cached[1]
        n, m = batch.token_count, batch.blocks.shape[0]
        block_shape = kv_cache.shape[2:]
        gathered = self._get_buffer(kv_cache, kv_cache.dtype, plan.max_gathered_blocks)[
            : 2 * m * block_shape.numel()
        ]
        gathered = gathered.view(2, m, *block_shape)
        both, upcast = gathered, None
        compute_dtype = attention_compute_dtype(kv_cache, self.native_bf16)
        if compute_dtype != kv_cache.dtype:
            upcast = self._get_buffer(kv_cache, compute_dtype, plan.max_gathered_blocks)[: gathered.numel()]
            both = upcast = upcast.view(gathered.shape)
        width = batch.num_blocks * kv_cache.shape[2]
        kv = both.flatten(1, 2).view(2, n, width, *kv_cache.shape[3:])[:, :, : batch.seq_len].transpose(2, 3)
        mask = batch.mask
        if (
            mask is not None
        ):  # SDPA turns a bool mask into this additive one on every call (where(¬m, -inf, 0))
            mask = torch.zeros(mask.shape, dtype=compute_dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf")
            )
        views = _DecodeViews(
            gathered=gathered,
            upcast=upcast,
            keys=kv[0],
            values=kv[1],  # [n, KVH, S, d] each
            mask=mask,
        )
        self._views = (key, views)
        return views

    @staticmethod
    def _fresh(
        keys: torch.Tensor, values: torch.Tensor, item: Prefill, compute_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [query_len, KVH, d] of a prefill with no cached prefix (query_len == seq_len), sliced
        from what :meth:`write_kv` stored (in the cache's dtype, so the same values :meth:`_gather` would
        read back; upcast like it where the compute dtype differs)."""
        rows = slice(item.start, item.start + item.query_len)
        keys, values = keys[rows], values[rows]
        if keys.dtype != compute_dtype:
            keys, values = keys.to(compute_dtype), values.to(compute_dtype)
        return keys, values

    def _gather(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, plan: Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``blocks`` (int64 [m]) of K and V (one ``index_select`` for both) into the reusable buffer →
        two [m * block_size, KVH, d] in the attention compute dtype."""
        m = blocks.shape[0]
        block_shape = kv_cache.shape[2:]
        gathered = self._get_buffer(kv_cache, kv_cache.dtype, plan.max_gathered_blocks)[
            : 2 * m * block_shape.numel()
        ]
        both = torch.index_select(kv_cache, 1, blocks, out=gathered.view(2, m, *block_shape))
        compute_dtype = attention_compute_dtype(kv_cache, self.native_bf16)
        if compute_dtype != kv_cache.dtype:
            upcast = self._get_buffer(kv_cache, compute_dtype, plan.max_gathered_blocks)[: gathered.numel()]
            both = upcast.view(both.shape).copy_(both)
        both = both.flatten(1, 2)
        return both[0], both[1]

    def _get_buffer(self, kv_cache: torch.Tensor, dtype: torch.dtype, num_blocks: int) -> torch.Tensor:
        """A flat ``dtype`` buffer on the cache's device for K and V of >= ``num_blocks`` blocks, reused
        across layers and steps (no allocation and page faults per layer); grown (x1.5) on demand."""
        buffer = self._buffers.get(dtype)
        needed = 2 * num_blocks * kv_cache.shape[2:].numel()
        if buffer is None or buffer.numel() < needed or buffer.device != kv_cache.device:
            size = max(needed, 0 if buffer is None else buffer.numel() * 3 // 2)
            buffer = torch.empty(size, dtype=dtype, device=kv_cache.device)
            self._buffers[dtype] = buffer
        return buffer

    def _get_plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> Plan:
        """Memoized per (metadata object, block_size): every layer of one forward shares the plan."""
        block_size = kv_cache.shape[2]
        cached = self._plan_for
        if self._plan is None or cached is None or cached[0] is not metadata or cached[1] != block_size:
            self._plan = build_plan(
                metadata, block_size, self.paged_decode and paged_decode_applies(kv_cache), self.paged_prefill
            )
            self._plan_for = (metadata, block_size)
            self._views = None
            self._release_large_buffers(2 * self._plan.max_gathered_blocks * kv_cache.shape[2:].numel())
            decodes = self._plan.decodes
            if decodes is not None and decodes.token_index is None and not self._plan.paged_decode:
                self.resident.begin_step(
                    decodes.blocks.view(decodes.token_count, decodes.num_blocks),
                    metadata.seq_lens,
                    metadata.slot_mapping,
                    block_size,
                )
            else:
                self.resident.begin_step(None, None, None, block_size)
        return self._plan

    def _release_large_buffers(self, numel: int) -> None:
        """Drop gather buffers over MAX_RETAINED_GATHER_BYTES (K and V each) that this step does not need in
        full (``numel`` elements: one long batch must not pin its gather memory for the engine's lifetime)."""
        for dtype, buffer in list(self._buffers.items()):
            too_big = buffer.numel() * buffer.element_size() > 2 * MAX_RETAINED_GATHER_BYTES
            if too_big and buffer.numel() > numel:
                del self._buffers[dtype]
