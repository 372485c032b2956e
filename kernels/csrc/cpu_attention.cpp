// kvscope CPU decode attention: one query token per request against its context, read from the
// paged KV cache in place (no gather copy), AVX-512, float32 accumulation.
//
//   paged_decode_attention(query [n, H, D] float32|bfloat16, kv_cache [2, num_blocks, block_size, KVH, D]
//                          float32|bfloat16, block_tables int32 [n, W], seq_lens int32 [n], scale)
//     -> [n, H, D] in the query's dtype
//
// Token t of request i lives at slot block_tables[i, t / block_size] * block_size + t % block_size (the layout of
// engine/attention/backend.py). Query head h attends KV head h / (H / KVH) (GQA, as HF repeat_kv).
//
// Work item: one (request, KV head, chunk of up to GB of that KV head's query heads). Each key and value vector
// is loaded once per item and used by all GB heads (GQA sharing). Three passes over the context, as a
// non-streaming softmax (the scores of one item, ≤ seq_len floats per head, stay in L1/L2):
//   1. scores s_t = scale · q·k_t, 16 keys at a time: per key GB dot products as D/16 FMAs into one vector
//      each, then one transpose-and-add tree turns 16 such vectors into the 16 scores (15 shuffle+add steps
//      instead of 16 horizontal reductions);
//   2. p_t = exp(s_t − max) with a vectorised exp (Cody-Waite range reduction x = n·ln2 + r, |r| ≤ ln2/2, a
//      degree-6 Taylor polynomial of e^r, relative error < 2e-7, then p · 2^n by vscalefps);
//   3. out = Σ_t p_t · v_t / Σ_t p_t, GB × D/16 accumulators.
// Results match softmax(q·Kᵀ·scale)·V in float32 to ~1e-6 relative (summation order differs from SDPA).
//
//   write_kv(key [T, KVH, D], value [T, KVH, D] in the cache's dtype (rows may be strided, KVH·D contiguous),
//            kv_cache [2, num_blocks, block_size, KVH, D] (written), slot_mapping int64 [T]) -> ()
//     token t's K and V rows copied to slot slot_mapping[t] of the cache's K and V planes (vLLM's
//     reshape_and_cache for this layout): torch.stack + index_copy_ did the same with a [2, T, KVH, D] temporary
//     (docs/benchmarks.md "C++ elementwise ops for prefill").
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && !(defined(__AVX512BW__) && defined(__AVX512DQ__))
#error "kvscope CPU attention needs AVX-512 F/BW/DQ, or AVX2 without AVX-512 (cpu_simd_avx2.h)"
#endif

namespace {

constexpr int kTile = 16;  // keys per score tile (one zmm of scores)
constexpr int64_t kAhead = 8;  // keys prefetched ahead: blocks are scattered, the hardware prefetcher stops at them

using kvscope_simd::exp16;

template <typename T>
inline __m512 attn_load16(const T* p) { return kvscope_simd::load16<T>(p); }

// r[k] = Σ_lanes v[k] for 16 vectors (module comment, pass 1). After the four levels lane 4u + j holds key
// u + 4j; the final permute puts key k in lane k.
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves: units [a0+a2, a1+a3, b0+b2, b1+b3]
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit units: unit u = key 4i + u (4 partial lanes)
    const __m512 a = w[2 * i], b = w[2 * i + 1];
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int i = 0; i < 2; ++i) {  // within units: lanes 0-1 key 8i + u, lanes 2-3 key 8i + 4 + u
    const __m512 a = x[2 * i], b = x[2 * i + 1];
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

template <typename T>
inline float attn_to_float(T v) { return static_cast<float>(v); }
template <typename T>
inline T attn_from_float(float v);
template <>
inline float attn_from_float<float>(float v) { return v; }
template <>
inline c10::BFloat16 attn_from_float<c10::BFloat16>(float v) { return c10::BFloat16(v); }  // nearest even

// The D elements of the key or value of token t (+ kAhead) into L1, if t + kAhead < seq_len.
template <typename TC>
inline void prefetch_ahead(const TC* base, int64_t kv_stride, const int64_t* slots, int64_t t, int64_t seq_len,
                           int64_t D) {
  const int64_t ahead = t + kAhead;
  if (ahead >= seq_len) return;
  const char* p = reinterpret_cast<const char*>(base + slots[ahead] * kv_stride);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(TC)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

struct PagedKV {
  int64_t slots;      // num_blocks · block_size
  int64_t block_size;
  int64_t KVH;
  int64_t D;
};

// Cache slot of each of a request's seq_len tokens (block_table[t / block_size] · block_size + t % block_size,
// without a division per token: two integer divisions per key were a measurable share of the work).
inline void token_slots(const int32_t* table, int64_t block_size, int64_t seq_len, std::vector<int64_t>& slots) {
  slots.resize(static_cast<size_t>(seq_len));
  int64_t t = 0;
  for (int64_t b = 0; t < seq_len; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * block_size;
    for (int64_t o = 0; o < block_size && t < seq_len; ++o, ++t) slots[t] = base + o;
  }
}

// One work item: GB query heads of one request sharing KV head g, DV = D / 16 vectors per head; q and out are
// float32 [GB, D] (the caller converts the query's dtype: one kernel per cache dtype, D and GB); slots from
// token_slots.
template <typename TC, int DV, int GB>
void attend_group(const float* q, float* out, const TC* cache, const PagedKV& kv, int64_t g, const int64_t* slots,
                  int64_t seq_len, float scale, std::vector<float>& scores) {
  const int64_t D = kv.D;
  const int64_t kv_stride = kv.KVH * D;  // elements between consecutive slots
  const TC* keys = cache + g * D;
  const TC* values = cache + kv.slots * kv_stride + g * D;
  if (seq_len <= 0) {
    for (int64_t j = 0; j < GB * D; ++j) out[j] = 0.f;
    return;
  }
  const int64_t padded = (seq_len + kTile - 1) / kTile * kTile;
  scores.resize(static_cast<size_t>(GB * padded));
  __m512 qv[GB][DV];
  for (int b = 0; b < GB; ++b) {
    for (int v = 0; v < DV; ++v) qv[b][v] = _mm512_mul_ps(_mm512_loadu_ps(q + b * D + 16 * v), _mm512_set1_ps(scale));
  }
  // pass 1: scores
  __m512 vmax[GB];
  for (int b = 0; b < GB; ++b) vmax[b] = _mm512_set1_ps(-INFINITY);
  __m512 part[GB][kTile];
  for (int64_t t0 = 0; t0 < seq_len; t0 += kTile) {
    const int cnt = static_cast<int>(std::min<int64_t>(kTile, seq_len - t0));
    for (int j = 0; j < cnt; ++j) {
      const int64_t t = t0 + j;
      const TC* k = keys + slots[t] * kv_stride;
      prefetch_ahead(keys, kv_stride, slots, t, seq_len, D);
      __m512 kvec[DV];
      for (int v = 0; v < DV; ++v) kvec[v] = attn_load16<TC>(k + 16 * v);
      for (int b = 0; b < GB; ++b) {
        __m512 acc = _mm512_mul_ps(qv[b][0], kvec[0]);
        for (int v = 1; v < DV; ++v) acc = _mm512_fmadd_ps(qv[b][v], kvec[v], acc);
        part[b][j] = acc;
      }
    }
    for (int b = 0; b < GB; ++b) {
      for (int j = cnt; j < kTile; ++j) part[b][j] = _mm512_setzero_ps();
      __m512 s = sum16(part[b]);
      const __mmask16 live = cnt == kTile ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cnt) - 1);
      s = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), s);
      vmax[b] = _mm512_max_ps(vmax[b], s);
      _mm512_storeu_ps(scores.data() + b * padded + t0, s);
    }
  }
  // pass 2: p = exp(s − max) (padding lanes: exp(−inf) → ~0, never summed past seq_len anyway)
  float inv_sum[GB];
  for (int b = 0; b < GB; ++b) {
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[b]));
    __m512 sum = _mm512_setzero_ps();
    float* sb = scores.data() + b * padded;
    for (int64_t t0 = 0; t0 < seq_len; t0 += kTile) {
      const int cnt = static_cast<int>(std::min<int64_t>(kTile, seq_len - t0));
      const __mmask16 live = cnt == kTile ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cnt) - 1);
      const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(sb + t0), mx)));
      _mm512_storeu_ps(sb + t0, p);
      sum = _mm512_add_ps(sum, p);
    }
    inv_sum[b] = 1.f / _mm512_reduce_add_ps(sum);
  }
  // pass 3: out = Σ p_t v_t / Σ p_t
  __m512 acc[GB][DV];
  for (int b = 0; b < GB; ++b) {
    for (int v = 0; v < DV; ++v) acc[b][v] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < seq_len; ++t) {
    const TC* val = values + slots[t] * kv_stride;
    prefetch_ahead(values, kv_stride, slots, t, seq_len, D);
    __m512 vvec[DV];
    for (int v = 0; v < DV; ++v) vvec[v] = attn_load16<TC>(val + 16 * v);
    for (int b = 0; b < GB; ++b) {
      const __m512 p = _mm512_set1_ps(scores[b * padded + t]);
      for (int v = 0; v < DV; ++v) acc[b][v] = _mm512_fmadd_ps(p, vvec[v], acc[b][v]);
    }
  }
  for (int b = 0; b < GB; ++b) {
    const __m512 inv = _mm512_set1_ps(inv_sum[b]);
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(out + b * D + 16 * v, _mm512_mul_ps(acc[b][v], inv));
  }
}

template <typename TC>
using GroupFn = void (*)(const float*, float*, const TC*, const PagedKV&, int64_t, const int64_t*, int64_t, float,
                         std::vector<float>&);

// Heads per work item: GB · DV ≤ 16 accumulators (zmm registers: 32, with the values and the scale).
template <typename TC, int DV>
GroupFn<TC> group_fn(int gb) {
  switch (gb) {
    case 1: return &attend_group<TC, DV, 1>;
    case 2: return &attend_group<TC, DV, 2>;
    case 3: return &attend_group<TC, DV, 3>;
    default: return &attend_group<TC, DV, 4>;
  }
}

template <typename TC, typename TQ, int DV>
void run_attention(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& tables,
                   const at::Tensor& seq_lens, float scale, at::Tensor& out) {
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = cache.size(3), group = H / KVH;
  constexpr int max_gb = std::min(4, std::max(1, 16 / DV));
  const int64_t chunks = (group + max_gb - 1) / max_gb;
  const PagedKV kv{cache.size(1) * cache.size(2), cache.size(2), KVH, D};
  const TQ* q = query.data_ptr<TQ>();
  TQ* o = out.data_ptr<TQ>();
  const TC* c = cache.data_ptr<TC>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t width = tables.size(1);
  at::parallel_for(0, n * KVH * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> slots;
    int64_t slots_of = -1;  // the request whose slots are in `slots` (its KV heads' items run back to back)
    float qf[4 * 16 * 8], of[4 * 16 * 8];  // GB · D ≤ 4 · 128
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / (KVH * chunks), g = task / chunks % KVH, chunk = task % chunks;
      const int64_t first = g * group + chunk * max_gb;
      const int gb = static_cast<int>(std::min<int64_t>(max_gb, g * group + group - first));
      const TQ* qi = q + (i * H + first) * D;
      for (int64_t j = 0; j < gb * D; ++j) qf[j] = attn_to_float(qi[j]);
      if (slots_of != i) {
        token_slots(tab + i * width, kv.block_size, lens[i], slots);
        slots_of = i;
      }
      group_fn<TC, DV>(gb)(qf, of, c, kv, g, slots.data(), lens[i], scale, scores);
      TQ* oi = o + (i * H + first) * D;
      for (int64_t j = 0; j < gb * D; ++j) oi[j] = attn_from_float<TQ>(of[j]);
    }
  });
}

template <typename TC, typename TQ>
void dispatch_dv(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& tables,
                 const at::Tensor& seq_lens, float scale, at::Tensor& out) {
  switch (query.size(2) / 16) {
    case 1: run_attention<TC, TQ, 1>(query, cache, tables, seq_lens, scale, out); break;
    case 2: run_attention<TC, TQ, 2>(query, cache, tables, seq_lens, scale, out); break;
    case 4: run_attention<TC, TQ, 4>(query, cache, tables, seq_lens, scale, out); break;
    case 8: run_attention<TC, TQ, 8>(query, cache, tables, seq_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim must be 16, 32, 64 or 128");
  }
}

at::Tensor paged_decode_attention(const at::Tensor& query_in, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in, double scale) {
  TORCH_CHECK(query_in.dim() == 3, "query: [n, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: contiguous [2, num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.size(4) == query_in.size(2), "query and cache disagree on head_dim");
  TORCH_CHECK(kv_cache.size(3) > 0 && query_in.size(1) % kv_cache.size(3) == 0,
              "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables_in.scalar_type() == at::kInt && block_tables_in.dim() == 2 &&
                  block_tables_in.size(0) == query_in.size(0), "block_tables: int32 [n, max_blocks]");
  TORCH_CHECK(seq_lens_in.scalar_type() == at::kInt && seq_lens_in.dim() == 1 &&
                  seq_lens_in.size(0) == query_in.size(0), "seq_lens: int32 [n]");
  const auto qt = query_in.scalar_type(), ct = kv_cache.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16, "query: float32 or bfloat16");
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16, "kv_cache: float32 or bfloat16");
  const at::Tensor query = query_in.contiguous();
  const at::Tensor tables = block_tables_in.contiguous();
  const at::Tensor seq_lens = seq_lens_in.contiguous();
  const int64_t n = query.size(0), width = tables.size(1), bs = kv_cache.size(2), blocks = kv_cache.size(1);
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {  // every block an item reads must exist (no read outside the cache)
    TORCH_CHECK(lens[i] >= 0 && lens[i] <= width * bs, "seq_len ", lens[i], " of row ", i, " exceeds its block table");
    for (int64_t b = 0; b < (lens[i] + bs - 1) / bs; ++b) {
      TORCH_CHECK(tab[i * width + b] >= 0 && tab[i * width + b] < blocks, "block id out of range in row ", i);
    }
  }
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (n == 0) return out;
  const float s = static_cast<float>(scale);
  if (ct == at::kBFloat16) {
    if (qt == at::kBFloat16) dispatch_dv<c10::BFloat16, c10::BFloat16>(query, kv_cache, tables, seq_lens, s, out);
    else dispatch_dv<c10::BFloat16, float>(query, kv_cache, tables, seq_lens, s, out);
  } else {
    if (qt == at::kBFloat16) dispatch_dv<float, c10::BFloat16>(query, kv_cache, tables, seq_lens, s, out);
    else dispatch_dv<float, float>(query, kv_cache, tables, seq_lens, s, out);
  }
  return out;
}

void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
              const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: a contiguous CPU [2, num_blocks, block_size, num_kv_heads, head_dim] tensor");
  const int64_t kvh = kv_cache.size(3), d = kv_cache.size(4), slots = kv_cache.size(1) * kv_cache.size(2);
  for (const at::Tensor* x : {&key, &value}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == kv_cache.scalar_type() && x->dim() == 3 &&
                    x->size(0) == key.size(0) && x->size(1) == kvh && x->size(2) == d && x->stride(2) == 1 &&
                    (x->stride(1) == d || kvh == 1),
                "key and value: [tokens, num_kv_heads, head_dim] in the cache's dtype, num_kv_heads · head_dim "
                "contiguous within a token");
  }
  TORCH_CHECK(slot_mapping_in.scalar_type() == at::kLong && slot_mapping_in.dim() == 1 &&
                  slot_mapping_in.size(0) == key.size(0), "slot_mapping: int64 [tokens]");
  const at::Tensor slot_mapping = slot_mapping_in.contiguous();
  const int64_t* slot = slot_mapping.const_data_ptr<int64_t>();
  const int64_t tokens = key.size(0);
  for (int64_t t = 0; t < tokens; ++t) {  // no write outside the cache
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " of token ", t, " is outside the cache");
  }
  const int64_t item = kv_cache.element_size(), row = kvh * d * item;
  char* k_plane = static_cast<char*>(kv_cache.data_ptr());
  char* v_plane = k_plane + slots * row;
  const char* pk = static_cast<const char*>(key.const_data_ptr());
  const char* pv = static_cast<const char*>(value.const_data_ptr());
  const int64_t k_stride = key.stride(0) * item, v_stride = value.stride(0) * item;
  at::parallel_for(0, tokens, 512, [&](int64_t begin, int64_t end) {  // ~100 KB a prompt: one thread is enough
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(k_plane + slot[t] * row, pk + t * k_stride, row);
      std::memcpy(v_plane + slot[t] * row, pv + t * v_stride, row);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) "
        "-> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv", &write_kv);
}
