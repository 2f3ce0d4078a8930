// The functions ops.cpp binds to Python, each defined in the translation unit of its kernel
// (named beside it). Declarations only: ops.cpp compiles none of the kernels.

#pragma once

#include "aten_lite.h"

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

// dense_rows.cpp: x [M, K] @ w [N, K]^T (+ bias), fp32.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias);

// gguf_linear.cpp: x @ W^T with W in GGUF blocks; into a (column slice of a) wider y; the
// fp32 rows the kernel multiplies by; the IQ1-IQ3 grids from gguf.quants.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype);
void gguf_linear_into(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                      at::Tensor& y);
at::Tensor gguf_dequantize(const at::Tensor& qweight, int64_t qtype, int64_t K);
void set_lattice_tables(const std::vector<int64_t>& types, const std::vector<at::Tensor>& grids,
                        const at::Tensor& ksigns);

// gguf_gemm.cpp: the same through torch's bf16 GEMM (AMX), W dequantized a panel at a time;
// x in bf16, y fp32 (rows may be strided).
void gguf_linear_bf16_into(const at::Tensor& x16, const at::Tensor& qweight, int64_t qtype,
                           at::Tensor& y);

// gguf_int8.cpp: the same with x rounded to int8 per 32 values (--quantization gguf-int8).
at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype);
void gguf_linear_int8_into(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                           at::Tensor& y);

// moe_experts.cpp: one projection of a MoE layer's chosen experts in one parallel region.
void moe_experts_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                        const std::vector<int64_t>& experts, const std::vector<int64_t>& starts,
                        int64_t int8_max_rows, at::Tensor& y);

// paged_attention.cpp: one query token per sequence, read from the paged KV cache.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window,
                                  const std::optional<at::Tensor>& sinks);

// row_ops.cpp: a layer's row-wise ops.
std::tuple<at::Tensor, at::Tensor> rms_norm_rows(const at::Tensor& x,
                                                 const std::optional<at::Tensor>& residual,
                                                 const at::Tensor& weight, double eps);
at::Tensor rope_rows_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor gated_activation_rows(const at::Tensor& gate_up, int64_t activation);

// state_layers.cpp: a Gated DeltaNet layer's one-token step for a step's decode rows (its
// gated norm too), each row's slot of `state` updated in place; its causal conv's step.
at::Tensor gated_delta_decode_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                               const at::Tensor& slots, bool tiled,
                               const std::optional<at::Tensor>& gate,
                               const std::optional<at::Tensor>& norm_weight, double eps);
at::Tensor causal_conv_decode_(const at::Tensor& x, at::Tensor& conv, const at::Tensor& slots,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// ... and Mamba-2's one-token step (Granite 4.0-H, Nemotron-H).
at::Tensor mamba2_decode_(const at::Tensor& x, const at::Tensor& B_in, const at::Tensor& C_in,
                          const at::Tensor& dt, const at::Tensor& A, const at::Tensor& D,
                          at::Tensor& state, const at::Tensor& slots);
