// paged_decode_attention, bound to Python: the checks, then paged_attention.h's kernel.

#include "paged_attention.h"

#include "aten_lite.h"
#include "ops.h"

using namespace zllm_attn;

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale,
                                  int64_t window,
                                  const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "q must be fp32 [S, H, D] with a contiguous last dim");
  const PagedCache cache = paged_cache(kv_cache, q.size(2));
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.is_contiguous(),
              "block_tables must be contiguous int64 [S, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64 [S]");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(H % cache.kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) == S && seq_lens.size(0) == S, "one table and length per sequence");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  check_tables(tables, max_blocks, lens, S, window, cache);
  if (sinks)
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H && sinks->is_contiguous() &&
                    sinks->scalar_type() == at::kFloat && sinks->device().is_cpu(),
                "sinks must be contiguous fp32 [heads] on CPU");
  auto out = q.new_empty({S, H, D});
  decode_attention(q.data_ptr<float>(), q.stride(0), q.stride(1), S, H, cache, tables, max_blocks,
                   lens, window, static_cast<float>(scale), out.data_ptr<float>(),
                   sinks ? sinks->data_ptr<float>() : nullptr);
  return out;
}
