// dense_linear, bound to Python: dense_rows.h's kernel or torch's matmul.

#include "dense_rows.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>

#include "aten_lite.h"
#include "ops.h"

namespace zllm_dense {

void dense_linear_into(const at::Tensor& x, const at::Tensor& w,
                       const at::Tensor& bias, at::Tensor& y) {
  const DenseRowsKernel kernel = dense_rows_kernel(x.size(0));
  if (kernel != nullptr && x.stride(1) == 1 && w.is_contiguous() && y.is_contiguous()) {
    kernel(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), w.size(0), w.size(1),
           y.data_ptr<float>(), y.stride(0));
    if (bias.defined()) y.add_(bias);
    return;
  }
  if (bias.defined())
    at::addmm_out(y, bias, x, w.t());
  else
    at::mm_out(y, x, w.t());
}

}  // namespace zllm_dense

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.dim() == 2 &&
                  w.scalar_type() == at::kFloat && x.size(1) == w.size(1),
              "dense_linear: fp32 x [M, K] and w [N, K]");
  auto y = x.new_empty({x.size(0), w.size(0)});
  zllm_dense::dense_linear_into(x, w, bias ? *bias : at::Tensor(), y);
  return y;
}
