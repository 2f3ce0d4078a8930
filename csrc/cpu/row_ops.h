// Row-wise ops of a decoder layer on CPU, fp32: RMSNorm (with the residual add), RoPE,
// SiLU/GeGLU-and-mul. The fused decode step (decode_stack.h) and the model's modules
// (executor/kernels/cpu_layer_ops.py, for prefill and every step the fused path does not take) call
// the same functions, so the two paths compute the same bits; torch's eager versions of
// them cost 6, 7 and 2 small ops each, a prefill's largest share after the matmuls.
//
// Rows are independent (a row's result never depends on the batch), so they keep
// deterministic mode batch-invariant; big calls split rows over torch's OpenMP pool.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include "aten_lite.h"

#include "paged_attention.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

namespace zllm_rows {

using zllm_attn::exp8;
using zllm_simd::hsum;

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// out = x * rsqrt(mean(x^2) + eps) * w over n floats (n a multiple of 8 or not).
inline void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// Sigmoid and tanh below come from exp(x) for x <= 0 (paged_attention.h's exp8).

// silu(g) * u over n floats: g * sigmoid(g) with sigmoid from exp(-|g|), never overflowing.
inline void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_or_ps(x, sign));  // exp(-|x|)
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    // sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below.
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// gelu_tanh(g) * u. 0.5 g (1 + tanh(t)) equals g * sigmoid(2t), t = sqrt(2/pi) (g + 0.044715
// g^3): the sigmoid form has no 1 + tanh cancellation for negative g, and shares silu's
// overflow-free sigmoid.
inline void gelu_tanh_mul(const float* g, const float* u, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  const __m256 c = _mm256_set1_ps(2.f * 0.7978845608028654f), k = _mm256_set1_ps(0.044715f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 z = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(k, x), _mm256_mul_ps(x, x), x));
    const __m256 e = exp8(_mm256_or_ps(z, sign));  // exp(-|z|)
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 neg = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    const float x = g[i];
    const float z = 2.f * 0.7978845608028654f * (x + 0.044715f * x * x * x);
    out[i] = x / (1.f + std::exp(-z)) * u[i];
  }
}

// One head: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over its first 2 * half dims, as
// HF's rotate_half; dims past them (a partial rotary factor) stay.
inline void rotate(float* head, const float* cos, const float* sin, int64_t half) {
  float* x2 = head + half;
  for (int64_t i = 0; i < half; ++i) {
    const float a = head[i], b = x2[i];
    head[i] = a * cos[i] - b * sin[i];
    x2[i] = b * cos[i] + a * sin[i];
  }
}

// act(gate) * up for S rows of [gate | up] (ld floats apart), I columns each, into out [S, I].
inline void gated_activation(const float* gate_up, int64_t S, int64_t ld, int64_t I,
                             Activation activation, float* out) {
  at::parallel_for(0, S, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t s = begin; s < end; ++s) {
                       const float* g = gate_up + s * ld;
                       if (activation == kSilu)
                         silu_mul(g, g + I, I, out + s * I);
                       else
                         gelu_tanh_mul(g, g + I, I, out + s * I);
                     }
                   });
}

// Rows of a 2-D [T, n] or 3-D [T, H, n] tensor whose last dim is contiguous: row r at
// base + (r / H) * stride0 + (r % H) * stride1.
struct Rows {
  int64_t count, per_token, stride0, stride1, n;
  static Rows of(const at::Tensor& t) {
    TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1 &&
                    t.scalar_type() == at::kFloat && t.device().is_cpu(),
                "expected fp32 CPU [T, n] or [T, H, n] with a contiguous last dim");
    const int64_t H = t.dim() == 3 ? t.size(1) : 1;
    return {t.size(0) * H, H, t.stride(0), t.dim() == 3 ? t.stride(1) : 0, t.size(-1)};
  }
  int64_t offset(int64_t r) const { return r / per_token * stride0 + r % per_token * stride1; }
  int64_t grain() const { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }
};

}  // namespace zllm_rows
