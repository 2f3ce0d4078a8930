// The pieces every GGUF type's kernel code is made of: the ggml type ids, 32 codes in one
// register widened to fp32 and scaled (the panel paths' dequantizers: gguf_linear.h,
// gguf_lowbit.h), and the few-rows path's per-row sums (linear_few_rows in gguf_linear.h).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace zllm_gguf {

using zllm_simd::half_to_float;
using zllm_simd::hsum;

constexpr int kBlock = 32;       // values per block of the 32-value types
constexpr int kSuper = 256;      // values per K-quant super-block
constexpr int kQ4_1Bytes = 20;   // f16 d, f16 m, 16 bytes of nibbles
constexpr int kQ8_0Bytes = 34;   // f16 d, 32 int8

// ggml type ids.
enum QType : int64_t {
  kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ2_XXS = 16, kIQ2_XS = 17, kIQ3_XXS = 18, kIQ1_S = 19,
  kIQ4_NL = 20, kIQ3_S = 21, kIQ2_S = 22, kIQ4_XS = 23, kIQ1_M = 29, kBF16 = 30, kTQ1_0 = 34,
  kTQ2_0 = 35, kMXFP4 = 39, kNVFP4 = 40,
  // zllm's own, no GGUF type: an fp8 checkpoint's e4m3 values, 32 to a block with their fp16
  // scale, laid out as Q8_0 (executor/weights/quantized/to_blocks.py).
  kFP8_E4M3 = 100
};
// F16 and BF16 are plain 16-bit values; the kernel reads them in runs of 32 (64 bytes) so
// they share the block-wise loops (gguf_linear.h). Both widen to fp32 exactly.

// --- Building blocks: 32 codes in one register, widened to fp32 and scaled -----------------

// Every code of every type fits a signed byte (Q6_K and Q8_0 are signed, the rest < 64), so
// one widening serves all: 32 int8 codes -> 4 x 8 fp32.
inline void widen(__m256i codes, __m256 q[4]) {
  const __m128i lo = _mm256_castsi256_si128(codes);
  const __m128i hi = _mm256_extracti128_si256(codes, 1);
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// out[j] = d * code[j] (+ m): two roundings, as numpy computes (d * q) + m.
inline void store_scaled(__m256i codes, float d, float* out) {
  __m256 q[4];
  widen(codes, q);
  const __m256 dv = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(dv, q[i]));
}

inline void store_scaled_offset(__m256i codes, float d, float m, float* out) {
  __m256 q[4];
  widen(codes, q);
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  for (int i = 0; i < 4; ++i)
    _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(_mm256_mul_ps(dv, q[i]), mv));
}

// The 32-value types' nibble layout: value j < 16 is the low nibble of byte j, value j >= 16
// the high nibble of byte j - 16.
inline __m256i nibbles_32(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

// --- Few input rows: the sums a row's dot product keeps ---------------------------------------

// What one row's dot product has summed so far. Groups alternate between two of these: one
// chain would wait an FMA's latency per group.
template <int MR>
struct RowSums {
  __m256 v[MR];
  float offset[MR];
};

// Where the MR input rows are: x at the block's first value, its row stride, and the rows'
// per-group sums of x at the block's first group (row stride xsum_ld). A group is 32 values,
// or the format's kSumValues where its offsets change faster (Q2_K: 16).
struct FewRowsInput {
  const float* x;
  int64_t ldx;
  const float* xsum;
  int64_t xsum_ld;
};

inline __m256i widen8_u(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i widen8_s(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 to_float(__m256i codes) { return _mm256_cvtepi32_ps(codes); }

// sums += d * (q . x) for the 32 values of group g of the block (x + 32 g), every row.
template <int MR>
inline void add_group(const __m256 q[4], float d, const FewRowsInput& in, int g,
                      RowSums<MR>& sums) {
  const __m256 dv = _mm256_set1_ps(d);
  for (int i = 0; i < MR; ++i) {
    const float* xg = in.x + i * in.ldx + kBlock * g;
    __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xg));
    dot = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xg + 8), dot);
    dot = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xg + 16), dot);
    dot = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xg + 24), dot);
    sums.v[i] = _mm256_fmadd_ps(dv, dot, sums.v[i]);
  }
}

// sums.offset += m * sum(x) over offset group g (32 values, or the format's kSumValues),
// every row.
template <int MR>
inline void add_group_offset(float m, const FewRowsInput& in, int g, RowSums<MR>& sums) {
  for (int i = 0; i < MR; ++i) sums.offset[i] += m * in.xsum[i * in.xsum_ld + g];
}


}  // namespace zllm_gguf
