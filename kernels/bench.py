"""``python -m kvscope.kernels.bench [--quick] [--save-path DIR]``: achieved bandwidth and FLOP/s of the
kernels on CUDA.

For each kernel and workload (pure decode batches, one prefill chunk behind a cached prefix, KV writes) over
context lengths and batch sizes, it times (``triton.testing.do_bench``, median) and reports:

- ``GB/s``: unique bytes moved / time. Attention reads Q, the K/V of every context token once, writes O;
  reshape_and_cache reads and writes the new K/V.
- ``TFLOP/s``: ``4 * num_heads * head_dim * sum(visible keys per query)`` / time (QK^T and PV, causal).

next to PyTorch: ``sdpa`` is ``F.scaled_dot_product_attention`` on K/V already gathered into dense tensors
(the dense upper bound), ``gather+sdpa`` includes the gather from the paged cache (what a plain torch backend
does), ``torch`` for writes is ``index_copy_``. ``triton-nosplit`` forces ``num_segments=1`` to show what
split-KV buys. The grid is declared as ``triton.testing.Benchmark`` objects and run with
``triton.testing.perf_report`` (tables, CSV and plots need pandas + matplotlib); without pandas the same grid
prints as plain tables.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.testing

from kvscope.kernels.paged_attention import paged_attention
from kvscope.kernels.reshape_and_cache import reshape_and_cache

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
ATTENTION_PROVIDERS = ("triton", "triton-nosplit", "sdpa", "gather+sdpa")
WRITE_PROVIDERS = ("triton", "torch")
PREFILL_CHUNK = 512


@dataclass(frozen=True, slots=True)
class HeadShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = {s.name: s for s in (HeadShape("smollm2-135m", 9, 3, 64), HeadShape("llama-3-8b", 32, 8, 128))}


@dataclass(frozen=True, slots=True)
class Workload:
    """``num_reqs`` requests of ``seq_len`` tokens, the last ``q_len`` of them new, in a shuffled paged
    cache."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    q_len: int
    seq_len: int
    bytes_moved: int
    flops: int


def make_workload(
    shape: HeadShape, num_reqs: int, q_len: int, seq_len: int, device: torch.device
) -> Workload:
    """Random query and cache; block ids shuffled so requests read scattered blocks."""
    blocks_per_req = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_reqs * blocks_per_req
    cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, device=device, dtype=DTYPE
    )
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(num_reqs, blocks_per_req)
    query = torch.randn(num_reqs * q_len, shape.num_heads, shape.head_dim, device=device, dtype=DTYPE)
    starts = torch.arange(0, num_reqs + 1, device=device, dtype=torch.int32) * q_len
    lens = torch.full((num_reqs,), seq_len, device=device, dtype=torch.int32)
    elem = DTYPE.itemsize
    kv_bytes = 2 * num_reqs * seq_len * shape.num_kv_heads * shape.head_dim * elem
    visible = num_reqs * sum(seq_len - q_len + j + 1 for j in range(q_len))
    return Workload(
        query, cache, starts, lens, tables, q_len, seq_len,
        bytes_moved=2 * query.numel() * elem + kv_bytes, flops=4 * shape.num_heads * shape.head_dim * visible,
    )  # fmt: skip


def gather_dense(w: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as dense ``[num_reqs, num_kv_heads, seq_len, head_dim]`` tensors (block-table gather)."""
    k, v = (w.kv_cache[i][w.block_tables.long()].flatten(1, 2)[:, : w.seq_len] for i in (0, 1))
    return k.transpose(1, 2), v.transpose(1, 2)


def _sdpa(
    w: Workload, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    q = w.query.view(-1, w.q_len, *w.query.shape[1:]).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def attention_runner(w: Workload, provider: str) -> Callable[[], object]:
    """A no-argument callable that runs one step of ``provider`` on ``w``."""
    scale = w.query.shape[-1] ** -0.5
    if provider.startswith("triton"):
        out = torch.empty_like(w.query)
        segments = 1 if provider == "triton-nosplit" else None
        args = (w.query, w.kv_cache, w.query_start_loc, w.seq_lens, w.block_tables, scale)
        kwargs = dict(max_query_len=w.q_len, max_seq_len=w.seq_len, num_segments=segments, out=out)
        return lambda: paged_attention(*args, **kwargs)
    mask = None
    if w.q_len > 1:  # bottom-right causal: query j sits at position seq_len - q_len + j
        positions = torch.arange(w.seq_len - w.q_len, w.seq_len, device=w.query.device)
        mask = torch.arange(w.seq_len, device=w.query.device)[None, :] <= positions[:, None]
    if provider == "sdpa":
        k, v = gather_dense(w)
        return lambda: _sdpa(w, k, v, mask, scale)
    return lambda: _sdpa(w, *gather_dense(w), mask, scale)


def write_runner(
    shape: HeadShape, num_tokens: int, provider: str, device: torch.device
) -> tuple[Callable, int]:
    """(callable writing ``num_tokens`` tokens' K/V at shuffled slots, bytes moved)."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    cache = torch.zeros(
        2, num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, device=device, dtype=DTYPE
    )
    key, value = torch.randn(2, num_tokens, shape.num_kv_heads, shape.head_dim, device=device, dtype=DTYPE)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    moved = 2 * 2 * key.numel() * DTYPE.itemsize + slots.numel() * 8
    if provider == "triton":
        return (lambda: reshape_and_cache(key, value, cache, slots)), moved
    flat = cache.view(2, -1, shape.num_kv_heads, shape.head_dim)
    return (lambda: (flat[0].index_copy_(0, slots, key), flat[1].index_copy_(0, slots, value))), moved


class Suite:
    """The benchmark grid; each (workload, provider) is timed once and reported in both metrics."""

    def __init__(self, device: torch.device, quick: bool) -> None:
        self.device = device
        self.quick = quick
        self._ms: dict[tuple, tuple[float, int, int]] = {}

    def _timed(self, key: tuple, build: Callable[[], tuple[Callable, int, int]]) -> tuple[float, int, int]:
        if key not in self._ms:
            fn, moved, flops = build()
            fn()  # compile outside the timed region
            self._ms[key] = (
                triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"),
                moved,
                flops,
            )
            del fn
            torch.cuda.empty_cache()
        return self._ms[key]

    def measure(self, x: int, provider: str, kind: str, shape: str, batch: int, metric: str) -> float:
        """One table cell: ``metric`` (GB/s or TFLOP/s) of ``provider`` at context/token count ``x``."""
        head = SHAPES[shape]
        if kind == "reshape_and_cache":
            ms, moved, flops = self._timed((kind, shape, x, provider), lambda: (*write_runner(
                head, x, provider, self.device), 0))  # fmt: skip
        else:
            q_len = 1 if kind == "decode" else min(PREFILL_CHUNK, x)
            if not self._fits(head, batch, x):
                return float("nan")
            ms, moved, flops = self._timed((kind, shape, batch, x, provider), lambda: self._attention(
                head, batch, q_len, x, provider))  # fmt: skip
        return (moved / ms / 1e6) if metric == "GB/s" else (flops / ms / 1e9)

    def _attention(self, head, batch, q_len, seq_len, provider) -> tuple[Callable, int, int]:
        w = make_workload(head, batch, q_len, seq_len, self.device)
        return attention_runner(w, provider), w.bytes_moved, w.flops

    def _fits(self, head: HeadShape, batch: int, seq_len: int) -> bool:
        """Paged cache + gathered copy must stay under 40% of device memory."""
        need = 4 * batch * seq_len * head.num_kv_heads * head.head_dim * DTYPE.itemsize
        return need < 0.4 * torch.cuda.get_device_properties(self.device).total_memory

    def benchmarks(self) -> list[triton.testing.Benchmark]:
        contexts = [1024, 4096, 16384] if self.quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
        batches = [1, 64] if self.quick else [1, 16, 64, 256]
        shapes = ["smollm2-135m"] if self.quick else list(SHAPES)
        marks = []
        for shape in shapes:
            for batch in batches:
                marks += [_bench("decode", shape, batch, m, contexts) for m in ("GB/s", "TFLOP/s")]
            marks += [_bench("prefill", shape, 1, m, contexts) for m in ("GB/s", "TFLOP/s")]
            tokens = [256, 4096] if self.quick else [64, 256, 1024, 4096, 16384]
            marks.append(_bench("reshape_and_cache", shape, 0, "GB/s", tokens))
        return marks


def _bench(kind: str, shape: str, batch: int, metric: str, xs: list[int]) -> triton.testing.Benchmark:
    providers = WRITE_PROVIDERS if kind == "reshape_and_cache" else ATTENTION_PROVIDERS
    suffix = "" if kind == "reshape_and_cache" else f"-batch{batch}"
    return triton.testing.Benchmark(
        x_names=["x"], x_vals=xs, line_arg="provider", line_vals=list(providers), line_names=list(providers),
        plot_name=f"{kind}-{shape}{suffix}-{metric.replace('/', 'per')}", ylabel=metric,
        xlabel="new tokens" if kind == "reshape_and_cache" else "context length",
        args={"kind": kind, "shape": shape, "batch": batch, "metric": metric},
    )  # fmt: skip


def _print_plain(suite: Suite, marks: list[triton.testing.Benchmark]) -> None:
    """perf_report's table without pandas: one row per x, one column per provider."""
    for mark in marks:
        print(f"\n{mark.plot_name} ({mark.ylabel}, {DTYPE}, block_size {BLOCK_SIZE})")
        print(f"{mark.xlabel:>16}" + "".join(f"{name:>16}" for name in mark.line_names))
        for x in mark.x_vals:
            cells = [suite.measure(x, p, **mark.args) for p in mark.line_vals]
            print(
                f"{x:>16}" + "".join(f"{'-' if math.isnan(c) else f'{c:.1f}':>16}" for c in cells), flush=True
            )


def main(argv: list[str] | None = None) -> int:
    """Run the grid; returns 2 (with a message) without a CUDA device."""
    parser = argparse.ArgumentParser(
        prog="python -m kvscope.kernels.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="a small grid (about a minute)")
    parser.add_argument("--save-path", default="", help="folder for perf_report CSV/PNG (needs pandas)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "kvscope.kernels.bench measures CUDA kernels, and torch sees no CUDA device here; "
            "nothing to run.",
            file=sys.stderr,
        )
        return 2
    suite = Suite(torch.device("cuda"), args.quick)
    marks = suite.benchmarks()
    try:
        import pandas  # noqa: F401  (perf_report's tables need it)
    except ImportError:
        _print_plain(suite, marks)
        return 0
    report = triton.testing.perf_report(marks)(suite.measure)
    report.run(print_data=True, show_plots=False, save_path=args.save_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
