// kvscope CPU kernels on AVX2 CPUs (AMD Zen 2/3, Intel Haswell to Alder Lake, ...): the AVX-512 intrinsics the
// kernels use, each on a 512-bit vector held as two 256-bit halves, so that the one source of every kernel
// builds for both instruction sets (cpu_simd.h includes this header where the compiler targets no AVX-512).
//
// Every operation computes what the AVX-512 instruction computes (Intel SDM), lane for lane and bit for bit,
// including the integer dot products (vpdpwssd, vpdpbusd: exact, no saturation, modulo 2^32) and the reductions,
// which add in the order of GCC's own _mm512_reduce_* (upper 256 bits + lower, then 128, then 64, then 32): a
// kernel's results on AVX2 are those of its AVX-512 build. What differs is the speed: a 512-bit operation is two
// 256-bit ones (or more, for the cross-lane permutes and the byte dot products), and AVX2 has 16 vector registers
// of 256 bits where AVX-512 has 32 of 512, so register blocks sized for AVX-512 spill some accumulators to L1.
//
// Only what the kernels use is here; the bfloat16 (AVX512-BF16) and AMX paths stay behind their own feature tests
// and are not built on these CPUs. Needs AVX2, FMA and F16C (kernels/cpu_decode.py AVX2_FLAGS).
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__)
#error "cpu_simd_avx2.h is the AVX2 build's stand-in for AVX-512: include cpu_simd.h instead"
#endif
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "kvscope CPU kernels need AVX-512 F/BW/DQ/VNNI or AVX2 with FMA and F16C (build with -march=native)"
#endif

namespace kvscope_avx2 {

#define KVSCOPE_INLINE inline __attribute__((always_inline))

// 16 float32 lanes (lo: lanes 0-7), 16 int32 / 32 int16 / 64 int8 lanes (lo: bytes 0-31), 8 float64 lanes.
struct m512 {
  __m256 lo, hi;
};
struct m512i {
  __m256i lo, hi;
};
struct m512d {
  __m256d lo, hi;
};

// ---- float32 arithmetic ---------------------------------------------------------------------------------------

KVSCOPE_INLINE m512 add_ps(m512 a, m512 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
KVSCOPE_INLINE m512 sub_ps(m512 a, m512 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
KVSCOPE_INLINE m512 mul_ps(m512 a, m512 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
KVSCOPE_INLINE m512 div_ps(m512 a, m512 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
KVSCOPE_INLINE m512 max_ps(m512 a, m512 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
KVSCOPE_INLINE m512 min_ps(m512 a, m512 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
KVSCOPE_INLINE m512 fmadd_ps(m512 a, m512 b, m512 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
KVSCOPE_INLINE m512 fnmadd_ps(m512 a, m512 b, m512 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
KVSCOPE_INLINE m512 abs_ps(m512 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
// vrndscaleps with scale 0 (imm bits 7-4 zero): the rounding-control bits 3-0 are vroundps's.
template <int Imm>
KVSCOPE_INLINE m512 roundscale_ps(m512 a) {
  static_assert((Imm >> 4) == 0, "roundscale_ps: only scale 0 (rounding to integers) is provided");
  return {_mm256_round_ps(a.lo, Imm & 0xF), _mm256_round_ps(a.hi, Imm & 0xF)};
}
// a · 2^floor(b) for integral b with |b| <= 252 (vscalefps; exp16's b is in [-126, 128]): two exact powers of two
// of at most 2^±126 each, so that a result in float32's normal range is exact and one below it rounds once.
KVSCOPE_INLINE __m256 scalef_half(__m256 a, __m256 b) {
  const __m256i n = _mm256_cvtps_epi32(_mm256_floor_ps(b));
  const __m256i n1 = _mm256_srai_epi32(n, 1);
  const __m256i n2 = _mm256_sub_epi32(n, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
}
KVSCOPE_INLINE m512 scalef_ps(m512 a, m512 b) { return {scalef_half(a.lo, b.lo), scalef_half(a.hi, b.hi)}; }

// GCC's _mm512_reduce_add_ps / _max_ps order: (hi256 op lo256), then its 128-bit halves, then lanes {2,3} onto
// {0,1}, then lane 1 onto lane 0.
KVSCOPE_INLINE float reduce_add_ps(m512 a) {
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
KVSCOPE_INLINE float reduce_max_ps(m512 a) {
  const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_movehl_ps(t6, t6));
  return _mm_cvtss_f32(_mm_max_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

// ---- float32 data movement ------------------------------------------------------------------------------------

KVSCOPE_INLINE m512 set1_ps(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
KVSCOPE_INLINE m512 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
KVSCOPE_INLINE m512 loadu_ps(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
KVSCOPE_INLINE void storeu_ps(void* p, m512 a) {
  float* f = static_cast<float*>(p);
  _mm256_storeu_ps(f, a.lo);
  _mm256_storeu_ps(f + 8, a.hi);
}
KVSCOPE_INLINE m512 broadcast_f32x4(__m128 a) {
  const __m256 v = _mm256_set_m128(a, a);
  return {v, v};
}
KVSCOPE_INLINE m512 castps128_ps512(__m128 a) {  // the upper 384 bits are undefined in the SDM: zero here
  return {_mm256_insertf128_ps(_mm256_setzero_ps(), a, 0), _mm256_setzero_ps()};
}
// Lane i of the result = a's lane (idx_i & 15) (vpermps over 16 lanes): each half permuted within itself by the
// low 3 bits, the half picked by bit 3.
KVSCOPE_INLINE __m256 permute16_half(__m256i idx, m512 a) {
  const __m256 from_lo = _mm256_permutevar8x32_ps(a.lo, idx);
  const __m256 from_hi = _mm256_permutevar8x32_ps(a.hi, idx);
  return _mm256_blendv_ps(from_lo, from_hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
KVSCOPE_INLINE m512 permutexvar_ps(m512i idx, m512 a) { return {permute16_half(idx.lo, a), permute16_half(idx.hi, a)}; }
// Lane i = (bit 4 of idx_i ? b : a)'s lane (idx_i & 15) (vpermt2ps).
KVSCOPE_INLINE __m256 permute32_half(__m256i idx, m512 a, m512 b) {
  return _mm256_blendv_ps(permute16_half(idx, a), permute16_half(idx, b),
                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27)));
}
KVSCOPE_INLINE m512 permutex2var_ps(m512 a, m512i idx, m512 b) {
  return {permute32_half(idx.lo, a, b), permute32_half(idx.hi, a, b)};
}
// 128-bit units: result = {a[imm 1:0], a[imm 3:2], b[imm 5:4], b[imm 7:6]} (vshuff32x4); vperm2f128's selectors
// 0-3 name the same units of (lo, hi).
template <int Imm>
KVSCOPE_INLINE m512 shuffle_f32x4(m512 a, m512 b) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, (Imm & 3) | (((Imm >> 2) & 3) << 4)),
          _mm256_permute2f128_ps(b.lo, b.hi, ((Imm >> 4) & 3) | (((Imm >> 6) & 3) << 4))};
}
template <int Imm>
KVSCOPE_INLINE m512 shuffle_ps(m512 a, m512 b) {  // within every 128-bit unit, as vshufps
  return {_mm256_shuffle_ps(a.lo, b.lo, Imm), _mm256_shuffle_ps(a.hi, b.hi, Imm)};
}
KVSCOPE_INLINE m512 unpacklo_ps(m512 a, m512 b) {
  return {_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpacklo_ps(a.hi, b.hi)};
}
KVSCOPE_INLINE m512 unpackhi_ps(m512 a, m512 b) {
  return {_mm256_unpackhi_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.hi, b.hi)};
}
KVSCOPE_INLINE m512d unpacklo_pd(m512d a, m512d b) {
  return {_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)};
}
KVSCOPE_INLINE m512d unpackhi_pd(m512d a, m512d b) {
  return {_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)};
}
KVSCOPE_INLINE m512d castps_pd(m512 a) { return {_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
KVSCOPE_INLINE m512 castpd_ps(m512d a) { return {_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)}; }
KVSCOPE_INLINE m512i castps_si512(m512 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
KVSCOPE_INLINE m512 castsi512_ps(m512i a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }

// Masks: bit i of a __mmask16 selects lane i.
KVSCOPE_INLINE __m256 mask_half(unsigned k) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i kv = _mm256_set1_epi32(static_cast<int>(k));
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(kv, bits), bits));
}
KVSCOPE_INLINE m512 mask_blend_ps(__mmask16 k, m512 a, m512 b) {  // lane i: bit i ? b : a
  return {_mm256_blendv_ps(a.lo, b.lo, mask_half(k & 0xFFu)), _mm256_blendv_ps(a.hi, b.hi, mask_half(k >> 8))};
}
KVSCOPE_INLINE m512 maskz_mov_ps(__mmask16 k, m512 a) {  // lane i: bit i ? a : 0
  return {_mm256_and_ps(a.lo, mask_half(k & 0xFFu)), _mm256_and_ps(a.hi, mask_half(k >> 8))};
}

// ---- conversions ----------------------------------------------------------------------------------------------

KVSCOPE_INLINE m512 cvtph_ps(__m256i h) {  // 16 float16 → float32 (exact)
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
KVSCOPE_INLINE m512 cvtepi32_ps(m512i a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
KVSCOPE_INLINE m512i cvtps_epi32(m512 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
KVSCOPE_INLINE m512i cvtepu8_epi16(__m256i a) {  // 32 bytes → 32 int16
  return {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a, 1))};
}
KVSCOPE_INLINE m512i cvtepu8_epi32(__m128i a) {  // 16 bytes → 16 int32
  return {_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))};
}
KVSCOPE_INLINE m512i cvtepu16_epi32(__m256i a) {  // 16 uint16 → 16 int32
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
// 8 int32 lanes → their low bytes (vpmovdb truncates) in the low 8 bytes.
KVSCOPE_INLINE __m128i low_bytes_half(__m256i a) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a, pick), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  return _mm256_castsi256_si128(b);
}
KVSCOPE_INLINE __m128i cvtepi32_epi8(m512i a) {
  return _mm_unpacklo_epi64(low_bytes_half(a.lo), low_bytes_half(a.hi));
}
// 8 int32 lanes → their low 16 bits (vpmovdw truncates) in the low 16 bytes.
KVSCOPE_INLINE __m128i low_words_half(__m256i a) {
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, pick), 0x08));  // qwords 0, 2
}
KVSCOPE_INLINE __m256i cvtepi32_epi16(m512i a) { return _mm256_set_m128i(low_words_half(a.hi), low_words_half(a.lo)); }

// ---- integers -------------------------------------------------------------------------------------------------

KVSCOPE_INLINE m512i setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
KVSCOPE_INLINE m512i set1_epi32(int v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
KVSCOPE_INLINE m512i set1_epi8(char v) { return {_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
KVSCOPE_INLINE m512i setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8, int e9,
                                int e10, int e11, int e12, int e13, int e14, int e15) {
  return {_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7), _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15)};
}
KVSCOPE_INLINE m512i loadu_si512(const void* p) {
  const __m256i* v = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
KVSCOPE_INLINE void storeu_si512(void* p, m512i a) {
  __m256i* v = static_cast<__m256i*>(p);
  _mm256_storeu_si256(v, a.lo);
  _mm256_storeu_si256(v + 1, a.hi);
}
KVSCOPE_INLINE m512i add_epi32(m512i a, m512i b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
KVSCOPE_INLINE m512i sub_epi32(m512i a, m512i b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
KVSCOPE_INLINE m512i and_si512(m512i a, m512i b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
KVSCOPE_INLINE m512i slli_epi32(m512i a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
KVSCOPE_INLINE m512i srli_epi32(m512i a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
KVSCOPE_INLINE m512i srai_epi32(m512i a, int n) { return {_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)}; }
KVSCOPE_INLINE m512i srli_epi16(m512i a, int n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
KVSCOPE_INLINE int reduce_add_epi32(m512i a) {
  const __m256i t = _mm256_add_epi32(a.hi, a.lo);
  __m128i s = _mm_add_epi32(_mm256_extracti128_si256(t, 1), _mm256_castsi256_si128(t));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(s) + _mm_extract_epi32(s, 1);
}
// vpdpwssd: src + a[2i]·b[2i] + a[2i+1]·b[2i+1] per int32 lane, modulo 2^32 — vpmaddwd's pair sums (which wrap
// alike: only (-32768)² + (-32768)² overflows, to -2^31 in both) plus src.
KVSCOPE_INLINE m512i dpwssd_epi32(m512i src, m512i a, m512i b) {
  return {_mm256_add_epi32(src.lo, _mm256_madd_epi16(a.lo, b.lo)),
          _mm256_add_epi32(src.hi, _mm256_madd_epi16(a.hi, b.hi))};
}
// vpdpbusd: src + Σ_{j<4} a.u8[4i+j] · b.s8[4i+j] per int32 lane, modulo 2^32, no saturation (vpmaddubsw would
// saturate its int16 pair sums): the even and odd bytes widened to int16 and summed in pairs by vpmaddwd, whose
// products (<= 255 · 128) and pair sums cannot overflow.
KVSCOPE_INLINE __m256i dpbusd_half(__m256i src, __m256i a, __m256i b) {
  const __m256i a_even = _mm256_and_si256(a, _mm256_set1_epi16(0x00FF));
  const __m256i a_odd = _mm256_srli_epi16(a, 8);
  const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
  const __m256i b_odd = _mm256_srai_epi16(b, 8);
  return _mm256_add_epi32(src, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even), _mm256_madd_epi16(a_odd, b_odd)));
}
KVSCOPE_INLINE m512i dpbusd_epi32(m512i src, m512i a, m512i b) {
  return {dpbusd_half(src.lo, a.lo, b.lo), dpbusd_half(src.hi, a.hi, b.hi)};
}
template <int Scale>
KVSCOPE_INLINE m512i i32gather_epi32(m512i idx, const void* base) {
  const int* p = static_cast<const int*>(base);
  return {_mm256_i32gather_epi32(p, idx.lo, Scale), _mm256_i32gather_epi32(p, idx.hi, Scale)};
}

#undef KVSCOPE_INLINE

}  // namespace kvscope_avx2

// The AVX-512 names the kernels are written with, bound to the above (after <immintrin.h>, which declares the real
// ones for AVX-512 targets only, some as macros: hence each #undef).
#undef __m512
#define __m512 kvscope_avx2::m512
#undef __m512i
#define __m512i kvscope_avx2::m512i
#undef __m512d
#define __m512d kvscope_avx2::m512d
#undef _mm512_add_ps
#define _mm512_add_ps kvscope_avx2::add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps kvscope_avx2::sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps kvscope_avx2::mul_ps
#undef _mm512_div_ps
#define _mm512_div_ps kvscope_avx2::div_ps
#undef _mm512_max_ps
#define _mm512_max_ps kvscope_avx2::max_ps
#undef _mm512_min_ps
#define _mm512_min_ps kvscope_avx2::min_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps kvscope_avx2::fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps kvscope_avx2::fnmadd_ps
#undef _mm512_abs_ps
#define _mm512_abs_ps kvscope_avx2::abs_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, imm) kvscope_avx2::roundscale_ps<(imm)>(a)
#undef _mm512_scalef_ps
#define _mm512_scalef_ps kvscope_avx2::scalef_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps kvscope_avx2::reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps kvscope_avx2::reduce_max_ps
#undef _mm512_set1_ps
#define _mm512_set1_ps kvscope_avx2::set1_ps
#undef _mm512_setzero_ps
#define _mm512_setzero_ps kvscope_avx2::setzero_ps
#undef _mm512_loadu_ps
#define _mm512_loadu_ps kvscope_avx2::loadu_ps
#undef _mm512_load_ps
#define _mm512_load_ps kvscope_avx2::loadu_ps
#undef _mm512_storeu_ps
#define _mm512_storeu_ps kvscope_avx2::storeu_ps
#undef _mm512_store_ps
#define _mm512_store_ps kvscope_avx2::storeu_ps
#undef _mm512_broadcast_f32x4
#define _mm512_broadcast_f32x4 kvscope_avx2::broadcast_f32x4
#undef _mm512_castps128_ps512
#define _mm512_castps128_ps512 kvscope_avx2::castps128_ps512
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps kvscope_avx2::permutexvar_ps
#undef _mm512_permutex2var_ps
#define _mm512_permutex2var_ps kvscope_avx2::permutex2var_ps
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm) kvscope_avx2::shuffle_f32x4<(imm)>(a, b)
#undef _mm512_shuffle_ps
#define _mm512_shuffle_ps(a, b, imm) kvscope_avx2::shuffle_ps<(imm)>(a, b)
#undef _mm512_unpacklo_ps
#define _mm512_unpacklo_ps kvscope_avx2::unpacklo_ps
#undef _mm512_unpackhi_ps
#define _mm512_unpackhi_ps kvscope_avx2::unpackhi_ps
#undef _mm512_unpacklo_pd
#define _mm512_unpacklo_pd kvscope_avx2::unpacklo_pd
#undef _mm512_unpackhi_pd
#define _mm512_unpackhi_pd kvscope_avx2::unpackhi_pd
#undef _mm512_castps_pd
#define _mm512_castps_pd kvscope_avx2::castps_pd
#undef _mm512_castpd_ps
#define _mm512_castpd_ps kvscope_avx2::castpd_ps
#undef _mm512_castps_si512
#define _mm512_castps_si512 kvscope_avx2::castps_si512
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps kvscope_avx2::castsi512_ps
#undef _mm512_mask_blend_ps
#define _mm512_mask_blend_ps kvscope_avx2::mask_blend_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps kvscope_avx2::maskz_mov_ps
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps kvscope_avx2::cvtph_ps
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps kvscope_avx2::cvtepi32_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 kvscope_avx2::cvtps_epi32
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16 kvscope_avx2::cvtepu8_epi16
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 kvscope_avx2::cvtepu8_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 kvscope_avx2::cvtepu16_epi32
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8 kvscope_avx2::cvtepi32_epi8
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 kvscope_avx2::cvtepi32_epi16
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 kvscope_avx2::setzero_si512
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 kvscope_avx2::set1_epi32
#undef _mm512_set1_epi8
#define _mm512_set1_epi8 kvscope_avx2::set1_epi8
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 kvscope_avx2::setr_epi32
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 kvscope_avx2::loadu_si512
#undef _mm512_storeu_si512
#define _mm512_storeu_si512 kvscope_avx2::storeu_si512
#undef _mm512_store_si512
#define _mm512_store_si512 kvscope_avx2::storeu_si512
#undef _mm512_add_epi32
#define _mm512_add_epi32 kvscope_avx2::add_epi32
#undef _mm512_sub_epi32
#define _mm512_sub_epi32 kvscope_avx2::sub_epi32
#undef _mm512_and_si512
#define _mm512_and_si512 kvscope_avx2::and_si512
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 kvscope_avx2::slli_epi32
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 kvscope_avx2::srli_epi32
#undef _mm512_srai_epi32
#define _mm512_srai_epi32 kvscope_avx2::srai_epi32
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 kvscope_avx2::srli_epi16
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 kvscope_avx2::reduce_add_epi32
#undef _mm512_dpwssd_epi32
#define _mm512_dpwssd_epi32 kvscope_avx2::dpwssd_epi32
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32 kvscope_avx2::dpbusd_epi32
#undef _mm512_i32gather_epi32
#define _mm512_i32gather_epi32(idx, base, scale) kvscope_avx2::i32gather_epi32<(scale)>(idx, base)
