"""kvscope's CPU decode kernels (kernels/cpu_decode.py, kernels/csrc/cpu_decode.cpp): the pair-block layout,
the VNNI GEMV against an exact float64 model of what it computes, and the clean fallback where it cannot
build.

The GEMV quantizes its input per block of 32 to 16-bit codes (the form of llama.cpp's Q8_1, 16-bit): the
reference below does the same float32 steps (d = max|x| / 32767, q = round-half-even(x · (1 / d))) and sums in
float64, so the only difference left is the kernel's float32 summation order (relative ~1e-6)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import torch

from kvscope.common.models.cache import cache_root
from kvscope.engine.platform.cpu import CPU_KERNELS_DIR
from kvscope.kernels import cpu_decode
from kvscope.kernels.cpu_decode import PAIR, PairBlocks, VnniBlocks, build, library_path, load


@pytest.fixture(scope="module")
def loaded() -> None:
    """The library, built into the model cache's cpu-kernels folder as the engine does (this CPU has
    AVX-512 VNNI: the test machines are Xeons with AMX)."""
    result = load(cache_root() / CPU_KERNELS_DIR)
    assert result.ok, result.detail


def random_blocks(
    rows: int, cols: int, bits: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=gen, dtype=torch.uint8)
    d = (torch.rand(rows, cols // 32, generator=gen) * 0.02).half().float()
    m = (-torch.rand(rows, cols // 32, generator=gen) * 0.1).half().float()
    return codes, d, m


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_keeps_every_code_and_scale(bits: int) -> None:
    codes, d, m = random_blocks(70, 192, bits, seed=bits)
    packed = PairBlocks.pack(codes, d, m, bits)
    assert packed.bits == bits and packed.out_features == 70
    assert packed.codes.shape == (70, 192 // (2 if bits == 4 else 1)) and packed.scales.shape == (70, 3, 4)
    assert packed.nbytes == 70 * 192 * bits // 8 + 70 * 6 * 2 * 2  # codes + a float16 d and m per block
    expected = (codes.view(70, -1, 32).float() * d[..., None] + m[..., None]).view(70, 192)
    assert torch.equal(packed.dequantize(), expected)


def test_pack_refuses_what_the_layout_cannot_hold() -> None:
    codes, d, m = random_blocks(8, 96, 4, seed=0)
    with pytest.raises(ValueError, match="K % 64 == 0"):
        PairBlocks.pack(codes, d, m, 4)
    codes, d, m = random_blocks(8, 64, 8, seed=0)
    with pytest.raises(ValueError, match="must fit 4 bits"):
        PairBlocks.pack(codes, d, m, 4)


def reference_qgemv(x: torch.Tensor, weights: PairBlocks) -> torch.Tensor:
    """float64 y = Σ_b d·d_x·Σ u·q + m·d_x·Σ q over blocks of 32, with the kernel's float32 quantization of
    x."""
    n, k = x.shape
    blocks = x.float().view(n, k // 32, 32)
    dx = blocks.abs().amax(dim=-1) / 32767.0  # float32, as the kernel
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    q = torch.round(blocks * inv[..., None])  # round half to even, as std::nearbyint
    rows = weights.out_features
    lanes = weights.codes.view(rows, k // PAIR, -1)
    if lanes.shape[-1] == 32:
        lanes = torch.cat([lanes & 15, lanes >> 4], dim=-1)
    u = torch.empty_like(lanes)
    u[:, :, cpu_decode._lane_order()] = lanes
    u = u.view(rows, k // 32, 32).double()
    s = weights.scales.double()
    dw, mw = s[:, :, :2].reshape(rows, -1), s[:, :, 2:].reshape(rows, -1)
    dots = torch.einsum("rbj,nbj->nrb", u, q.double())  # [n, rows, blocks]
    return (
        dots * dw[None] * dx.double()[:, None, :] + mw[None] * (dx.double() * q.double().sum(-1))[:, None, :]
    ).sum(-1)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize(
    ("bits", "rows", "cols", "n"),
    [(4, 70, 64, 1), (4, 960, 576, 3), (4, 576, 1536, 5), (8, 131, 576, 1), (8, 64, 128, 9)],
)
def test_qgemv_is_the_block_quantized_dot_product(loaded, bits: int, rows: int, cols: int, n: int) -> None:
    codes, d, m = random_blocks(rows, cols, bits, seed=rows)
    weights = PairBlocks.pack(codes, d, m, bits)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    x[0, :32] = 0.0  # an all-zero block (d_x = 0) is exact
    out = weights.matmul(x)
    ref = reference_qgemv(x, weights)
    assert out.dtype == torch.float32 and out.shape == (n, rows)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(weights.matmul(x.bfloat16()), weights.matmul(x.bfloat16().float()))  # bf16 in: same


@pytest.mark.cpu_kernels
def test_qgemv_error_against_float_weights_is_the_activation_rounding(loaded) -> None:
    """Against the exact float product the only error is the 16-bit activation codes: ~1e-5 of the output norm
    (int8 codes, as llama.cpp's Q8_1, were ~5e-3 and cost +0.5 % perplexity)."""
    codes, d, m = random_blocks(256, 576, 4, seed=3)
    weights = PairBlocks.pack(codes, d, m, 4)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(5))
    exact = x.double() @ weights.dequantize().double().T
    error = (weights.matmul(x).double() - exact).norm() / exact.norm()
    assert 1e-7 < error < 1e-4


def test_q8_blocks_from_float_are_gguf_q8_0() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    q8 = PairBlocks.q8_from_float(w)
    d = (w.view(64, 4, 32).abs().amax(-1) / 127).half().float()
    assert torch.equal(q8.scales[:, :, :2].reshape(64, 4).float(), d)  # the Q8_0 scale, float16
    assert torch.equal(q8.scales[:, :, 2:].reshape(64, 4).float(), -128 * d)
    assert (q8.dequantize() - w).abs().max() <= d.max() / 2 + 1e-7  # round to nearest


def test_build_reports_a_missing_compiler_and_a_cpu_without_vnni(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(
        cpu_decode, "_cpu_flags", lambda: "flags\t: avx512f avx512bw avx512dq avx512_vnni f16c"
    )
    assert cpu_decode.cpu_supports()
    result = build(tmp_path / "a", compiler=str(tmp_path / "no-such-g++"))
    assert (result.ok, result.library) == (False, None) and result.detail.startswith(
        "C++ compiler unavailable"
    )
    monkeypatch.setattr(cpu_decode, "_cpu_flags", lambda: "flags\t: fpu sse2 avx2")  # no FMA, no F16C
    result = build(tmp_path / "b")
    assert (result.ok, result.detail) == (
        False,
        "this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C (the kernels' instructions)",
    )
    assert not list(tmp_path.rglob("*.so"))


def test_the_build_targets_avx512_with_vnni_else_avx2(monkeypatch) -> None:
    """The AVX2 build compiles the same sources with ``-mno-avx512f`` (cpu_simd_avx2.h stands in for the
    AVX-512 intrinsics), also on a CPU with some AVX-512 but no VNNI; the flags are part of the cache key."""
    flags_of = {
        "flags\t: fpu avx2 fma f16c avx512f avx512bw avx512dq avx512_vnni": ("avx512", ()),
        "flags\t: fpu avx2 fma f16c": ("avx2", ("-mno-avx512f",)),
        "flags\t: fpu avx2 fma f16c avx512f avx512bw avx512dq": ("avx2", ("-mno-avx512f",)),  # Skylake-SP
        "flags\t: fpu avx f16c": (None, ()),
    }
    keys = set()
    for flags, (isa, extra) in flags_of.items():
        monkeypatch.setattr(cpu_decode, "_cpu_flags", lambda flags=flags: flags)
        assert cpu_decode.kernel_isa() == isa and cpu_decode.cpu_supports() == (isa is not None)
        command = cpu_decode._compile_command(Path("a.cpp"), Path("a.o"), "g++")
        assert [f for f in command if f.startswith("-m")] == ["-march=native", *extra]
        keys.add(cpu_decode.library_path(Path("/cache")))
    assert len(keys) == len(flags_of)


@pytest.mark.cpu_kernels
def test_a_compile_error_is_reported_not_raised(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "cpu_bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_decode, "SOURCES", (bad,))
    result = build(tmp_path / "c")
    assert not result.ok and result.detail.startswith("compile failed:") and "error" in result.detail


@pytest.mark.cpu_kernels
def test_a_truncated_cached_library_is_rebuilt_not_loaded(loaded, tmp_path: Path, monkeypatch) -> None:
    """A cut-off .so in the cache crashed the process in dlopen (SIGBUS, break-it finding): the build
    checks the cached file against the digest it wrote and rebuilds when it differs or is missing. The
    "linker" here copies the library the session already built (a real build is ~40 s;
    test_a_compile_error… runs the real compiler)."""
    real = library_path(cache_root() / CPU_KERNELS_DIR)
    monkeypatch.setattr(cpu_decode, "_compile_command", lambda source, obj, compiler: ["touch", str(obj)])
    monkeypatch.setattr(
        cpu_decode, "_link_command", lambda objects, out, compiler: ["cp", str(real), str(out)]
    )
    built = build(tmp_path)
    assert built.ok and built.detail.startswith("built ") and built.library is not None
    library = built.library
    assert (build(tmp_path).detail, build(tmp_path).library) == (f"cached {library}", library)
    good = library.read_bytes()
    library.write_bytes(good[: len(good) // 3])  # truncated
    rebuilt = build(tmp_path)
    assert rebuilt.detail == f"built {library}" and library.read_bytes() == good
    library.with_name(library.name + ".sha256").unlink()  # a library without its digest: rebuilt too
    assert build(tmp_path).detail == f"built {library}"


def test_processes_starting_at_once_build_the_library_once(tmp_path: Path, monkeypatch) -> None:
    """Two engines starting together on a fresh machine (``kvscope serve``'s replicas, two pytest workers):
    the first takes ``.build.lock`` and compiles, the second waits and loads that library. The "compiler"
    sleeps 0.3 s per source and logs each run, so without the lock both would have compiled (10 runs, not
    5)."""
    monkeypatch.setattr(
        cpu_decode, "_cpu_flags", lambda: "flags\t: avx512f avx512bw avx512dq avx512_vnni f16c"
    )
    log = tmp_path / "compiler.log"
    monkeypatch.setattr(
        cpu_decode,
        "_compile_command",
        lambda source, obj, compiler: ["sh", "-c", f'sleep 0.3; echo compile >> "{log}"; touch "{obj}"'],
    )
    monkeypatch.setattr(
        cpu_decode,
        "_link_command",
        lambda objects, out, compiler: ["sh", "-c", f'echo link >> "{log}"; echo library > "{out}"'],
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: build(tmp_path / "cache"), range(2)))
    assert log.read_text().split() == ["compile"] * len(cpu_decode.SOURCES) + ["link"]
    assert all(r.ok for r in results) and results[0].library == results[1].library
    assert sorted(r.detail.split(" ")[0] for r in results) == ["built", "cached"]
    assert "built by another process" in next(r.detail for r in results if r.detail.startswith("cached"))


def expanded_weights(weights: PairBlocks, tile: str) -> torch.Tensor:
    """float64 [N, K]: each weight as the small-batch matmul expands it: fma(d, u, m) rounded once to float32
    (float64 holds the exact product and sum of float16 d, m and an 8-bit u), then to bfloat16 for its
    bfloat16 tiles."""
    codes, d, m = weights.unpack()
    rows = codes.shape[0]
    u = codes.view(rows, -1, 32).double()
    w = (u * d.double()[..., None] + m.double()[..., None]).float().view(rows, -1)
    return (w.bfloat16() if tile == "bfloat16" else w).double()


def tile_kinds() -> list[str]:
    return ["float32", "bfloat16"] if cpu_decode.bf16_tiles_built() else ["float32"]


@pytest.mark.cpu_kernels
@pytest.mark.parametrize(
    ("bits", "rows", "cols", "n"),
    [
        (4, 70, 64, 1),
        (4, 960, 576, 3),
        (4, 576, 1536, 5),
        (8, 131, 576, 17),
        (8, 64, 128, 33),
        (4, 24, 1536, 8),
    ],
)
def test_tile_matmul_is_the_product_of_the_expanded_weights(
    loaded, bits: int, rows: int, cols: int, n: int
) -> None:
    """The small-batch matmul (cpu_pair_gemm.h) multiplies x (rounded as its tiles: float32 exact, bfloat16
    to nearest even) by the weights it expands, summing in float32: against float64 sums only the order
    differs. Row counts off the 4 x 4 micro-kernel and N off its 4 weight rows take the remainder paths."""
    codes, d, m = random_blocks(rows, cols, bits, seed=rows + n)
    weights = PairBlocks.pack(codes, d, m, bits)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    for tile in tile_kinds():
        xt = x.bfloat16().double() if tile == "bfloat16" else x.double()
        ref = xt @ expanded_weights(weights, tile).T
        out = weights.matmul(x, 1, tile)
        assert out.dtype == torch.float32 and out.shape == (n, rows)
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), tile


@pytest.mark.cpu_kernels
def test_tile_rows_picks_the_kernel_and_rows_do_not_change_each_other(loaded) -> None:
    """Below ``tile_rows`` the GEMV runs (bit for bit), from it the tiles; a row's result on the tiles is the
    same bits whatever rows share the call (each output is one accumulator summed in the same order), so a
    batch or a speculative verification gives a request the logits it gets alone."""
    codes, d, m = random_blocks(96, 576, 4, seed=11)
    weights = PairBlocks.pack(codes, d, m, 4)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(2))
    assert torch.equal(weights.matmul(x[:3], 4), weights.matmul(x[:3]))
    assert torch.equal(weights.matmul(x[:4], 4), weights.matmul(x[:4], 1))
    assert not torch.equal(weights.matmul(x[:4], 4), weights.matmul(x[:4]))
    for tile in tile_kinds():
        alone = torch.cat([weights.matmul(x[i : i + 1], 1, tile) for i in range(9)])
        assert torch.equal(weights.matmul(x, 1, tile), alone), tile


@pytest.mark.cpu_kernels
def test_bfloat16_tiles_are_refused_where_not_built(loaded, monkeypatch) -> None:
    codes, d, m = random_blocks(8, 64, 4, seed=1)
    weights = PairBlocks.pack(codes, d, m, 4)
    x = torch.ones(4, 64)
    with pytest.raises(KeyError):
        weights.matmul(x, 1, "float16")
    if not cpu_decode.bf16_tiles_built():
        with pytest.raises(RuntimeError, match="bfloat16, where built"):
            weights.matmul(x, 1, "bfloat16")
    with pytest.raises(RuntimeError, match=r"tile: 1 \(float32\) or 2"):
        torch.ops.kvscope_cpu.qgemv(x, weights.codes, weights.scales, 1, 3)


@pytest.mark.parametrize("bits", [4, 8])
def test_vnni_blocks_keep_every_code_and_scale(bits: int) -> None:
    """The transposed copy of the int16 tiles holds the pair blocks' weights bit for bit, and byte 4n + j of
    chunk g of block b is row n's code 32b + 4g + j (4-bit: the low nibble; chunk g + 4 in the high one)."""
    codes, d, m = random_blocks(48, 128, bits, seed=bits)
    pairs = PairBlocks.pack(codes, d, m, bits)
    vnni = VnniBlocks.from_pair_blocks(pairs)
    assert vnni.bits == bits and vnni.out_features == 48
    assert vnni.codes.shape == (3, 4, 256 if bits == 4 else 512) and vnni.dm.shape == (3, 4, 2, 16)
    assert torch.equal(vnni.dequantize(), pairs.dequantize())
    t, b, g, n, j = 2, 3, 1, 5, 2
    byte = int(vnni.codes[t, b, 64 * g + 4 * n + j])
    assert byte & 15 == int(codes[16 * t + n, 32 * b + 4 * g + j]) % 16
    if bits == 4:
        assert byte >> 4 == int(codes[16 * t + n, 32 * b + 4 * (g + 4) + j])
    assert vnni.dm[t, b, 0, n] == pairs.unpack()[1][16 * t + n, b]
    assert vnni.nbytes == pairs.nbytes
    with pytest.raises(ValueError, match="N % 16"):
        VnniBlocks.from_pair_blocks(PairBlocks.pack(*random_blocks(40, 64, 4, seed=1), 4))


@pytest.mark.cpu_kernels
@pytest.mark.parametrize(
    ("bits", "rows", "cols", "n"),
    [
        (4, 64, 64, 1),
        (4, 960, 576, 3),
        (4, 576, 1536, 8),
        (4, 3072, 576, 13),
        (8, 144, 576, 9),
        (8, 64, 128, 33),
    ],
)
def test_int16_tiles_are_the_gemv_s_block_quantized_product(
    loaded, bits: int, rows: int, cols: int, n: int
) -> None:
    """The int16 tiles (cpu_pair_vnni.h) quantize x as the GEMV does and sum u · q exactly in int32 (the
    16-bit code split into a signed high byte and an offset low byte on vpdpbusd): against the float64 sums
    of the same codes only float32 rounding differs, for every row count of the 8-row passes, 4- and 8-bit
    codes (the 8-bit ones up to 255, the most the split must hold) and the largest activation codes
    (±32767)."""
    codes, d, m = random_blocks(rows, cols, bits, seed=rows + n)
    codes[0] = (1 << bits) - 1
    weights = PairBlocks.pack(codes, d, m, bits)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    x[0, :32] = 0.0  # an all-zero block (d_x = 0) is exact
    x[-1, 32:64] = -x[-1, 32:64].abs()  # a block whose largest code is -32767
    out = VnniBlocks.from_pair_blocks(weights).matmul(x)
    ref = reference_qgemv(x, weights)
    assert out.dtype == torch.float32 and out.shape == (n, rows)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    gemv = weights.matmul(x).double()
    assert (out.double() - gemv).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.cpu_kernels
def test_int16_tiles_give_a_row_the_same_bits_whatever_shares_its_call(loaded) -> None:
    """Each output is one accumulator over the blocks in one order: a row's result does not depend on the
    other rows (1-33 rows, across the 8-row passes), so a request's logits are those it gets alone."""
    codes, d, m = random_blocks(96, 576, 4, seed=12)
    vnni = VnniBlocks.from_pair_blocks(PairBlocks.pack(codes, d, m, 4))
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([vnni.matmul(x[i : i + 1]) for i in range(33)])
    assert torch.equal(vnni.matmul(x), alone)
    assert torch.equal(vnni.matmul(x[5:17]), alone[5:17])
    with pytest.raises(RuntimeError, match=r"x must be \[M, 576\]"):
        vnni.matmul(x[:, :64])
