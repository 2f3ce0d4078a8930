// gguf_linear_bf16_into: y = x @ W^T with W in GGUF blocks through torch's bf16 GEMM, which
// oneDNN runs on AMX tiles where the CPU has them. For calls of many rows (prefill chunks):
// there the GEMM multiplies 4-6x faster than the block kernels' fp32 panels or integer tiles,
// and dequantizing the weights is paid once per call, not per row.
//
// The weights are never dequantized whole (a 1B model's Q4_K matrix would be 4x its blocks):
// each thread takes panels of kPanelRows weight rows, dequantizes one into a bf16 buffer that
// stays in its core's cache, multiplies x by it (the GEMM runs on that thread alone inside
// the parallel region) and widens the panel's columns of the output into y. A matrix of
// fewer panels than threads is dequantized whole instead and multiplied by one GEMM over
// every thread.
//
// Arithmetic: the file's values rounded to bf16, x rounded to bf16, fp32 sums, each output
// rounded to bf16 (torch has no bf16 x bf16 -> fp32 GEMM on CPU): vLLM's CPU arithmetic for a
// bf16 model, on the file's values. executor/kernels/gguf_arithmetic.py says when.

#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "aten_lite.h"
#include "gguf_checks.h"
#include "ops.h"

namespace {

// Enough weight rows that the GEMM's tiles run long (oneDNN's AMX kernels block N by 16-64),
// few enough that a panel of a 8192-wide matrix (1 MiB of bf16) stays in a core's L2.
constexpr int64_t kPanelRows = 64;

inline uint16_t bf16_bits(float value) {  // round to nearest even; a NaN stays a NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float widen_bf16_bits(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// Weight rows [n0, n0 + rows) into dst (bf16, K values a row), each through an fp32 row.
void dequant_rows_bf16(zllm_gguf::DequantRow dequant, const uint8_t* wp, int64_t row_bytes,
                       int64_t n0, int64_t rows, int64_t K, float* row, uint16_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    dequant(wp + (n0 + r) * row_bytes, K, row);
    uint16_t* d = dst + r * K;
    for (int64_t k = 0; k < K; ++k) d[k] = bf16_bits(row[k]);
  }
}

// out rows [m0, m1) of a bf16 [M, cols] product widened into y's columns [n0, n0 + cols).
void widen_into(const uint16_t* out, int64_t m0, int64_t m1, int64_t cols, float* yp,
                int64_t ldy, int64_t n0) {
  for (int64_t m = m0; m < m1; ++m) {
    float* yr = yp + m * ldy + n0;
    const uint16_t* sr = out + m * cols;
    for (int64_t c = 0; c < cols; ++c) yr[c] = widen_bf16_bits(sr[c]);
  }
}

}  // namespace

// x16: bf16 [M, K] contiguous; qweight: uint8 [N, bytes per row]; y: fp32 [M, N] whose rows
// may be strided (a column slice of a fused matmul's output).
void gguf_linear_bf16_into(const at::Tensor& x16, const at::Tensor& qweight, int64_t qtype,
                           at::Tensor& y) {
  using namespace zllm_gguf;
  TORCH_CHECK(x16.dim() == 2 && x16.scalar_type() == at::kBFloat16 && x16.is_contiguous(),
              "x must be contiguous bf16 [M, K]");
  TORCH_CHECK(x16.device().is_cpu() && qweight.device().is_cpu() && y.device().is_cpu(),
              "the GGUF kernels run on CPU tensors");
  const int64_t M = x16.size(0), K = x16.size(1);
  const DequantRow dequant = checked_blocks(qweight, qtype, K).dequant;
  const int64_t N = qweight.size(0);
  check_output(y, M, N);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    y.zero_();
    return;
  }
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const int64_t row_bytes = qweight.size(1), ldy = y.stride(0);
  float* yp = y.data_ptr<float>();
  const int64_t panels = (N + kPanelRows - 1) / kPanelRows;
  if (panels < at::get_num_threads()) {
    // Fewer panels than threads (a narrow matrix on a many-core CPU): the matrix in bf16
    // whole (at most 64 rows a thread), its rows dequantized in parallel, then one GEMM that
    // oneDNN spreads over every thread.
    at::Tensor w = x16.new_empty({N, K});
    auto* wq = reinterpret_cast<uint16_t*>(w.data_ptr());
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      dequant_rows_bf16(dequant, wp, row_bytes, begin, end - begin, K, row.data(),
                        wq + begin * K);
    });
    const at::Tensor out = at::mm(x16, w.t());
    const auto* src = reinterpret_cast<const uint16_t*>(out.data_ptr());
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      widen_into(src, begin, end, N, yp, ldy, 0);
    });
    return;
  }
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    at::Tensor panel = x16.new_empty({kPanelRows, K});
    at::Tensor out = x16.new_empty({M, kPanelRows});
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelRows, rows = std::min(kPanelRows, N - n0);
      dequant_rows_bf16(dequant, wp, row_bytes, n0, rows, K, row.data(),
                        reinterpret_cast<uint16_t*>(panel.data_ptr()));
      // (A partial last panel: its first rows, and a contiguous [M, rows] product.)
      const at::Tensor w = rows == kPanelRows ? panel : panel.narrow(0, 0, rows);
      at::Tensor o = out.view({-1}).narrow(0, 0, M * rows).view({M, rows});
      at::mm_out(o, x16, w.t());
      widen_into(reinterpret_cast<const uint16_t*>(o.data_ptr()), 0, M, rows, yp, ldy, n0);
    }
  });
}
