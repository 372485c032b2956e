"""Pick the CPU matmul kernels by timing them on this machine (a start-up probe), not by CPU model.

What it decides, on one matrix of the model's MLP shape (``[N, K]`` = gate/up of SmolLM2-135M by default):

- ``dense_dtype``: bfloat16 or float32 for dense matmuls of many rows (prefill, batched decode): oneDNN runs
  bfloat16 on AMX tiles (Sapphire Rapids and later) or AVX512_BF16 (Zen 4), and emulates it elsewhere, where
  float32 wins. Also what ``--dtype auto`` resolves to.
- ``max_rows[fmt]`` for fmt int4/int8: up to how many rows the compact weight-only kernel beats the dense
  packed one. The compact kernels are GEMVs: they win at a few rows and lose several-fold at batched-decode
  sizes, so a compact layer keeps a dense bf16 copy for bigger batches. When compact wins at every probed
  size, no dense copy is kept (``NO_DENSE``).
- ``tile_rows`` and ``tile``: from how many rows kvscope's pair-block weights run the small-batch matmul
  instead of the GEMV, and on which tile type: ``float32``/``bfloat16`` (kernels/csrc/cpu_pair_gemm.h: the
  weights expanded once per call, float32 FMAs or AVX512-BF16 dot products) or ``int16`` (cpu_pair_vnni.h:
  the GEMV's 16-bit activation codes on vpdpbusd, from a transposed copy, ``VnniBlocks``); which is faster
  depends on the CPU; probed where the AMX int4 matmul is not (it serves those rows faster). The
  ``int4@n`` timing is then the one the engine runs at n rows, and ``max_rows["int4"]`` its crossover
  against dense.
- ``batched_rows``: up to how many rows kvscope's AMX int4 matmul (kernels/csrc/cpu_amx.cpp, where the CPU
  kernels were built on a CPU with AMX-BF16) beats the dense bfloat16 copy, probed up to
  :data:`BATCHED_PROBE_ROWS`; the int4 layers use it between ``max_rows["int4"]`` and this (0: not available).

Measured kernel times, crossovers and the probe's own cost: docs/benchmarks.md "Weight formats and the format
chooser" and "AMX int4 matmul".

Each (kernel, rows) pair takes the minimum of a few timed runs of one thread's CPU time, which is robust to
other processes on a shared machine (they only ever make a run slower, and CPU time does not count the waits
of a preempted thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvscope.engine.models.layers import packed_linear_kernel
from kvscope.engine.weights.quant import Int4Blocks, Int4Weight, Int8Weight, int4_weight
from kvscope.kernels import cpu_decode

logger = logging.getLogger(__name__)

NO_DENSE = 1 << 62
"""``max_rows`` meaning: the compact kernel at every size, no dense copy."""
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)
BATCHED_PROBE_ROWS = PROBE_ROWS
"""Rows the AMX int4 matmul is probed at. Not above 64: one cached 3072×576 matrix on one thread favours the
expansion more than a whole model's matmuls on two threads do (the probe said 128 rows on some starts, where a
whole step's matmuls ran slower on AMX than dense; docs/benchmarks.md "AMX int4 matmul")."""


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The measured choice (see module doc); ``timings_ms`` maps ``"<kernel>@<rows>"`` to the best time."""

    dense_dtype: torch.dtype
    max_rows: dict[str, int]
    timings_ms: dict[str, float] = field(default_factory=dict)
    cpu_capability: str = ""
    """``torch.backends.cpu.get_cpu_capability()`` (``AVX512``, ``AVX2``…)."""
    cpu_flags: tuple[str, ...] = ()
    """The :data:`BF16_FLAGS` this CPU has."""
    batched_rows: int = 0
    """Up to how many rows kvscope's AMX int4 matmul replaces the dense copy (module doc); 0: never."""
    tile_rows: int = 0
    """From how many rows kvscope's pair-block weights run the small-batch matmul instead of the GEMV (module
    doc); 0: never (the GEMV at every compact size)."""
    tile: str = ""
    """That matmul's tile kind, ``float32``, ``bfloat16`` or ``int16`` (the fastest here); "" where not
    probed."""

    def describe(self) -> str:
        """One line for the start-up log."""
        rows = ", ".join(
            f"{fmt} up to {'all' if n >= NO_DENSE else n} rows" for fmt, n in self.max_rows.items()
        )
        amx = f", int4 on AMX up to {self.batched_rows} rows" if self.batched_rows else ""
        tiles = f", int4 on {self.tile} tiles from {self.tile_rows} rows" if self.tile_rows else ""
        return (
            f"dense {str(self.dense_dtype).removeprefix('torch.')}, compact {rows}{amx}{tiles} (cpu "
            f"{self.cpu_capability}{', ' + ' '.join(self.cpu_flags) if self.cpu_flags else ''})"
        )

    def row_kernels(self, compact_rows: int | None = None) -> list[tuple[str, int, int]]:
        """Which kernel serves which row counts of a pair-block (gguf int4) weight: ``(kernel, first, last)``
        in row order, ``last`` = ``NO_DENSE`` for "and above". Kernels: ``gemv``, ``tiles_<dtype>``,
        ``amx``, ``dense_<dtype>``. ``compact_rows``: where the compact kernels hand over (default the
        probe's ``max_rows["int4"]``; the fused decode step's own limit for decode steps)."""
        compact = self.max_rows.get("int4", 0) if compact_rows is None else compact_rows
        spans: list[tuple[str, int, int]] = []
        tile_from = self.tile_rows if 0 < self.tile_rows <= compact else compact + 1
        if tile_from > 1:
            spans.append(("gemv", 1, min(tile_from - 1, compact)))
        if tile_from <= compact:
            spans.append((f"tiles_{self.tile}", tile_from, compact))
        if compact >= NO_DENSE:
            return spans
        first = compact + 1
        if self.batched_rows > compact:
            spans.append(("amx", first, self.batched_rows))
            first = self.batched_rows + 1
        spans.append((f"dense_{str(self.dense_dtype).removeprefix('torch.')}", first, NO_DENSE))
        return spans


def describe_row_kernels(spans: Sequence[tuple[str, int, int]]) -> str:
    """``gemv 1-3, tiles_float32 4-8, dense_float32 9+`` from :meth:`KernelChoice.row_kernels`."""
    return ", ".join(
        f"{kernel} {first}+"
        if last >= NO_DENSE
        else f"{kernel} {first}" + (f"-{last}" if last > first else "")
        for kernel, first, last in spans
    )


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
"""/proc/cpuinfo flags that matter for bfloat16/int8 matmuls; logged with the probe (the probe decides)."""


def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """Which of ``BF16_FLAGS`` the first CPU reports; () where there is no /proc/cpuinfo."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ()
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return tuple(f for f in BF16_FLAGS if f in flags)


def best_ms(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The best of ``repeats`` timed calls of ``fn`` by ``clock``, in ms, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best * 1e3


def crossover(compact_ms: Sequence[float], dense_ms: Sequence[float], rows: Sequence[int]) -> int:
    """The largest row count up to which compact is not slower at any probed size; 0 when it loses at the
    first size, ``NO_DENSE`` when it never loses."""
    best = 0
    for n, c, d in zip(rows, compact_ms, dense_ms, strict=True):
        if c > d:
            return best
        best = n
    return NO_DENSE


def _interleaved_best_ms(
    fns: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Best time (ms) of each function by ``clock``, timing them round-robin so that a burst of load elsewhere
    slows every candidate alike instead of one of them."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for key, fn in fns.items():
            start = clock()
            fn()
            best[key] = min(best[key], clock() - start)
    return {key: t * 1e3 for key, t in best.items()}


def probe_cpu_kernels(
    out_features: int = 3072,
    in_features: int = 576,
    rows: Sequence[int] = PROBE_ROWS,
    repeats: int = 5,
    batched_rows: Sequence[int] = BATCHED_PROBE_ROWS,
) -> KernelChoice:
    """Time dense float32/bfloat16 (oneDNN packed) and compact int4/int8 matmuls of a random
    ``[out_features, in_features]`` weight at each row count, and kvscope's AMX int4 matmul against the
    dense bfloat16 one at each of ``batched_rows`` where it is built; returns the KernelChoice. Times one
    thread's CPU time (``time.thread_time``, torch set to 1 thread for the probe, restored after): robust
    to other processes on the machine. Raises RuntimeError when this torch build lacks oneDNN."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.02
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        kernel = packed_linear_kernel(weight.to(dtype), None)
        if kernel is not None:
            kernels[str(dtype).removeprefix("torch.")] = kernel
    if "float32" not in kernels:
        raise RuntimeError("oneDNN is not available in this torch build")
    # oneDNN packs bfloat16 only where the CPU has AVX512-BW/VL/DQ or AVX-NE-CONVERT ("bf16 path needs the
    # cpu support ..."): an AVX2-only CPU (AMD Zen 3, older Xeons) runs float32 dense matmuls, no bfloat16
    blocks = Int4Blocks(
        codes=torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8),
        scale=torch.full((out_features, in_features // 32), 0.01),
        zero=torch.zeros(out_features, in_features // 32),
    )
    kernels["int4"] = _int4_kernel(blocks)
    kernels["int8"] = Int8Weight.from_float(weight).matmul
    inputs = {
        (dtype, n): torch.ones(n, in_features, dtype=dtype)
        for dtype in (torch.float32, torch.bfloat16)
        for n in (*rows, *batched_rows)
    }
    fns = {
        f"{name}@{n}": (
            lambda k=kernel, x=inputs[torch.float32 if name == "float32" else torch.bfloat16, n]: k(x)
        )
        for name, kernel in kernels.items()
        for n in rows
    }
    amx = _amx_kernel(blocks)
    # the small-batch matmul on the same pair blocks, for CPUs without AMX (with it, the AMX matmul takes the
    # batched rows: 10.7 ms for a SmolLM2 step's matmuls at 8 rows against the tiles' ~15; docs/benchmarks.md)
    tile_kinds = _tile_kernels(blocks) if amx is None else {}
    for kind, kernel in tile_kinds.items():
        for n in rows:
            fns[f"int4_tile_{kind}@{n}"] = lambda k=kernel, x=inputs[torch.float32, n]: k(x)
    if amx is not None:  # the AMX matmul against the bfloat16 copy it would replace, also above ``rows``
        for n in batched_rows:
            x = inputs[torch.bfloat16, n]
            fns[f"int4_amx@{n}"] = lambda x=x: amx(x)
            fns.setdefault(f"bfloat16@{n}", lambda x=x: kernels["bfloat16"](x))
    # one thread's CPU time, not wall time: on a loaded machine a preempted OpenMP thread stretches wall times
    # at random (a start-up next to a test run once picked the slower float32 from wall times:
    # docs/benchmarks.md "Weight formats and the format chooser"); the CPU cost of each kernel on one core
    # ranks them the same way on an idle machine and is robust to the load
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            timings = _interleaved_best_ms(fns, repeats, clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    tile, tile_rows = tile_choice(timings, rows, tuple(tile_kinds))
    if tile_rows:  # "int4" is what the engine runs: the GEMV below tile_rows, the tiles from there
        for n in rows:
            timings[f"int4_gemv@{n}"] = timings[f"int4@{n}"]
            if n >= tile_rows:
                timings[f"int4@{n}"] = timings[f"int4_tile_{tile}@{n}"]
    series = {name: [timings[f"{name}@{n}"] for n in rows] for name in kernels}
    dense_dtype = (
        torch.bfloat16
        if "bfloat16" in series and sum(series["bfloat16"]) < sum(series["float32"])
        else torch.float32
    )
    dense = series[str(dense_dtype).removeprefix("torch.")]
    max_rows = {fmt: crossover(series[fmt], dense, rows) for fmt in ("int4", "int8")}
    if tile_rows:  # the tiles are for decode batches: prefill chunks of hundreds of rows keep the dense copy
        max_rows["int4"] = min(max_rows["int4"], rows[-1])
    amx_limit = 0
    if amx is not None and dense_dtype == torch.bfloat16:
        amx_limit = amx_rows(timings, max_rows["int4"], batched_rows)
    choice = KernelChoice(
        dense_dtype=dense_dtype,
        max_rows=max_rows,
        timings_ms=timings,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu_flags=cpu_bf16_flags(),
        batched_rows=amx_limit,
        tile_rows=tile_rows,
        tile=tile,
    )
    logger.info(
        "CPU kernel probe (1 thread, CPU time; engine %d threads, %dx%d): %s",
        threads,
        out_features,
        in_features,
        choice.describe(),
    )
    # the timings behind the choice (format@rows → ms): --log-level debug, or `python -m
    # kvscope.engine.platform.kernel_probe_cli`, which prints them as a table
    logger.debug("CPU kernel probe timings, ms: %s", {k: round(v, 3) for k, v in timings.items()})
    return choice


def tile_choice(timings_ms: dict[str, float], rows: Sequence[int], kinds: Sequence[str]) -> tuple[str, int]:
    """``(tile, tile_rows)``: of the small-batch matmul's tile kinds (``int4_tile_<kind>@n``) the one that
    serves the probed sizes fastest next to the GEMV (``int4@n``), and from how many rows it runs: the
    smallest probed size from which it is not slower than the GEMV at every larger size. ``("", 0)`` when
    no kind was probed or none beats the GEMV at the largest size."""
    best: tuple[float, str, int] | None = None
    for kind in kinds:
        tile = [timings_ms[f"int4_tile_{kind}@{n}"] for n in rows]
        gemv = [timings_ms[f"int4@{n}"] for n in rows]
        start = len(rows)
        while start > 0 and tile[start - 1] <= gemv[start - 1]:
            start -= 1
        if start == len(rows):
            continue
        total = sum(gemv[:start]) + sum(tile[start:])
        if best is None or total < best[0]:
            best = (total, kind, rows[start])
    return ("", 0) if best is None else (best[1], best[2])


def _tile_kernels(blocks: Int4Blocks) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """kvscope's small-batch pair-block matmul of ``blocks`` by tile kind (float32 in every build of the
    CPU kernels, bfloat16 where built, int16 on the VNNI copy where N % 16 == 0), every row on the tiles; {}
    where the kernels are not loaded."""
    if not cpu_decode.is_loaded() or blocks.codes.shape[1] % cpu_decode.PAIR:
        return {}
    pairs = int4_weight(blocks, pair_layout=True)
    assert isinstance(pairs, cpu_decode.PairBlocks)
    kinds = ["float32", *(["bfloat16"] if cpu_decode.bf16_tiles_built() else [])]
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        kind: (lambda x, kind=kind: pairs.matmul(x, 1, kind)) for kind in kinds
    }
    if pairs.out_features % cpu_decode.VNNI_LANES == 0:
        fns["int16"] = cpu_decode.VnniBlocks.from_pair_blocks(pairs).matmul
    return fns


def amx_rows(
    timings_ms: dict[str, float], compact_rows: int, probed: Sequence[int] = BATCHED_PROBE_ROWS
) -> int:
    """Up to how many rows the AMX int4 matmul (``int4_amx@n``) is not slower than the dense bfloat16 copy
    (``bfloat16@n``) at every ``probed`` size above ``compact_rows`` (where the GEMV hands over), capped at
    the largest probed size; 0 when it loses at the first of them."""
    above = [n for n in probed if n > compact_rows]
    if not above:
        return 0
    won = crossover(
        [timings_ms[f"int4_amx@{n}"] for n in above], [timings_ms[f"bfloat16@{n}"] for n in above], above
    )
    return min(won, above[-1])


def _amx_kernel(blocks: Int4Blocks) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """kvscope's AMX int4 matmul of ``blocks``, where it is built and the shape fits."""
    out_features, in_features = blocks.codes.shape
    if not cpu_decode.amx_loaded() or out_features % cpu_decode.TILE or in_features % cpu_decode.PAIR:
        return None
    pairs = int4_weight(blocks, pair_layout=True)
    assert isinstance(pairs, cpu_decode.PairBlocks)
    tiles = cpu_decode.TileBlocks.from_pair_blocks(pairs)
    # the kernel asks Linux for the AMX tile state on its first call: a kernel that refuses it → not used
    try:
        tiles.matmul(torch.zeros(1, in_features, dtype=torch.bfloat16))
    except RuntimeError as exc:
        logger.warning("kvscope's AMX int4 matmul is not used: %s", exc)
        return None
    return tiles.matmul


def _int4_kernel(blocks: Int4Blocks) -> Callable[[torch.Tensor], torch.Tensor]:
    """The int4 matmul the engine will run (kvscope's pair-block kernel where it is loaded)."""
    return int4_weight(blocks, cpu_decode.is_loaded() and blocks.codes.shape[1] % cpu_decode.PAIR == 0).matmul


def decode_matmul_ms(
    shapes: Sequence[tuple[int, int]],
    rows: int,
    fmt: str,
    choice: KernelChoice,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Best time (ms) of one decode step's matmuls ``shapes`` (``[N, K]`` each, in order, e.g.
    :func:`model_linear_shapes`) at ``rows`` rows in format ``fmt``: float32/bfloat16 (dense, as
    ``Linear.prepare_for_cpu``) or int4/int8 (compact kernels switching to dense above ``choice.max_rows``;
    the last shape, the LM head, stays dense under int4 as in ``kvscope.engine.platform.compact``),
    optionally with the model dtype, e.g. ``int4:bfloat16`` (activations and the dense LM head; default
    float32). ``clock``: ``time.process_time`` measures CPU time instead of wall time, which on one thread
    and a busy shared machine is close to the idle wall time (waiting for a core is not counted)."""
    from kvscope.engine.models.layers import cpu_linear_kernel
    from kvscope.engine.weights.quant import CompactLinearKernel

    quant, _, dtype_name = fmt.partition(":")
    dtype = getattr(torch, dtype_name or ("bfloat16" if quant == "bfloat16" else "float32"))
    gen = torch.Generator().manual_seed(0)
    kernels = []
    for i, (n, k) in enumerate(shapes):
        weight = torch.randn(n, k, generator=gen) * 0.02
        if quant in ("float32", "bfloat16") or (quant == "int4" and i == len(shapes) - 1):
            kernels.append(cpu_linear_kernel(weight.to(dtype), None))
            continue
        compact = (
            Int8Weight.from_float(weight)
            if quant == "int8"
            else Int4Weight.from_blocks(
                Int4Blocks(
                    codes=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                    scale=torch.full((n, k // 32), 0.01),
                    zero=torch.zeros(n, k // 32),
                )
            )
        )
        limit = choice.max_rows[quant]
        dense = packed_linear_kernel(weight.to(choice.dense_dtype), None) if limit < NO_DENSE else None
        kernels.append(
            CompactLinearKernel(
                compact=compact,
                bias=None,
                dense=dense,
                dense_dtype=choice.dense_dtype,
                max_compact_rows=limit,
            )
        )
    inputs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in shapes]

    def step() -> None:
        for kernel, x in zip(kernels, inputs, strict=True):
            kernel(x)

    with torch.inference_mode():
        return best_ms(step, repeats, clock)


def model_linear_shapes(hf_config: dict) -> list[tuple[int, int]]:
    """``[N, K]`` of every matmul of one forward, as the engine fuses them (qkv, o, gate_up, down per layer,
    then the LM head)."""
    hidden, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    layer = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inter, hidden),
        (hidden, inter),
    ]
    return layer * hf_config["num_hidden_layers"] + [(hf_config["vocab_size"], hidden)]
