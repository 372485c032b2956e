"""Compile every kernel to a CUDA cubin without a GPU (``python tests/kernels/compile_for_cuda.py [sm]``).

The interpreter runs the kernels' Python semantics; this script runs the real Triton compiler (frontend, MLIR
passes, LLVM, ptxas bundled with triton) for an NVIDIA target, so loop-carried types, constexpr branches and
dot shapes that only the compiler checks are checked on a CPU machine too. It must run in a process where
``TRITON_INTERPRET`` is unset (test_compile_cuda.py starts it in a subprocess). The launch arguments come
from the launchers' own ``*_args`` builders, so the compiled signatures are the ones a launch would use.
Prints one line per compiled variant and exits non-zero on the first failure.
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvscope.kernels.merge_attn_states import _merge_attn_states_kernel
from kvscope.kernels.paged_attention import (
    _paged_attention_kernel,
    choose_block_m,
    choose_num_warps,
    paged_attention_args,
)
from kvscope.kernels.reshape_and_cache import _reshape_and_cache_kernel, reshape_and_cache_args

TYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}


def _signature(kernel, args: dict[str, object]) -> tuple[dict[str, str], dict[str, object]]:
    """Map launch arguments to an ASTSource signature (``*fp16``, ``i32``, ``fp32``, ``constexpr``)."""
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPE_NAMES[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        elif value == 1:  # the launcher specialises integer arguments equal to 1 the same way
            signature[param.name], constexprs[param.name] = "constexpr", 1
        else:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
    return signature, constexprs


def _compile(kernel, args: dict[str, object], target: GPUTarget, num_warps: int) -> int:
    signature, constexprs = _signature(kernel, args)
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=target, options={"num_warps": num_warps}
    )
    return len(compiled.asm["cubin"])


ATTENTION_VARIANTS = (
    # dtype, head_dim, heads, kv_heads, block_size, max_query_len, num_segments, num_reqs
    (torch.float16, 64, 9, 3, 16, 1, 1, 1),  # SmolLM2 decode, one request (num_reqs specialised to 1)
    (torch.bfloat16, 64, 9, 3, 16, 512, 1, 2),  # SmolLM2 prefill chunk
    (torch.bfloat16, 128, 32, 8, 32, 1, 8, 2),  # Llama-8B-like split-KV decode
    (torch.float32, 128, 8, 8, 1, 256, 1, 2),  # fp32, block size 1, no GQA
    (torch.float32, 64, 9, 3, 16, 1, 4, 2),  # fp32 split decode
)


def _attention_variants():
    """(label, args, num_warps) over dtypes, head dims, GQA groups, block sizes and split/no-split."""
    for dtype, head_dim, heads, kv_heads, block_size, max_q, segments, num_reqs in ATTENTION_VARIANTS:
        query = torch.empty(4, heads, head_dim, dtype=dtype)
        cache = torch.empty(2, 8, block_size, kv_heads, head_dim, dtype=dtype)
        qsl, seq_lens = torch.zeros(num_reqs + 1, dtype=torch.int32), torch.zeros(num_reqs, dtype=torch.int32)
        tables = torch.zeros(num_reqs, 4, dtype=torch.int32)
        part = torch.empty(1, dtype=torch.float32)
        block_m = choose_block_m(heads // kv_heads, max_q)
        args = paged_attention_args(
            query, query, cache, qsl, seq_lens, tables, 0.125, (part, part, part), block_m, segments
        )
        label = (
            f"{dtype} d={head_dim} h={heads}/{kv_heads} bs={block_size} M={block_m} seg={segments} "
            f"reqs={num_reqs}"
        )
        yield label, args, choose_num_warps(block_m, head_dim, dtype)


def main(capability: int) -> None:
    target = GPUTarget("cuda", capability, 32)
    for label, args, num_warps in _attention_variants():
        print(
            f"ok paged_attention {label}: {_compile(_paged_attention_kernel, args, target, num_warps)} B",
            flush=True,
        )
    for dtype in (torch.float16, torch.float32):
        kv = torch.empty(4, 3, 64, dtype=dtype)
        args = reshape_and_cache_args(
            kv, kv, torch.empty(2, 8, 16, 3, 64, dtype=dtype), torch.zeros(4).long()
        )
        print(f"ok reshape_and_cache {dtype}: {_compile(_reshape_and_cache_kernel, args, target, 1)} B")
        merge = dict(out_ptr=kv, part_acc_ptr=torch.empty(1), part_m_ptr=torch.empty(1),
                     part_l_ptr=torch.empty(1),
                     stride_o_t=192, stride_o_h=64, NUM_HEADS=3, NUM_SEGMENTS=8, HEAD_DIM=64)  # fmt: skip
        print(f"ok merge_attn_states {dtype}: {_compile(_merge_attn_states_kernel, merge, target, 2)} B")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
