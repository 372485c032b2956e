"""The prefill's four projection shapes at a prompt's row count in three formats: oneDNN-packed bfloat16 (what
the engine's prefill runs on AMX/AVX512_BF16), ``torch._int_mm`` (int8 x int8 -> int32, weights not
pre-packed), and oneDNN's int8 linear with pre-packed weights and the dequantization fused
(``onednn.qlinear_pointwise``, the op torch's x86 inductor quantizer emits). Median ms of 30 calls and
GFLOP/s, SmolLM2-135M's shapes by default. A benchmark, not a test: it answers whether int8 activations
(W8A8) would bring the idle TTFT under a target at this hour's matmul speed; their quality cost is measured
separately (both in docs/benchmarks.md "Int8 activations (W8A8) for prefill").

    python bench/prefill_matmul_formats.py [--rows 128] [--threads 2] [--hidden 576] [--intermediate 1536]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], calls: int = 30) -> float:
    """Median wall milliseconds of ``calls`` calls of ``fn`` after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def time_shape(m: int, k: int, n: int) -> dict[str, float]:
    """Median ms of an ``[m, k] x [k, n]`` projection in each format (random values: speed only)."""
    weight = torch.randn(n, k)
    x = torch.randn(m, k).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16().contiguous(), m)
    w_scale = weight.abs().amax(1) / 127
    w_q = (weight / w_scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    w_qt = w_q.t().contiguous()
    x_q = torch.randint(-127, 127, (m, k), dtype=torch.int8)
    x_u8 = torch.randint(0, 255, (m, k), dtype=torch.uint8)
    w_packed = torch.ops.onednn.qlinear_prepack(w_q.contiguous(), [m, k])
    zeros = torch.zeros(n, dtype=torch.int64)
    x_scale, x_zero = torch.tensor(0.02), torch.tensor(128)
    return {
        "bfloat16": median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")),
        "_int_mm": median_ms(lambda: torch._int_mm(x_q, w_qt)),
        "qlinear": median_ms(
            lambda: torch.ops.onednn.qlinear_pointwise.tensor(
                x_u8, x_scale, x_zero, w_packed, w_scale, zeros, None, 1.0, 0, torch.bfloat16, "none", [], ""
            )
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="prompt tokens (rows of the activation)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv-width", type=int, default=192, help="k (= v) projection width")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    h, i, m = args.hidden, args.intermediate, args.rows
    shapes = {"qkv": (h, h + 2 * args.kv_width), "o": (h, h), "gate_up": (h, 2 * i), "down": (i, h)}
    totals = {"bfloat16": 0.0, "_int_mm": 0.0, "qlinear": 0.0}
    for name, (k, n) in shapes.items():
        ms = time_shape(m, k, n)
        gflop = 2 * m * k * n / 1e9
        print(
            f"{name:8s} {m} x {k} -> {n}: "
            + "  ".join(f"{fmt} {t:.3f} ms ({gflop / t * 1e3:.0f} GFLOP/s)" for fmt, t in ms.items())
        )
        for fmt, t in ms.items():
            totals[fmt] += t
    print("one layer: " + "  ".join(f"{fmt} {t:.2f} ms" for fmt, t in totals.items()))


if __name__ == "__main__":
    main()
