// Checks kernels/csrc/cpu_simd_avx2.h lane by lane against scalar models of the AVX-512 instructions it stands in
// for (Intel SDM; the reductions in GCC's _mm512_reduce_* order), on random and edge-case inputs (NaN and ±0
// included: vmaxps/vminps return their second operand for them), and cpu_pair_vnni_avx2.h's block sums against
// the vpdpbusd chain of cpu_pair_vnni.h they replace. Built and run by
// tests/kernels/test_cpu_simd_avx2.py with -mavx2 -mfma -mf16c -mno-avx512f; prints "checked N" and exits 0, or
// prints every mismatch and exits 1.
#include "cpu_simd_avx2.h"
#include "cpu_pair_vnni_avx2.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

std::mt19937 rng(12345);
int failures = 0;
long checked = 0;

float rand_float() {
  static const float specials[] = {0.f, -0.f, 1.f, -1.f, 0.5f, 1.5f, 2.5f, -2.5f, 1e-30f, -87.3f, 88.7f, 3.4e38f,
                                   std::nanf(""), -std::nanf("")};
  const uint32_t r = rng();
  if (r % 8 == 0) return specials[r % (sizeof(specials) / sizeof(float))];
  return std::uniform_real_distribution<float>(-100.f, 100.f)(rng);
}
int32_t rand_int() {
  static const int32_t specials[] = {0, 1, -1, 127, -128, 255, 32767, -32768, 65535, INT32_MAX, INT32_MIN};
  const uint32_t r = rng();
  if (r % 4 == 0) return specials[r % (sizeof(specials) / sizeof(int32_t))];
  return static_cast<int32_t>(rng());
}

struct F16 { float v[16]; };
struct I16 { int32_t v[16]; };

__m512 load(const F16& a) { return _mm512_loadu_ps(a.v); }
__m512i load(const I16& a) { return _mm512_loadu_si512(a.v); }
F16 rand_f() { F16 a; for (float& x : a.v) x = rand_float(); return a; }
I16 rand_i() { I16 a; for (int32_t& x : a.v) x = rand_int(); return a; }
F16 out(__m512 v) { F16 a; _mm512_storeu_ps(a.v, v); return a; }
I16 out(__m512i v) { I16 a; _mm512_storeu_si512(a.v, v); return a; }

bool same(float a, float b) { return std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b)); }

void expect(const char* what, const F16& got, const F16& want) {
  ++checked;
  for (int i = 0; i < 16; ++i) {
    if (!same(got.v[i], want.v[i])) {
      std::printf("%s lane %d: got %.9g want %.9g\n", what, i, got.v[i], want.v[i]);
      ++failures;
      return;
    }
  }
}
void expect(const char* what, const I16& got, const I16& want) {
  ++checked;
  for (int i = 0; i < 16; ++i) {
    if (got.v[i] != want.v[i]) {
      std::printf("%s lane %d: got %d want %d\n", what, i, got.v[i], want.v[i]);
      ++failures;
      return;
    }
  }
}
void expect_scalar(const char* what, float got, float want) {
  ++checked;
  if (!same(got, want)) {
    std::printf("%s: got %.9g want %.9g\n", what, got, want);
    ++failures;
  }
}

// vmaxps on one lane: the second operand unless the first is greater (NaN and ±0 included).
float vmax(float x, float y) { return x > y ? x : y; }

// GCC's _mm512_reduce_max_ps: (hi256 max lo256), its 128-bit halves, lanes {2,3} onto {0,1}, lane 1 onto 0.
float reduce_max_model(const F16& a) {
  float m3[8], m6[4];
  for (int i = 0; i < 8; ++i) m3[i] = vmax(a.v[8 + i], a.v[i]);
  for (int i = 0; i < 4; ++i) m6[i] = vmax(m3[4 + i], m3[i]);
  return vmax(vmax(m6[0], m6[2]), vmax(m6[1], m6[3]));
}

template <int Imm>
void check_shuffles(const F16& a, const F16& b) {
  F16 w;
  for (int u = 0; u < 4; ++u) {  // vshuff32x4: units 0-1 from a, 2-3 from b
    const F16& src = u < 2 ? a : b;
    const int sel = (Imm >> (2 * u)) & 3;
    for (int j = 0; j < 4; ++j) w.v[4 * u + j] = src.v[4 * sel + j];
  }
  expect("shuffle_f32x4", out(_mm512_shuffle_f32x4(load(a), load(b), Imm)), w);
  for (int u = 0; u < 4; ++u) {  // vshufps within each 128-bit unit
    w.v[4 * u + 0] = a.v[4 * u + (Imm & 3)];
    w.v[4 * u + 1] = a.v[4 * u + ((Imm >> 2) & 3)];
    w.v[4 * u + 2] = b.v[4 * u + ((Imm >> 4) & 3)];
    w.v[4 * u + 3] = b.v[4 * u + ((Imm >> 6) & 3)];
  }
  expect("shuffle_ps", out(_mm512_shuffle_ps(load(a), load(b), Imm)), w);
}

void check_floats() {
  const F16 a = rand_f(), b = rand_f(), c = rand_f();
  F16 w;
  for (int i = 0; i < 16; ++i) w.v[i] = a.v[i] + b.v[i];
  expect("add_ps", out(_mm512_add_ps(load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = a.v[i] - b.v[i];
  expect("sub_ps", out(_mm512_sub_ps(load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = a.v[i] * b.v[i];
  expect("mul_ps", out(_mm512_mul_ps(load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = a.v[i] / b.v[i];
  expect("div_ps", out(_mm512_div_ps(load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = vmax(a.v[i], b.v[i]);
  expect("max_ps", out(_mm512_max_ps(load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i];
  expect("min_ps", out(_mm512_min_ps(load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  expect("fmadd_ps", out(_mm512_fmadd_ps(load(a), load(b), load(c))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = std::fma(-a.v[i], b.v[i], c.v[i]);
  expect("fnmadd_ps", out(_mm512_fnmadd_ps(load(a), load(b), load(c))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = std::fabs(a.v[i]);
  expect("abs_ps", out(_mm512_abs_ps(load(a))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = std::nearbyint(a.v[i]);
  expect("roundscale_ps", out(_mm512_roundscale_ps(load(a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), w);
  F16 n;  // vscalefps as exp16 uses it: integral exponents in [-126, 128], values near 1
  for (int i = 0; i < 16; ++i) {
    n.v[i] = static_cast<float>(static_cast<int>(rng() % 255) - 126);
    w.v[i] = std::ldexp(a.v[i] / 128.f, static_cast<int>(n.v[i]));
  }
  F16 a128;
  for (int i = 0; i < 16; ++i) a128.v[i] = a.v[i] / 128.f;
  expect("scalef_ps", out(_mm512_scalef_ps(load(a128), load(n))), w);
  // GCC's _mm512_reduce_add_ps: (hi256 + lo256), its 128-bit halves, lanes {2,3} onto {0,1}, lane 1 onto 0
  float t3[8], t6[4];
  for (int i = 0; i < 8; ++i) t3[i] = a.v[8 + i] + a.v[i];
  for (int i = 0; i < 4; ++i) t6[i] = t3[4 + i] + t3[i];
  expect_scalar("reduce_add_ps", _mm512_reduce_add_ps(load(a)), (t6[0] + t6[2]) + (t6[1] + t6[3]));
  expect_scalar("reduce_max_ps", _mm512_reduce_max_ps(load(a)), reduce_max_model(a));
  const __m128 q = _mm_loadu_ps(a.v);
  for (int i = 0; i < 16; ++i) w.v[i] = a.v[i % 4];
  expect("broadcast_f32x4", out(_mm512_broadcast_f32x4(q)), w);
  F16 low4 = out(_mm512_castps128_ps512(q));
  for (int i = 4; i < 16; ++i) low4.v[i] = 0.f;  // the upper lanes are undefined in the SDM
  for (int i = 0; i < 16; ++i) w.v[i] = i < 4 ? a.v[i] : 0.f;
  expect("castps128_ps512", low4, w);
  I16 idx;
  for (int32_t& x : idx.v) x = static_cast<int32_t>(rng());  // only the low 4 (5) bits select
  for (int i = 0; i < 16; ++i) w.v[i] = a.v[idx.v[i] & 15];
  expect("permutexvar_ps", out(_mm512_permutexvar_ps(load(idx), load(a))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = (idx.v[i] & 16 ? b : a).v[idx.v[i] & 15];
  expect("permutex2var_ps", out(_mm512_permutex2var_ps(load(a), load(idx), load(b))), w);
  check_shuffles<_MM_SHUFFLE(1, 0, 1, 0)>(a, b);
  check_shuffles<_MM_SHUFFLE(3, 2, 3, 2)>(a, b);
  check_shuffles<_MM_SHUFFLE(2, 0, 2, 0)>(a, b);
  check_shuffles<_MM_SHUFFLE(3, 1, 3, 1)>(a, b);
  check_shuffles<0x1B>(a, b);
  for (int u = 0; u < 4; ++u) {
    for (int j = 0; j < 2; ++j) {
      w.v[4 * u + 2 * j] = a.v[4 * u + j];
      w.v[4 * u + 2 * j + 1] = b.v[4 * u + j];
    }
  }
  expect("unpacklo_ps", out(_mm512_unpacklo_ps(load(a), load(b))), w);
  for (int u = 0; u < 4; ++u) {
    for (int j = 0; j < 2; ++j) {
      w.v[4 * u + 2 * j] = a.v[4 * u + 2 + j];
      w.v[4 * u + 2 * j + 1] = b.v[4 * u + 2 + j];
    }
  }
  expect("unpackhi_ps", out(_mm512_unpackhi_ps(load(a), load(b))), w);
  for (int u = 0; u < 4; ++u) {  // as float64 pairs: lo takes pair 0 of each unit, hi pair 1
    for (int j = 0; j < 2; ++j) {
      w.v[4 * u + j] = a.v[4 * u + j];
      w.v[4 * u + 2 + j] = b.v[4 * u + j];
    }
  }
  expect("unpacklo_pd", out(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(load(a)), _mm512_castps_pd(load(b))))), w);
  for (int u = 0; u < 4; ++u) {
    for (int j = 0; j < 2; ++j) {
      w.v[4 * u + j] = a.v[4 * u + 2 + j];
      w.v[4 * u + 2 + j] = b.v[4 * u + 2 + j];
    }
  }
  expect("unpackhi_pd", out(_mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(load(a)), _mm512_castps_pd(load(b))))), w);
  const __mmask16 k = static_cast<__mmask16>(rng());
  for (int i = 0; i < 16; ++i) w.v[i] = (k >> i) & 1 ? b.v[i] : a.v[i];
  expect("mask_blend_ps", out(_mm512_mask_blend_ps(k, load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = (k >> i) & 1 ? a.v[i] : 0.f;
  expect("maskz_mov_ps", out(_mm512_maskz_mov_ps(k, load(a))), w);
  I16 bits_of;
  std::memcpy(bits_of.v, a.v, sizeof(a.v));
  expect("castps_si512", out(_mm512_castps_si512(load(a))), bits_of);
  expect("castsi512_ps", out(_mm512_castsi512_ps(load(bits_of))), a);
}

// reduce_max_ps with one NaN, or one -0 among +0 (and the reverse), in every lane position: the order of
// GCC's tree and vmaxps's second-operand rule decide which comes out.
void check_reduce_max_order() {
  for (float odd : {std::nanf(""), -0.f, 0.f}) {
    for (int pos = 0; pos < 16; ++pos) {
      F16 a;
      for (int i = 0; i < 16; ++i) a.v[i] = odd == 0.f ? (std::signbit(odd) ? 0.f : -0.f) : -1.f;
      a.v[pos] = odd;
      const float want = reduce_max_model(a);
      ++checked;
      const float got = _mm512_reduce_max_ps(load(a));
      if (std::memcmp(&got, &want, 4) != 0 && !(std::isnan(got) && std::isnan(want))) {
        std::printf("reduce_max_ps order, odd lane %d: got %g want %g\n", pos, got, want);
        ++failures;
      }
      if (std::isnan(got) != std::isnan(want)) {
        std::printf("reduce_max_ps NaN, odd lane %d\n", pos);
        ++failures;
      }
    }
  }
}

// block_sums_avx2 (cpu_pair_vnni_avx2.h) against the vpdpbusd chain it replaces (cpu_pair_vnni.h, AVX-512 branch):
// per row m and int32 lane n, 256 · Σ_g Σ_j w[g][4n + j] · hi[g, m][j] + Σ_g Σ_j lo-products, modulo 2^32 — the
// low bytes unsigned times the codes for 4-bit weights, the codes times signed (lo − 128) bytes for 8-bit ones.
template <int BITS>
void check_block_sums(bool extreme) {
  constexpr int MR = 3, Stride = 8;
  alignas(64) uint8_t wb[8][64];
  alignas(16) int32_t ac[16 * Stride];
  for (auto& g : wb) {
    for (uint8_t& x : g) x = extreme ? (BITS == 4 ? 15 : 255) : static_cast<uint8_t>(rng() % (BITS == 4 ? 16 : 256));
  }
  int8_t* bytes = reinterpret_cast<int8_t*>(ac);
  for (int i = 0; i < 16 * Stride * 4; ++i) {
    const bool high = i < 8 * Stride * 4;
    if (extreme) {
      bytes[i] = high ? -128 : (BITS == 4 ? static_cast<int8_t>(255) : -128);
    } else {
      bytes[i] = static_cast<int8_t>(rng());
    }
  }
  __m512i w[8];
  for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(wb[g]);
  __m512i acc[MR];
  kvscope_pair_vnni::block_sums_avx2<MR, BITS, Stride>(w, ac, acc);
  for (int m = 0; m < MR; ++m) {
    I16 want;
    for (int n = 0; n < 16; ++n) {
      int64_t hi = 0, lo = 0;
      for (int g = 0; g < 8; ++g) {
        const int8_t* h = reinterpret_cast<const int8_t*>(&ac[g * Stride + m]);
        const int8_t* l = reinterpret_cast<const int8_t*>(&ac[(8 + g) * Stride + m]);
        for (int j = 0; j < 4; ++j) {
          const int u = wb[g][4 * n + j];
          hi += int64_t{u} * h[j];
          lo += BITS == 4 ? int64_t{static_cast<uint8_t>(l[j])} * static_cast<int8_t>(u) : int64_t{u} * l[j];
        }
      }
      want.v[n] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(hi * 256 + lo)));
    }
    expect(BITS == 4 ? "block_sums_avx2<4>" : "block_sums_avx2<8>", out(acc[m]), want);
  }
}

void check_conversions() {
  uint16_t halves[16];
  for (uint16_t& h : halves) h = static_cast<uint16_t>(rng());
  F16 w;
  for (int i = 0; i < 16; ++i) w.v[i] = _cvtsh_ss(halves[i]);
  expect("cvtph_ps", out(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves)))), w);
  const I16 a = rand_i();
  for (int i = 0; i < 16; ++i) w.v[i] = static_cast<float>(a.v[i]);
  expect("cvtepi32_ps", out(_mm512_cvtepi32_ps(load(a))), w);
  const F16 f = rand_f();
  I16 wi;
  for (int i = 0; i < 16; ++i) {
    const float r = std::nearbyint(f.v[i]);
    wi.v[i] = r >= -2147483648.f && r < 2147483648.f ? static_cast<int32_t>(r) : INT32_MIN;
  }
  expect("cvtps_epi32", out(_mm512_cvtps_epi32(load(f))), wi);
  uint8_t bytes[32];
  for (uint8_t& x : bytes) x = static_cast<uint8_t>(rng());
  const __m256i b32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  int16_t w16[32];
  for (int i = 0; i < 32; ++i) w16[i] = bytes[i];
  I16 w16_as32;
  std::memcpy(w16_as32.v, w16, sizeof(w16));
  expect("cvtepu8_epi16", out(_mm512_cvtepu8_epi16(b32)), w16_as32);
  for (int i = 0; i < 16; ++i) wi.v[i] = bytes[i];
  expect("cvtepu8_epi32", out(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)))), wi);
  uint16_t u16[16];
  std::memcpy(u16, bytes, sizeof(u16));
  for (int i = 0; i < 16; ++i) wi.v[i] = u16[i];
  expect("cvtepu16_epi32", out(_mm512_cvtepu16_epi32(b32)), wi);
  alignas(16) int8_t got8[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(got8), _mm512_cvtepi32_epi8(load(a)));
  I16 g8, w8;
  for (int i = 0; i < 16; ++i) {
    g8.v[i] = got8[i];
    w8.v[i] = static_cast<int8_t>(static_cast<uint32_t>(a.v[i]) & 0xFF);  // vpmovdb truncates
  }
  expect("cvtepi32_epi8", g8, w8);
  int16_t got16[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(got16), _mm512_cvtepi32_epi16(load(a)));
  for (int i = 0; i < 16; ++i) {
    g8.v[i] = got16[i];
    w8.v[i] = static_cast<int16_t>(static_cast<uint32_t>(a.v[i]) & 0xFFFF);  // vpmovdw truncates
  }
  expect("cvtepi32_epi16", g8, w8);
}

uint32_t wrap(int64_t v) { return static_cast<uint32_t>(static_cast<uint64_t>(v)); }

void check_integers() {
  const I16 a = rand_i(), b = rand_i(), c = rand_i();
  I16 w;
  for (int i = 0; i < 16; ++i) w.v[i] = static_cast<int32_t>(wrap(int64_t{a.v[i]} + b.v[i]));
  expect("add_epi32", out(_mm512_add_epi32(load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = static_cast<int32_t>(wrap(int64_t{a.v[i]} - b.v[i]));
  expect("sub_epi32", out(_mm512_sub_epi32(load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) w.v[i] = a.v[i] & b.v[i];
  expect("and_si512", out(_mm512_and_si512(load(a), load(b))), w);
  for (int n : {0, 1, 4, 7, 8, 16, 31}) {
    for (int i = 0; i < 16; ++i) w.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) << n);
    expect("slli_epi32", out(_mm512_slli_epi32(load(a), n)), w);
    for (int i = 0; i < 16; ++i) w.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) >> n);
    expect("srli_epi32", out(_mm512_srli_epi32(load(a), n)), w);
    for (int i = 0; i < 16; ++i) w.v[i] = a.v[i] >> n;  // arithmetic (GCC)
    expect("srai_epi32", out(_mm512_srai_epi32(load(a), n)), w);
  }
  uint16_t h[32], wh[32];
  std::memcpy(h, a.v, sizeof(h));
  for (int i = 0; i < 32; ++i) wh[i] = static_cast<uint16_t>(h[i] >> 4);
  std::memcpy(w.v, wh, sizeof(wh));
  expect("srli_epi16", out(_mm512_srli_epi16(load(a), 4)), w);
  int64_t sum = 0;
  for (int32_t x : a.v) sum += x;
  ++checked;
  if (_mm512_reduce_add_epi32(load(a)) != static_cast<int32_t>(wrap(sum))) {
    std::printf("reduce_add_epi32 differs\n");
    ++failures;
  }
  int16_t a16[32], b16[32];
  std::memcpy(a16, a.v, sizeof(a16));
  std::memcpy(b16, b.v, sizeof(b16));
  for (int i = 0; i < 16; ++i) {  // vpdpwssd: src + two int16 products, modulo 2^32
    w.v[i] = static_cast<int32_t>(
        wrap(int64_t{c.v[i]} + int64_t{a16[2 * i]} * b16[2 * i] + int64_t{a16[2 * i + 1]} * b16[2 * i + 1]));
  }
  expect("dpwssd_epi32", out(_mm512_dpwssd_epi32(load(c), load(a), load(b))), w);
  uint8_t u8[64];
  int8_t s8[64];
  std::memcpy(u8, a.v, sizeof(u8));
  std::memcpy(s8, b.v, sizeof(s8));
  for (int i = 0; i < 16; ++i) {  // vpdpbusd: src + four u8 × s8 products, modulo 2^32, no saturation
    int64_t s = c.v[i];
    for (int j = 0; j < 4; ++j) s += int64_t{u8[4 * i + j]} * s8[4 * i + j];
    w.v[i] = static_cast<int32_t>(wrap(s));
  }
  expect("dpbusd_epi32", out(_mm512_dpbusd_epi32(load(c), load(a), load(b))), w);
  uint16_t table[1024];
  for (uint16_t& t : table) t = static_cast<uint16_t>(rng());
  I16 idx;
  for (int32_t& x : idx.v) x = static_cast<int32_t>(rng() % 1000);
  for (int i = 0; i < 16; ++i) std::memcpy(&w.v[i], reinterpret_cast<const char*>(table) + 2 * idx.v[i], 4);
  expect("i32gather_epi32", out(_mm512_i32gather_epi32(load(idx), table, 2)), w);
  I16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = i * 3 - 7;
  expect("setr_epi32", out(_mm512_setr_epi32(-7, -4, -1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38)), r);
  for (int i = 0; i < 16; ++i) r.v[i] = 0x05050505;
  expect("set1_epi8", out(_mm512_set1_epi8(5)), r);
}

}  // namespace

int main() {
  for (int round = 0; round < 2000; ++round) {
    check_floats();
    check_conversions();
    check_integers();
    check_block_sums<4>(false);
    check_block_sums<8>(false);
  }
  check_block_sums<4>(true);
  check_block_sums<8>(true);
  check_reduce_max_order();
  // vpdpbusd at its extremes: 255 · -128 four times per lane, onto INT32_MIN and INT32_MAX
  I16 c, a, b, w;
  for (int i = 0; i < 16; ++i) {
    c.v[i] = i % 2 ? INT32_MAX : INT32_MIN;
    a.v[i] = -1;  // four bytes of 255
    b.v[i] = static_cast<int32_t>(0x80808080u);  // four bytes of -128
    w.v[i] = static_cast<int32_t>(wrap(int64_t{c.v[i]} + 4 * 255 * -128));
  }
  expect("dpbusd_epi32 extremes", out(_mm512_dpbusd_epi32(load(c), load(a), load(b))), w);
  for (int i = 0; i < 16; ++i) {  // vpdpwssd: (-32768)² twice wraps
    a.v[i] = static_cast<int32_t>(0x80008000u);
    w.v[i] = static_cast<int32_t>(wrap(int64_t{c.v[i]} + 2 * int64_t{32768} * 32768));
  }
  expect("dpwssd_epi32 extremes", out(_mm512_dpwssd_epi32(load(c), load(a), load(a))), w);
  std::printf("checked %ld\n", checked);
  return failures == 0 ? 0 : 1;
}
