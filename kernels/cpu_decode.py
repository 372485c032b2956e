"""Build and load the CPU decode kernels (kernels/csrc/cpu_*.cpp, one shared library): a block-quantized GEMV
on AVX-512 VNNI (or AVX2) and the matmul of small batches on the same weights (cpu_pair_gemm.h), one whole
decode step of a Llama-family decoder in one call, the matmul of small batches on a transposed copy of the
same weights (cpu_pair_vnni.h, :class:`VnniBlocks`), paged decode attention, the elementwise ops of bfloat16
steps (RMSNorm, residual add + RMSNorm, SwiGLU, RoPE: one pass each instead of a chain of torch ops, so a
step's cost comes near its matmuls') and, on CPUs with AMX, the int4 matmul of batched decode steps
(cpu_amx.cpp). Also the weight packings they read ("pair blocks" and "tile blocks", described in the C++
files).

The shared library is compiled once per machine with the system C++ compiler against the installed torch
(``-march=native``: the kernels use the CPU's own AVX-512/VNNI instructions) and cached under a directory the
caller names, keyed by the source, torch version and compiler flags. A CPU with AVX2, FMA and F16C but not
AVX-512 VNNI (AMD Zen 2/3, Intel's Haswell to Comet Lake and Alder Lake onwards, Skylake-SP) gets the same
kernels from the same sources built with ``-mno-avx512f``: kernels/csrc/cpu_simd_avx2.h gives them the
AVX-512 intrinsics they use on pairs of 256-bit vectors, with the same results (:func:`kernel_isa`). Where it
cannot build (no compiler, neither instruction set) :func:`load` returns a :class:`BuildResult` with
``ok=False`` and the reason; callers keep torch's own kernels. Imports only torch and filelock (torch's own
dependency; contract "kernels import only torch/triton").
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock, Timeout

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("cpu_*.cpp")))
"""Every C++ file of the library (each registers its ops with ``TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m)``)."""
HEADERS = tuple(sorted(CSRC.glob("*.h")))
"""Headers the sources include (part of the library's cache key)."""
PAIR = 64
"""Weights per pair of 32-weight blocks: the unit of the packed layout (rows must be a multiple)."""
BLOCK = 32
CXX_FLAGS = ("-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w")
AVX2_CXX_FLAGS = ("-mno-avx512f",)
"""Added for the AVX2 build (:func:`kernel_isa`): a CPU with some AVX-512 but not VNNI (Skylake-SP) builds the
AVX2 sources too."""
BUILD_TIMEOUT_S = 300


@dataclass(frozen=True, slots=True)
class BuildResult:
    """What :func:`load` found: ``ok`` when ``torch.ops.kvscope_cpu`` is usable; ``detail`` says why not, or
    which library was loaded."""

    ok: bool
    detail: str
    library: Path | None = None


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


def default_compiler() -> str:
    """The system C++ compiler: ``g++``, else ``c++`` (the name itself when neither is on PATH: the build then
    fails with a clear reason)."""
    return shutil.which("g++") or shutil.which("c++") or "g++"


def _cxx_flags() -> tuple[str, ...]:
    """The compiler flags of this CPU's build: ``CXX_FLAGS``, plus ``AVX2_CXX_FLAGS`` for the AVX2 build."""
    return CXX_FLAGS + (AVX2_CXX_FLAGS if kernel_isa() == "avx2" else ())


def _compile_command(source: Path, obj: Path, compiler: str) -> list[str]:
    """One source to one object file (``CXX_FLAGS`` without ``-shared``)."""
    torch_dir = _torch_dir()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        *(f for f in _cxx_flags() if f != "-shared"),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        "-c",
        str(source),
        "-o",
        str(obj),
    ]


def _link_command(objects: list[Path], out: Path, compiler: str) -> list[str]:
    torch_dir = _torch_dir()
    return [
        compiler,
        *_cxx_flags(),
        *map(str, objects),
        "-o",
        str(out),
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


def _run_all(commands: list[list[str]], jobs: int) -> subprocess.CompletedProcess | None:
    """Run ``commands`` up to ``jobs`` at a time; the first that failed (by source order), else None. Raises
    OSError (no compiler) or subprocess.TimeoutExpired (one ran past ``BUILD_TIMEOUT_S``)."""

    def run(command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(run, commands))
    return next((proc for proc in done if proc.returncode != 0), None)


def _build_jobs() -> int:
    """Compilers run at once: the CPUs this process may use (each source is a long -O3 compile; times in
    docs/benchmarks.md "Engine start-up")."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def library_path(cache_dir: Path) -> Path:
    """Where the library for this source, torch, compiler flags and CPU lives under ``cache_dir``."""
    key = hashlib.sha256()
    for part in (
        *(src.read_bytes() for src in SOURCES + HEADERS),
        torch.__version__.encode(),
        " ".join(_cxx_flags()).encode(),
        _cpu_flags().encode(),
        sysconfig.get_platform().encode(),
    ):
        key.update(part)
    return Path(cache_dir) / f"kvscope_cpu_decode-{key.hexdigest()[:16]}.so"


def build(cache_dir: Path, compiler: str | None = None) -> BuildResult:
    """Compile the library into ``cache_dir`` unless it is there already, with ``compiler`` (default
    :func:`default_compiler`). Returns ok=False with the reason (neither AVX-512 VNNI nor AVX2, no compiler,
    the compiler's last lines, another process's build still running after ``2 × BUILD_TIMEOUT_S``) where it
    cannot.

    Processes that start at once on a fresh machine (the replicas of ``kvscope serve``) build it once: the
    first takes ``cache_dir/.build.lock``, the others wait for it and load its library (the rename into place
    is atomic, so a reader never sees half a file either way)."""
    target = library_path(cache_dir)
    if target.exists() and _intact(target):
        return BuildResult(True, f"cached {target}", target)
    if not cpu_supports():
        return BuildResult(
            False, "this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C (the kernels' instructions)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(target.parent / ".build.lock", timeout=2 * BUILD_TIMEOUT_S):
            if target.exists() and _intact(target):  # another process built it while this one waited
                return BuildResult(True, f"cached {target} (built by another process)", target)
            return _build_locked(target, compiler)
    except Timeout:
        return BuildResult(
            False, f"another process has held {target.parent / '.build.lock'} for {2 * BUILD_TIMEOUT_S} s"
        )


def _build_locked(target: Path, compiler: str | None) -> BuildResult:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cxx = compiler or default_compiler()
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        try:  # the sources in parallel (one library), then one link
            failed = _run_all(
                [_compile_command(src, obj, cxx) for src, obj in zip(SOURCES, objects, strict=True)],
                _build_jobs(),
            )
            failed = failed or _run_all([_link_command(objects, out, cxx)], 1)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return BuildResult(False, f"C++ compiler unavailable: {exc}")
        if failed is not None:
            tail = " | ".join((failed.stderr or failed.stdout).strip().splitlines()[-3:])
            return BuildResult(False, f"compile failed: {tail}")
        digest = Path(tmp) / (target.name + ".sha256")
        digest.write_text(_sha256(out))
        os.replace(digest, _digest_path(target))  # the digest first: a library without its digest is rebuilt
        os.replace(out, target)
    return BuildResult(True, f"built {target}", target)


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(library: Path) -> bool:
    """Whether a cached library is byte for byte what its build wrote (its ``.sha256`` beside it): a
    truncated or overwritten shared library can crash the process inside ``dlopen`` (SIGBUS) before Python
    sees an error, so it is checked before loading and rebuilt when it differs."""
    try:
        return _digest_path(library).read_text().strip() == _sha256(library)
    except OSError:
        return False


VNNI_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512_vnni", "f16c")
"""The /proc/cpuinfo flags of the instructions the library's AVX-512 build uses (AVX-512 F/BW/DQ/VNNI, F16C);
without them, :data:`AVX2_FLAGS` (:func:`kernel_isa`)."""
AMX_FLAGS = ("avx512_bf16", "amx_tile", "amx_bf16")
"""The flags ``int4_gemm_amx`` needs besides :data:`VNNI_FLAGS` (AVX512-BF16, AMX tiles with bfloat16)."""


def missing_cpu_flags(needed: tuple[str, ...]) -> tuple[str, ...]:
    """The flags of ``needed`` that this CPU's /proc/cpuinfo does not list, in ``needed``'s order (all of them
    where /proc/cpuinfo cannot be read)."""
    flags = set(_cpu_flags().split())
    return tuple(f for f in needed if f not in flags)


AVX2_FLAGS = ("avx2", "fma", "f16c")
"""The /proc/cpuinfo flags of the library's AVX2 build (kernels/csrc/cpu_simd_avx2.h: the AVX-512 intrinsics
the kernels use, on 256-bit halves), for a CPU without :data:`VNNI_FLAGS`."""


def kernel_isa() -> str | None:
    """The instruction set the library is built for on this CPU, by /proc/cpuinfo: ``"avx512"`` where it has
    :data:`VNNI_FLAGS`, else ``"avx2"`` where it has :data:`AVX2_FLAGS` (the same kernels and results, each
    512-bit operation as two 256-bit ones: slower per instruction, far faster than torch's eager ops), else
    None (no library)."""
    if not missing_cpu_flags(VNNI_FLAGS):
        return "avx512"
    if not missing_cpu_flags(AVX2_FLAGS):
        return "avx2"
    return None


def cpu_supports() -> bool:
    """Whether the library builds for this CPU (:func:`kernel_isa` is not None), by /proc/cpuinfo."""
    return kernel_isa() is not None


def cpu_supports_amx() -> bool:
    """Whether this CPU has what ``int4_gemm_amx`` needs besides :func:`cpu_supports` (:data:`AMX_FLAGS`), by
    /proc/cpuinfo."""
    return not missing_cpu_flags(VNNI_FLAGS + AMX_FLAGS)


def load(cache_dir: Path) -> BuildResult:
    """Build if needed and load the library into ``torch.ops.kvscope_cpu`` (once per process: loading the
    same library again is a no-op). Never raises for a missing compiler or CPU feature."""
    if is_loaded():
        return BuildResult(True, "already loaded")
    result = build(cache_dir)
    if not result.ok or result.library is None:
        return result
    try:
        torch.ops.load_library(str(result.library))
    except (OSError, RuntimeError) as exc:
        return BuildResult(False, f"load failed: {exc}")
    return result


def is_loaded() -> bool:
    """Whether ``torch.ops.kvscope_cpu`` is registered in this process."""
    return _has_op("qgemv")


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.kvscope_cpu, name)  # raises when the library (or this op of it) is not loaded
    except (AttributeError, RuntimeError):
        return False
    return True


TILE_KINDS = {"float32": 1, "bfloat16": 2, "int16": 3}
"""The small-batch matmul's tile kinds → the ops' ``tile`` argument: the expanded weights' element type
(kernels/csrc/cpu_pair_gemm.h ``Tile``), or 3, the 16-bit activation codes on :class:`VnniBlocks`
(cpu_pair_vnni.h; ``decode_step`` then takes their codes and scales, ``qgemv`` refuses it)."""


def bf16_tiles_built() -> bool:
    """Whether the loaded library has the small-batch matmul's bfloat16 tiles (built on a CPU with
    AVX512-BF16); its float32 tiles are in every build."""
    return _has_op("has_bf16_tiles") and bool(torch.ops.kvscope_cpu.has_bf16_tiles())


def _lane_order() -> torch.Tensor:
    """int64 [64]: source index (within a pair of blocks) of each stored byte: byte 4l + j, lane l = 2k + b,
    holds weight 4k + j of block b (see cpu_decode.cpp)."""
    t = torch.arange(PAIR)
    lane, j = t // 4, t % 4
    k, b = lane // 2, lane % 2
    return b * BLOCK + 4 * k + j


@dataclass(frozen=True, slots=True)
class PairBlocks:
    """A ``[N, K]`` weight in the kernels' packed layout: ``w = d · u + m`` per block of 32."""

    codes: torch.Tensor
    """uint8 ``[N, K/2]`` (4-bit) or ``[N, K]`` (8-bit), lane order per pair of blocks."""
    scales: torch.Tensor
    """float16 ``[N, K/64, 4]`` = (d_A, d_B, m_A, m_B)."""

    @property
    def bits(self) -> int:
        return 4 if self.codes.shape[1] * 2 == self.scales.shape[1] * PAIR else 8

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 2

    @classmethod
    def pack(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> PairBlocks:
        """codes uint8 ``[N, K]`` (0…2^bits − 1), d and m ``[N, K/32]`` (any float dtype; stored as float16)
        → packed. Raises ValueError when K is not a multiple of 64 or a code does not fit ``bits``."""
        rows, cols = codes.shape
        if cols % PAIR or d.shape != (rows, cols // BLOCK) or m.shape != d.shape:
            raise ValueError(
                f"pair blocks need K % {PAIR} == 0 and d, m of shape [N, K/32]; got {tuple(codes.shape)}"
            )
        if bits not in (4, 8) or int(codes.max()) >= 1 << bits:
            raise ValueError(f"codes must fit {bits} bits")
        lanes = codes.view(rows, cols // PAIR, PAIR)[:, :, _lane_order()]
        if bits == 4:
            lanes = lanes[:, :, :32] | (lanes[:, :, 32:] << 4)
        scales = torch.stack([d.view(rows, -1, 2), m.view(rows, -1, 2)], dim=2).reshape(rows, -1, 4)
        return cls(codes=lanes.reshape(rows, -1).contiguous(), scales=scales.to(torch.float16).contiguous())

    @classmethod
    def q8_from_float(cls, weight: torch.Tensor) -> PairBlocks:
        """8-bit blocks of 32 as GGUF Q8_0 (ggml ``quantize_row_q8_0``: d = max|w| / 127 as float16,
        q = round(w / d) in [-127, 127]), stored as u = q + 128, m = -128 d."""
        w = weight.detach().to(torch.float32)
        rows, cols = w.shape
        blocks = w.view(rows, cols // BLOCK, BLOCK)
        d = (blocks.abs().amax(dim=-1) / 127.0).to(torch.float16).to(torch.float32)
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(blocks / safe[..., None]).clamp_(-127, 127)
        codes = (q + 128).to(torch.uint8).view(rows, cols)
        return cls.pack(codes, d, -128.0 * d, 8)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inverse of :meth:`pack`: codes uint8 ``[N, K]`` in weight order, d and m float16 ``[N,
        K/32]``."""
        rows = self.codes.shape[0]
        pairs = self.scales.shape[1]
        lanes = self.codes.view(rows, pairs, -1)
        if lanes.shape[-1] == 32:
            lanes = torch.cat([lanes & 15, lanes >> 4], dim=-1)
        codes = torch.empty_like(lanes)
        codes[:, :, _lane_order()] = lanes
        return (
            codes.view(rows, -1),
            self.scales[:, :, :2].reshape(rows, -1),
            self.scales[:, :, 2:].reshape(rows, -1),
        )

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: the weights the kernels multiply by (for tests and error checks)."""
        codes, d, m = self.unpack()
        rows = codes.shape[0]
        blocks = codes.view(rows, -1, BLOCK).to(torch.float32)
        return (blocks * d.float()[..., None] + m.float()[..., None]).view(rows, -1)

    def matmul(self, x: torch.Tensor, tile_rows: int = 0, tile: str = "float32") -> torch.Tensor:
        """x ``[M, K]`` (float32 or bfloat16) → float32 ``[M, N]``. Below ``tile_rows`` rows (0: at every
        size) the GEMV: activations quantized per block of 32 to 16-bit codes, d = max|x| / 32767. From
        ``tile_rows`` rows the small-batch matmul (kernels/csrc/cpu_pair_gemm.h): the weights expanded once
        per call to ``tile`` (``float32``, or ``bfloat16`` where :func:`bf16_tiles_built`) and every row
        multiplied by them, float32 sums. Needs :func:`load`; RuntimeError for bfloat16 tiles not built."""
        return torch.ops.kvscope_cpu.qgemv(x, self.codes, self.scales, tile_rows, TILE_KINDS[tile])


TILE = 16
"""Output rows per AMX tile block (:class:`TileBlocks`: N must be a multiple)."""


def amx_loaded() -> bool:
    """Whether the loaded library has the AMX int4 matmul (built on a CPU with AMX-BF16 and AVX512-BF16)."""
    return _has_op("int4_gemm_amx")


def _tile_dm(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d and m ``[N, K/32]`` → float16 ``[N/16, K/32, 2, 16]``: per tile of 16 output rows and block, the
    rows' d, then their m (the scale layout of :class:`TileBlocks` and :class:`VnniBlocks`)."""
    rows, blocks = d.shape
    return torch.stack(
        [t.view(rows // TILE, TILE, blocks).permute(0, 2, 1) for t in (d, m)], dim=2
    ).contiguous()


def _dequantize_tiles(u: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, K]`` from the codes ``u`` ``[N, K/32, 32]`` (weight order) and :func:`_tile_dm`'s
    scales."""
    rows, blocks = u.shape[:2]
    scales = dm.to(torch.float32).permute(0, 3, 1, 2).reshape(rows, blocks, 2)  # [N, b, (d, m)]
    return (u.to(torch.float32) * scales[..., :1] + scales[..., 1:]).view(rows, blocks * BLOCK)


@dataclass(frozen=True, slots=True)
class TileBlocks:
    """A 4-bit ``[N, K]`` weight (``w = d · u + m`` per block of 32, as :class:`PairBlocks`) in the layout of
    ``int4_gemm_amx`` (kernels/csrc/cpu_amx.cpp): the batched matmul of decode steps above the GEMV's rows."""

    codes: torch.Tensor
    """uint8 ``[N/16, K/32, 256]``: byte ``16 r + 2 n + j`` (n < 8) of block (t, b) = u[16t + n, 32b + 2r +
    j] | u[16t + 8 + n, 32b + 2r + j] << 4 (kernels/csrc/cpu_amx.cpp)."""
    dm: torch.Tensor
    """float16 ``[N/16, K/32, 2, 16]``: the 16 rows' d, then their m."""

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * TILE

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.dm.numel() * 2

    @classmethod
    def from_pair_blocks(cls, weight: PairBlocks) -> TileBlocks:
        """The same 4-bit weights (codes, d and m bit for bit) in the AMX layout. Raises ValueError for 8-bit
        blocks or N not a multiple of 16."""
        if weight.bits != 4 or weight.out_features % TILE:
            raise ValueError(f"AMX tile blocks need 4-bit codes and N % {TILE} == 0")
        codes, d, m = weight.unpack()
        rows, blocks = d.shape
        u = codes.view(rows // TILE, TILE, blocks, TILE, 2).permute(0, 2, 3, 1, 4)  # [t, b, r, n, j]
        half = TILE // 2  # low nibbles: columns 0-7, high nibbles: columns 8-15 (byte 2n + j)
        lo = u[:, :, :, :half].reshape(rows // TILE, blocks, TILE, TILE)
        hi = u[:, :, :, half:].reshape(rows // TILE, blocks, TILE, TILE)
        packed = (lo | (hi << 4)).contiguous().view(rows // TILE, blocks, TILE * TILE)
        return cls(codes=packed, dm=_tile_dm(d, m))

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` (for tests)."""
        tiles, blocks = self.codes.shape[:2]
        b = self.codes.view(tiles, blocks, TILE, TILE // 2, 2)  # [t, b, r, n % 8, j]
        u = torch.cat([b & 15, b >> 4], dim=3).permute(0, 3, 1, 2, 4)  # [t, n, b, r, j]
        return _dequantize_tiles(u.reshape(tiles * TILE, blocks, BLOCK), self.dm)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, K]`` (float32 or bfloat16; the tiles multiply it rounded to bfloat16) → ``[M, N]`` in
        x's dtype (float32 sums). Needs :func:`amx_loaded`; RuntimeError for mismatched shapes."""
        return torch.ops.kvscope_cpu.int4_gemm_amx(x, self.codes, self.dm)


VNNI_LANES = TILE
"""Output rows per tile of :class:`VnniBlocks` (N must be a multiple): the int32 lanes of a zmm, and the tile
of :class:`TileBlocks`, whose scale layout it shares."""


@dataclass(frozen=True, slots=True)
class VnniBlocks:
    """A 4- or 8-bit ``[N, K]`` weight (``w = d · u + m`` per block of 32, as :class:`PairBlocks`) transposed
    in tiles of 16 output rows for the int16 tiles (kernels/csrc/cpu_pair_vnni.h): one 64-byte vector holds 4
    consecutive codes of 16 rows, the operand of one vpdpbusd. A copy made at load time beside the pair blocks
    (the GEMV's layout), for batches from the probe's ``tile_rows``."""

    codes: torch.Tensor
    """uint8 ``[N/16, K/32, 256]`` (4-bit: 64-byte chunk g < 4, byte ``4 n + j`` = u[16t + n, 32b + 4g + j] |
    u[16t + n, 32b + 4(g + 4) + j] << 4) or ``[N/16, K/32, 512]`` (8-bit: chunk g < 8, byte ``4 n + j`` =
    u[16t + n, 32b + 4g + j])."""
    dm: torch.Tensor
    """float16 ``[N/16, K/32, 2, 16]``: the 16 rows' d, then their m (as :class:`TileBlocks`)."""

    @property
    def bits(self) -> int:
        return 4 if self.codes.shape[2] == 256 else 8

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * VNNI_LANES

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.dm.numel() * 2

    @classmethod
    def from_pair_blocks(cls, weight: PairBlocks) -> VnniBlocks:
        """The same weights (codes, d and m bit for bit) in the VNNI layout. Raises ValueError for N not a
        multiple of 16."""
        if weight.out_features % VNNI_LANES:
            raise ValueError(f"VNNI blocks need N % {VNNI_LANES} == 0, got {weight.out_features}")
        codes, d, m = weight.unpack()
        rows, blocks = d.shape
        tiles = rows // VNNI_LANES
        u = codes.view(tiles, VNNI_LANES, blocks, 8, 4).permute(0, 2, 3, 1, 4)  # [t, b, g, n, j]
        if weight.bits == 4:
            u = u[:, :, :4] | (u[:, :, 4:] << 4)
        return cls(codes=u.contiguous().view(tiles, blocks, -1), dm=_tile_dm(d, m))

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` (for tests)."""
        tiles, blocks = self.codes.shape[:2]
        c = self.codes.view(tiles, blocks, -1, VNNI_LANES, 4)  # [t, b, g, n, j]
        u = torch.cat([c & 15, c >> 4], dim=2) if self.bits == 4 else c
        return _dequantize_tiles(u.permute(0, 3, 1, 2, 4).reshape(tiles * VNNI_LANES, blocks, BLOCK), self.dm)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, K]`` (float32 or bfloat16) → float32 ``[M, N]``: activations quantized per block of 32 to
        16-bit codes as the GEMV (:meth:`PairBlocks.matmul`), integer sums on vpdpbusd. Needs :func:`load`;
        RuntimeError for mismatched shapes."""
        return torch.ops.kvscope_cpu.vnni_gemm(x, self.codes, self.dm)
