// kvscope CPU kernels: the pair-block matmul of small batches (4-64 rows) for AVX-512 CPUs without AMX (AMD Zen
// 4/5, Xeons whose AMX is not exposed). Included by cpu_decode.cpp (its GEMV's weight format).
//
// The GEMV (cpu_decode.cpp) multiplies 16-bit activation codes by the weight codes and scales each pair's
// integer sums per activation row: about 8 instructions per 64 weights per row, so a decode step of 8-32 rows
// costs several times what reading the 4-bit weights does. Here each weight is expanded once per call to
// fma(d, u, m) in float32, or that rounded to bfloat16 (the rounding of the dense bfloat16 copy of the same
// weights, as the AMX kernel cpu_amx.cpp), into a tile of output rows held in L1, and every activation row
// (float32, or rounded to bfloat16) is multiplied by that tile: 4 VFMADD231PS (16 products each) or 2 VDPBF16PS
// (16 float32 lanes, 2 products each; Intel SDM) per 64 weights per row, the expansion paid once per call. Sums
// are float32, per output one accumulator in one order whatever the other rows (another order than oneDNN's).
// Which tile type is faster depends on the CPU (docs/benchmarks.md "Small batches without AMX"): the start-up
// probe times both (engine/platform/kernel_probe.py).
//
// The expanded tile and the activations keep the codes' "lane order" (cpu_decode.cpp module comment): the dot
// product of two vectors in the same order is the same sum, so no transpose is needed.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_simd.h"  // the intrinsics on AVX2 CPUs too

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#define KVSCOPE_PAIR_GEMM_BF16 1  // the bfloat16 tiles are built (VDPBF16PS, VCVTNE2PS2BF16)
#endif

namespace kvscope_pair_gemm {

constexpr int64_t kPair = 64;
constexpr int64_t kTileBytes = 24 * 1024;  // an expanded tile: half of a 48 KB L1, beside kMR activation rows
constexpr int64_t kMaxTileN = 16;
constexpr int kMR = 4;          // activation rows per micro-kernel
constexpr int kNR = 4;          // weight rows per micro-kernel (kMR · kNR accumulators)
constexpr int64_t kPrefetchRows = 32;

// Element types of the expanded tile and activations: float32 (VFMADD231PS, 16 products an instruction) or
// bfloat16 (VDPBF16PS, 32; built where the compiler targets AVX512-BF16).
enum class Tile : int64_t { kFloat32 = 1, kBFloat16 = 2 };

// float32 x [n, K] → [n, K] with each pair of 32-blocks in lane order (codes 0-31: weights 0-15 of block A
// and B interleaved by 4 (A0-3, B0-3, A4-7, …), codes 32-63: weights 16-31 likewise), as float32 or bfloat16.
template <Tile T>
inline void activations(const float* x, int64_t n, int64_t K, void* out) {
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t p = 0; p < K; p += kPair) {
      const float* xp = x + i * K + p;
      const __m512 a0 = _mm512_loadu_ps(xp), a1 = _mm512_loadu_ps(xp + 16);
      const __m512 b0 = _mm512_loadu_ps(xp + 32), b1 = _mm512_loadu_ps(xp + 48);
      const __m512 c0 = _mm512_permutex2var_ps(a0, lo_idx, b0), c1 = _mm512_permutex2var_ps(a0, hi_idx, b0);
      const __m512 c2 = _mm512_permutex2var_ps(a1, lo_idx, b1), c3 = _mm512_permutex2var_ps(a1, hi_idx, b1);
      if constexpr (T == Tile::kFloat32) {
        float* o = static_cast<float*>(out) + i * K + p;
        _mm512_storeu_ps(o, c0);
        _mm512_storeu_ps(o + 16, c1);
        _mm512_storeu_ps(o + 32, c2);
        _mm512_storeu_ps(o + 48, c3);
      } else {
#if defined(KVSCOPE_PAIR_GEMM_BF16)
        uint16_t* o = static_cast<uint16_t*>(out) + i * K + p;
        _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(c1, c0));
        _mm512_storeu_si512(o + 32, (__m512i)_mm512_cvtne2ps_pbh(c3, c2));
#endif
      }
    }
  }
}

// 16 codes (32-bit lanes) of lane order → 16 float32 weights d · u + m, the block of code c being (c >> 2) & 1:
// dv and mv hold d_A or d_B (m_A or m_B) in that pattern.
inline __m512 expand16(__m512i codes, __m512 dv, __m512 mv) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), dv, mv);
}

// Weight rows [r, r + rows) of W (pair blocks, BITS 4 or 8) → [rows, K] in lane order: float32 fma(d, u, m),
// or that rounded to bfloat16 (nearest even: the dense bfloat16 copy's rounding).
template <int BITS, Tile T>
inline void expand_rows(const uint8_t* W, const uint16_t* S, int64_t P, int64_t r, int64_t rows, void* out) {
  constexpr int64_t kPairBytes = BITS == 4 ? 32 : 64;
  const __m512i d_idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const __m512i m_idx = _mm512_add_epi32(d_idx, _mm512_set1_epi32(2));
  for (int64_t j = 0; j < rows; ++j) {
    const uint8_t* w = W + (r + j) * P * kPairBytes;
    const uint16_t* s = S + (r + j) * P * 4;
    for (int64_t p = 0; p < P; ++p) {
      // software prefetch kPrefetchRows rows ahead, as the GEMV (the hardware prefetcher alone reads these
      // weights at about half of the DRAM bandwidth: docs/benchmarks.md "Fused CPU decode step")
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * P * kPairBytes + p * kPairBytes), _MM_HINT_T1);
      if (p % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(s + (kPrefetchRows * P + p) * 4), _MM_HINT_T1);
      const __m512 sc = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 4 * p))));
      const __m512 dv = _mm512_permutexvar_ps(d_idx, sc), mv = _mm512_permutexvar_ps(m_idx, sc);
      // codes 0-15, 16-31, 32-47, 48-63 as 32-bit lanes, zero-extended straight from memory (VPMOVZXBD with a
      // memory operand: no shuffle-port extracts; 4-bit byte j holds u[j] | u[j + 32] << 4)
      __m512 e0, e1, e2, e3;
      if constexpr (BITS == 4) {
        const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 32)));
        const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 32 + 16)));
        const __m512i low4 = _mm512_set1_epi32(0x0F);
        e0 = expand16(_mm512_and_si512(b0, low4), dv, mv);
        e1 = expand16(_mm512_and_si512(b1, low4), dv, mv);
        e2 = expand16(_mm512_srli_epi32(b0, 4), dv, mv);
        e3 = expand16(_mm512_srli_epi32(b1, 4), dv, mv);
      } else {
        const __m128i* c = reinterpret_cast<const __m128i*>(w + p * 64);
        e0 = expand16(_mm512_cvtepu8_epi32(_mm_loadu_si128(c)), dv, mv);
        e1 = expand16(_mm512_cvtepu8_epi32(_mm_loadu_si128(c + 1)), dv, mv);
        e2 = expand16(_mm512_cvtepu8_epi32(_mm_loadu_si128(c + 2)), dv, mv);
        e3 = expand16(_mm512_cvtepu8_epi32(_mm_loadu_si128(c + 3)), dv, mv);
      }
      if constexpr (T == Tile::kFloat32) {
        float* o = static_cast<float*>(out) + (j * P + p) * kPair;
        _mm512_storeu_ps(o, e0);
        _mm512_storeu_ps(o + 16, e1);
        _mm512_storeu_ps(o + 32, e2);
        _mm512_storeu_ps(o + 48, e3);
      } else {
#if defined(KVSCOPE_PAIR_GEMM_BF16)
        uint16_t* o = static_cast<uint16_t*>(out) + (j * P + p) * kPair;
        _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        _mm512_storeu_si512(o + 32, (__m512i)_mm512_cvtne2ps_pbh(e3, e2));
#endif
      }
    }
  }
}

// Sum of each of 16 vectors' lanes → one vector, lane t = Σ v[t] (a transposing reduction: 15 adds).
inline __m512 reduce16(const __m512 v[16]) {
  __m512 s8[8], s4[4], s2[2];
  for (int t = 0; t < 8; ++t) {  // per 128-bit lane: {v2t, v2t+1, v2t, v2t+1}
    s8[t] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * t], v[2 * t + 1]), _mm512_unpackhi_ps(v[2 * t], v[2 * t + 1]));
  }
  for (int t = 0; t < 4; ++t) {  // per 128-bit lane: {v4t, v4t+1, v4t+2, v4t+3}
    const __m512d a = _mm512_castps_pd(s8[2 * t]), b = _mm512_castps_pd(s8[2 * t + 1]);
    s4[t] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int t = 0; t < 2; ++t) {  // 128-bit lanes: v8t..+3 (halves 0+1), (2+3), then v8t+4..+7 likewise
    s2[t] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * t], s4[2 * t + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s4[2 * t], s4[2 * t + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// out[m · kNR + j] = the lane sums' vector of activation row i0 + m times expanded weight row j (row stride K
// elements of T): MR · NR accumulators in registers over K.
template <int MR, int NR, Tile T>
inline void micro(const void* xv, int64_t i0, const void* wv, int64_t K, __m512 out[kMR * kNR]) {
  __m512 acc[MR * NR];  // local, so that they stay in registers
  for (int t = 0; t < MR * NR; ++t) acc[t] = _mm512_setzero_ps();
  if constexpr (T == Tile::kFloat32) {
    const float* x0 = static_cast<const float*>(xv) + i0 * K;
    const float* wt = static_cast<const float*>(wv);
    for (int64_t k = 0; k < K; k += 16) {
      __m512 w[NR];
      for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_ps(wt + j * K + k);
      for (int m = 0; m < MR; ++m) {
        const __m512 a = _mm512_loadu_ps(x0 + m * K + k);
        for (int j = 0; j < NR; ++j) acc[m * NR + j] = _mm512_fmadd_ps(a, w[j], acc[m * NR + j]);
      }
    }
  } else {
#if defined(KVSCOPE_PAIR_GEMM_BF16)
    const uint16_t* x0 = static_cast<const uint16_t*>(xv) + i0 * K;
    const uint16_t* wt = static_cast<const uint16_t*>(wv);
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh w[NR];
      for (int j = 0; j < NR; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wt + j * K + k);
      for (int m = 0; m < MR; ++m) {
        const __m512bh a = (__m512bh)_mm512_loadu_si512(x0 + m * K + k);
        for (int j = 0; j < NR; ++j) acc[m * NR + j] = _mm512_dpbf16_ps(acc[m * NR + j], a, w[j]);
      }
    }
#endif
  }
  for (int t = 0; t < kMR * kNR; ++t) out[t] = t < MR * NR ? acc[t] : _mm512_setzero_ps();
}

// The tile's expanded rows [0, rows) times every activation row → Y[:, r0 + …] (+ bias).
template <Tile T>
inline void tile_times_rows(const void* xv, int64_t n, const void* tile, int64_t rows, int64_t K, int64_t r0,
                            float* Y, int64_t ldy, const float* bias) {
  constexpr int64_t kElem = T == Tile::kFloat32 ? 4 : 2;
  __m512 acc[kMR * kNR];
  alignas(64) float sums[16];
  // activation rows outer: their kMR rows stay in L1 while the tile's rows pass by
  for (int64_t i0 = 0; i0 < n; i0 += kMR) {
    const int mr = static_cast<int>(std::min<int64_t>(kMR, n - i0));
    for (int64_t j0 = 0; j0 < rows; j0 += kNR) {
      const int nr = static_cast<int>(std::min<int64_t>(kNR, rows - j0));
      const void* wt = static_cast<const char*>(tile) + j0 * K * kElem;
      if (nr == kNR) {
        switch (mr) {
          case 4: micro<4, kNR, T>(xv, i0, wt, K, acc); break;
          case 3: micro<3, kNR, T>(xv, i0, wt, K, acc); break;
          case 2: micro<2, kNR, T>(xv, i0, wt, K, acc); break;
          default: micro<1, kNR, T>(xv, i0, wt, K, acc); break;
        }
      } else {  // the last 1-3 rows of a weight whose N is not a multiple of kNR
        __m512 one[kMR * kNR];
        for (int t = 0; t < kMR * kNR; ++t) acc[t] = _mm512_setzero_ps();
        for (int m = 0; m < mr; ++m) {
          for (int j = 0; j < nr; ++j) {
            micro<1, 1, T>(xv, i0 + m, static_cast<const char*>(wt) + j * K * kElem, K, one);
            acc[m * kNR + j] = one[0];
          }
        }
      }
      _mm512_store_ps(sums, reduce16(acc));  // lane m · kNR + j: row i0 + m, weight row j0 + j
      for (int m = 0; m < mr; ++m) {
        for (int j = 0; j < nr; ++j) {
          float y = sums[m * kNR + j];
          if (bias != nullptr) y += bias[r0 + j0 + j];
          Y[(i0 + m) * ldy + r0 + j0 + j] = y;
        }
      }
    }
  }
}

template <Tile T>
inline void pair_gemm_typed(const float* X, int64_t n, int64_t K, const uint8_t* W, const uint16_t* S, int64_t N,
                            int bits, const float* bias, float* Y) {
  using E = std::conditional_t<T == Tile::kFloat32, float, uint16_t>;
  const int64_t P = K / kPair;
  std::vector<E> xe(n * K);
  activations<T>(X, n, K, xe.data());
  // weight rows per tile: a multiple of kNR whose expansion fits kTileBytes (4 at K = 1536 float32, 8 at 576)
  const int64_t tile_n = std::clamp<int64_t>(kTileBytes / (K * static_cast<int64_t>(sizeof(E))) / kNR * kNR, kNR,
                                             kMaxTileN);
  const int64_t tiles = (N + tile_n - 1) / tile_n;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<E> tile(tile_n * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * tile_n;
      const int64_t rows = std::min(tile_n, N - r0);
      if (bits == 4) {
        expand_rows<4, T>(W, S, P, r0, rows, tile.data());
      } else {
        expand_rows<8, T>(W, S, P, r0, rows, tile.data());
      }
      tile_times_rows<T>(xe.data(), n, tile.data(), rows, K, r0, Y, N, bias);
    }
  });
}

// Y [n, N] = X [n, K] · Wᵀ (+ bias) for a pair-block weight of N rows (BITS 4 or 8), float32 in and out, on
// tiles of kind ``tile`` (float32 where bfloat16 tiles are not built). Work items are tiles of kTileN weight rows over the OpenMP threads; each expands its
// tile once and multiplies every activation row by it.
inline void pair_gemm(const float* X, int64_t n, int64_t K, const uint8_t* W, const uint16_t* S, int64_t N, int bits,
                      Tile tile, const float* bias, float* Y) {
#if defined(KVSCOPE_PAIR_GEMM_BF16)
  if (tile == Tile::kBFloat16) {
    pair_gemm_typed<Tile::kBFloat16>(X, n, K, W, S, N, bits, bias, Y);
    return;
  }
#endif
  pair_gemm_typed<Tile::kFloat32>(X, n, K, W, S, N, bits, bias, Y);
}

}  // namespace kvscope_pair_gemm
