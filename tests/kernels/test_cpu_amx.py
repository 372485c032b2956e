"""kvscope's AMX int4 matmul (kernels/csrc/cpu_amx.cpp, kernels/cpu_decode.py TileBlocks): the tile layout
keeps every code and scale, the kernel equals an exact float64 model of what it computes (weights expanded
to bfloat16(fma(d, u, m)), x rounded to bfloat16, float32 sums) at row counts across its tile and pass
edges, a bfloat16 output is that float32 result rounded once, and the engine's compact layers route rows to
it only between the GEMV's and the probe's limits.

The layout and routing tests run on every CPU with kvscope's kernels (AVX-512 VNNI): routing with a stand-in
whose matmul is the exact model; the tests marked ``amx`` run the AMX op itself and skip elsewhere, naming the
missing instructions (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kvscope.common.models.cache import cache_root
from kvscope.engine.models.layers import packed_linear_kernel, uses_packed_dense
from kvscope.engine.platform.cpu import CPU_KERNELS_DIR
from kvscope.engine.platform.kernel_probe import BATCHED_PROBE_ROWS, amx_rows
from kvscope.engine.weights.quant import CompactLinearKernel
from kvscope.kernels.cpu_decode import PairBlocks, TileBlocks, amx_loaded, load


@pytest.fixture(scope="module")
def library() -> None:
    """kvscope's CPU kernels, built and loaded (the tests using it are marked ``vnni`` or ``amx``)."""
    result = load(cache_root() / CPU_KERNELS_DIR)
    assert result.ok, result.detail


@pytest.fixture(scope="module")
def loaded(library: None) -> None:
    assert amx_loaded(), "built on a CPU with AMX-BF16, the library must have int4_gemm_amx"


def random_pairs(rows: int, cols: int, seed: int) -> PairBlocks:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    d = (torch.rand(rows, cols // 32, generator=gen) * 0.2 + 0.01).half().float()  # GGUF-like: d ~0.1, m ~-8d
    m = (-8 * d + torch.randn(rows, cols // 32, generator=gen) * 0.05).half().float()
    return PairBlocks.pack(codes, d, m, 4)


def reference(x: torch.Tensor, weights: TileBlocks) -> torch.Tensor:
    """float64 sums of bfloat16(x) · bfloat16(d·u + m), the fma computed exactly then rounded once (as the
    kernel's float32 fma: d·u + m of float16 d, m and u < 16 is exact in float32 before the bfloat16
    rounding)."""
    w = weights.dequantize().to(torch.bfloat16).double()
    return x.to(torch.bfloat16).double() @ w.T


@pytest.mark.parametrize(("rows", "cols"), [(48, 64), (960, 576), (576, 1536)])
def test_tile_layout_keeps_every_weight(rows: int, cols: int) -> None:
    pairs = random_pairs(rows, cols, seed=rows)
    tiles = TileBlocks.from_pair_blocks(pairs)
    assert tiles.codes.shape == (rows // 16, cols // 32, 256) and tiles.dm.shape == (
        rows // 16,
        cols // 32,
        2,
        16,
    )
    assert tiles.out_features == rows and tiles.nbytes == pairs.nbytes  # 4 bits + a float16 d and m per 32
    assert torch.equal(tiles.dequantize(), pairs.dequantize())


def test_tile_layout_refuses_what_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="N % 16"):
        TileBlocks.from_pair_blocks(random_pairs(40, 64, seed=0))
    eight_bit = PairBlocks.q8_from_float(torch.randn(32, 64))
    with pytest.raises(ValueError, match="4-bit"):
        TileBlocks.from_pair_blocks(eight_bit)


@pytest.mark.amx
@pytest.mark.parametrize("m", [1, 15, 16, 17, 32, 33, 48, 64, 65, 130])
@pytest.mark.parametrize(("rows", "cols"), [(48, 64), (960, 576), (576, 1536)])
def test_matches_the_exact_model(loaded: None, m: int, rows: int, cols: int) -> None:
    """Row counts on both sides of the 16-row tiles and the 64-row passes; 48 output rows = an odd column
    tile."""
    tiles = TileBlocks.from_pair_blocks(random_pairs(rows, cols, seed=m + rows))
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    expected = reference(x, tiles)
    out = tiles.matmul(x)
    assert out.dtype == torch.float32 and out.shape == (m, rows)
    assert torch.isfinite(out).all()
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= 2e-6 * scale * cols**0.5
    bf16 = tiles.matmul(x.to(torch.bfloat16))  # same sums, rounded once to bfloat16 (nearest even)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, out.to(torch.bfloat16))


@pytest.mark.amx
def test_non_contiguous_input_and_shape_errors(loaded: None) -> None:
    tiles = TileBlocks.from_pair_blocks(random_pairs(64, 128, seed=1))
    wide = torch.randn(20, 256)
    x = wide[:, ::2]
    assert torch.equal(tiles.matmul(x), tiles.matmul(x.contiguous()))
    assert tiles.matmul(torch.empty(0, 128)).shape == (0, 64)
    with pytest.raises(RuntimeError, match="columns"):
        tiles.matmul(torch.randn(4, 96))


class ExactModelTiles(TileBlocks):
    """Tile blocks whose matmul is :func:`reference` rounded to x's dtype: what ``int4_gemm_amx`` computes,
    on a CPU without AMX."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return reference(x, self).to(x.dtype)


@pytest.mark.cpu_kernels
@pytest.mark.onednn_bf16  # its layers' dense copy is bfloat16
def test_compact_layers_route_rows_between_the_limits(library: None) -> None:
    """Rows 5-32 go to the batched copy (the exact model here), 1-4 to the GEMV, 33+ to the dense copy."""
    check_routing(ExactModelTiles)


@pytest.mark.amx
def test_compact_layers_run_the_amx_matmul_between_the_limits(loaded: None) -> None:
    check_routing(TileBlocks)


def check_routing(tiles_class: type[TileBlocks]) -> None:
    pairs = random_pairs(96, 576, seed=7)
    dense_weight = pairs.dequantize().to(torch.bfloat16)
    dense = packed_linear_kernel(dense_weight, None)
    tiles = tiles_class.from_pair_blocks(pairs)
    assert type(tiles) is tiles_class
    kernel = CompactLinearKernel(
        compact=pairs,
        bias=None,
        dense=dense,
        dense_dtype=torch.bfloat16,
        max_compact_rows=4,
        batched=tiles,
        max_batched_rows=32,
    )
    gen = torch.Generator().manual_seed(0)
    for rows, path in ((4, pairs.matmul), (5, tiles.matmul), (32, tiles.matmul), (33, dense)):
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        expected = path(x)
        assert torch.equal(
            kernel(x), expected if expected.dtype == torch.bfloat16 else expected.to(torch.bfloat16)
        )
        assert uses_packed_dense(kernel, rows) == (rows > 32)
    assert kernel.nbytes == pairs.nbytes + tiles.nbytes + dense.nbytes


def test_probe_picks_the_rows_where_amx_is_not_slower() -> None:
    def timings(amx: dict[int, float]) -> dict[str, float]:
        return {
            **{f"bfloat16@{n}": 1.0 for n in BATCHED_PROBE_ROWS},
            **{f"int4_amx@{n}": amx.get(n, 0.5) for n in BATCHED_PROBE_ROWS},
        }

    assert BATCHED_PROBE_ROWS[-1] == 64
    assert amx_rows(timings({}), compact_rows=4) == 64  # never slower: capped at the largest probed size
    assert amx_rows(timings({64: 1.2}), compact_rows=4) == 32
    assert amx_rows(timings({1: 9.0, 2: 9.0, 8: 1.5}), compact_rows=4) == 0  # loses above the GEMV's rows
    assert amx_rows(timings({1: 9.0, 2: 9.0}), compact_rows=2) == 64  # sizes the GEMV takes do not count
    assert amx_rows(timings({}), compact_rows=64) == 0
