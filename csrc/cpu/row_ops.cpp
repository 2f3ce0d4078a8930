// The row-wise ops bound to Python (rms_norm_rows, rope_rows_, gated_activation_rows): the
// checks, then row_ops.h's loops, which decode_stack.cpp calls too.

#include "row_ops.h"

#include "aten_lite.h"
#include "ops.h"

using namespace zllm_rows;

// (weight * norm(x + residual), x + residual), or (weight * norm(x), x) without a residual:
// models/llama.py RMSNorm's contract. Outputs are contiguous.
std::tuple<at::Tensor, at::Tensor> rms_norm_rows(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const at::Tensor& weight, double eps) {
  using namespace zllm_rows;
  const Rows rows = Rows::of(x);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == rows.n && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight must be contiguous fp32 [n]");
  at::Tensor summed = x;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape");
    summed = x.new_empty(x.sizes());
    const Rows res = Rows::of(*residual);
    const float* xp = x.data_ptr<float>();
    const float* rp = residual->data_ptr<float>();
    float* sp = summed.data_ptr<float>();
    at::parallel_for(0, rows.count, rows.grain(), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* a = xp + rows.offset(r);
        const float* b = rp + res.offset(r);
        float* o = sp + r * rows.n;
        for (int64_t i = 0; i < rows.n; ++i) o[i] = a[i] + b[i];
      }
    });
  }
  auto out = x.new_empty(x.sizes());
  const Rows in = Rows::of(summed);
  const float* ip = summed.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows.count, rows.grain(), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm(ip + in.offset(r), wp, rows.n, e, op + r * rows.n);
  });
  return {out, summed};
}

// Rotates qk [T, H, D] (last dim contiguous) in place with cos, sin [T, 1, half] (each
// token's row of the RoPE table, last dim contiguous): the first 2 * half dims of each head.
at::Tensor rope_rows_(at::Tensor qk, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.scalar_type() == at::kFloat &&
                  qk.device().is_cpu(),
              "qk must be fp32 CPU [T, heads, D] with a contiguous last dim");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2);
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == 1 && t->stride(2) == 1 &&
                    t->scalar_type() == at::kFloat && 2 * t->size(2) <= D,
                "cos and sin must be fp32 [T, 1, half] with a contiguous last dim, half <= D / 2");
  TORCH_CHECK(cos.size(2) == sin.size(2), "cos and sin must have the same width");
  const int64_t half = cos.size(2);
  float* qp = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(H * D, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t)
                       for (int64_t h = 0; h < H; ++h)
                         zllm_rows::rotate(qp + t * qk.stride(0) + h * qk.stride(1),
                                           cp + t * cos.stride(0), sp + t * sin.stride(0), half);
                   });
  return qk;
}

// act(gate) * up of the fused [T, gate | up] projection (rows contiguous) -> [T, I].
at::Tensor gated_activation_rows(const at::Tensor& gate_up, int64_t activation) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0 &&
                  gate_up.scalar_type() == at::kFloat && gate_up.device().is_cpu(),
              "gate_up must be fp32 CPU [T, 2 I] with contiguous rows");
  TORCH_CHECK(activation == zllm_rows::kSilu || activation == zllm_rows::kGeluTanh,
              "unknown activation");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = gate_up.new_empty({T, I});
  zllm_rows::gated_activation(gate_up.data_ptr<float>(), T, gate_up.stride(0), I,
                              static_cast<zllm_rows::Activation>(activation),
                              out.data_ptr<float>());
  return out;
}
