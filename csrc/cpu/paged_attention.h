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
// Layouts (the executor's contract, executor/attention/paged.py):
//   q            [S, H, D]   any sequence/head stride, last dim contiguous
//   kv_cache     [2, num_blocks, block_size, KVH, D] contiguous, 0 = K, 1 = V; fp32, or
//                bf16 / fp16 (--kv-cache-dtype: each K/V row is widened to fp32 as it loads),
//                or int8 rows [.., KVH, D + 2 D / group]: D signed bytes, then a bf16 scale
//                per group of 32 values (16 or 8 where D needs; zllm/kv/kv_dtypes.py);
//                each 8 values are widened and scaled in registers as they load
//   block_tables int64 [S, max_blocks]     seq_lens int64 [S]
//   out          [S, H, D] contiguous
//
// Sliding window (window > 0): a sequence of context L attends to positions
// [max(0, L - window), L), and its block table starts at the block holding the first of them
// (the blocks before the window may be released), as attention.py's decode batch builds it.
// Chunked attention (window < 0, Llama 4's): a sequence of context L attends to the positions
// of its own chunk of -window tokens, [(L - 1) / -window * -window, L); its table starts at
// the block holding that chunk's first position.
//
// Attention sinks (gpt-oss; sinks fp32 [H], else null): head h's sink logit joins its
// softmax denominator and brings no value: out = sum_t e^(s_t - m) v_t / (e^(sink - m) +
// sum_t e^(s_t - m)), m the largest of the scores and the sink.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include "aten_lite.h"

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
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
struct Q8 {  // an int8 row's value; the row's bf16 scales (one per group) follow its D values
  int8_t v;
};

inline float bf16_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

// fp32 bits -> bf16 bits, rounded to nearest even as torch's .to(torch.bfloat16) (a NaN stays a NaN).
inline uint16_t bf16_bits(uint32_t b) {
  const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
  return nan ? uint16_t{0x7fc0}  // torch's bf16 NaN
             : static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// int8 rows: values in groups of 2^shift (32, else 16, else 8: the largest dividing D), a bf16
// scale per group (zllm/kv/kv_dtypes.py int8_group).
constexpr int64_t kMaxQ8Groups = 64;  // head_dim up to 512 in groups of 8 or more

inline int64_t q8_group_shift(int64_t D) { return D % 32 == 0 ? 5 : D % 16 == 0 ? 4 : 3; }

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const Brain* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline __m256 load8(const Q8* p) {  // unscaled: RowReader<Q8> applies the group's scale
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
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
  for (int i = 0; i < 8; ++i) p[i].bits = bf16_bits(bits[i]);
}

// One cache row of D values read as fp32 vectors of 8 (d a multiple of 8): float rows as they
// are, int8 rows times their group's scale (read once per row).
// dot<NV> and axpy<NV> serve decode_item's fixed widths (NV vectors of 8): q . row, and
// o += w * row, with an int8 row's scales applied once per group, not per load.
template <class E>
struct RowReader {
  const E* p;
  RowReader(const E* row, int64_t /*D*/, int64_t /*group_shift*/) : p(row) {}
  __m256 load(int64_t d) const { return load8(p + d); }
  template <int NV>
  __m256 dot(const float* q) const {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), load8(p));
    for (int v = 1; v < NV; ++v)
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * v), load8(p + 8 * v), a);
    return a;
  }
  template <int NV>
  void axpy(float w, __m256* o) const {
    const __m256 wv = _mm256_set1_ps(w);
    for (int v = 0; v < NV; ++v) o[v] = _mm256_fmadd_ps(wv, load8(p + 8 * v), o[v]);
  }
};

template <>
struct RowReader<Q8> {
  const Q8* p;
  int64_t shift;
  float scale[kMaxQ8Groups];
  RowReader(const Q8* row, int64_t D, int64_t group_shift) : p(row), shift(group_shift) {
    for (int64_t g = 0; g < (D >> shift); ++g) {
      uint16_t bits;
      std::memcpy(&bits, row + D + 2 * g, sizeof(bits));
      scale[g] = bf16_to_float(bits);
    }
  }
  __m256 load(int64_t d) const {
    return _mm256_mul_ps(load8(p + d), _mm256_set1_ps(scale[d >> shift]));
  }
  // (decode_item's widths, 64 and 128, are groups of 32: 4 vectors a scale.)
  template <int NV>
  __m256 dot(const float* q) const {
    __m256 a = _mm256_setzero_ps();
    for (int g = 0; g < NV / 4; ++g) {
      const float* qg = q + 32 * g;
      const Q8* pg = p + 32 * g;
      __m256 part = _mm256_mul_ps(_mm256_loadu_ps(qg), load8(pg));
      for (int v = 1; v < 4; ++v)
        part = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * v), load8(pg + 8 * v), part);
      a = _mm256_fmadd_ps(part, _mm256_set1_ps(scale[g]), a);
    }
    return a;
  }
  template <int NV>
  void axpy(float w, __m256* o) const {
    for (int g = 0; g < NV / 4; ++g) {
      const __m256 wv = _mm256_set1_ps(w * scale[g]);
      for (int v = 0; v < 4; ++v)
        o[4 * g + v] = _mm256_fmadd_ps(wv, load8(p + 32 * g + 8 * v), o[4 * g + v]);
    }
  }
};

// A row of D fp32 values (D % 8 == 0) into the cache's row at p. int8: per group, the scale
// absmax / 127 rounded to bf16, each value over it rounded to nearest even, then the
// group's scales after the D values: the operations of executor/kv/quant.py quantize_rows,
// so both write the same bytes.
template <class E>
inline void store_row(E* p, const float* x, int64_t D, int64_t group_shift) {
  if constexpr (std::is_same_v<E, Q8>) {
    const int64_t group = int64_t{1} << group_shift;
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    for (int64_t g0 = 0; g0 < D; g0 += group) {
      __m256 amax = _mm256_setzero_ps();
      for (int64_t d = g0; d < g0 + group; d += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + d)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, amax);
      const float exact = *std::max_element(lanes, lanes + 8) / 127.f;
      uint32_t word;
      std::memcpy(&word, &exact, sizeof(word));
      const uint16_t bits = bf16_bits(word);
      const float scale = bf16_to_float(bits);
      const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      for (int64_t d = g0; d < g0 + group; d += 8) {
        const __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d), inv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo), hi));
        const __m128i i16 =
            _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(p + d), _mm_packs_epi16(i16, i16));
      }
      std::memcpy(p + D + 2 * (g0 >> group_shift), &bits, sizeof(bits));
    }
  } else {
    (void)group_shift;
    for (int64_t d = 0; d < D; d += 8) store8(p + d, _mm256_loadu_ps(x + d));
  }
}

template <class E>
inline float dot(const float* a, const RowReader<E>& b, int64_t D) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), b.load(d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), b.load(d + 8), acc1);
  }
  for (; d < D; d += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), b.load(d), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

// out += w * v over D values.
template <class E>
inline void axpy(float w, const RowReader<E>& v, float* out, int64_t D) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int64_t d = 0; d < D; d += 8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wv, v.load(d), _mm256_loadu_ps(out + d)));
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
// `sink`: the G heads' sink logits, or null.
template <int D, class E>  // D: 64 or 128 (int8 rows: groups of 32)
void decode_item(const float* const* qg, int64_t G, const E* k_base, const E* v_base,
                 const int64_t* table, int64_t block_size, int64_t row, int64_t group_shift,
                 int64_t begin, int64_t end, float scale, const float* sink,
                 float* const* out, std::vector<float>& scores) {
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
        const RowReader<E> k(k_base + slot_of(t0 + j) * row, D, group_shift);
        acc[j] = k.template dot<NV>(q);
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
    float m = *std::max_element(lanes, lanes + 8);
    if (sink) m = std::max(m, sink[g]);
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < Lp; t0 += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t0), vm));
      _mm256_storeu_ps(sg + t0, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    const float inv = 1.f / (hsum(vsum) + (sink ? std::exp(sink[g] - m) : 0.f));
    __m256 o[NV];
    for (int v = 0; v < NV; ++v) o[v] = _mm256_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      const RowReader<E> vr(v_base + slot_of(t) * row, D, group_shift);
      vr.template axpy<NV>(sg[t], o);
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out[g] + 8 * v, _mm256_mul_ps(o[v], vinv));
  }
}

// Any other head_dim (a multiple of 8): the plain loops, same contract as decode_item.
template <class E>
inline void decode_item_any(const float* const* qg, int64_t G, int64_t D, const E* k_base,
                            const E* v_base, const int64_t* table, int64_t block_size,
                            int64_t row, int64_t group_shift, int64_t begin, int64_t end,
                            float scale, const float* sink, float* const* out,
                            std::vector<float>& scores) {
  const int64_t L = end - begin;
  scores.resize(G * L);
  auto slot_of = [&](int64_t j) {
    const int64_t t = begin + j;
    return table[t / block_size] * block_size + t % block_size;
  };
  // Pass 1: scores[g][t] = q_g . k_t * scale, per group head, with its running max (from
  // its sink's logit, if any).
  std::vector<float> maxes(G, -INFINITY);
  if (sink) std::copy(sink, sink + G, maxes.begin());
  for (int64_t t = 0; t < L; ++t) {
    const RowReader<E> k(k_base + slot_of(t) * row, D, group_shift);
    for (int64_t g = 0; g < G; ++g) {
      const float x = dot(qg[g], k, D) * scale;
      scores[g * L + t] = x;
      maxes[g] = std::max(maxes[g], x);
    }
  }
  // Softmax weights, then out_g = sum_t w[g][t] v_t / sum_t w[g][t] (+ the sink's weight).
  std::vector<float> sums(G, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    if (sink) sums[g] = std::exp(sink[g] - maxes[g]);
    float* sg = scores.data() + g * L;
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = std::exp(sg[t] - maxes[g]);
      sums[g] += sg[t];
    }
    std::fill_n(out[g], D, 0.f);
  }
  for (int64_t t = 0; t < L; ++t) {
    const RowReader<E> v(v_base + slot_of(t) * row, D, group_shift);
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
  if (window == 0 || L <= window) return {0, L};
  // A chunk (window < 0): positions since the last multiple of -window before L.
  const int64_t first = window > 0 ? L - window : (L - 1) / -window * -window;
  const int64_t base = first / block_size * block_size;  // the table's first block starts here
  return {first - base, L - base};
}

// The paged cache one layer reads: [2, num_blocks, block_size, KVH, head_stride] contiguous,
// of `type`; head_stride is D, or for int8 rows D values and a bf16 scale per group of
// 2^group_shift values.
enum class KVType { kF32, kF16, kBF16, kI8 };

struct PagedCache {
  void* k;  // of the element type `type` names
  void* v;
  KVType type;
  int64_t num_blocks, block_size, kv_heads, head_dim, head_stride, group_shift;
};

// `D`: the head_dim of the model reading it (an int8 row's width depends on it).
inline PagedCache paged_cache(const at::Tensor& kv_cache, int64_t D) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2 &&
                  kv_cache.device().is_cpu(),
              "kv_cache must be contiguous [2, blocks, block_size, kv_heads, D] on CPU");
  const auto st = kv_cache.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 ||
                  st == at::kChar,
              "kv_cache must be fp32, fp16, bf16 or int8 rows");
  const KVType type = st == at::kFloat   ? KVType::kF32
                      : st == at::kHalf ? KVType::kF16
                      : st == at::kChar    ? KVType::kI8
                                              : KVType::kBF16;
  auto* k = static_cast<uint8_t*>(kv_cache.data_ptr());
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t KVH = kv_cache.size(3), stride = kv_cache.size(4);
  TORCH_CHECK(D > 0 && D % 8 == 0, "head_dim must be a multiple of 8");
  const int64_t shift = type == KVType::kI8 ? q8_group_shift(D) : 0;
  const int64_t row_width = type == KVType::kI8 ? D + 2 * (D >> shift) : D;
  TORCH_CHECK(stride == row_width, "the KV cache's rows do not match head_dim ", D);
  TORCH_CHECK(type != KVType::kI8 || (D >> shift) <= kMaxQ8Groups, "int8 rows of at most ",
              kMaxQ8Groups << 3, " values");
  const int64_t half = num_blocks * block_size * KVH * stride * kv_cache.element_size();
  return {k, k + half, type, num_blocks, block_size, KVH, D, stride, shift};
}

// Calls f(E*) with the cache's K (or V) base as its element type.
template <class F>
inline void with_elements(const PagedCache& cache, void* base, F&& f) {
  switch (cache.type) {
    case KVType::kF32: return f(static_cast<float*>(base));
    case KVType::kF16: return f(static_cast<Half*>(base));
    case KVType::kBF16: return f(static_cast<Brain*>(base));
    case KVType::kI8: return f(static_cast<Q8*>(base));
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
// token each (checked tables: check_tables). q rows at q + s * q_seq + h * q_head; `sinks`:
// fp32 [H] sink logits, or null.
inline void decode_attention(const float* q, int64_t q_seq, int64_t q_head, int64_t S,
                             int64_t H, const PagedCache& cache, const int64_t* tables,
                             int64_t max_blocks, const int64_t* lens, int64_t window,
                             float scale, float* out, const float* sinks = nullptr) {
  const int64_t KVH = cache.kv_heads, D = cache.head_dim, G = H / KVH;
  const int64_t row = KVH * cache.head_stride;  // elements between consecutive tokens of a block
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
      const float* sink = sinks ? sinks + kvh * G : nullptr;
      with_elements(cache, cache.k, [&](auto* k) {
        using E = std::remove_pointer_t<decltype(k)>;
        const E* k_base = k + kvh * cache.head_stride;
        const E* v_base = static_cast<const E*>(cache.v) + kvh * cache.head_stride;
        const int64_t gs = cache.group_shift;
        if (D == 64)
          decode_item<64>(qg.data(), G, k_base, v_base, table, cache.block_size, row, gs,
                          span.begin, span.end, scale, sink, og.data(), scores);
        else if (D == 128)
          decode_item<128>(qg.data(), G, k_base, v_base, table, cache.block_size, row, gs,
                           span.begin, span.end, scale, sink, og.data(), scores);
        else
          decode_item_any(qg.data(), G, D, k_base, v_base, table, cache.block_size, row, gs,
                          span.begin, span.end, scale, sink, og.data(), scores);
      });
    }
  });
}

}  // namespace zllm_attn
