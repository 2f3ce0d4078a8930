// y = x @ W^T with W in GGUF blocks and x quantized to int8 per 32 values: llama.cpp-style
// arithmetic, as the opt-in `--quantization gguf-int8`. (llama.cpp itself keeps fp16
// activation scales, 256-value activation blocks for K-quants and offsets from the codes'
// sums; here scales are fp32, blocks 32 values, offsets from x's own sums.)
//
// Why: the float path widens every 4-8 bit code to fp32 before an FMA (8 values per
// instruction); here the codes stay bytes and one VPMADDUBSW multiplies 32 code/activation
// pairs, summing neighbours into int16. It changes the arithmetic (activations rounded to
// 8 bits, one scale per 32 values), so it is a mode with its accuracy measured, not the
// default (BENCHMARKS.md).
//
// Every type is read as groups of 32 values: value_k = a * c_k + b, c_k a signed code (the
// type's code minus its zero point: Q4_0's 8, Q5_0's 16, Q6_K's 32), a the group's scale
// (Q6_K: one per 16 values, so a pair), b an offset (Q4_1/Q5_1's m, the K-quants'
// -dmin * min). With x_k ~ dx * qx_k:
//   sum_k value_k x_k = a * dx * sum_k c_k qx_k + b * sum_k x_k
// the first sum in int32, the second from fp32 block sums of x itself. VPMADDUBSW wants one
// unsigned operand: |c| times qx with c's sign (VPSIGNB). Pair sums stay within int16:
// 2 * 128 * 127 < 32767.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "gguf_linear.h"
#include "kquant_int8.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

namespace zllm_gguf_int8 {

using namespace zllm_gguf;

// One group of 32 values of a weight row, decoded.
struct Group {
  float a_lo, a_hi;  // scale of values 0-15 and 16-31 (equal except Q6_K)
  float b;           // offset (multiplies x's block sum)
};

// x quantized per 32 values: codes, scales, and per block the fp32 sum of x itself (not of
// its rounded codes), for the offsets.
struct QuantizedX {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K / 32]
  std::vector<float> sum;  // [M, K / 32]
};

inline QuantizedX quantize_x(const float* x, int64_t M, int64_t ldx, int64_t K) {
  const int64_t groups = K / kBlock;
  QuantizedX out{std::vector<int8_t>(M * K), std::vector<float>(M * groups),
                 std::vector<float>(M * groups)};
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const float* xb = x + m * ldx + g * kBlock;
        __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(xb + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
          total = _mm256_add_ps(total, v[i]);
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float block_sum = hsum(total);
        // A block below FLT_MIN rounds to zeros (127 / max_abs would overflow). A NaN or an
        // infinity (which max/convert would turn into finite codes) makes d NaN, so the
        // output is NaN as the float kernel's would be.
        const float max_abs = _mm_cvtss_f32(h) < FLT_MIN ? 0.0f : _mm_cvtss_f32(h);
        const float d = std::isfinite(block_sum) ? max_abs / 127.0f : NAN;
        const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
        __m256i q32[4];
        for (int i = 0; i < 4; ++i)
          q32[i] = _mm256_cvtps_epi32(_mm256_round_ps(
              _mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // int32 -> int8 keeping order: packs interleave 128-bit lanes, a permute undoes it.
        const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]);
        const __m256i q16b = _mm256_packs_epi32(q32[2], q32[3]);
        const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&out.q[m * K + g * kBlock]), q8);
        out.d[m * groups + g] = d;
        out.sum[m * groups + g] = block_sum;
      }
  });
  return out;
}

// --- Decoding one weight row into codes and groups, per type --------------------------------

// Writes K signed codes and K / 32 groups.
using DecodeRow = void (*)(const uint8_t* row, int64_t K, int8_t* codes, Group* groups);

inline void store_codes(int8_t* p, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

inline void decode_q4_0(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 18;
    store_codes(codes + g * kBlock, _mm256_sub_epi8(nibbles_32(blk + 2), _mm256_set1_epi8(8)));
    const float d = half_to_float(blk);
    groups[g] = {d, d, 0.0f};
  }
}

inline void decode_q4_1(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 20;
    store_codes(codes + g * kBlock, nibbles_32(blk + 4));
    const float d = half_to_float(blk);
    groups[g] = {d, d, half_to_float(blk + 2)};
  }
}

inline void decode_q5_0(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 22;
    const __m256i codes32 = _mm256_or_si256(nibbles_32(blk + 6), fifth_bits_32(blk + 2));
    store_codes(codes + g * kBlock, _mm256_sub_epi8(codes32, _mm256_set1_epi8(16)));
    const float d = half_to_float(blk);
    groups[g] = {d, d, 0.0f};
  }
}

inline void decode_q5_1(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 24;
    store_codes(codes + g * kBlock, _mm256_or_si256(nibbles_32(blk + 8), fifth_bits_32(blk + 4)));
    const float d = half_to_float(blk);
    groups[g] = {d, d, half_to_float(blk + 2)};
  }
}

inline void decode_q8_0(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 34;
    std::memcpy(codes + g * kBlock, blk + 2, kBlock);  // already signed
    const float d = half_to_float(blk);
    groups[g] = {d, d, 0.0f};
  }
}

inline void decode_q4_k(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 144;
    float dsc[8], dm[8];
    k_scales_mins(blk + 4, half_to_float(blk), half_to_float(blk + 2), dsc, dm);
    for (int s = 0; s < 8; ++s) {
      store_codes(codes + b * kSuper + 32 * s, q4_k_codes(blk, s));
      groups[b * 8 + s] = {dsc[s], dsc[s], -dm[s]};
    }
  }
}

inline void decode_q5_k(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 176;
    float dsc[8], dm[8];
    k_scales_mins(blk + 4, half_to_float(blk), half_to_float(blk + 2), dsc, dm);
    for (int s = 0; s < 8; ++s) {
      store_codes(codes + b * kSuper + 32 * s, q5_k_codes(blk, s));
      groups[b * 8 + s] = {dsc[s], dsc[s], -dm[s]};
    }
  }
}

inline void decode_q6_k(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 210;
    const float d = half_to_float(blk + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    for (int t = 0; t < 8; ++t) {
      store_codes(codes + b * kSuper + 32 * t, q6_k_codes(blk, t));
      groups[b * 8 + t] = {d * static_cast<float>(scales[2 * t]),
                           d * static_cast<float>(scales[2 * t + 1]), 0.0f};
    }
  }
}

inline DecodeRow decoder(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return decode_q4_0;
    case kQ4_1: return decode_q4_1;
    case kQ5_0: return decode_q5_0;
    case kQ5_1: return decode_q5_1;
    case kQ8_0: return decode_q8_0;
    case kQ4_K: return decode_q4_k;
    case kQ5_K: return decode_q5_k;
    case kQ6_K: return decode_q6_k;
    default: return nullptr;
  }
}

// One decoded weight row against one quantized x row. PAIR: two scales per group (Q6_K);
// OFFSET: the type has an offset b.
template <bool PAIR, bool OFFSET>
inline float dot_row(const int8_t* codes, const Group* groups, const QuantizedX& qx, int64_t m,
                     int64_t K) {
  const int64_t num_groups = K / kBlock;
  const int8_t* xq = qx.q.data() + m * K;
  const float* dx = qx.d.data() + m * num_groups;
  const float* xsum = qx.sum.data() + m * num_groups;
  const __m256i ones_16 = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  float offset = 0.0f;
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kBlock));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * kBlock));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(q, c));
    const __m256i sums = _mm256_madd_epi16(pairs, ones_16);  // lanes 0-3: values 0-15
    const Group& gr = groups[g];
    const __m256 scale = PAIR ? _mm256_setr_m128(_mm_set1_ps(gr.a_lo * dx[g]),
                                                 _mm_set1_ps(gr.a_hi * dx[g]))
                              : _mm256_set1_ps(gr.a_lo * dx[g]);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
    if (OFFSET) offset += gr.b * xsum[g];
  }
  return hsum(acc) + offset;
}

// A panel of kPanel decoded weight rows against one quantized x row: one accumulator chain
// per weight row (a single chain would wait on the FMA's latency every group), and the x
// block loaded once for all of them.
constexpr int64_t kPanel = 4;

template <bool PAIR, bool OFFSET>
inline void dot_panel(const int8_t* codes, const Group* groups, const QuantizedX& qx, int64_t m,
                      int64_t K, float* out) {
  const int64_t num_groups = K / kBlock;
  const int8_t* xq = qx.q.data() + m * K;
  const float* dx = qx.d.data() + m * num_groups;
  const float* xsum = qx.sum.data() + m * num_groups;
  const __m256i ones_16 = _mm256_set1_epi16(1);
  __m256 acc[kPanel];
  float offset[kPanel];
  for (int j = 0; j < kPanel; ++j) {
    acc[j] = _mm256_setzero_ps();
    offset[j] = 0.0f;
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * kBlock));
    for (int j = 0; j < kPanel; ++j) {
      const __m256i c =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * K + g * kBlock));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(q, c));
      const __m256i sums = _mm256_madd_epi16(pairs, ones_16);
      const Group& gr = groups[j * num_groups + g];
      const __m256 scale = PAIR ? _mm256_setr_m128(_mm_set1_ps(gr.a_lo * dx[g]),
                                                   _mm_set1_ps(gr.a_hi * dx[g]))
                                : _mm256_set1_ps(gr.a_lo * dx[g]);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[j]);
      if (OFFSET) offset[j] += gr.b * xsum[g];
    }
  }
  for (int j = 0; j < kPanel; ++j) out[j] = hsum(acc[j]) + offset[j];
}

// Two x rows against a panel of kPanel weight rows: each code vector loaded (and its absolute
// value taken) once for both rows; 8 accumulator chains.
template <bool PAIR, bool OFFSET>
inline void dot_panel_2rows(const int8_t* codes, const Group* groups, const QuantizedX& qx,
                            int64_t m, int64_t K, float* out, int64_t ldy) {
  constexpr int MR = 2;
  const int64_t num_groups = K / kBlock;
  const __m256i ones_16 = _mm256_set1_epi16(1);
  __m256 acc[MR][kPanel];
  float offset[MR][kPanel];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kPanel; ++j) {
      acc[i][j] = _mm256_setzero_ps();
      offset[i][j] = 0.0f;
    }
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256i q[MR];
    float dx[MR], xsum[MR];
    for (int i = 0; i < MR; ++i) {
      q[i] = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(qx.q.data() + (m + i) * K + g * kBlock));
      dx[i] = qx.d[(m + i) * num_groups + g];
      xsum[i] = qx.sum[(m + i) * num_groups + g];
    }
    for (int j = 0; j < kPanel; ++j) {
      const __m256i c =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * K + g * kBlock));
      const __m256i magnitude = _mm256_abs_epi8(c);
      const Group& gr = groups[j * num_groups + g];
      for (int i = 0; i < MR; ++i) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q[i], c));
        const __m256i sums = _mm256_madd_epi16(pairs, ones_16);
        const __m256 scale = PAIR ? _mm256_setr_m128(_mm_set1_ps(gr.a_lo * dx[i]),
                                                     _mm_set1_ps(gr.a_hi * dx[i]))
                                  : _mm256_set1_ps(gr.a_lo * dx[i]);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[i][j]);
        if (OFFSET) offset[i][j] += gr.b * xsum[i];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kPanel; ++j) out[i * ldy + j] = hsum(acc[i][j]) + offset[i][j];
}

using DotRow = float (*)(const int8_t*, const Group*, const QuantizedX&, int64_t, int64_t);
using DotPanel2 = void (*)(const int8_t*, const Group*, const QuantizedX&, int64_t, int64_t,
                           float*, int64_t);
using DotPanel = void (*)(const int8_t*, const Group*, const QuantizedX&, int64_t, int64_t,
                          float*);

}  // namespace zllm_gguf_int8

namespace zllm_gguf_int8 {

// y [M, N] = quantize_int8(x) [M, K] @ W^T on checked pointers. Every output is computed
// alone (one weight row's codes against one x row's), so a call over a 4-aligned slice of W's
// rows gives those outputs' bits (csrc/cpu/moe_experts.h splits W's rows so).
inline void linear_int8_rows(const float* xp, int64_t M, int64_t ldx, const uint8_t* wp,
                             int64_t row_bytes, int64_t qtype, DecodeRow decode, int64_t N,
                             int64_t K, float* yp, int64_t ldy) {
  if (zllm_kquant::serves(qtype)) {  // Q3_K / Q4_K / Q6_K: whole super-blocks
    zllm_kquant::linear(xp, M, ldx, wp, row_bytes, qtype, N, K, yp, ldy);
    return;
  }
  const QuantizedX qx = quantize_x(xp, M, ldx, K);
  const bool has_offset = qtype == kQ4_1 || qtype == kQ5_1 || qtype == kQ4_K || qtype == kQ5_K;
  const DotRow dot = qtype == kQ6_K ? dot_row<true, false>
                     : has_offset   ? dot_row<false, true>
                                    : dot_row<false, false>;
  const DotPanel dot4 = qtype == kQ6_K ? dot_panel<true, false>
                        : has_offset   ? dot_panel<false, true>
                                       : dot_panel<false, false>;
  const DotPanel2 dot4x2 = qtype == kQ6_K ? dot_panel_2rows<true, false>
                           : has_offset   ? dot_panel_2rows<false, true>
                                          : dot_panel_2rows<false, false>;
  // Each weight row is decoded once per call, kPanel rows at a time, and its codes (1 byte a
  // value) reused by every x row while they sit in L1. A task takes ~16K weights' panels.
  const int64_t grain = std::max<int64_t>(1, 16384 / K);
  at::parallel_for(0, (N + kPanel - 1) / kPanel, grain, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> codes(kPanel * K);
    std::vector<Group> groups(kPanel * (K / kBlock));
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, nr = std::min<int64_t>(kPanel, N - n0);
      for (int64_t j = 0; j < nr; ++j)
        decode(wp + (n0 + j) * row_bytes, K, codes.data() + j * K,
               groups.data() + j * (K / kBlock));
      int64_t m = 0;
      if (nr == kPanel)
        for (; m + 2 <= M; m += 2)
          dot4x2(codes.data(), groups.data(), qx, m, K, yp + m * ldy + n0, ldy);
      for (; m < M; ++m) {
        if (nr == kPanel) {
          dot4(codes.data(), groups.data(), qx, m, K, yp + m * ldy + n0);
          continue;
        }
        for (int64_t j = 0; j < nr; ++j)
          yp[m * ldy + n0 + j] =
              dot(codes.data() + j * K, groups.data() + j * (K / kBlock), qx, m, K);
      }
    }
  });
}

}  // namespace zllm_gguf_int8

// y [M, N] = quantize_int8(x) [M, K] @ W^T into y (rows may be strided), W in GGUF blocks.
void gguf_linear_int8_into(const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype,
                           torch::Tensor& y) {
  using namespace zllm_gguf_int8;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be fp32 [M, K]");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu() && y.device().is_cpu(),
              "the GGUF kernels run on CPU tensors");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kUInt8 &&
                  qweight.is_contiguous(),
              "qweight must be contiguous uint8 [N, bytes per row]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const BlockFormat* format = block_format(qtype);
  const DecodeRow decode = decoder(qtype);
  TORCH_CHECK(format != nullptr && (decode != nullptr || zllm_kquant::serves(qtype)),
              "unsupported ggml type ", qtype);
  TORCH_CHECK(K % format->values == 0 && qweight.size(1) == K / format->values * format->bytes,
              "qweight row bytes do not match K=", K);
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat32 && y.size(0) == M &&
                  y.size(1) == N && y.stride(1) == 1,
              "y must be fp32 [M, N] with contiguous rows");
  if (M == 0 || N == 0) return;
  linear_int8_rows(x.data_ptr<float>(), M, x.stride(0), qweight.data_ptr<uint8_t>(),
                   qweight.size(1), qtype, decode, N, K, y.data_ptr<float>(), y.stride(0));
}

torch::Tensor gguf_linear_int8(const torch::Tensor& x, const torch::Tensor& qweight,
                               int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be fp32 [M, K]");
  auto y = torch::empty({x.size(0), qweight.size(0)}, x.options());
  gguf_linear_int8_into(x, qweight, qtype, y);
  return y;
}
