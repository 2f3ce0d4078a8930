// One projection of a mixture-of-experts layer's chosen experts in one parallel region
// (executor/layers/moe/'s decode path).
//
// Why: a decode step's experts are tiny matmuls (Qwen3-30B-A3B: 8 chosen experts, 1536 x 2048
// and 2048 x 768 each). One kernel call per expert opens an OpenMP region per matmul, and
// its fork and barrier took 10-17% of the step (perf, issue 57). Here the tasks are (expert,
// slice of its weight rows) pairs, shared by one region; inside it each task runs the same
// kernel the per-expert call would (gguf_linear.h's linear_rows, or gguf_int8.h's
// linear_int8_rows under gguf-int8), serially (ATen runs a parallel_for nested in a region
// inline). Each output is computed alone from one weight row and one x row, and the slices
// start at multiples of kSliceAlign (a multiple of every kernel's weight-row panel: 3, 4, 12,
// 16), so every output's bits are the per-expert call's.

#include <ATen/Parallel.h>
#include "aten_lite.h"

#include "gguf_checks.h"
#include "gguf_int8.h"
#include "gguf_linear.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace zllm_moe {

constexpr int64_t kSliceAlign = 48;
// Tasks per thread the slices aim at, so experts with more rows than others even out.
constexpr int64_t kTasksPerThread = 4;

struct Task {
  int64_t group;       // index into the chosen experts
  int64_t begin, end;  // its weight rows (output columns)
};

}  // namespace zllm_moe

// y [R, N] (rows may be strided) = x [R, K] through the chosen experts: rows
// starts[g] .. starts[g + 1] of x through experts[g]'s matrix blocks[experts[g]] ([E, N, bytes
// per row]). A group of at most int8_max_rows rows takes the integer kernel (gguf-int8).
void moe_experts_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                        const std::vector<int64_t>& experts, const std::vector<int64_t>& starts,
                        int64_t int8_max_rows, at::Tensor& y) {
  using namespace zllm_moe;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be fp32 [R, K] with contiguous rows");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous(),
              "blocks must be contiguous uint8 [E, N, bytes per row]");
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu() && y.device().is_cpu(),
              "the GGUF kernels run on CPU tensors");
  const int64_t R = x.size(0), K = x.size(1), E = blocks.size(0), N = blocks.size(1);
  const int64_t row_bytes = blocks.size(2);
  const zllm_gguf::BlockFormat& format = zllm_gguf::checked_type(qtype);
  TORCH_CHECK(K > 0, "x must have values (K > 0)");
  zllm_gguf::check_row_bytes(format, row_bytes, K);
  zllm_gguf::check_output(y, R, N);
  const int64_t G = static_cast<int64_t>(experts.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == G + 1 && (G == 0 || starts[0] == 0) &&
                  starts[G] == R,
              "starts must run from 0 to the row count, one more than experts");
  for (int64_t g = 0; g < G; ++g)
    TORCH_CHECK(experts[g] >= 0 && experts[g] < E && starts[g] <= starts[g + 1],
                "expert ", experts[g], " or its rows are out of range");
  const zllm_gguf_int8::DecodeRow decode = zllm_gguf_int8::decoder(qtype);
  const bool int8_ok = decode != nullptr || zllm_kquant::serves(qtype);
  if (R == 0 || N == 0) return;

  // Slices of N per expert: enough tasks for every thread, each a multiple of kSliceAlign.
  const int64_t wanted = kTasksPerThread * at::get_num_threads();
  const int64_t slices = std::max<int64_t>(1, (wanted + G - 1) / G);
  int64_t slice = (N + slices - 1) / slices;
  slice = (slice + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  std::vector<Task> tasks;
  for (int64_t g = 0; g < G; ++g)
    if (starts[g + 1] > starts[g])
      for (int64_t n0 = 0; n0 < N; n0 += slice) tasks.push_back({g, n0, std::min(N, n0 + slice)});

  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t m0 = starts[task.group], M = starts[task.group + 1] - m0;
      const uint8_t* w = wp + (experts[task.group] * N + task.begin) * row_bytes;
      const int64_t n = task.end - task.begin;
      float* out = yp + m0 * ldy + task.begin;
      if (int8_ok && M <= int8_max_rows)
        zllm_gguf_int8::linear_int8_rows(xp + m0 * ldx, M, ldx, w, row_bytes, qtype, decode, n,
                                         K, out, ldy);
      else
        zllm_gguf::linear_rows(xp + m0 * ldx, M, ldx, w, row_bytes, qtype, format, n, K, out,
                               ldy);
    }
  });
}
