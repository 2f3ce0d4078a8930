// Q4_K and Q6_K matrices against a few int8 activation rows, one super-block (256 values) at
// a time with no decode pass: `--quantization gguf-int8`'s kernel for these types at decode
// sizes (gguf_int8.h's generic path decodes each weight row into codes first).
//
// Why: at one row a decode step is a stream of weight bytes, and the generic path spends
// per 32 values a float conversion, a scale product and an FMA besides the integer dot, plus
// a write and a read of the decoded codes: ~4x the machine's read bandwidth for Llama-1B's
// Q4_K_M (BENCHMARKS.md). Here x is rounded to int8 per 256 values (one scale per
// super-block, as llama.cpp's Q8_K), so the super-block's sub-block scales (6-bit Q4_K,
// int8 Q6_K) multiply integer sums and one float FMA per super-block remains.
//
//   Q4_K: value = d * sc_s * q - dmin * m_s, q in 0..15, s the 32-value sub-block
//     sum_k value_k x_k ~ d * dx * sum_s sc_s sum_{k in s} q_k qx_k - dmin * sum_s m_s X_s
//   Q6_K: value = d * sc_t * c, c = q - 32 in -32..31, t the 16-value sub-block
//     sum_k value_k x_k ~ d * dx * sum_t sc_t sum_{k in t} c_k qx_k
// with x_k ~ dx * qx_k (qx int8, dx = max|x| / 127 over the 256 values) and X_s the exact
// fp32 sum of x over sub-block s (the offsets do not round x).
//
// Integer ranges: VPMADDUBSW pairs stay within int16 (Q4_K 2 * 15 * 127, Q6_K's |c| <= 32:
// 2 * 32 * 127); VPMADDWD by a scale (< 64, or |int8| <= 128) gives at most ~1.1M a lane and
// a super-block's 8 sub-blocks sum well inside int32.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_linear.h"

namespace zllm_kquant {

using namespace zllm_gguf;

constexpr int64_t kQ4_KBytes = 144, kQ6_KBytes = 210;

// x rounded to int8 per 256 values, with the exact fp32 sum of every 32 values.
struct QuantizedX256 {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, K / 256]
  std::vector<float> sum32;  // [M, K / 32]
};

inline QuantizedX256 quantize_x256(const float* x, int64_t M, int64_t ldx, int64_t K) {
  const int64_t blocks = K / kSuper, groups = K / kBlock;
  QuantizedX256 out{std::vector<int8_t>(M * K), std::vector<float>(M * blocks),
                    std::vector<float>(M * groups)};
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * ldx + b * kSuper;
      __m256 amax = _mm256_setzero_ps();
      bool finite = true;
      for (int g = 0; g < kSuper / kBlock; ++g) {
        __m256 total = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          const __m256 v = _mm256_loadu_ps(xb + kBlock * g + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v));
          total = _mm256_add_ps(total, v);
        }
        const float sum = hsum(total);
        finite = finite && std::isfinite(sum);
        out.sum32[m * groups + b * (kSuper / kBlock) + g] = sum;
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      // Below FLT_MIN: zeros (127 / max would overflow). A NaN or infinity makes d NaN, so
      // the output is NaN as the float kernel's would be.
      const float max_abs = _mm_cvtss_f32(h) < FLT_MIN ? 0.0f : _mm_cvtss_f32(h);
      out.d[m * blocks + b] = finite ? max_abs / 127.0f : NAN;
      const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
      for (int g = 0; g < kSuper / kBlock; ++g) {
        __m256i q32[4];
        for (int i = 0; i < 4; ++i)
          q32[i] = _mm256_cvtps_epi32(
              _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + kBlock * g + 8 * i), inv),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // int32 -> int8 in order: the packs interleave 128-bit lanes, a permute undoes it.
        const __m256i q8 = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]),
                               _mm256_packs_epi32(q32[2], q32[3])),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&out.q[m * K + b * kSuper + kBlock * g]),
                            q8);
      }
    }
  return out;
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Q4_K's 8 sub-block scales and 8 mins (6 bits each, packed in the 12 bytes at p), as bytes,
// a 32-bit word at a time. Byte s of each word: scale s = p[s] & 63 and min s = p[s + 4] & 63
// for s < 4; for s = 4 + j, the low four bits of p[8 + j] (scale) or its high four (min),
// with the top two bits of p[j] (scale) or p[4 + j] (min) above them.
inline void k_scales_mins_bytes(const uint8_t* p, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t w[3];
  std::memcpy(w, p, 12);
  const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  const uint32_t out[4] = {
      w[0] & six,                                        // scales 0-3
      (w[2] & four) | (((w[0] >> 6) & two) << 4),        // scales 4-7
      w[1] & six,                                        // mins 0-3
      ((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4)  // mins 4-7
  };
  std::memcpy(sc, out, 8);
  std::memcpy(mn, out + 2, 8);
}

// out[i] = row . x_i for MR consecutive x rows from m0.
template <int MR>
inline void q4_k_row(const uint8_t* row, const QuantizedX256& qx, int64_t m0, int64_t K,
                     float* out, int64_t ldy) {
  const int64_t blocks = K / kSuper, groups = K / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MR], offset[MR];  // offset: sum over sub-blocks of dmin * min_s * X_s, by lane s
  for (int i = 0; i < MR; ++i) acc[i] = offset[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kQ4_KBytes;
    uint8_t sc[8], mn[8];
    k_scales_mins_bytes(blk + 4, sc, mn);
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high ones)
      const __m256i v = load32(blk + 16 + 32 * c);
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      const __m256i sc_lo = _mm256_set1_epi16(static_cast<int16_t>(sc[2 * c]));
      const __m256i sc_hi = _mm256_set1_epi16(static_cast<int16_t>(sc[2 * c + 1]));
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = qx.q.data() + (m0 + i) * K + b * kSuper + 64 * c;
        const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(xq)), sc_lo);
        const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(xq + 32)), sc_hi);
        isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(p_lo, p_hi));
      }
    }
    const float d = half_to_float(blk);
    const __m256 mins = _mm256_mul_ps(
        _mm256_set1_ps(half_to_float(blk + 2)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)))));
    for (int i = 0; i < MR; ++i) {
      const float dx = qx.d[(m0 + i) * blocks + b];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * dx), acc[i]);
      const __m256 xs = _mm256_loadu_ps(qx.sum32.data() + (m0 + i) * groups + b * 8);
      offset[i] = _mm256_fmadd_ps(mins, xs, offset[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldy] = hsum(acc[i]) - hsum(offset[i]);
}

template <int MR>
inline void q6_k_row(const uint8_t* row, const QuantizedX256& qx, int64_t m0, int64_t K,
                     float* out, int64_t ldy) {
  const int64_t blocks = K / kSuper;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kQ6_KBytes;
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      const __m256i codes = q6_k_codes(blk, t);  // signed, -32..31
      const __m256i magnitude = _mm256_abs_epi8(codes);
      // Values 0-15 of the group (the low 128-bit lane) take scale 2t, 16-31 scale 2t + 1.
      const __m256i sc = _mm256_setr_m128i(_mm_set1_epi16(scales[2 * t]),
                                           _mm_set1_epi16(scales[2 * t + 1]));
      for (int i = 0; i < MR; ++i) {
        const __m256i xq = load32(qx.q.data() + (m0 + i) * K + b * kSuper + kBlock * t);
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq, codes));
        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(pairs, sc));
      }
    }
    const float d = half_to_float(blk + 208);
    for (int i = 0; i < MR; ++i) {
      const float dx = qx.d[(m0 + i) * blocks + b];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * dx), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldy] = hsum(acc[i]);
}

// Rows sharing one pass over the weights (a pass per 4 rows beyond: the modules send decode-
// sized calls only, and `zllm bench accuracy` scores whole sequences with decode's arithmetic).
constexpr int64_t kMaxRows = 4;

inline bool serves(int64_t qtype) { return qtype == kQ4_K || qtype == kQ6_K; }

template <int MR>
inline void linear_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                        int64_t qtype, int64_t N, int64_t K, float* y, int64_t ldy) {
  const QuantizedX256 qx = quantize_x256(x, MR, ldx, K);
  const auto row_dot = qtype == kQ4_K ? q4_k_row<MR> : q6_k_row<MR>;
  // A task takes ~64K weights' rows (decode-sized matmuls are a few million weights).
  const int64_t grain = std::max<int64_t>(1, 65536 / K);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) row_dot(w + n * row_bytes, qx, 0, K, y + n, ldy);
  });
}

// y [M, N] (rows ldy apart) = int8(x) @ W^T for a Q4_K or Q6_K W, kMaxRows rows a pass.
inline void linear(const float* x, int64_t M, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                   int64_t qtype, int64_t N, int64_t K, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const float* xm = x + m * ldx;
    float* ym = y + m * ldy;
    switch (std::min(kMaxRows, M - m)) {
      case 1: linear_rows<1>(xm, ldx, w, row_bytes, qtype, N, K, ym, ldy); break;
      case 2: linear_rows<2>(xm, ldx, w, row_bytes, qtype, N, K, ym, ldy); break;
      case 3: linear_rows<3>(xm, ldx, w, row_bytes, qtype, N, K, ym, ldy); break;
      default: linear_rows<4>(xm, ldx, w, row_bytes, qtype, N, K, ym, ldy); break;
    }
  }
}

}  // namespace zllm_kquant
