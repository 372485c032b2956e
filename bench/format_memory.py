"""Weights bytes and process RSS per weight format (docs/engine-server.md "Memory per weight format").

Each format loads in a fresh process (``python bench/format_memory.py --one FORMAT`` prints one JSON line) so
that its RSS is its own: the engine built with a 64 MiB KV cache, one thread, then ``VmRSS``/``VmHWM``.
``python bench/format_memory.py`` runs every format and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from kvscope.common.weight_formats import format_flags

FORMATS = {
    **{
        name: dict(zip(("dtype", "quantization"), format_flags(name, "auto"), strict=True))
        for name in ("float32", "bfloat16", "int8", "gguf")
    },
    "auto": {"dtype": "auto", "quantization": "auto"},
}
"""Format name → LLM keyword arguments: the engine's own formats (a compact one's dense dtype left to the
start-up probe, ``auto``) and the chooser's pick."""


def one(name: str, model: str) -> dict:
    """Build the engine in format ``name`` and report its bytes (B)."""
    from kvscope.engine.llm import LLM
    from kvscope.engine.memory import process_memory_bytes

    before, _ = process_memory_bytes()
    info = LLM(model, kv_cache_memory=64 << 20, num_threads=1, **FORMATS[name]).engine.info
    rss, peak = process_memory_bytes()
    return {
        "format": name,
        "dtype": info.dtype,
        "quantization": info.quantization,
        "weights_bytes": info.weights_bytes,
        "kv_cache_bytes": info.kv_cache_bytes,
        "rss_bytes": rss,
        "peak_rss_bytes": peak,
        "rss_before_load_bytes": before,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--one", choices=list(FORMATS))
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.model)))
        return 0
    print(
        "| format | dtype / quantization | weights | KV cache | RSS after start | peak RSS | RSS before load "
        "|"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in FORMATS:
        out = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--one", name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        mib = {k: f"{r[k] / (1 << 20):.0f} MiB" for k in r if k.endswith("_bytes")}
        print(
            f"| {name} | {r['dtype']} / {r['quantization']} | {mib['weights_bytes']} ({r['weights_bytes']:,} "
            f"B) | {mib['kv_cache_bytes']} | {mib['rss_bytes']} | {mib['peak_rss_bytes']} | "
            f"{mib['rss_before_load_bytes']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
