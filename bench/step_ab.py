"""In-process A/B of issue-13p's per-step changes: the implementations before them (main at 45a43b8, copied
below as ``old_*``) patched in and out of one engine every 5 steps, 40 timed decode steps each, CPU seconds of
the engine thread. Process-to-process runs on a shared 2-core box disagree by more than the change; this
does not (docs/benchmarks.md "Per-step cost of the eager decoder"). A benchmark, not a test.

Usage: python bench/step_ab.py BATCH GROUPS [THREADS]   (GROUPS: comma-separated of rms, compact, calls, attn;
       THREADS > 1 times wall seconds)
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import kvscope.engine.attention.torch_backend as TB
import kvscope.engine.models.layers as L
import kvscope.engine.models.llama as M
import kvscope.engine.weights.quant as Q
from kvscope.engine.attention.forward_context import get_forward_context
from kvscope.engine.bench import random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams


def old_rms(self, x):
    if x.dtype == self.weight.dtype == torch.float32:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + self.eps)
    return self.weight * h.to(dtype)


def old_compact(self, x):
    rows = x.shape[0]
    if rows == 0:
        return x.new_empty(0, self.compact.out_features)
    if self.dense is not None and rows > self.max_compact_rows:
        return self.dense(x.to(self.dense_dtype)).to(x.dtype)
    out = self.compact.matmul(x.to(Q.COMPUTE_DTYPE).contiguous())
    if self.bias is not None:
        out = out + self.bias.to(out.dtype)
    return out.to(x.dtype)


def old_layer(self, hidden, cos, sin):
    hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
    return hidden + self.mlp(self.post_attention_layernorm(hidden))


def old_mlp(self, x):
    return self.down_proj(L.silu_and_mul(self.gate_up_proj(x)))


def old_model(self, input_ids, positions):
    hidden = self.embed_tokens(input_ids)
    cos, sin = L.rope_tables(*self.rotary_emb(positions, hidden.dtype))
    for layer in self.layers:
        hidden = layer(hidden, cos, sin)
    return self.norm(hidden)


def old_attn(self, hidden, cos, sin):
    num_tokens = hidden.shape[0]
    qkv = self.qkv_proj(hidden)
    v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
    qk = qkv[:, : self.q_size + self.kv_size].view(
        num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
    )
    q, k = L.apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
    context = get_forward_context()
    kv_cache = context.kv_caches[self.layer_idx]
    context.backend.write_kv(k, v, kv_cache, context.attn_metadata.slot_mapping)
    out = context.backend.forward(q, kv_cache, context.attn_metadata, self.scale)
    return self.o_proj(out.reshape(num_tokens, self.q_size))


def old_decode(self, query, kv_cache, batch, plan, scale):
    n = query.shape[0]
    keys, values = self._gather(kv_cache, batch.blocks, plan)
    width = batch.num_blocks * kv_cache.shape[2]
    k = keys.view(n, width, *keys.shape[1:])[:, : batch.seq_len].transpose(1, 2)
    v = values.view(n, width, *values.shape[1:])[:, : batch.seq_len].transpose(1, 2)
    o = F.scaled_dot_product_attention(
        query[:, :, None, :], k, v, attn_mask=batch.mask, scale=scale, enable_gqa=True
    )
    return o[:, :, 0, :]


def old_write(self, key, value, kv_cache, slot_mapping):
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    both = torch.stack((key, value)).to(kv_cache.dtype)
    kv_cache.view(2, -1, num_kv_heads, head_dim).index_copy_(1, slot_mapping, both)


PATCHES = {
    "rms": [(L.RMSNorm, "forward", old_rms)],
    "compact": [(Q.CompactLinearKernel, "__call__", old_compact)],
    "calls": [
        (M.DecoderLayer, "forward", old_layer),
        (M.MLP, "forward", old_mlp),
        (M.LlamaModel, "forward", old_model),
        (M.Attention, "forward", old_attn),
    ],
    "attn": [
        (TB.TorchAttentionBackend, "_decode", old_decode),
        (TB.TorchAttentionBackend, "write_kv", old_write),
    ],
}
NEW = {k: [(c, n, getattr(c, n)) for c, n, _ in v] for k, v in PATCHES.items()}


def apply(names, old):
    for k in PATCHES:
        for c, n, f in PATCHES[k] if (old and k in names) else NEW[k]:
            setattr(c, n, f)


def main() -> None:
    batch, groups = int(sys.argv[1]), sys.argv[2].split(",")
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    llm = LLM(
        "smollm2-135m",
        dtype="auto",
        quantization="gguf",
        num_threads=threads,
        enable_prefix_caching=False,
        max_model_len=1024,
    )
    engine = llm.engine
    for i, ids in enumerate(random_prompts(batch, 128, engine.vocab_size, 1)):
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    times: dict[str, list[float]] = {"old": [], "new": []}
    clock = time.thread_time if threads == 1 else time.perf_counter  # wall time with more threads
    for rnd in range(10):
        for variant in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
            apply(groups, variant == "old")
            off = variant == "old" and "attn" in groups  # main had no resident copy
            engine.runner.backend.resident.min_bytes = (1 << 62) if off else (256 << 10)
            engine.step()  # the first step after a switch is not timed
            for _ in range(4):
                start = clock()
                engine.step()
                times[variant].append(clock() - start)
    apply(groups, False)
    old, new = times["old"], times["new"]
    print(
        f"batch {batch}, switched {groups}: main's code median {1e3 * statistics.median(old):.1f} min "
        f"{1e3 * min(old):.1f} | this branch median {1e3 * statistics.median(new):.1f} "
        f"min {1e3 * min(new):.1f} "
        f"ms {'CPU' if threads == 1 else 'wall'} per step, {threads} thread(s)"
    )


if __name__ == "__main__":
    main()
