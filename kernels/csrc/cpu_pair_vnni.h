// kvscope CPU kernels: the matmul of small batches (4-64 rows) on integer dot products, for AVX-512 VNNI CPUs
// without AMX (AMD Zen 4/5, Xeons whose AMX is not exposed). Included by cpu_decode.cpp, whose GEMV it shares
// the numerics with: activations quantized per block of 32 to 16-bit codes (x ≈ d_x · q, d_x = max|x| / 32767,
// llama.cpp's Q8_1 form with 16-bit codes), the weights' codes u as they are (w = d · u + m),
//   Σ_j w_j x_j = d · d_x · Σ u_j q_j + m · (d_x · Σ q_j)
// with Σ u q exact in int32; only the order of the float32 sums over blocks differs from the GEMV's.
//
// Why another form: the GEMV (cpu_decode.cpp) is a dot product per weight row, so each pair of blocks costs a
// conversion and a scaling per activation row beside its 2 vpdpwssd, and it re-reads the weights every 4 rows;
// the float32/bfloat16 tiles (cpu_pair_gemm.h) expand every weight to float once per call and then run at the
// float32 FMA's (or VDPBF16PS's) rate. Here the weights are stored transposed in tiles of 16 rows ("VNNI
// blocks", kernels/cpu_decode.py VnniBlocks: a copy made at load time), so that one zmm holds 4 consecutive
// codes of 16 output rows (the int32 lanes), and each activation row is multiplied in outer-product form:
// vpdpbusd (64 u8 × s8 products, 4 per 32-bit lane; Intel SDM) with the activation's 4 bytes broadcast from
// memory, 8 per block of 32 for each byte of the 16-bit code, then one scaling per block, activation row and 16
// outputs. One core retires vpdpbusd at the rate of vfmadd231ps (Zen 4: one zmm a cycle), so the 16-bit codes
// cost 2 instructions per 4 products of 16 lanes where float32 costs 4 (docs/benchmarks.md "Int16 tiles on an
// AMD EPYC").
//
// The 16-bit code q = 256 · hi + lo with hi = q >> 8 (a signed byte) and lo = q & 255 (unsigned); vpdpbusd
// multiplies an unsigned by a signed operand. 4-bit codes (0-15) fit either role: hi times the codes as the
// unsigned operand, then lo as the unsigned one times the codes as signed. 8-bit codes (0-255) are unsigned
// only, so lo is stored as lo − 128 and the block's 128 · Σ u is added back:
//   Σ u q = 256 · Σ u · hi + Σ u · (lo − 128) + 128 · Σ u
// Bounds: the total ≤ 32 · 255 · 32767 < 2^31 (8-bit codes; 4-bit: 17x less).
//
// Layout (tile t = output rows 16t … 16t + 15, block b = k 32b … 32b + 31):
//   4-bit codes [N/16, K/32, 256]: 64-byte chunk g < 4, byte 4n + j = u[16t + n, 32b + 4g + j]
//                                  | u[16t + n, 32b + 4(g + 4) + j] << 4
//   8-bit codes [N/16, K/32, 512]: 64-byte chunk g < 8, byte 4n + j = u[16t + n, 32b + 4g + j]
//   dm float16 [N/16, K/32, 2, 16]: the 16 rows' d, then their m (as the AMX kernel's TileBlocks)
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_simd.h"  // the intrinsics on AVX2 CPUs too
#if !defined(__AVX512F__)
#include "cpu_pair_vnni_avx2.h"
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvscope_pair_vnni {

constexpr int64_t kBlock = 32;
constexpr int64_t kLanes = 16;  // weight rows per tile: the int32 lanes of a zmm
constexpr int kMR = 8;          // activation rows per pass (8 int32 + 8 float32 accumulators + 8 code vectors)
constexpr int64_t kPrefetchTiles = 2;

// x [n, K] float32 → per block of 32: the 16-bit codes' high bytes (signed) and low bytes (unsigned, or − 128
// for 8-bit weights: module comment) and {d_x, d_x · Σ q} (the GEMV's quantization, cpu_decode.cpp
// quantize_rows). Laid out for the passes of kMR rows: per group of kMR rows and block, the high bytes then the
// low bytes, each [8 (4 consecutive k), kMR (rows), 4 bytes], so that the kMR rows' broadcasts of one pass are
// constant offsets from one pointer (rows past n are zeros).
struct Activations {
  std::vector<int8_t> codes;  // [groups, K/32, 2, 8, kMR, 4]
  std::vector<float> ds;      // [groups, K/32, kMR, 2]
};

constexpr int64_t kGroupBlockBytes = 2 * 8 * kMR * 4;

inline Activations quantize(const float* x, int64_t n, int64_t K, int bits) {
  const int64_t B = K / kBlock;
  const int64_t groups = (n + kMR - 1) / kMR;
  Activations a{std::vector<int8_t>(groups * B * kGroupBlockBytes), std::vector<float>(groups * B * kMR * 2)};
  const __m512i lo_offset = _mm512_set1_epi32(bits == 4 ? 0 : 128);
  const __m512i low8 = _mm512_set1_epi32(0xFF);
  alignas(64) int32_t hi[8], lo[8];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t group = i / kMR, m = i % kMR;
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + i * K + b * kBlock;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float d = amax / 32767.f;
      const __m512 id = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      // round to nearest even (the MXCSR default), as std::nearbyint in the GEMV's quantize_rows
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
      _mm_store_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q0, 8)));
      _mm_store_si128(reinterpret_cast<__m128i*>(hi + 4), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q1, 8)));
      _mm_store_si128(reinterpret_cast<__m128i*>(lo),
                      _mm512_cvtepi32_epi8(_mm512_sub_epi32(_mm512_and_si512(q0, low8), lo_offset)));
      _mm_store_si128(reinterpret_cast<__m128i*>(lo + 4),
                      _mm512_cvtepi32_epi8(_mm512_sub_epi32(_mm512_and_si512(q1, low8), lo_offset)));
      int32_t* out = reinterpret_cast<int32_t*>(a.codes.data() + (group * B + b) * kGroupBlockBytes);
      for (int g = 0; g < 8; ++g) {
        out[g * kMR + m] = hi[g];
        out[(8 + g) * kMR + m] = lo[g];
      }
      float* ds = a.ds.data() + ((group * B + b) * kMR + m) * 2;
      ds[0] = d;
      ds[1] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
  }
  return a;
}

// Y[i0 + m, 16t + lane] for m < MR (i0 = group · kMR): activation rows times tile t (module comment).
template <int MR, int BITS>
inline void rows_times_tile(const Activations& a, int64_t K, const uint8_t* codes, const uint16_t* dm, int64_t t,
                            int64_t group, float* Y, int64_t ldy, const float* bias) {
  constexpr int64_t kBlockBytes = BITS == 4 ? 256 : 512;
  const int64_t B = K / kBlock;
  const uint8_t* tc = codes + t * B * kBlockBytes;
  const uint16_t* tdm = dm + t * B * 2 * kLanes;
  const int32_t* ac = reinterpret_cast<const int32_t*>(a.codes.data() + group * B * kGroupBlockBytes);
  const float* ads = a.ds.data() + group * B * kMR * 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 accf[MR];
  for (int m = 0; m < MR; ++m) accf[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b, ac += kGroupBlockBytes / 4, ads += kMR * 2) {
    const uint8_t* bc = tc + b * kBlockBytes;
    if (group == 0) {  // the tiles kPrefetchTiles ahead (one stream per thread), as the GEMV prefetches
      for (int64_t off = 0; off < kBlockBytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(bc + kPrefetchTiles * B * kBlockBytes + off), _MM_HINT_T0);
      }
      _mm_prefetch(reinterpret_cast<const char*>(tdm + (kPrefetchTiles * B + b) * 2 * kLanes), _MM_HINT_T0);
    }
    __m512i w[8];
    if constexpr (BITS == 4) {
      for (int g = 0; g < 4; ++g) {
        const __m512i c = _mm512_loadu_si512(bc + 64 * g);
        w[g] = _mm512_and_si512(c, low4);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
      }
    } else {
      for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(bc + 64 * g);
    }
    __m512i u = _mm512_setzero_si512();  // 8-bit: 128 · Σ u per row
    if constexpr (BITS == 8) {
      for (int g = 0; g < 8; ++g) u = _mm512_dpbusd_epi32(u, w[g], ones);
      u = _mm512_slli_epi32(u, 7);
    }
    __m512i acc[MR];
#if !defined(__AVX512F__)
    block_sums_avx2<MR, BITS, kMR>(w, ac, acc);
#else
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      for (int m = 0; m < MR; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], w[g], _mm512_set1_epi32(ac[g * kMR + m]));
    }
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_slli_epi32(acc[m], 8);
    for (int g = 0; g < 8; ++g) {
      for (int m = 0; m < MR; ++m) {
        const __m512i lo = _mm512_set1_epi32(ac[(8 + g) * kMR + m]);
        // 4-bit: lo unsigned times the codes as signed bytes; 8-bit: the codes unsigned times lo − 128
        acc[m] = BITS == 4 ? _mm512_dpbusd_epi32(acc[m], lo, w[g]) : _mm512_dpbusd_epi32(acc[m], w[g], lo);
      }
    }
#endif
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tdm + b * 2 * kLanes)));
    const __m512 mn =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tdm + b * 2 * kLanes + kLanes)));
    for (int m = 0; m < MR; ++m) {
      const __m512 sums = _mm512_cvtepi32_ps(BITS == 4 ? acc[m] : _mm512_add_epi32(acc[m], u));
      accf[m] = _mm512_fmadd_ps(sums, _mm512_mul_ps(d, _mm512_set1_ps(ads[2 * m])), accf[m]);
      accf[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(ads[2 * m + 1]), accf[m]);
    }
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias + t * kLanes) : _mm512_setzero_ps();
  const int64_t i0 = group * kMR;
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(Y + (i0 + m) * ldy + t * kLanes, _mm512_add_ps(accf[m], bv));
}

template <int BITS>
inline void tile_rows_pass(const Activations& a, int64_t n, int64_t K, const uint8_t* codes, const uint16_t* dm,
                           int64_t t, float* Y, int64_t ldy, const float* bias) {
  for (int64_t group = 0; group * kMR < n; ++group) {
    switch (std::min<int64_t>(kMR, n - group * kMR)) {
      case 8: rows_times_tile<8, BITS>(a, K, codes, dm, t, group, Y, ldy, bias); break;
      case 7: rows_times_tile<7, BITS>(a, K, codes, dm, t, group, Y, ldy, bias); break;
      case 6: rows_times_tile<6, BITS>(a, K, codes, dm, t, group, Y, ldy, bias); break;
      case 5: rows_times_tile<5, BITS>(a, K, codes, dm, t, group, Y, ldy, bias); break;
      case 4: rows_times_tile<4, BITS>(a, K, codes, dm, t, group, Y, ldy, bias); break;
      case 3: rows_times_tile<3, BITS>(a, K, codes, dm, t, group, Y, ldy, bias); break;
      case 2: rows_times_tile<2, BITS>(a, K, codes, dm, t, group, Y, ldy, bias); break;
      default: rows_times_tile<1, BITS>(a, K, codes, dm, t, group, Y, ldy, bias); break;
    }
  }
}

// Y [n, N] = X [n, K] · Wᵀ (+ bias) for a weight of N = 16 · tiles rows in VNNI blocks (module comment) of BITS
// 4 or 8; float32 in and out. Work items are tiles of 16 weight rows over the OpenMP threads, each multiplied by
// every activation row, kMR rows at a time.
inline void vnni_gemm(const float* X, int64_t n, int64_t K, const uint8_t* codes, const uint16_t* dm, int64_t tiles,
                      int bits, const float* bias, float* Y) {
  const Activations a = quantize(X, n, K, bits);
  const int64_t N = tiles * kLanes;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (bits == 4) {
        tile_rows_pass<4>(a, n, K, codes, dm, t, Y, N, bias);
      } else {
        tile_rows_pass<8>(a, n, K, codes, dm, t, Y, N, bias);
      }
    }
  });
}

}  // namespace kvscope_pair_vnni
