// Decode attention straight from the paged KV cache, fp32: rows of one query token each (a
// decode step's one per sequence, or a verify step's few, each with its own context length).
//
// Why: the torch path gathers every sequence's K and V blocks into a fresh padded tensor each
// layer and then runs SDPA over it, so each cached value crosses memory three times (read,
// write, read) and padding is computed. Here each K and V row is read once, where it lies,
// through the block table. At 32 sequences of ~200 tokens that is most of a step's
// attention time on a 2-core machine.
//
// Work item = (sequence, KV head): the G = heads / kv_heads query heads sharing that KV head
// are served together, so a K/V row read from memory is used G times. Two passes over the
// context: scores (q.k * scale) into a small buffer, softmax, then the weighted sum of V.
//
// Layouts (the executor's contract, executor/attention.py):
//   q            [S, H, D]   any sequence/head stride, last dim contiguous
//   kv_cache     [2, num_blocks, block_size, KVH, D] contiguous, 0 = K, 1 = V; fp32, or
//                bf16 / fp16 (--kv-cache-dtype: each K/V row is widened to fp32 as it loads)
//   block_tables int64 [S, max_blocks]     seq_lens int64 [S]
//   out          [S, H, D] contiguous
//
// Sliding window (window > 0): a sequence of context L attends to positions
// [max(0, L - window), L), and its block table starts at the block holding the first of them
// (the blocks before the window may be released), as attention.py's decode batch builds it.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace zllm_attn {

using zllm_simd::hsum;

// A KV cache's element types: fp32, or 16-bit values widened to fp32 as they load.
struct Half {
  uint16_t bits;
};
struct Brain {
  uint16_t bits;
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const Brain* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// fp32 -> the cache's type, rounded to nearest even as torch's .to() rounds (a NaN stays a
// NaN), so the fused decode step writes the bits the module path's index_copy_ writes.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store8(Brain* p, __m256 v) {
  alignas(32) uint32_t bits[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bits), _mm256_castps_si256(v));
  for (int i = 0; i < 8; ++i) {
    const uint32_t b = bits[i];
    const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
    p[i].bits = nan ? uint16_t{0x7fc0}  // torch's bf16 NaN
                    : static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  }
}

template <class E>
inline float dot(const float* a, const E* b, int64_t D) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), load8(b + d + 8), acc1);
  }
  for (; d < D; d += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

// out += w * v over D values.
template <class E>
inline void axpy(float w, const E* v, float* out, int64_t D) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int64_t d = 0; d < D; d += 8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wv, load8(v + d), _mm256_loadu_ps(out + d)));
}

// exp(x) for 8 floats, x <= 0 here (scores minus their max): Cephes' polynomial on
// x = n ln2 + r, |r| <= ln2 / 2, then 2^n through the exponent bits. ~2 ulp.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums at the cost of about two.
inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One (sequence, KV head) item for head_dim D (64 or 128), G query heads on it, over the
// context positions [begin, end) of its block table (0 and L unless windowed).
//   pass 1: scores of 8 tokens at a time: 8 independent FMA chains, one hsum8, one exp8
//           later; padding lanes get -inf (weight 0)
//   pass 2: per query head, out (D floats) stays in registers while the V rows stream by.
template <int D, class E>
void decode_item(const float* const* qg, int64_t G, const E* k_base, const E* v_base,
                 const int64_t* table, int64_t block_size, int64_t row, int64_t begin,
                 int64_t end, float scale, float* const* out, std::vector<float>& scores) {
  constexpr int NV = D / 8;
  const int64_t L = end - begin;
  const int64_t Lp = (L + 7) / 8 * 8;
  scores.resize(G * Lp);
  auto slot_of = [&](int64_t j) {
    const int64_t t = begin + j;
    return table[t / block_size] * block_size + t % block_size;
  };
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = qg[g];
    float* sg = scores.data() + g * Lp;
    __m256 vmax = neg_inf;
    for (int64_t t0 = 0; t0 < L; t0 += 8) {
      const int64_t tb = std::min<int64_t>(8, L - t0);
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t j = 0; j < tb; ++j) {
        const E* k = k_base + slot_of(t0 + j) * row;
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
        for (int v = 1; v < NV; ++v)
          a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * v), load8(k + 8 * v), a);
        acc[j] = a;
      }
      __m256 sc = _mm256_mul_ps(hsum8(acc), vscale);
      if (tb < 8) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, sc);
        for (int64_t j = tb; j < 8; ++j) lanes[j] = -INFINITY;
        sc = _mm256_load_ps(lanes);
      }
      _mm256_storeu_ps(sg + t0, sc);
      vmax = _mm256_max_ps(vmax, sc);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    const float m = *std::max_element(lanes, lanes + 8);
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < Lp; t0 += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t0), vm));
      _mm256_storeu_ps(sg + t0, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    const float inv = 1.f / hsum(vsum);
    __m256 o[NV];
    for (int v = 0; v < NV; ++v) o[v] = _mm256_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      const E* vr = v_base + slot_of(t) * row;
      const __m256 w = _mm256_set1_ps(sg[t]);
      for (int v = 0; v < NV; ++v) o[v] = _mm256_fmadd_ps(w, load8(vr + 8 * v), o[v]);
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out[g] + 8 * v, _mm256_mul_ps(o[v], vinv));
  }
}

// Any other head_dim (a multiple of 8): the plain loops, same contract as decode_item.
template <class E>
inline void decode_item_any(const float* const* qg, int64_t G, int64_t D, const E* k_base,
                            const E* v_base, const int64_t* table, int64_t block_size,
                            int64_t row, int64_t begin, int64_t end, float scale,
                            float* const* out, std::vector<float>& scores) {
  const int64_t L = end - begin;
  scores.resize(G * L);
  auto slot_of = [&](int64_t j) {
    const int64_t t = begin + j;
    return table[t / block_size] * block_size + t % block_size;
  };
  // Pass 1: scores[g][t] = q_g . k_t * scale, per group head, with its running max.
  std::vector<float> maxes(G, -INFINITY);
  for (int64_t t = 0; t < L; ++t) {
    const E* k = k_base + slot_of(t) * row;
    for (int64_t g = 0; g < G; ++g) {
      const float x = dot(qg[g], k, D) * scale;
      scores[g * L + t] = x;
      maxes[g] = std::max(maxes[g], x);
    }
  }
  // Softmax weights, then out_g = sum_t w[g][t] v_t / sum_t w[g][t].
  std::vector<float> sums(G, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * L;
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = std::exp(sg[t] - maxes[g]);
      sums[g] += sg[t];
    }
    std::fill_n(out[g], D, 0.f);
  }
  for (int64_t t = 0; t < L; ++t) {
    const E* v = v_base + slot_of(t) * row;
    for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + t], v, out[g], D);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / sums[g];
    for (int64_t d = 0; d < D; ++d) out[g][d] *= inv;
  }
}

// Where a sequence's attended positions lie in its (possibly window-trimmed) block table:
// [begin, end), in table coordinates.
struct Span {
  int64_t begin, end;
};

inline Span attended_span(int64_t L, int64_t window, int64_t block_size) {
  if (window <= 0 || L <= window) return {0, L};
  const int64_t first = L - window;
  const int64_t base = first / block_size * block_size;  // the table's first block starts here
  return {first - base, L - base};
}

// The paged cache one layer reads: [2, num_blocks, block_size, KVH, D] contiguous, of `type`.
enum class KVType { kF32, kF16, kBF16 };

struct PagedCache {
  void* k;  // of the element type `type` names
  void* v;
  KVType type;
  int64_t num_blocks, block_size, kv_heads, head_dim;
};

inline PagedCache paged_cache(const torch::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2 &&
                  kv_cache.device().is_cpu(),
              "kv_cache must be contiguous [2, blocks, block_size, kv_heads, D] on CPU");
  const auto st = kv_cache.scalar_type();
  TORCH_CHECK(st == torch::kFloat32 || st == torch::kFloat16 || st == torch::kBFloat16,
              "kv_cache must be fp32, fp16 or bf16");
  const KVType type = st == torch::kFloat32   ? KVType::kF32
                      : st == torch::kFloat16 ? KVType::kF16
                                              : KVType::kBF16;
  auto* k = static_cast<uint8_t*>(kv_cache.data_ptr());
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t KVH = kv_cache.size(3), D = kv_cache.size(4);
  const int64_t half = num_blocks * block_size * KVH * D * kv_cache.element_size();
  return {k, k + half, type, num_blocks, block_size, KVH, D};
}

// Calls f(E*) with the cache's K (or V) base as its element type.
template <class F>
inline void with_elements(const PagedCache& cache, void* base, F&& f) {
  switch (cache.type) {
    case KVType::kF32: return f(static_cast<float*>(base));
    case KVType::kF16: return f(static_cast<Half*>(base));
    case KVType::kBF16: return f(static_cast<Brain*>(base));
  }
}

// Every sequence's length fits its table and every block id it reads is in the cache.
inline void check_tables(const int64_t* tables, int64_t max_blocks, const int64_t* lens,
                         int64_t S, int64_t window, const PagedCache& cache) {
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= 1, "seq_len must be at least 1");
    const Span span = attended_span(lens[s], window, cache.block_size);
    TORCH_CHECK(span.end <= max_blocks * cache.block_size,
                "seq_len out of range for its block table");
    for (int64_t b = span.begin / cache.block_size;
         b < (span.end + cache.block_size - 1) / cache.block_size; ++b) {
      const int64_t id = tables[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < cache.num_blocks, "block id out of range");
    }
  }
}

// out[s, h] = attention of q[s, h] over sequence s's context, for S sequences of one new
// token each (checked tables: check_tables). q rows at q + s * q_seq + h * q_head.
inline void decode_attention(const float* q, int64_t q_seq, int64_t q_head, int64_t S,
                             int64_t H, const PagedCache& cache, const int64_t* tables,
                             int64_t max_blocks, const int64_t* lens, int64_t window,
                             float scale, float* out) {
  const int64_t KVH = cache.kv_heads, D = cache.head_dim, G = H / KVH;
  const int64_t row = KVH * D;  // values between consecutive tokens of a block
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> qg(G);
    std::vector<float*> og(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, kvh = item % KVH;
      for (int64_t g = 0; g < G; ++g) {
        qg[g] = q + s * q_seq + (kvh * G + g) * q_head;
        og[g] = out + (s * H + kvh * G + g) * D;
      }
      const Span span = attended_span(lens[s], window, cache.block_size);
      const int64_t* table = tables + s * max_blocks;
      with_elements(cache, cache.k, [&](auto* k) {
        using E = std::remove_pointer_t<decltype(k)>;
        const E* k_base = k + kvh * D;
        const E* v_base = static_cast<const E*>(cache.v) + kvh * D;
        if (D == 64)
          decode_item<64>(qg.data(), G, k_base, v_base, table, cache.block_size, row,
                          span.begin, span.end, scale, og.data(), scores);
        else if (D == 128)
          decode_item<128>(qg.data(), G, k_base, v_base, table, cache.block_size, row,
                           span.begin, span.end, scale, og.data(), scores);
        else
          decode_item_any(qg.data(), G, D, k_base, v_base, table, cache.block_size, row,
                          span.begin, span.end, scale, og.data(), scores);
      });
    }
  });
}

}  // namespace zllm_attn

using namespace zllm_attn;

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.stride(2) == 1,
              "q must be fp32 [S, H, D] with a contiguous last dim");
  const PagedCache cache = paged_cache(kv_cache);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt64 &&
                  block_tables.is_contiguous(),
              "block_tables must be contiguous int64 [S, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == torch::kInt64 &&
                  seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64 [S]");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(cache.head_dim == D && D % 8 == 0, "head_dim must match and be a multiple of 8");
  TORCH_CHECK(H % cache.kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) == S && seq_lens.size(0) == S, "one table and length per sequence");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  check_tables(tables, max_blocks, lens, S, window, cache);
  auto out = torch::empty({S, H, D}, q.options());
  decode_attention(q.data_ptr<float>(), q.stride(0), q.stride(1), S, H, cache, tables, max_blocks,
                   lens, window, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}
