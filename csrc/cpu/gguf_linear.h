// y = x @ W^T with W in GGUF blocks: what other translation units call (the kernels are
// gguf_linear.cpp's, compiled once there; the entry points bound to Python are in ops.h).

#pragma once

#include "gguf_dequant.h"

#include <cstdint>

namespace zllm_gguf {

// y [M, N] = x [M, K] @ W^T on checked pointers (K > 0): the kernel each row count takes.
// Every output is computed alone (a weight row against an x row), so a call over a slice of
// W's rows gives those outputs' bits (moe_experts.cpp splits W's rows so).
void linear_rows(const float* xp, int64_t M, int64_t ldx, const uint8_t* wp, int64_t row_bytes,
                 int64_t qtype, const BlockFormat& format, int64_t N, int64_t K, float* yp,
                 int64_t ldy);

}  // namespace zllm_gguf
