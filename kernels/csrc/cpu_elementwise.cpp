// kvscope CPU elementwise kernels for bfloat16 activations (so that prefill and batched decode steps come near
// their matmuls' cost). Each replaces a chain of torch ops (one pass over memory instead of 2-7, no temporaries) and
// rounds to bfloat16 where torch's chain rounds, so results equal torch's up to the order of one float32 sum
// in RMSNorm (a rare one-ulp bfloat16 difference):
//
//   rms_norm(x [R, H] bf16, weight [H] bf16, eps) -> [R, H] bf16
//       n = bf16(x · 1/sqrt(mean(x², -1) + eps))  (float32; F.rms_norm without weight, rounded as HF's
//       h.to(dtype));  y = bf16(n · weight)         (HF's weight * h: a bfloat16 multiply)
//   add_rms_norm(x [R, H] bf16, residual [R, H] bf16, weight [H] bf16, eps) -> (sum, y)
//       sum = bf16(x + residual) (torch's bfloat16 add, bit for bit);  y = rms_norm(sum, weight, eps)
//   silu_and_mul(gate_up [R, 2·I] bf16) -> [R, I] bf16
//       SwiGLU (Shazeer 2020): bf16(bf16(silu(g)) · u), bf16(silu(g)) looked up in a table of F.silu over every
//       bfloat16 value (silu_table), then a bfloat16 multiply: bit for bit torch's F.silu(g) * u
//   rope(x [T, heads, D] bf16 (rows may be strided, heads·D contiguous), cos [T, 1, D] bf16,
//        signed_sin [T, 1, D] bf16) -> [T, heads, D] bf16 contiguous
//       RoPE, NeoX "rotate half" layout: bf16(bf16(x·cos) + bf16(roll(x, D/2)·signed_sin)), torch's three
//       bfloat16 ops of engine/models/llama.py apply_rope bit for bit (a product of two bfloat16 is exact in
//       float32, so each step rounds once, as torch's does)
//
// Rows are split over torch's intra-op threads (at::parallel_for) in chunks of at least ROW_GRAIN rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) && !defined(__AVX512BW__)
#error "kvscope CPU elementwise kernels need AVX-512 F/BW, or AVX2 without AVX-512 (cpu_simd_avx2.h)"
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t ROW_GRAIN = 16;

// 16 float32 lanes → 16 bfloat16, round to nearest even (c10::BFloat16's rounding; inputs are never NaN here).
inline __m256i to_bf16_exact(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// The same with AVX512_BF16 (Sapphire Rapids, Zen 4): one VCVTNEPS2BF16 instead of six integer ops. It flushes
// float32 denormals (0 < |v| < 2^-126) to zero where c10 keeps them, so a vector holding one takes the path above.
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) != 0, 0)) return to_bf16_exact(v);  // 0x20: denormal
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return to_bf16_exact(v);
#endif
}

inline __m512 round_bf16(__m512 v) {  // v rounded to bfloat16, as float32
  return kvscope_simd::load16_bits(to_bf16(v));
}

// F.silu of every bfloat16 value (65,536 entries, 128 KiB, computed once by at::silu itself, so a lookup equals
// torch's SwiGLU bit for bit), plus one padding entry for the 32-bit gather of the last one. A gather per 16
// lanes replaced exp + vdivps (docs/benchmarks.md "C++ elementwise ops for prefill").
const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> bits(65536 + 1, 0);
    for (uint32_t v = 0; v < 65536; ++v) bits[v] = static_cast<uint16_t>(v);
    const at::Tensor x = at::from_blob(bits.data(), {65536}, at::TensorOptions().dtype(at::kBFloat16));
    const at::Tensor y = at::silu(x).contiguous();
    std::memcpy(bits.data(), y.const_data_ptr<bf16>(), 65536 * sizeof(uint16_t));
    return bits;
  }();
  return table.data();
}

// silu(x) for 16 bfloat16 bit patterns, as float32 (exact: a bfloat16 widened).
inline __m512 silu16(__m256i raw, const uint16_t* table) {
  const __m512i gathered = _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(raw), table, 2);
  return _mm512_castsi512_ps(_mm512_slli_epi32(gathered, 16));  // the entry is the low half of the 32-bit load
}

inline void store16(bf16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }

// One row: out = bf16(bf16(x · r) · w) with r = 1/sqrt(mean(x²) + eps); x read as float32 from ``src``.
inline void norm_row(const bf16* src, const bf16* w, bf16* out, int64_t h, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < h; j += 16) {
    const __m512 x = kvscope_simd::load16(src + j);
    acc = _mm512_fmadd_ps(x, x, acc);
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(h) + eps);
  const __m512 vr = _mm512_set1_ps(r);
  for (int64_t j = 0; j < h; j += 16) {
    const __m512 n = round_bf16(_mm512_mul_ps(kvscope_simd::load16(src + j), vr));
    store16(out + j, _mm512_mul_ps(n, kvscope_simd::load16(w + j)));
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, name, " must be a CPU bfloat16 tensor");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous [rows, hidden] tensor");
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 1 &&
                  weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight must be a contiguous bfloat16 [hidden] tensor");
  TORCH_CHECK(x.size(1) % 16 == 0, "hidden size must be a multiple of 16, got ", x.size(1));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_weight(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t h = x.size(1);
  const bf16* px = x.const_data_ptr<bf16>();
  const bf16* pw = weight.const_data_ptr<bf16>();
  bf16* po = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, x.size(0), ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) norm_row(px + i * h, pw, po + i * h, h, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  check_weight(x, weight);
  at::Tensor sum = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t h = x.size(1);
  const bf16* px = x.const_data_ptr<bf16>();
  const bf16* pr = residual.const_data_ptr<bf16>();
  const bf16* pw = weight.const_data_ptr<bf16>();
  bf16* ps = sum.mutable_data_ptr<bf16>();
  bf16* po = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, x.size(0), ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = 0; j < h; j += 16) {
        const int64_t k = i * h + j;
        store16(ps + k, _mm512_add_ps(kvscope_simd::load16(px + k), kvscope_simd::load16(pr + k)));
      }
      norm_row(ps + i * h, pw, po + i * h, h, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 32 == 0, "gate_up width must be a multiple of 32, got ", gate_up.size(1));
  at::Tensor out = at::empty({gate_up.size(0), inter}, gate_up.options());
  const bf16* pg = gate_up.const_data_ptr<bf16>();
  bf16* po = out.mutable_data_ptr<bf16>();
  const uint16_t* table = silu_table();
  at::parallel_for(0, gate_up.size(0), ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* g = pg + i * 2 * inter;
      const bf16* u = g + inter;
      for (int64_t j = 0; j < inter; j += 16) {
        const __m512 s = silu16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j)), table);
        store16(po + i * inter + j, _mm512_mul_ps(s, kvscope_simd::load16(u + j)));
      }
    }
  });
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 3, "x must be a CPU bfloat16 "
              "[tokens, heads, head_dim] tensor");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == d, "x must be contiguous within a token (heads · head_dim)");
  TORCH_CHECK(d % 32 == 0, "head_dim must be a multiple of 32, got ", d);
  for (const at::Tensor* table : {&cos, &signed_sin}) {
    TORCH_CHECK(table->scalar_type() == at::kBFloat16 && table->numel() == t * d && table->is_contiguous(),
                "cos and signed_sin must be contiguous bfloat16 [tokens, 1, head_dim] tables");
  }
  at::Tensor out = at::empty({t, heads, d}, x.options());
  const bf16* px = x.const_data_ptr<bf16>();
  const bf16* pc = cos.const_data_ptr<bf16>();
  const bf16* ps = signed_sin.const_data_ptr<bf16>();
  bf16* po = out.mutable_data_ptr<bf16>();
  const int64_t row = x.stride(0), half = d / 2;
  at::parallel_for(0, t, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* c = pc + i * d;
      const bf16* sn = ps + i * d;
      for (int64_t h = 0; h < heads; ++h) {
        const bf16* src = px + i * row + h * d;
        bf16* dst = po + (i * heads + h) * d;
        for (int64_t j = 0; j < d; j += 16) {
          const int64_t rolled = j < half ? j + half : j - half;  // roll(x, D/2)[j] = x[j − D/2 mod D]
          const __m512 a = round_bf16(_mm512_mul_ps(kvscope_simd::load16(src + j), kvscope_simd::load16(c + j)));
          const __m512 b = round_bf16(_mm512_mul_ps(kvscope_simd::load16(src + rolled),
                                                    kvscope_simd::load16(sn + j)));
          store16(dst + j, _mm512_add_ps(a, b));
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvscope_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope", &rope);
}
