"""Compact weights (engine/weights/quant.py, compact.py, kernel_probe.py): GGUF Q4_0/Q4_1 blocks map onto
torch's int4 CPU kernel without re-quantizing, int8 per-row weights, the compact/dense switch and the byte
count.

Exactness: the kernels take bfloat16 activations and bfloat16 scales, accumulate in float32 and round the
result to bfloat16. So each output must be within one bfloat16 ulp of the float64 product of the same
bfloat16 inputs, and the distance to the GGUF's exact dequantization is bounded by the bfloat16 rounding of
the scales (relative 2⁻⁹ of d and of m + 8d) — asserted as such, not as a loose tolerance."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvscope.engine.models.layers import Linear, packed_linear_kernel
from kvscope.engine.platform.compact import model_weight_bytes, source_names
from kvscope.engine.platform.kernel_probe import NO_DENSE, crossover
from kvscope.engine.weights.quant import (
    CompactLinearKernel,
    Int4Blocks,
    Int4Weight,
    Int8Weight,
    int4_blocks_from_float,
    int4_blocks_from_gguf,
)
from tests.conftest import onednn_bf16_skip

N, K = 64, 256


def gguf_blocks(qtype: Q, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF rows, gguf.quants' own dequantization float32 [N, K]) of a random weight."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(N, K)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at |x| (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**-120)))
    return torch.exp2(exponent - 7)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_unpack_to_exactly_the_gguf_dequantization(qtype: Q) -> None:
    raw, reference = gguf_blocks(qtype)
    blocks = int4_blocks_from_gguf(raw, qtype, (N, K))
    assert blocks.codes.dtype == torch.uint8 and int(blocks.codes.max()) <= 15
    assert torch.equal(blocks.dequantize(), torch.from_numpy(reference))
    if qtype == Q.Q4_0:
        assert torch.count_nonzero(blocks.zero) == 0


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_int4_packed_matmul_is_x_times_the_gguf_blocks(qtype: Q, rows: int) -> None:
    raw, reference = gguf_blocks(qtype, seed=rows)
    blocks = int4_blocks_from_gguf(raw, qtype, (N, K))
    weight = Int4Weight.from_blocks(blocks)
    sz = weight.scales_and_zeros
    assert sz.shape == (K // 32, N, 2) and sz.dtype == torch.bfloat16
    assert torch.equal(sz[..., 0].t(), blocks.scale.to(torch.bfloat16))  # layout: [group, row, (scale, zero)]
    assert torch.equal(sz[..., 1].t(), blocks.zero.to(torch.bfloat16))
    x = (torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))).to(torch.bfloat16)
    out = weight.matmul(x).double()
    # the same bfloat16 scales/zeros, in float64: the kernel is this product up to its rounding
    scale, zero = (
        t.to(torch.bfloat16).double().repeat_interleave(32, dim=1) for t in (blocks.scale, blocks.zero)
    )
    w_bf16_scales = (blocks.codes.double() - 8) * scale + zero
    exact = x.double() @ w_bf16_scales.t()
    assert ((out - exact).abs() <= bf16_ulp(exact) + 1e-6).all()
    # against gguf's dequantization with the float16 scales: within the bf16 rounding of scale and zero
    gguf_exact = x.double() @ torch.from_numpy(reference).double().t()
    codes = (blocks.codes.double() - 8).abs()
    d = blocks.scale.double().abs().repeat_interleave(32, dim=1)  # Q4_0 scales may be negative
    z = blocks.zero.double().abs().repeat_interleave(32, dim=1)
    bound = x.double().abs() @ (2.0**-9 * (codes * d + z)).t()
    assert ((out - gguf_exact).abs() <= bound + bf16_ulp(gguf_exact) + 1e-6).all()


def test_float_weights_quantize_as_llama_cpp_q4_1() -> None:
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    blocks = int4_blocks_from_float(w)
    q4_1 = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), Q.Q4_1), Q.Q4_1)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(q4_1))
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_blocks_from_float(torch.ones(16, 40))
    with pytest.raises(ValueError, match="not a Q4_0/Q4_1"):
        int4_blocks_from_gguf(np.zeros((16, 34), np.uint8), Q.Q8_0, (16, 32))


def test_int4_blocks_concatenate_and_permute_rows() -> None:
    a = int4_blocks_from_float(torch.randn(16, 64, generator=torch.Generator().manual_seed(1)))
    b = int4_blocks_from_float(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)))
    fused = Int4Blocks.cat([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    flipped = a.map_rows(lambda m: m[::-1])
    assert torch.equal(flipped.dequantize(), a.dequantize().flip(0))


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int8_rows_and_matmul(rows: int) -> None:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(rows))
    q = Int8Weight.from_float(w)
    assert q.weight.dtype == torch.int8 and q.scales.dtype == torch.bfloat16
    assert q.weight.abs().amax(dim=1).tolist() == [127] * N  # every row uses the full range
    assert (q.dequantize() - w).abs().max() <= (q.scales.float() / 2).max() * (1 + 2**-7)  # round to nearest
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    exact = x.double() @ q.dequantize().double().t()
    assert ((q.matmul(x).double() - exact).abs() <= bf16_ulp(exact) + 1e-6).all()


@pytest.mark.onednn_bf16
def test_compact_kernel_switches_to_the_dense_copy_above_its_crossover() -> None:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(5))
    compact = Int8Weight.from_float(w)
    dense = packed_linear_kernel(w.to(torch.bfloat16), bias.to(torch.bfloat16))
    kernel = CompactLinearKernel(
        compact=compact, bias=bias, dense=dense, dense_dtype=torch.bfloat16, max_compact_rows=2
    )
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        small, big = kernel(x[:2]), kernel(x)
        assert small.dtype == torch.float32 and kernel(x[:0]).shape == (0, N)
        assert torch.equal(
            small, (compact.matmul(x[:2].to(torch.bfloat16)) + bias.to(torch.bfloat16)).float()
        )
        assert torch.equal(big, dense(x.to(torch.bfloat16)).float())
    assert kernel.fmt == "int8"
    assert kernel.nbytes == N * K + 2 * N + 4 * N + (
        N * K * 2 + 2 * N
    )  # int8 + scales, bias, dense bf16 + bias


def test_crossover_is_the_last_size_where_compact_is_not_slower() -> None:
    rows = [1, 2, 4, 8]
    assert crossover([1.0, 1.0, 3.0, 9.0], [2.0, 1.0, 2.0, 2.0], rows) == 2
    assert crossover([3.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], rows) == 0
    assert crossover([1.0] * 4, [2.0] * 4, rows) == NO_DENSE


def test_linear_use_compact_drops_the_dense_weight_and_counts_bytes() -> None:
    layer = Linear(K, N, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(N, K, generator=torch.Generator().manual_seed(7)))
    compact = Int4Weight.from_blocks(int4_blocks_from_float(layer.weight))
    layer.use_compact(CompactLinearKernel(compact=compact, bias=None))
    assert layer.weight is None and layer.prepare_for_cpu() is True  # keeps the compact kernel
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(8))
    assert torch.equal(layer(x), compact.matmul(x.to(torch.bfloat16)).float())  # grad mode too
    assert model_weight_bytes(layer) == N * K // 2 + (K // 32) * N * 2 * 2


def test_source_names_follow_the_fused_shard_order() -> None:
    assert source_names("model.layers.3.self_attn.qkv_proj") == [
        f"model.layers.3.self_attn.{p}_proj.weight" for p in ("q", "k", "v")
    ]
    assert source_names("model.layers.0.mlp.gate_up_proj") == [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    assert source_names("model.layers.0.mlp.down_proj") == ["model.layers.0.mlp.down_proj.weight"]


def test_cpu_flags_are_read_from_cpuinfo(tmp_path) -> None:
    from kvscope.engine.platform.kernel_probe import cpu_bf16_flags

    (tmp_path / "amx").write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n")
    (tmp_path / "zen3").write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert cpu_bf16_flags(tmp_path / "amx") == ("avx512_bf16", "amx_bf16", "amx_tile")
    assert cpu_bf16_flags(tmp_path / "zen3") == ()
    assert cpu_bf16_flags(tmp_path / "missing") == ()


def test_probe_times_every_candidate_and_picks_consistently() -> None:
    from kvscope.engine.platform.kernel_probe import amx_rows, probe_cpu_kernels, tile_choice
    from kvscope.kernels import cpu_decode
    from kvscope.kernels.cpu_decode import amx_loaded

    choice = probe_cpu_kernels(out_features=64, in_features=64, rows=(1, 4), repeats=1, batched_rows=(4, 8))
    # oneDNN packs bfloat16 only with AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU probes no bfloat16
    dense_kinds = ("float32", "bfloat16") if onednn_bf16_skip() is None else ("float32",)
    expected = {f"{k}@{n}" for k in (*dense_kinds, "int4", "int8") for n in (1, 4)}
    if amx_loaded():  # kvscope's AMX int4 matmul against the bfloat16 copy at the batched sizes
        expected |= {f"{k}@{n}" for k in ("int4_amx", "bfloat16") for n in (4, 8)}
    if (
        cpu_decode.is_loaded() and not amx_loaded()
    ):  # the small-batch tiles, and the GEMV's times where they run
        kinds = ("float32", "bfloat16") if cpu_decode.bf16_tiles_built() else ("float32",)
        kinds += ("int16",)  # on the VNNI blocks (every build has VNNI)
        expected |= {f"int4_tile_{kind}@{n}" for kind in kinds for n in (1, 4)}
        assert (choice.tile, choice.tile_rows) == tile_choice(
            {k: v for k, v in choice.timings_ms.items() if "gemv" not in k}
            | {
                f"int4@{n}": choice.timings_ms.get(f"int4_gemv@{n}", choice.timings_ms[f"int4@{n}"])
                for n in (1, 4)
            },
            (1, 4),
            kinds,
        )
        if choice.tile_rows:
            expected |= {f"int4_gemv@{n}" for n in (1, 4)}
    assert sorted(choice.timings_ms) == sorted(expected)
    dense = "bfloat16" if choice.dense_dtype == torch.bfloat16 else "float32"
    for fmt in ("int4", "int8"):
        times = [choice.timings_ms[f"{fmt}@{n}"] for n in (1, 4)]
        won = crossover(times, [choice.timings_ms[f"{dense}@{n}"] for n in (1, 4)], (1, 4))
        # with the tiles, int4 keeps its dense copy above the probed sizes (prefill chunks)
        assert choice.max_rows[fmt] == (min(won, 4) if fmt == "int4" and choice.tile_rows else won)
    amx = amx_loaded() and dense == "bfloat16"
    assert choice.batched_rows == (amx_rows(choice.timings_ms, choice.max_rows["int4"], (4, 8)) if amx else 0)


def test_a_cpu_whose_onednn_packs_no_bfloat16_probes_float32_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU (AMD Zen 3: oneDNN refuses to pack bfloat16, "bf16 path needs the cpu support
    avx_ne_convert or avx512bw, avx512vl and avx512dq"): the probe times the rest, the dense dtype is
    float32, and the engine starts (it raised "oneDNN is not available" before)."""
    from kvscope.engine.platform import kernel_probe

    real = kernel_probe.packed_linear_kernel

    def no_bf16(weight: torch.Tensor, bias: torch.Tensor | None):  # noqa: ANN202 - the real one's type
        return None if weight.dtype == torch.bfloat16 else real(weight, bias)

    monkeypatch.setattr(kernel_probe, "packed_linear_kernel", no_bf16)
    choice = kernel_probe.probe_cpu_kernels(out_features=64, in_features=64, rows=(1, 4), repeats=1)
    assert choice.dense_dtype == torch.float32
    assert not [k for k in choice.timings_ms if k.startswith("bfloat16@")]
    assert {f"{k}@{n}" for k in ("float32", "int4", "int8") for n in (1, 4)} <= set(choice.timings_ms)
    monkeypatch.setattr(kernel_probe, "packed_linear_kernel", lambda weight, bias: None)
    with pytest.raises(RuntimeError, match="oneDNN is not available"):
        kernel_probe.probe_cpu_kernels(out_features=64, in_features=64, rows=(1,), repeats=1)


def test_the_tiles_run_from_the_size_where_they_stay_faster_than_the_gemv() -> None:
    from kvscope.engine.platform.kernel_probe import tile_choice

    rows = (1, 2, 4, 8, 16)

    def timings(gemv: list[float], **tiles: list[float]) -> dict[str, float]:
        out = {f"int4@{n}": t for n, t in zip(rows, gemv, strict=True)}
        for kind, times in tiles.items():
            out |= {f"int4_tile_{kind}@{n}": t for n, t in zip(rows, times, strict=True)}
        return out

    gemv = [1.0, 2.0, 4.0, 8.0, 16.0]
    assert tile_choice(timings(gemv, float32=[2.0, 2.5, 3.0, 4.0, 6.0]), rows, ("float32",)) == ("float32", 4)
    # faster at 2 rows, slower at 4, faster again from 8: only the sizes from which it stays faster count
    assert tile_choice(timings(gemv, float32=[2.0, 1.5, 5.0, 7.0, 9.0]), rows, ("float32",)) == ("float32", 8)
    assert tile_choice(timings(gemv, float32=[2.0, 3.0, 5.0, 9.0, 17.0]), rows, ("float32",)) == ("", 0)
    assert tile_choice(timings(gemv), rows, ()) == ("", 0)
    # of two kinds the one that serves the probed sizes fastest next to the GEMV, whatever its start
    both = timings(gemv, float32=[2.0, 2.5, 3.0, 4.0, 6.0], bfloat16=[3.0, 3.0, 3.5, 5.0, 5.0])
    assert tile_choice(both, rows, ("float32", "bfloat16")) == (
        "float32",
        4,
    )  # 1 + 2 + 3 + 4 + 6 < 1 + 2 + 3.5 + 5 + 5
    assert tile_choice(both | {"int4_tile_bfloat16@16": 3.0}, rows, ("float32", "bfloat16")) == (
        "bfloat16",
        4,
    )


def test_row_kernels_say_which_kernel_serves_which_rows() -> None:
    from kvscope.engine.platform.kernel_probe import KernelChoice

    def choice(**kw) -> KernelChoice:
        return KernelChoice(dense_dtype=torch.float32, max_rows={"int4": kw.pop("compact"), "int8": 2}, **kw)

    assert choice(compact=16, tile_rows=4, tile="float32").row_kernels() == [
        ("gemv", 1, 3),
        ("tiles_float32", 4, 16),
        ("dense_float32", 17, NO_DENSE),
    ]
    assert choice(compact=2, tile_rows=4, tile="float32").row_kernels() == [
        ("gemv", 1, 2),
        ("dense_float32", 3, NO_DENSE),
    ]
    assert choice(compact=0).row_kernels() == [("dense_float32", 1, NO_DENSE)]
    assert choice(compact=NO_DENSE, tile_rows=1, tile="bfloat16").row_kernels() == [
        ("tiles_bfloat16", 1, NO_DENSE)
    ]
    amx = KernelChoice(
        dense_dtype=torch.bfloat16, max_rows={"int4": 8}, batched_rows=64, tile_rows=4, tile="float32"
    )
    assert amx.row_kernels() == [
        ("gemv", 1, 3),
        ("tiles_float32", 4, 8),
        ("amx", 9, 64),
        ("dense_bfloat16", 65, NO_DENSE),
    ]
    assert "int4 on float32 tiles from 4 rows" in amx.describe()


@pytest.mark.cpu_kernels
def test_int16_tiles_without_a_vnni_copy_run_the_gemv() -> None:
    """A layer whose N is not a multiple of 16 gets no VNNI copy: with the probe's int16 tiles it runs the
    GEMV at every compact size and the dense copy above (break-it pass: it raised at 1 and 4 rows)."""
    from kvscope.common.models.cache import cache_root
    from kvscope.engine.platform.compact import _kernel
    from kvscope.engine.platform.cpu import load_cpu_kernels
    from kvscope.engine.platform.kernel_probe import KernelChoice
    from kvscope.engine.weights.quant import int4_blocks_from_float, int4_weight

    assert load_cpu_kernels(cache_root()).ok
    weight = torch.randn(24, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    pairs = int4_weight(int4_blocks_from_float(weight), True)
    choice = KernelChoice(
        dense_dtype=torch.float32, max_rows={"int4": 4, "int8": 2}, tile_rows=1, tile="int16"
    )
    kernel = _kernel(pairs, weight, None, choice)
    assert kernel.vnni is None and (kernel.tile_rows, kernel.tile) == (0, "float32")
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kernel(x[:1]), pairs.matmul(x[:1])) and torch.equal(kernel(x[:4]), pairs.matmul(x[:4]))
    assert kernel(x).shape == (9, 24)
