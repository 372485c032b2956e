// kvscope CPU kernels: AVX-512 helpers shared by cpu_decode.cpp, cpu_attention.cpp and cpu_elementwise.cpp (header-only, inline).
// Every kernel source includes it before its first vector: on a CPU without AVX-512 (the library's AVX2 build,
// kernels/cpu_decode.py) it brings cpu_simd_avx2.h, the same intrinsics on pairs of 256-bit vectors.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#if !defined(__AVX512F__)
#include "cpu_simd_avx2.h"
#endif

namespace kvscope_simd {

// 16 bfloat16 bit patterns (as loaded into a 256-bit register) → 16 float32 lanes (exact).
inline __m512 load16_bits(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 floats from float32 or bfloat16 memory (bfloat16 → float32 is exact: the upper half of the float's bits).
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  return load16_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x per lane, float32: 2^n · p(r) with n = round(x · log2 e) and r = x − n · ln 2 (Cody-Waite: ln 2 split in a
// high and a low part, |r| ≤ ln2 / 2), p the degree-6 Taylor polynomial of e^r (truncation ≤ r⁷/7! ≈ 1.2e-7
// relative), 2^n applied by vscalefps. x is clamped to [-87.3, 88.7] (the float32 range: e^−87.3 ≈ 1.2e-38).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace kvscope_simd
