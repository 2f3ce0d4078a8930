// The integer kernel of gguf_int8.h: x rounded to int8 per 32 values against decoded weight
// codes (the arithmetic is described there).

#include "gguf_int8.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "aten_lite.h"
#include "gguf_checks.h"
#include "kquant_int8.h"
#include "ops.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

namespace zllm_gguf_int8 {

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

void linear_int8_rows(const float* xp, int64_t M, int64_t ldx, const uint8_t* wp,
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
void gguf_linear_int8_into(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                           at::Tensor& y) {
  using namespace zllm_gguf_int8;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu() && y.device().is_cpu(),
              "the GGUF kernels run on CPU tensors");
  const int64_t M = x.size(0), K = x.size(1);
  zllm_gguf::checked_blocks(qweight, qtype, K);
  const int64_t N = qweight.size(0);
  const DecodeRow decode = decoder(qtype);
  TORCH_CHECK(decode != nullptr || zllm_kquant::serves(qtype), "ggml type ", qtype,
              " has no integer path");
  zllm_gguf::check_output(y, M, N);
  if (M == 0 || N == 0) return;
  linear_int8_rows(x.data_ptr<float>(), M, x.stride(0), qweight.data_ptr<uint8_t>(),
                   qweight.size(1), qtype, decode, N, K, y.data_ptr<float>(), y.stride(0));
}

at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& qweight,
                            int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  auto y = x.new_empty({x.size(0), qweight.size(0)});
  gguf_linear_int8_into(x, qweight, qtype, y);
  return y;
}
