// gguf_linear_bf16_into: y = x @ W^T with W in GGUF blocks through torch's bf16 GEMM, which
// oneDNN runs on AMX tiles where the CPU has them. For calls of many rows (prefill chunks):
// there the GEMM multiplies 4-6x faster than the block kernels' fp32 panels or integer tiles,
// and dequantizing the weights is paid once per call, not per row.
//
// The weights are never dequantized whole (a 1B model's Q4_K matrix would be 4x its blocks):
// each thread takes panels of kPanelRows weight rows, dequantizes one into a bf16 buffer that
// stays in its core's cache, multiplies x by it (the GEMM runs on that thread alone inside
// the parallel region) and widens the panel's columns of the output into y.
//
// Arithmetic: the file's values rounded to bf16, x rounded to bf16, fp32 sums, each output
// rounded to bf16 (torch has no bf16 x bf16 -> fp32 GEMM on CPU): vLLM's CPU arithmetic for a
// bf16 model, on the file's values. executor/kernels/gguf_arithmetic.py says when.

#include <ATen/ops/mm.h>

#include <cstring>
#include <vector>

#include "aten_lite.h"
#include "gguf_dequant.h"
#include "gguf_lattice.h"
#include "ops.h"

namespace {

// Enough weight rows that the GEMM's tiles run long (oneDNN's AMX kernels block N by 16-64),
// few enough that a panel of a 8192-wide matrix (1 MiB of bf16) stays in a core's L2.
constexpr int64_t kPanelRows = 64;

inline uint16_t bf16_bits(float value) {  // round to nearest even (the weights are finite)
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float widen_bf16_bits(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

}  // namespace

// x16: bf16 [M, K] contiguous; qweight: uint8 [N, bytes per row]; y: fp32 [M, N] whose rows
// may be strided (a column slice of a fused matmul's output).
void gguf_linear_bf16_into(const at::Tensor& x16, const at::Tensor& qweight, int64_t qtype,
                           at::Tensor& y) {
  using namespace zllm_gguf;
  TORCH_CHECK(x16.dim() == 2 && x16.scalar_type() == at::kBFloat16 && x16.is_contiguous(),
              "x must be contiguous bf16 [M, K]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte &&
                  qweight.is_contiguous() && x16.device().is_cpu() && qweight.device().is_cpu(),
              "qweight must be contiguous uint8 [N, bytes per row] on the CPU");
  const int64_t M = x16.size(0), K = x16.size(1), N = qweight.size(0);
  const BlockFormat* format = block_format(qtype);
  TORCH_CHECK(format != nullptr, "unsupported ggml type ", qtype);
  TORCH_CHECK(!is_lattice_type(qtype) || g_lattice_ready.load(), "ggml type ", qtype,
              " needs its lattice grid (set_lattice_tables)");
  TORCH_CHECK(K % format->values == 0 && qweight.size(1) == K / format->values * format->bytes,
              "qweight row bytes do not match K=", K);
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.size(0) == M &&
                  y.size(1) == N && y.stride(1) == 1,
              "y must be fp32 [M, N] with contiguous rows");
  if (M == 0 || N == 0) return;
  if (K == 0) {
    y.zero_();
    return;
  }
  const DequantRow dequant = format->dequant;
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const int64_t row_bytes = qweight.size(1), ldy = y.stride(0);
  float* yp = y.data_ptr<float>();
  const int64_t panels = (N + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    at::Tensor panel = x16.new_empty({kPanelRows, K});
    at::Tensor out = x16.new_empty({M, kPanelRows});
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelRows, rows = std::min(kPanelRows, N - n0);
      auto* dst = reinterpret_cast<uint16_t*>(panel.data_ptr());
      for (int64_t r = 0; r < rows; ++r) {
        dequant(wp + (n0 + r) * row_bytes, K, row.data());
        uint16_t* d = dst + r * K;
        for (int64_t k = 0; k < K; ++k) d[k] = bf16_bits(row[k]);
      }
      at::Tensor w = rows == kPanelRows ? panel : panel.narrow(0, 0, rows);
      at::Tensor o = rows == kPanelRows ? out : out.narrow(1, 0, rows).contiguous();
      at::mm_out(o, x16, w.t());
      const auto* src = reinterpret_cast<const uint16_t*>(o.data_ptr());
      for (int64_t m = 0; m < M; ++m) {
        float* yr = yp + m * ldy + n0;
        const uint16_t* sr = src + m * rows;
        for (int64_t r = 0; r < rows; ++r) yr[r] = widen_bf16_bits(sr[r]);
      }
    }
  });
}
