// kvscope CPU decode kernels: block-quantized GEMV with AVX-512 VNNI, and one decode step of a
// Llama-family decoder (RMSNorm, RoPE, paged attention read in place, SwiGLU) in one call.
//
// Weight format ("pair blocks"): a row of K weights is K/64 pairs of 32-weight blocks (GGUF Q4_1 / Q8_0
// granularity). Each weight is w = d * u + m with u unsigned (0..15 for 4-bit, 0..255 for 8-bit) and d, m
// float16 per block: GGUF Q4_1 is exactly this (u = q, m = min), Q4_0 is m = -8 d, Q8_0 is u = q + 128,
// m = -128 d. Inside a pair the 64 codes are stored in "lane order": byte 4l + j (lane l = 2k + b) holds
// weight 4k + j of block b, so that one vpdpbusd sums 4 products of one block per 32-bit lane and the
// per-block scales are a broadcast of 2 floats. 4-bit: 32 bytes per pair, byte j = u[j] | u[j + 32] << 4.
// Scales: float16 [rows, pairs, 4] = {d_A, d_B, m_A, m_B}.
//
// Activations are quantized per 32-block to int16 (x ≈ d_x · q, d_x = max|x| / 32767; the form of llama.cpp's
// Q8_1 with 16-bit codes: ggml-quants.c quantize_row_q8_1, vec_dot_q4_1_q8_1):
//   Σ_j w_j x_j = d·d_x·Σ u_j q_j + m·(d_x·Σ q_j)
// The integer dot products run on vpdpwssd (16-bit weight codes × 16-bit activations, pairs summed per 32-bit
// lane). int8 activations (vpdpbusd, as llama.cpp) failed the int4 format's perplexity bound on SmolLM2-135M
// (docs/benchmarks.md "Fused CPU decode step"); 16-bit codes make the activation
// rounding ~1e-5 relative, at ~1.5x the instructions per weight (the GEMVs stay close to memory-bound).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_pair_gemm.h"
#include "cpu_pair_vnni.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && !(defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__) && \
                               defined(__F16C__))
#error "kvscope CPU decode kernels need AVX-512 F/BW/DQ/VNNI and F16C, or AVX2 without AVX-512 (cpu_simd_avx2.h)"
#endif

namespace {

using kvscope_simd::exp16;

constexpr int64_t kPair = 64;
constexpr int kMaxRowsPerPass = 4;
constexpr int64_t kPrefetchRows = 32;

struct QuantizedRows {
  std::vector<int16_t> q;  // [n, K] lane order per pair
  std::vector<float> ds;   // [n, P, 4] = {d_A, d_B, s_A, s_B}, s = d * Σ q
};

constexpr float kQMax = 32767.f;

// x [n, K] float32 → int16 per 32-block (module comment), laid out in each pair's lane order.
QuantizedRows quantize_rows(const float* x, int64_t n, int64_t K) {
  const int64_t P = K / kPair;
  QuantizedRows out{std::vector<int16_t>(n * K), std::vector<float>(n * P * 4)};
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t p = 0; p < P; ++p) {
      const float* xp = x + i * K + p * kPair;
      int16_t* qp = out.q.data() + i * K + p * kPair;
      float* ds = out.ds.data() + (i * P + p) * 4;
      for (int b = 0; b < 2; ++b) {
        const float* xb = xp + 32 * b;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / kQMax;
        const float id = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
          const int v = static_cast<int>(std::nearbyint(xb[j] * id));
          qp[4 * (2 * (j / 4) + b) + (j % 4)] = static_cast<int16_t>(v);
          sum += v;
        }
        ds[b] = d;
        ds[2 + b] = d * static_cast<float>(sum);
      }
    }
  }
  return out;
}

// The 64 codes of pair p of a row as two vectors of 32 16-bit codes (lane order: codes 0-31, then 32-63).
template <int BITS>
inline void load_codes(const uint8_t* w, int64_t p, __m512i& lo, __m512i& hi) {
  if constexpr (BITS == 4) {
    // 32 bytes hold u[j] (low nibble) and u[j + 32] (high nibble)
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    lo = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, low4));
    hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
  } else {
    lo = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64)));
    hi = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + 32)));
  }
}

// y[i, r] = Σ_k w[r, k] x[i, k] (+ bias[r]) for RB weight rows from r and NR activation rows from row0:
// RB × NR independent accumulators (the loop-carried FMA latency, not the instruction count, bounds one row).
// vpdpwssd over 32 codes sums codes 2m and 2m+1 into 32-bit lane m: in lane order lanes m = 4t, 4t+1 belong to
// block A and 4t+2, 4t+3 to block B, so each pair's scale vector is {s_A, s_A, s_B, s_B} four times.
template <int NR, int RB, int BITS>
inline void gemv_block(const uint8_t* W, const uint16_t* S, int64_t P, const QuantizedRows& xq, int64_t row0,
                       int64_t K, int64_t r, float* Y, int64_t ldy, const float* bias) {
  constexpr int64_t kPairBytes = BITS == 4 ? 32 : 64;
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[RB][NR];
  __m128 macc[RB][NR];
  for (int b = 0; b < RB; ++b) {
    for (int i = 0; i < NR; ++i) {
      acc[b][i] = _mm512_setzero_ps();
      macc[b][i] = _mm_setzero_ps();
    }
  }
  for (int64_t p = 0; p < P; ++p) {
    __m512i wlo[RB], whi[RB];
    __m128 wd[RB];
    __m128 wm[RB];
    for (int b = 0; b < RB; ++b) {
      // software prefetch kPrefetchRows rows ahead: the hardware prefetcher alone left these GEMVs at about
      // half of the DRAM bandwidth (docs/benchmarks.md "Fused CPU decode step")
      _mm_prefetch(reinterpret_cast<const char*>(W + (r + b + kPrefetchRows) * P * kPairBytes + p * kPairBytes),
                   _MM_HINT_T1);
      if (p % 8 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(S + ((r + b + kPrefetchRows) * P + p) * 4), _MM_HINT_T1);
      }
      load_codes<BITS>(W + (r + b) * P * kPairBytes, p, wlo[b], whi[b]);
      const __m128 sc = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(S + ((r + b) * P + p) * 4)));
      wd[b] = sc;                       // d_A d_B m_A m_B
      wm[b] = _mm_movehl_ps(sc, sc);    // m_A m_B m_A m_B
    }
    for (int i = 0; i < NR; ++i) {
      const int64_t row = row0 + i;
      const int16_t* q = xq.q.data() + row * K + p * kPair;
      const __m512i qlo = _mm512_loadu_si512(q);
      const __m512i qhi = _mm512_loadu_si512(q + 32);
      const __m128 dsv = _mm_loadu_ps(xq.ds.data() + (row * P + p) * 4);
      const __m128 as = _mm_movehl_ps(dsv, dsv);  // s_A s_B s_A s_B
      for (int b = 0; b < RB; ++b) {
        const __m128 dd = _mm_mul_ps(wd[b], dsv);  // d_A·d_xA, d_B·d_xB, …
        const __m512 scale = _mm512_broadcast_f32x4(_mm_unpacklo_ps(dd, dd));  // s_A s_A s_B s_B × 4
        // both halves into one int32 lane: 4 products of ≤ 255 · 32767 each stay far below 2^31
        const __m512i dot = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, wlo[b], qlo), whi[b], qhi);
        acc[b][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[b][i]);
        macc[b][i] = _mm_fmadd_ps(wm[b], as, macc[b][i]);
      }
    }
  }
  for (int b = 0; b < RB; ++b) {
    for (int i = 0; i < NR; ++i) {
      // macc holds each block's min term twice (lanes 0-1 and 2-3)
      const __m128 m2 = _mm_add_ps(macc[b][i], _mm_movehl_ps(macc[b][i], macc[b][i]));
      float y = _mm512_reduce_add_ps(acc[b][i]) + 0.5f * (_mm_cvtss_f32(m2) + _mm_cvtss_f32(_mm_shuffle_ps(m2, m2, 1)));
      if (bias != nullptr) y += bias[r + b];
      Y[(row0 + i) * ldy + r + b] = y;
    }
  }
}

template <int NR, int BITS>
void gemv_rows(const uint8_t* W, const uint16_t* S, int64_t P, const QuantizedRows& xq, int64_t row0, int64_t K,
               int64_t r0, int64_t r1, float* Y, int64_t ldy, const float* bias) {
  constexpr int RB = NR <= 2 ? 4 : 2;
  int64_t r = r0;
  for (; r + RB <= r1; r += RB) gemv_block<NR, RB, BITS>(W, S, P, xq, row0, K, r, Y, ldy, bias);
  for (; r < r1; ++r) gemv_block<NR, 1, BITS>(W, S, P, xq, row0, K, r, Y, ldy, bias);
}

template <int BITS>
void gemv_pass(const uint8_t* W, const uint16_t* S, int64_t P, const QuantizedRows& xq, int64_t row0, int nr,
               int64_t K, int64_t r0, int64_t r1, float* Y, int64_t ldy, const float* bias) {
  switch (nr) {
    case 1: gemv_rows<1, BITS>(W, S, P, xq, row0, K, r0, r1, Y, ldy, bias); break;
    case 2: gemv_rows<2, BITS>(W, S, P, xq, row0, K, r0, r1, Y, ldy, bias); break;
    case 3: gemv_rows<3, BITS>(W, S, P, xq, row0, K, r0, r1, Y, ldy, bias); break;
    default: gemv_rows<4, BITS>(W, S, P, xq, row0, K, r0, r1, Y, ldy, bias); break;
  }
}

// Y [n, N] = X [n, K] · Wᵀ for a pair-block weight of N rows (float32 in and out), rows split over threads.
void qgemv_raw(const float* X, int64_t n, int64_t K, const uint8_t* W, const uint16_t* S, int64_t N, int bits,
               const float* bias, float* Y) {
  const QuantizedRows xq = quantize_rows(X, n, K);
  const int64_t P = K / kPair;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row0 = 0; row0 < n; row0 += kMaxRowsPerPass) {
      const int nr = static_cast<int>(std::min<int64_t>(kMaxRowsPerPass, n - row0));
      if (bits == 4) {
        gemv_pass<4>(W, S, P, xq, row0, nr, K, begin, end, Y, N, bias);
      } else {
        gemv_pass<8>(W, S, P, xq, row0, nr, K, begin, end, Y, N, bias);
      }
    }
  });
}

struct PairWeight {
  const uint8_t* w;
  const uint16_t* s;
  int64_t rows;
  int64_t cols;
  int bits;
};

PairWeight pair_weight(const at::Tensor& w, const at::Tensor& s) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2, "weight codes: uint8 [N, bytes]");
  TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.dim() == 3 && s.size(2) == 4,
              "weight scales: float16 [N, K/64, 4]");
  TORCH_CHECK(s.size(0) == w.size(0), "codes and scales disagree on rows");
  const int64_t P = s.size(1);
  int bits;
  if (w.size(1) == P * 32) {
    bits = 4;
  } else {
    TORCH_CHECK(w.size(1) == P * 64, "codes must hold 32 (4-bit) or 64 (8-bit) bytes per pair of blocks");
    bits = 8;
  }
  return {w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>()), w.size(0), P * kPair,
          bits};
}

// A weight in the VNNI blocks of cpu_pair_vnni.h (kernels/cpu_decode.py VnniBlocks).
struct VnniWeight {
  const uint8_t* codes;
  const uint16_t* dm;
  int64_t tiles;
  int64_t cols;
  int bits;
};

VnniWeight vnni_weight(const at::Tensor& codes, const at::Tensor& dm) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 &&
                  (codes.size(2) == 256 || codes.size(2) == 512),
              "VNNI codes: contiguous uint8 [N/16, K/32, 256 (4-bit) or 512 (8-bit)]");
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.dim() == 4 && dm.size(0) == codes.size(0) &&
                  dm.size(1) == codes.size(1) && dm.size(2) == 2 && dm.size(3) == 16,
              "VNNI dm: contiguous float16 [N/16, K/32, 2, 16]");
  return {codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()), codes.size(0),
          codes.size(1) * 32, codes.size(2) == 256 ? 4 : 8};
}

// y [n, N] = x [n, K] · Wᵀ: the GEMV below ``tile_rows`` rows (0: always), else the small-batch matmul on
// tiles of kind ``tile``: 1 float32 or 2 bfloat16 (cpu_pair_gemm.h, from the pair blocks), 3 int16
// (cpu_pair_vnni.h: the GEMV's 16-bit codes on vpdpbusd, from the same weights' VNNI blocks ``vw``); the
// start-up probe measures the crossover and the kind (engine/platform/kernel_probe.py).
void gemv(const PairWeight& pw, const float* x, int64_t n, float* y, int64_t tile_rows = 0, int64_t tile = 1,
          const float* bias = nullptr, const VnniWeight* vw = nullptr) {
  if (tile_rows > 0 && n >= tile_rows && tile == 3) {
    TORCH_CHECK(vw != nullptr && vw->tiles * 16 == pw.rows && vw->cols == pw.cols && vw->bits == pw.bits,
                "int16 tiles need the weight's VNNI blocks");
    kvscope_pair_vnni::vnni_gemm(x, n, pw.cols, vw->codes, vw->dm, vw->tiles, vw->bits, bias, y);
    return;
  }
  if (tile_rows > 0 && n >= tile_rows) {
    kvscope_pair_gemm::pair_gemm(x, n, pw.cols, pw.w, pw.s, pw.rows, pw.bits, static_cast<kvscope_pair_gemm::Tile>(tile),
                                 bias, y);
    return;
  }
  qgemv_raw(x, n, pw.cols, pw.w, pw.s, pw.rows, pw.bits, bias, y);
}

// Whether the bfloat16 tiles of cpu_pair_gemm.h are built (AVX512-BF16 at compile time).
bool has_bf16_tiles() {
#if defined(KVSCOPE_PAIR_GEMM_BF16)
  return true;
#else
  return false;
#endif
}

// x [M, K] (float32 or bfloat16) → float32 [M, N]; the tile matmul from ``tile_rows`` rows (gemv above).
at::Tensor qgemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t tile_rows, int64_t tile) {
  TORCH_CHECK(tile == 1 || (tile == 2 && has_bf16_tiles()),
              "tile: 1 (float32) or 2 (bfloat16, where built); int16 tiles: vnni_gemm");
  const PairWeight pw = pair_weight(w, s);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == pw.cols, "x must be [M, ", pw.cols, "]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), pw.rows}, x.options().dtype(at::kFloat));
  if (x.size(0) > 0) gemv(pw, xf.data_ptr<float>(), x.size(0), y.data_ptr<float>(), tile_rows, tile);
  return y;
}


// x [M, K] (float32 or bfloat16) → float32 [M, N] on the weight's VNNI blocks (cpu_pair_vnni.h), every row.
at::Tensor vnni_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm) {
  const VnniWeight vw = vnni_weight(codes, dm);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == vw.cols, "x must be [M, ", vw.cols, "]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), vw.tiles * 16}, x.options().dtype(at::kFloat));
  if (x.size(0) > 0) {
    kvscope_pair_vnni::vnni_gemm(xf.data_ptr<float>(), x.size(0), vw.cols, vw.codes, vw.dm, vw.tiles, vw.bits, nullptr,
                                 y.data_ptr<float>());
  }
  return y;
}

// ---- the decode step -------------------------------------------------------------------------------------

// y = x / sqrt(mean(x²) + eps) * weight, per row of [n, H] (float32; Zhang & Sennrich 2019).
void rms_norm(const float* x, const float* weight, int64_t n, int64_t H, float eps, float* y) {
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * H;
    float ss = 0.f;
    for (int64_t j = 0; j < H; ++j) ss += xi[j] * xi[j];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t j = 0; j < H; ++j) y[i * H + j] = xi[j] * inv * weight[j];
  }
}

// NeoX "rotate half" RoPE (HF apply_rotary_pos_emb) of `heads` heads of one token, in place.
void rope(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * D;
    for (int64_t j = 0; j < half; ++j) {
      const float a = xh[j], b = xh[j + half];
      xh[j] = a * cos[j] - b * sin[j];
      xh[j + half] = b * cos[j + half] + a * sin[j + half];
    }
  }
}

template <typename T>
struct KVView {
  T* base;            // [2, slots, KVH, D]
  int64_t slots;
  int64_t KVH;
  int64_t D;
  T* key(int64_t slot, int64_t g) const { return base + (slot * KVH + g) * D; }
  T* value(int64_t slot, int64_t g) const { return base + ((slots + slot) * KVH + g) * D; }
};

// SiLU(g) · u over n elements (SwiGLU, Shazeer 2020), 16 lanes at a time.
void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 gv = _mm512_loadu_ps(g + j);
    const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + j)));
  }
  for (; j < n; ++j) out[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
}

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) { return c10::BFloat16(v); }  // round to nearest even

struct StepDims {
  int64_t n, H, NH, KVH, D, I, V;
  float eps, scale;
};

template <typename T>
void decode_layers(const StepDims& d, float* hidden, const int64_t* positions, const float* inv_freq,
                   const std::vector<at::Tensor>& norms, const std::vector<PairWeight>& mats,
                   const std::vector<at::Tensor>& caches, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const int64_t* slots, int64_t tile_rows, int64_t tile, const std::vector<VnniWeight>& vnni) {
  // kvscope_cpu::paged_decode_attention (cpu_attention.cpp), through the dispatcher (one call per layer)
  static const auto attention_op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("kvscope_cpu::paged_decode_attention", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  auto attention = [&](const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                       const at::Tensor& lens, double scale) { return attention_op.call(q, cache, tables, lens, scale); };
  const int64_t n = d.n, H = d.H, D = d.D, NH = d.NH, KVH = d.KVH, I = d.I;
  const int64_t qkv_width = (NH + 2 * KVH) * D;
  std::vector<float> normed(n * H), qkv(n * qkv_width), attn(n * NH * D), proj(n * H), gate_up(n * 2 * I),
      act(n * I), cos(n * D), sin(n * D);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < D / 2; ++j) {
      const float f = static_cast<float>(positions[i]) * inv_freq[j];
      cos[i * D + j] = cos[i * D + j + D / 2] = std::cos(f);
      sin[i * D + j] = sin[i * D + j + D / 2] = std::sin(f);
    }
  }
  const int64_t layers = static_cast<int64_t>(caches.size());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& cache = caches[l];
    const int64_t block_size = cache.size(2);
    KVView<T> kv{cache.data_ptr<T>(), cache.size(1) * block_size, KVH, D};
    rms_norm(hidden, norms[2 * l].data_ptr<float>(), n, H, d.eps, normed.data());
    gemv(mats[4 * l], normed.data(), n, qkv.data(), tile_rows, tile, nullptr,
         vnni.empty() ? nullptr : &vnni[4 * l]);
    for (int64_t i = 0; i < n; ++i) {
      float* row = qkv.data() + i * qkv_width;
      rope(row, NH + KVH, D, cos.data() + i * D, sin.data() + i * D);  // q heads then k heads
      const float* k = row + NH * D;
      const float* v = k + KVH * D;
      for (int64_t g = 0; g < KVH; ++g) {
        T* kd = kv.key(slots[i], g);
        T* vd = kv.value(slots[i], g);
        for (int64_t j = 0; j < D; ++j) {
          kd[j] = from_float<T>(k[g * D + j]);
          vd[j] = from_float<T>(v[g * D + j]);
        }
      }
    }
    {  // decode attention over the paged cache in place: kernels/csrc/cpu_attention.cpp's op
      const at::Tensor q = at::from_blob(qkv.data(), {n, NH, D}, {qkv_width, D, 1}, at::TensorOptions().dtype(at::kFloat));
      const at::Tensor out = attention(q, cache, block_tables, seq_lens, static_cast<double>(d.scale));  // [n, NH, D]
      std::memcpy(attn.data(), out.data_ptr<float>(), sizeof(float) * n * NH * D);
    }
    gemv(mats[4 * l + 1], attn.data(), n, proj.data(), tile_rows, tile, nullptr,
         vnni.empty() ? nullptr : &vnni[4 * l + 1]);
    for (int64_t j = 0; j < n * H; ++j) hidden[j] += proj[j];
    rms_norm(hidden, norms[2 * l + 1].data_ptr<float>(), n, H, d.eps, normed.data());
    gemv(mats[4 * l + 2], normed.data(), n, gate_up.data(), tile_rows, tile, nullptr,
         vnni.empty() ? nullptr : &vnni[4 * l + 2]);
    for (int64_t i = 0; i < n; ++i) {
      silu_mul(gate_up.data() + i * 2 * I, gate_up.data() + i * 2 * I + I, I, act.data() + i * I);
    }
    gemv(mats[4 * l + 3], act.data(), n, proj.data(), tile_rows, tile, nullptr,
         vnni.empty() ? nullptr : &vnni[4 * l + 3]);
    for (int64_t j = 0; j < n * H; ++j) hidden[j] += proj[j];
  }
}

// One decode step (every row one new token): embedding → layers → final norm → logits float32 [n, V].
at::Tensor decode_step(const at::Tensor& token_ids, const at::Tensor& positions, const at::Tensor& embed,
                       const at::Tensor& inv_freq, at::TensorList norms, at::TensorList codes,
                       at::TensorList scales, const at::Tensor& final_norm, const at::Tensor& head_codes,
                       const at::Tensor& head_scales, at::TensorList kv_caches, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, const at::Tensor& slot_mapping, int64_t num_heads,
                       int64_t num_kv_heads, double eps, int64_t tile_rows, int64_t tile,
                       at::TensorList tile_codes, at::TensorList tile_dm) {
  TORCH_CHECK(tile == 1 || tile == 3 || (tile == 2 && has_bf16_tiles()),
              "tile: 1 (float32), 2 (bfloat16, where built) or 3 (int16)");
  TORCH_CHECK(tile_codes.size() == tile_dm.size(), "decode_step: tile_codes and tile_dm disagree");
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(norms.size() == static_cast<size_t>(2 * layers) && codes.size() == static_cast<size_t>(4 * layers) &&
                  scales.size() == codes.size(), "decode_step: 2 norms and 4 matrices per layer");
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slot_mapping.scalar_type() == at::kLong, "token_ids, positions, slot_mapping: int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables, seq_lens: int32");
  const int64_t n = token_ids.size(0);
  const int64_t H = embed.size(1);
  const at::Tensor& cache0 = kv_caches[0];
  StepDims d{n, H, num_heads, num_kv_heads, cache0.size(4), codes[2].size(0) / 2, head_codes.size(0),
             static_cast<float>(eps), 1.f / std::sqrt(static_cast<float>(cache0.size(4)))};
  TORCH_CHECK(d.D == 64 || d.D == 128, "head_dim must be 64 or 128");
  std::vector<PairWeight> mats;
  for (size_t m = 0; m < codes.size(); ++m) mats.push_back(pair_weight(codes[m], scales[m]));
  const PairWeight head = pair_weight(head_codes, head_scales);
  // the int16 tiles' VNNI blocks: 4 per layer, then the head's (empty for the other tile kinds)
  std::vector<VnniWeight> vnni;
  if (tile == 3 && tile_rows > 0) {
    TORCH_CHECK(tile_codes.size() == codes.size() + 1, "decode_step: int16 tiles need 4 VNNI blocks per layer and the head's");
    for (size_t m = 0; m < tile_codes.size(); ++m) vnni.push_back(vnni_weight(tile_codes[m], tile_dm[m]));
  }
  std::vector<at::Tensor> norm_list(norms.begin(), norms.end());
  std::vector<at::Tensor> cache_list(kv_caches.begin(), kv_caches.end());
  for (const auto& t : norm_list) TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "norms: float32");
  const at::Tensor ids = token_ids.contiguous();
  TORCH_CHECK(embed.dim() == 2 && (embed.scalar_type() == at::kBFloat16 || embed.scalar_type() == at::kFloat),
              "embedding: bfloat16 or float32 [vocab, hidden]");
  // Any strides: a tied float32 embedding is a column-major view of the LM head's packed copy
  // (engine/platform/cpu.py prepare_for_cpu); its rows are then gathered element by element (H loads).
  const int64_t row_stride = embed.stride(0), col_stride = embed.stride(1);
  at::Tensor hidden = at::empty({n, H}, embed.options().dtype(at::kFloat));
  for (int64_t i = 0; i < n; ++i) {  // the rows of this step's tokens (bfloat16 → float32 is exact)
    const int64_t id = ids.data_ptr<int64_t>()[i];
    TORCH_CHECK(id >= 0 && id < embed.size(0), "token id out of range");
    float* dst = hidden.data_ptr<float>() + i * H;
    if (embed.scalar_type() == at::kFloat) {
      const float* src = embed.data_ptr<float>() + id * row_stride;
      if (col_stride == 1) {
        std::memcpy(dst, src, H * sizeof(float));
      } else {
        for (int64_t j = 0; j < H; ++j) dst[j] = src[j * col_stride];
      }
    } else {
      const c10::BFloat16* src = embed.data_ptr<c10::BFloat16>() + id * row_stride;
      for (int64_t j = 0; j < H; ++j) dst[j] = static_cast<float>(src[j * col_stride]);
    }
  }
  const at::Tensor tables = block_tables.contiguous();
  if (cache0.scalar_type() == at::kBFloat16) {
    decode_layers<c10::BFloat16>(d, hidden.data_ptr<float>(), positions.contiguous().data_ptr<int64_t>(),
                                 inv_freq.contiguous().data_ptr<float>(), norm_list, mats, cache_list, tables,
                                 seq_lens.contiguous(), slot_mapping.contiguous().data_ptr<int64_t>(), tile_rows, tile, vnni);
  } else {
    TORCH_CHECK(cache0.scalar_type() == at::kFloat, "KV cache: bfloat16 or float32");
    decode_layers<float>(d, hidden.data_ptr<float>(), positions.contiguous().data_ptr<int64_t>(),
                         inv_freq.contiguous().data_ptr<float>(), norm_list, mats, cache_list, tables,
                         seq_lens.contiguous(), slot_mapping.contiguous().data_ptr<int64_t>(), tile_rows, tile, vnni);
  }
  at::Tensor normed = at::empty({n, H}, hidden.options());
  rms_norm(hidden.data_ptr<float>(), final_norm.contiguous().data_ptr<float>(), n, H, d.eps, normed.data_ptr<float>());
  at::Tensor logits = at::empty({n, head.rows}, hidden.options());
  gemv(head, normed.data_ptr<float>(), n, logits.data_ptr<float>(), tile_rows, tile, nullptr,
       vnni.empty() ? nullptr : &vnni.back());
  return logits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m) {
  m.def("qgemv(Tensor x, Tensor codes, Tensor scales, int tile_rows=0, int tile=1) -> Tensor");
  m.def("has_bf16_tiles() -> bool", &has_bf16_tiles);
  m.def("decode_step(Tensor token_ids, Tensor positions, Tensor embed, Tensor inv_freq, Tensor[] norms, "
        "Tensor[] codes, Tensor[] scales, Tensor final_norm, Tensor head_codes, Tensor head_scales, "
        "Tensor[] kv_caches, Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads, float eps, int tile_rows, int tile, Tensor[] tile_codes, Tensor[] tile_dm) -> Tensor");
  m.def("vnni_gemm(Tensor x, Tensor codes, Tensor dm) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvscope_cpu, CPU, m) {
  m.impl("qgemv", &qgemv);
  m.impl("decode_step", &decode_step);
  m.impl("vnni_gemm", &vnni_gemm);
}
