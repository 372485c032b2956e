// kvscope CPU kernels, AVX2 build: the integer sums of one VNNI block for cpu_pair_vnni.h's rows_times_tile
// (included there where the compiler targets no AVX-512; no ATen, so tests/kernels/simd_avx2_check.cpp checks it
// against a scalar model of the vpdpbusd chain it replaces). ``ac``: the activation codes of one block as
// rows_times_tile reads them, the high bytes of code group g and row m at ac[g · Stride + m], the low bytes at
// ac[(8 + g) · Stride + m] (Stride: the rows of a pass, kMR).
#pragma once

#include "cpu_simd_avx2.h"

#include <cstdint>

namespace kvscope_pair_vnni {

// The AVX2 build's integer sums of one block (what the vpdpbusd chain of rows_times_tile computes on AVX-512:
// acc[m] = 256 · Σ_g w[g] · hi[g, m] + Σ_g (lo or w)[g] · (w or lo)[g, m], per int32 lane), without emulating
// vpdpbusd (cpu_simd_avx2.h: ~9 instructions a half). vpmaddubsw multiplies unsigned by signed bytes into int16
// pair sums, saturating, so every product it is given is a 4-bit code (0-15) times a byte: a pair sums to at most
// 2 · 15 · 128 = 3,840 in magnitude with a signed byte (8 such sums: 30,720) and 2 · 15 · 255 = 7,650 with an
// unsigned one (4 sums: 30,600), below 32,767: the int16 sums of several g are exact, and one vpmaddwd by ones
// widens them to int32. 8-bit codes are split into their two nibbles, u = 16 · u_h + u_l. The integers are the
// vpdpbusd chain's exactly, so the results are the AVX-512 build's bit for bit.
template <int MR, int BITS, int Stride>
inline void block_sums_avx2(const __m512i w[8], const int32_t* ac, __m512i acc[MR]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i zero = _mm256_setzero_si256();
  for (int m = 0; m < MR; ++m) {
    __m256i half_sums[2];
    for (int h = 0; h < 2; ++h) {
      if constexpr (BITS == 4) {
        __m256i hi = zero, lo_a = zero, lo_b = zero;  // lo: 4 g each (the unsigned low bytes' bound)
        for (int g = 0; g < 8; ++g) {
          const __m256i wg = h == 0 ? w[g].lo : w[g].hi;
          hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(wg, _mm256_set1_epi32(ac[g * Stride + m])));
          const __m256i lo = _mm256_maddubs_epi16(_mm256_set1_epi32(ac[(8 + g) * Stride + m]), wg);
          if (g < 4) {
            lo_a = _mm256_add_epi16(lo_a, lo);
          } else {
            lo_b = _mm256_add_epi16(lo_b, lo);
          }
        }
        half_sums[h] = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi, ones), 8),
                                        _mm256_add_epi32(_mm256_madd_epi16(lo_a, ones), _mm256_madd_epi16(lo_b, ones)));
      } else {
        __m256i hh = zero, hl = zero, lh = zero, ll = zero;  // (high byte, low byte) × (high nibble, low nibble)
        for (int g = 0; g < 8; ++g) {
          const __m256i wg = h == 0 ? w[g].lo : w[g].hi;
          const __m256i wl = _mm256_and_si256(wg, low4), wh = _mm256_and_si256(_mm256_srli_epi16(wg, 4), low4);
          const __m256i a_hi = _mm256_set1_epi32(ac[g * Stride + m]), a_lo = _mm256_set1_epi32(ac[(8 + g) * Stride + m]);
          hh = _mm256_add_epi16(hh, _mm256_maddubs_epi16(wh, a_hi));
          hl = _mm256_add_epi16(hl, _mm256_maddubs_epi16(wl, a_hi));
          lh = _mm256_add_epi16(lh, _mm256_maddubs_epi16(wh, a_lo));
          ll = _mm256_add_epi16(ll, _mm256_maddubs_epi16(wl, a_lo));
        }
        const __m256i high = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hh, ones), 4), _mm256_madd_epi16(hl, ones));
        const __m256i low = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(lh, ones), 4), _mm256_madd_epi16(ll, ones));
        half_sums[h] = _mm256_add_epi32(_mm256_slli_epi32(high, 8), low);
      }
    }
    acc[m] = {half_sums[0], half_sums[1]};
  }
}

}  // namespace kvscope_pair_vnni
