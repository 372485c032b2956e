"""``python -m kvscope.engine.platform.kernel_probe_cli``: the start-up kernel probe
(:mod:`kvscope.engine.platform.kernel_probe`) and ms per decode step of a model's matmuls per weight format,
rows and threads (see docs/engine-server.md, Weight formats). A separate module so that the probe stays
below the loader (no import circle)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from kvscope.engine.platform.kernel_probe import decode_matmul_ms, model_linear_shapes, probe_cpu_kernels
from kvscope.engine.weights.files import read_hf_config, resolve_model_dir


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvscope.engine.platform.kernel_probe_cli [--model M] [--threads 1 2] [--rows 1 32]``: run
    the probe, then print ms per decode step of the model's matmuls per format and thread count (wall time,
    and on one thread also CPU time: see :func:`decode_matmul_ms`)."""
    p = argparse.ArgumentParser(
        prog="python -m kvscope.engine.platform.kernel_probe_cli", description=main.__doc__
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument(
        "--formats",
        nargs="+",
        default=["float32", "bfloat16", "int8", "int8:bfloat16", "int4", "int4:bfloat16"],
    )
    args = p.parse_args(argv)
    shapes = model_linear_shapes(read_hf_config(resolve_model_dir(args.model)))
    for threads in args.threads:
        torch.set_num_threads(threads)
        choice = probe_cpu_kernels()
        print(f"{threads} thread(s): {choice.describe()}", flush=True)
        for rows in args.rows:
            for name, clock in (("wall", time.perf_counter), ("cpu", time.process_time))[
                : 2 if threads == 1 else 1
            ]:
                times = {
                    fmt: decode_matmul_ms(shapes, rows, fmt, choice, clock=clock) for fmt in args.formats
                }
                print(
                    f"  {len(shapes)} matmuls x {rows:3d} rows, {name} ms: "
                    + ", ".join(f"{fmt} {ms:6.1f}" for fmt, ms in times.items()),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
