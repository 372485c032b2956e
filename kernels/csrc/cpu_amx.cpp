// kvscope CPU kernels: batched int4 matmul on AMX tiles (Sapphire Rapids and later Xeons).
//
//   int4_gemm_amx(x [M, K] float32|bfloat16, codes uint8 [N/16, K/32, 256], dm float16 [N/16, K/32, 2, 16])
//       -> [M, N] in x's dtype (x rounded to bfloat16 for the tiles; float32 sums rounded once to bfloat16)
//
// y = x · Wᵀ with W[n, k] = d[n, b] · u[n, k] + m[n, b] for the 4-bit code u of block b = k / 32 (a GGUF Q4_1
// block's own d and min, as PairBlocks). What it is for: a decode step of 5–64 requests. There the engine used
// oneDNN's bfloat16 AMX matmul on a dense copy of the weights, which is bound by reading 2 bytes a weight
// (docs/benchmarks.md "AMX int4 matmul"); this kernel reads the 4-bit codes (0.625 bytes a
// weight with the scales) and expands each 16×32 block to bfloat16 in L1 right before the tile multiply, so
// the same AMX arithmetic runs on 3.2x fewer bytes from memory.
//
// Layout (kernels/cpu_decode.py TileBlocks.from_pair_blocks): the codes of output rows 16·t … 16·t+15 and block b
// are 256 bytes, byte 16·r + 2n + j = u[16t + n, 32b + 2r + j] | u[16t + 8 + n, 32b + 2r + j] << 4 (n < 8), so
// that one row r of 16 bytes expands to row r of an AMX B tile in its VNNI order (bfloat16 pairs (k = 2r, 2r + 1)
// of the 16 columns) with no transpose; dm holds the block's 16 d then 16 m (float16).
//
// Each weight is expanded as bfloat16(fma(d, u, m)) (round to nearest even), the rounding of the dense
// bfloat16 copy of the same weights; products are summed in float32 by TDPBF16PS (Intel SDM, "Intel AMX
// instructions"), 32 k at a time, in another order than oneDNN's.
//
// Tiles: C 0–3 (16 × 16 float32), A 4–5 (16 rows × 32 bfloat16 of x), B 6–7 (one expanded 16 × 32 block). Rows
// are zero-padded to a multiple of 16; per pass up to 2 row tiles × 2 column tiles, or 3–4 row tiles × 1. Work
// items (1 or 2 column tiles over the whole K) go to the OpenMP threads (at::parallel_for). Linux hands a
// process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; oneDNN asks
// the same): the op asks once and fails with an error if refused.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kCodeBytes = 256;  // one 16 × 32 block of 4-bit codes

bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtiledata = 18;    // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
  _tile_loadconfig(&cfg);
}

// One 16 × 32 block of codes → the B tile (16 rows of 32 bfloat16: the pairs (2r, 2r+1) of columns 0…15). Row
// r's 16 bytes hold, in their low nibbles, the pairs of columns 0–7 (byte 2n + j: column n, k = 2r + j) and in
// their high nibbles those of columns 8–15, so that vcvtne2ps2bf16 (low half from its second operand) writes
// the tile row in order, with no shuffle per row.
inline void expand_block(const uint8_t* codes, const c10::Half* dm, uint16_t* dst) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 16)));
  const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512 d_lo = _mm512_permutexvar_ps(first, d), m_lo = _mm512_permutexvar_ps(first, m);
  const __m512 d_hi = _mm512_permutexvar_ps(second, d), m_hi = _mm512_permutexvar_ps(second, m);
  const __m512i low_nibble = _mm512_set1_epi32(15);
  for (int r = 0; r < 16; ++r) {
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * r)));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(u, low_nibble)), d_lo, m_lo);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(u, 4)), d_hi, m_hi);
    _mm512_store_si512(dst + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// GCC's tile intrinsics are asm statements without a memory operand: the stores that expand a block into the
// buffer a tile load reads must be kept and finished before it (else they are dead stores to the compiler).
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// C tiles for MT row tiles × NT column tiles (MT·NT ≤ 4), summed over all K blocks; the first ``rows`` rows are
// written to out (row stride N) in out's type.
template <int MT, int NT, typename TO>
void gemm_item(const uint16_t* x, int64_t K, const uint8_t* codes, const c10::Half* dm, int64_t t0, TO* out,
               int64_t N, int64_t rows) {
  static_assert(MT * NT <= 4 && NT <= 2 && MT <= 4, "four C tiles");
  alignas(64) uint16_t b0[512];
  alignas(64) uint16_t b1[512];
  const int64_t blocks = K / kBlock, ldx = K * 2;
  _tile_zero(0);
  if constexpr (MT * NT > 1) _tile_zero(1);
  if constexpr (MT * NT > 2) _tile_zero(2);
  if constexpr (MT * NT > 3) _tile_zero(3);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = t0 * blocks + b;
    expand_block(codes + i0 * kCodeBytes, dm + i0 * 32, b0);
    memory_barrier();
    _tile_loadd(6, b0, 64);
    if constexpr (NT == 2) {
      const int64_t i1 = (t0 + 1) * blocks + b;
      expand_block(codes + i1 * kCodeBytes, dm + i1 * 32, b1);
      memory_barrier();
      _tile_loadd(7, b1, 64);
    }
    const uint16_t* xb = x + b * kBlock;
    _tile_loadd(4, xb, ldx);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT >= 2) {
      _tile_loadd(5, xb + kTileRows * K, ldx);
      if constexpr (NT == 2) {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_dpbf16ps(1, 5, 6);
      }
    }
    if constexpr (MT >= 3) {
      _tile_loadd(4, xb + 2 * kTileRows * K, ldx);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (MT >= 4) {
      _tile_loadd(5, xb + 3 * kTileRows * K, ldx);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  alignas(64) float c[4][kTileRows * kTileRows];  // C tile i: row tile i / NT, column tile i % NT
  _tile_stored(0, c[0], 64);
  if constexpr (MT * NT > 1) _tile_stored(1, c[1], 64);
  if constexpr (MT * NT > 2) _tile_stored(2, c[2], 64);
  if constexpr (MT * NT > 3) _tile_stored(3, c[3], 64);
  memory_barrier();
  for (int i = 0; i < MT * NT; ++i) {
    const int64_t row0 = (i / NT) * kTileRows, col0 = (t0 + i % NT) * kTileRows;
    for (int64_t r = 0; r < kTileRows && row0 + r < rows; ++r) {
      const __m512 v = _mm512_load_ps(c[i] + r * kTileRows);
      TO* dst = out + (row0 + r) * N + col0;
      if constexpr (std::is_same_v<TO, float>) {
        _mm512_storeu_ps(dst, v);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));  // nearest even
      }
    }
  }
}

// All column tiles for one pass of MT row tiles (x and out already offset to the pass's first row).
template <int MT, typename TO>
void gemm_pass(const uint16_t* x, int64_t K, const uint8_t* codes, const c10::Half* dm, TO* out, int64_t N,
               int64_t rows) {
  const int64_t tiles = N / kTileRows;
  constexpr int NT = MT <= 2 ? 2 : 1;
  const int64_t items = (tiles + NT - 1) / NT;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t0 = i * NT;
      if (NT == 2 && t0 + 1 < tiles) gemm_item<MT, NT, TO>(x, K, codes, dm, t0, out, N, rows);
      else gemm_item<MT, 1, TO>(x, K, codes, dm, t0, out, N, rows);
    }
    _tile_release();
  });
}

template <typename TO>
void gemm(const uint16_t* x, int64_t M, int64_t K, const uint8_t* codes, const c10::Half* dm, TO* out, int64_t N) {
  const int64_t padded = (M + kTileRows - 1) / kTileRows * kTileRows;
  for (int64_t row = 0; row < padded; row += 4 * kTileRows) {  // passes of up to 64 rows
    const int64_t tiles = std::min<int64_t>(4, (padded - row) / kTileRows), rows = M - row;
    const uint16_t* xr = x + row * K;
    TO* orow = out + row * N;
    switch (tiles) {
      case 1: gemm_pass<1, TO>(xr, K, codes, dm, orow, N, rows); break;
      case 2: gemm_pass<2, TO>(xr, K, codes, dm, orow, N, rows); break;
      case 3: gemm_pass<3, TO>(xr, K, codes, dm, orow, N, rows); break;
      default: gemm_pass<4, TO>(xr, K, codes, dm, orow, N, rows); break;
    }
  }
}

at::Tensor int4_gemm_amx(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& dm) {
  TORCH_CHECK(amx_permitted(), "int4_gemm_amx: the kernel refused the AMX tile state (arch_prctl)");
  TORCH_CHECK(x_in.dim() == 2, "x: [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == kCodeBytes &&
                  codes.is_contiguous(), "codes: contiguous uint8 [N/16, K/32, 256]");
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.dim() == 4 && dm.size(0) == codes.size(0) &&
                  dm.size(1) == codes.size(1) && dm.size(2) == 2 && dm.size(3) == 16 && dm.is_contiguous(),
              "dm: contiguous float16 [N/16, K/32, 2, 16]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = codes.size(0) * kTileRows;
  TORCH_CHECK(K == codes.size(1) * kBlock, "x has ", K, " columns, the weight ", codes.size(1) * kBlock);
  at::Tensor out = at::empty({M, N}, x_in.options());
  if (M == 0) return out;
  // the tiles read 16 rows at a time: rows padded with zeros (x as is when it already fits)
  const int64_t padded = (M + kTileRows - 1) / kTileRows * kTileRows;
  at::Tensor x = x_in;
  if (padded != M || x_in.scalar_type() != at::kBFloat16 || !x_in.is_contiguous()) {
    x = at::empty({padded, K}, x_in.options().dtype(at::kBFloat16));
    x.narrow(0, 0, M).copy_(x_in);
    if (padded > M) x.narrow(0, M, padded - M).zero_();
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* dp = dm.data_ptr<at::Half>();
  if (out.scalar_type() == at::kFloat) gemm<float>(xp, M, K, cp, dp, out.data_ptr<float>(), N);
  else gemm<c10::BFloat16>(xp, M, K, cp, dp, out.data_ptr<c10::BFloat16>(), N);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m) {
  m.def("int4_gemm_amx(Tensor x, Tensor codes, Tensor dm) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvscope_cpu, CPU, m) { m.impl("int4_gemm_amx", &int4_gemm_amx); }

#endif  // AMX: on other CPUs the library has no int4_gemm_amx op (kernels/cpu_decode.py amx_loaded)
