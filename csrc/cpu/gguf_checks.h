// The argument checks every matmul over GGUF blocks makes (gguf_linear.cpp, gguf_int8.cpp,
// gguf_gemm.cpp, moe_experts.cpp): one rule, one message, for each mistake a caller can make.

#pragma once

#include "aten_lite.h"
#include "gguf_dequant.h"
#include "gguf_lattice.h"

#include <cstdint>

namespace zllm_gguf {

// The block layout of a type the kernels read; refuses one they do not, and a lattice type
// before set_lattice_tables has handed its grid over.
inline const BlockFormat& checked_type(int64_t qtype) {
  const BlockFormat* format = block_format(qtype);
  TORCH_CHECK(format != nullptr, "unsupported ggml type ", qtype);
  TORCH_CHECK(!is_lattice_type(qtype) || g_lattice_ready.load(), "ggml type ", qtype,
              " needs its lattice grid, which set_lattice_tables has not been given (zllm's "
              "executor/kernels/cpu.py load() hands gguf-py's over)");
  return *format;
}

// A weight row of K values takes `row_bytes` bytes of whole blocks.
inline void check_row_bytes(const BlockFormat& format, int64_t row_bytes, int64_t K) {
  TORCH_CHECK(K % format.values == 0 && row_bytes == K / format.values * format.bytes,
              "qweight row bytes do not match K=", K);
}

// qweight: contiguous uint8 [N, bytes per row] holding K values a row in `qtype`'s blocks.
inline const BlockFormat& checked_blocks(const at::Tensor& qweight, int64_t qtype, int64_t K) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte &&
                  qweight.is_contiguous(),
              "qweight must be contiguous uint8 [N, bytes per row]");
  const BlockFormat& format = checked_type(qtype);
  check_row_bytes(format, qweight.size(1), K);
  return format;
}

// y: fp32 [M, N] whose rows are contiguous (they may be strided: a column slice of a fused
// matmul's wider output).
inline void check_output(const at::Tensor& y, int64_t M, int64_t N) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.size(0) == M &&
                  y.size(1) == N && y.stride(1) == 1,
              "y must be fp32 [", M, ", ", N, "] with contiguous rows");
}

}  // namespace zllm_gguf
