"""In-process A/B of issue 13 round 11's prefill changes: the code before them (main at 991f556, copied below
as ``old_*``) patched in and out of one engine, alternating every prompt, so that the machine's drift (larger
than the change between minutes on a shared 2-vCPU host) falls on both sides alike.
Each sample is one 128-token prefill step (a fresh prompt, prefix caching off), engine-thread CPU seconds with
1 thread and wall seconds with more. A benchmark, not a test.

Switched: ``write_kv`` (torch.stack + index_copy_ against kvscope_cpu.write_kv), the residual stream (the
MLP's add in the layer and the final norm separate, against fused into the next add_rms_norm) and the
attention output (SDPA's output copied into a preallocated tensor, against returned as it is). Not switched:
SwiGLU's table lookup, which replaced the kernel's own exp + division inside the C++ library (bench it with
``python bench/prefill_ab.py --silu``: the op alone at the model's shapes).

Usage: python bench/prefill_ab.py [--threads N] [--rounds R] [--silu]
"""

import argparse
import statistics
import time

import torch

import kvscope.engine.attention.torch_backend as TB
import kvscope.engine.models.layers as L
import kvscope.engine.models.llama as M
from kvscope.engine.bench import random_prompts
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams


def old_write(self, key, value, kv_cache, slot_mapping):
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    both = torch.stack((key, value))
    if both.dtype != kv_cache.dtype:
        both = both.to(kv_cache.dtype)
    kv_cache.view(2, -1, num_kv_heads, head_dim).index_copy_(1, slot_mapping, both)
    self._written = (kv_cache, slot_mapping, both[0], both[1])


def old_layer(self, hidden, residual, cos, sin):
    if residual is not None:
        hidden = residual + hidden  # the previous layer's own add
    attn = self.self_attn.forward(self.input_layernorm.forward(hidden), cos, sin)
    hidden, normed = L.add_norm(self.post_attention_layernorm, attn, hidden)
    return hidden + self.mlp.forward(normed), None


def old_model(self, input_ids, positions):
    hidden = self.embed_tokens(input_ids)
    cos, sin = L.rope_tables(*self.rotary_emb(positions, hidden.dtype))
    for layer in self.layers:
        hidden, _ = layer.forward(hidden, None, cos, sin)
    return self.norm(hidden)


def old_forward(self, query, kv_cache, metadata, scale):  # the SDPA path with its output copy
    plan = self._get_plan(metadata, kv_cache)
    written, self._written = self._written, None
    compute_dtype = TB.attention_compute_dtype(kv_cache, self.native_bf16)
    dtype = query.dtype
    if compute_dtype != dtype:
        query = query.to(compute_dtype)
    out = torch.empty_like(query)
    for item in plan.prefills:
        keys, values = self._fresh(written[2], written[3], item, compute_dtype)
        q = query[item.start : item.start + item.query_len].transpose(0, 1)[None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q,
            keys[: item.seq_len].transpose(0, 1)[None],
            values[: item.seq_len].transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[item.start : item.start + item.query_len] = o[0].transpose(0, 1)
    return out if compute_dtype == dtype else out.to(dtype)


PATCHES = [
    (TB.TorchAttentionBackend, "write_kv", old_write),
    (M.DecoderLayer, "forward", old_layer),
    (M.LlamaModel, "forward", old_model),
    (TB.TorchAttentionBackend, "forward", old_forward),
]
NEW = [(cls, name, getattr(cls, name)) for cls, name, _ in PATCHES]


def apply(old: bool) -> None:
    for cls, name, fn in PATCHES if old else NEW:
        setattr(cls, name, fn)


def silu(threads: int) -> None:
    torch.set_num_threads(threads)
    gate_up = torch.randn(128, 3072).bfloat16()
    ops = torch.ops.kvscope_cpu
    for name, fn in (
        ("kvscope_cpu.silu_and_mul", lambda: ops.silu_and_mul(gate_up)),
        ("torch F.silu(g) * u", lambda: torch.nn.functional.silu(gate_up[:, :1536]) * gate_up[:, 1536:]),
    ):
        for _ in range(50):
            fn()
        samples = []
        for _ in range(1000):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        print(
            f"{name} [128, 3072] bf16, {threads} thread(s): "
            f"median {1e6 * statistics.median(samples):.1f} µs, "
            f"min {1e6 * min(samples):.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--silu", action="store_true", help="time the SwiGLU op alone")
    args = parser.parse_args()
    llm = LLM(
        "smollm2-135m",
        dtype="auto",
        quantization="auto",
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_model_len=1024,
    )
    if args.silu:
        silu(args.threads)
        return
    engine = llm.engine
    prompts = random_prompts(4 * args.rounds + 2, 128, engine.vocab_size, 3)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {"old": [], "new": []}
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, ids in enumerate(prompts):
        variant = ("old", "new")[(i + i // 2) % 2]  # old new new old old new …: neither side always first
        apply(variant == "old")
        engine.add_request(f"p{i}", ids, params)
        start = clock()
        engine.step()
        if i >= 2:  # the first of each is a warm-up
            times[variant].append(clock() - start)
        while engine.has_unfinished_requests():
            engine.step()
    apply(False)
    old, new = times["old"], times["new"]
    print(
        f"128-token prefill step, {args.threads} thread(s), {len(old)}+{len(new)} samples "
        f"({'CPU' if args.threads == 1 else 'wall'} ms): "
        f"before median {1e3 * statistics.median(old):.1f} min "
        f"{1e3 * min(old):.1f} | after median {1e3 * statistics.median(new):.1f} min {1e3 * min(new):.1f} "
        f"| after ÷ before {statistics.median(new) / statistics.median(old):.3f}"
    )


if __name__ == "__main__":
    main()
