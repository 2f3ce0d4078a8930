// The decode stack's step (decode_stack.h): its matmuls call the GGUF, int8 and dense kernels
// through their entry points; norms, RoPE, cache writes and attention are inlined here.

#include "decode_stack.h"

#include "aten_lite.h"
#include "ops.h"

namespace zllm_fused {

void Matmul::operator()(const at::Tensor& x, at::Tensor& y) const {
  if (dense.defined()) {
    zllm_dense::dense_linear_into(x, dense, bias, y);
    return;
  }
  const bool int8 = x.size(0) <= int8_max_rows;
  int64_t start = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    at::Tensor columns = y.narrow(1, start, blocks[i].size(0));
    if (int8)
      gguf_linear_int8_into(x, blocks[i], types[i], columns);
    else
      gguf_linear_into(x, blocks[i], types[i], columns);
    start += blocks[i].size(0);
  }
  if (bias.defined()) y.add_(bias);
}

at::Tensor DecodeStack::forward(const at::Tensor& x_in, const at::Tensor& positions,
                                const std::vector<at::Tensor>& kv_caches,
                                const std::vector<int64_t>& meta_of_layer,
                                const std::vector<at::Tensor>& block_tables,
                                const std::vector<at::Tensor>& slots,
                                const std::vector<int64_t>& windows, const at::Tensor& seq_lens,
                                bool final_norm) {
  const int64_t L = num_layers();
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == hidden_ && x_in.scalar_type() == at::kFloat,
              "x must be fp32 [S, hidden]");
  const int64_t S = x_in.size(0);
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == L &&
                  static_cast<int64_t>(meta_of_layer.size()) == L,
              "one KV cache and one metadata index per layer");
  TORCH_CHECK(block_tables.size() == slots.size() && block_tables.size() == windows.size(),
              "one block table, slot list and window per metadata");
  check_rows(positions, S, "positions");
  check_rows(seq_lens, S, "seq_lens");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (const auto& table : rope_tables_)
    for (int64_t s = 0; s < S; ++s)
      TORCH_CHECK(pos[s] >= 0 && pos[s] < table.size(0), "position beyond the RoPE table");
  for (int64_t l = 0; l < L; ++l) {
    const int64_t m = meta_of_layer[l];
    TORCH_CHECK(m >= 0 && m < static_cast<int64_t>(block_tables.size()), "bad metadata index");
  }
  // Every cache must have the same geometry (so a step's tables serve each layer that reads
  // them); each metadata is checked once.
  std::vector<bool> checked(block_tables.size(), false);
  const zllm_attn::PagedCache first = zllm_attn::paged_cache(kv_caches[0], head_dim_);
  TORCH_CHECK(first.kv_heads == kv_heads_ && first.head_dim == head_dim_,
              "KV cache heads do not match the model");
  for (int64_t l = 0; l < L; ++l) {
    const zllm_attn::PagedCache cache = zllm_attn::paged_cache(kv_caches[l], head_dim_);
    TORCH_CHECK(cache.num_blocks == first.num_blocks && cache.block_size == first.block_size &&
                    cache.kv_heads == first.kv_heads && cache.head_dim == first.head_dim,
                "every layer's KV cache must have the same shape");
    const int64_t m = meta_of_layer[l];
    if (checked[m]) continue;
    checked[m] = true;
    const auto& table = block_tables[m];
    TORCH_CHECK(table.dim() == 2 && table.size(0) == S && table.scalar_type() == at::kLong &&
                    table.is_contiguous(),
                "block tables must be contiguous int64 [S, max_blocks]");
    zllm_attn::check_tables(table.data_ptr<int64_t>(), table.size(1), lens, S, windows[m], cache);
    check_rows(slots[m], S, "slots");
    const int64_t* sl = slots[m].data_ptr<int64_t>();
    for (int64_t s = 0; s < S; ++s)
      TORCH_CHECK(sl[s] >= 0 && sl[s] < cache.num_blocks * cache.block_size, "slot out of range");
  }

  const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  const int64_t qkv_size = q_size + 2 * kv_size;
  at::Tensor x = x_in.contiguous().clone();  // the residual stream
  at::Tensor h = x_in.new_empty({S, hidden_});
  at::Tensor sub = x_in.new_empty({S, hidden_});  // a sublayer's output
  at::Tensor qkv = x_in.new_empty({S, qkv_size});
  at::Tensor attn = x_in.new_empty({S, q_size});
  at::Tensor gate_up = x_in.new_empty({S, 2 * intermediate_});
  at::Tensor act = x_in.new_empty({S, intermediate_});
  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* subp = sub.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();

  for (int64_t l = 0; l < L; ++l) {
    const Layer& layer = layers_[l];
    const int64_t m = meta_of_layer[l];
    norm_rows(xp, layer.attn_norm, S, hidden_, hp);
    layer.qkv(h, qkv);
    if (layer.q_norm.defined()) head_norms(qkvp, S, qkv_size, layer);
    if (layer.rope_table >= 0) rope(qkvp, S, qkv_size, pos, rope_tables_[layer.rope_table]);
    const zllm_attn::PagedCache cache = zllm_attn::paged_cache(kv_caches[l], head_dim_);
    write_cache(qkvp, S, qkv_size, slots[m].data_ptr<int64_t>(), cache);
    const auto& table = block_tables[m];
    zllm_attn::decode_attention(qkvp, qkv_size, head_dim_, S, heads_, cache,
                                table.data_ptr<int64_t>(), table.size(1), lens, windows[m],
                                static_cast<float>(layer.scale), attn.data_ptr<float>());
    layer.o(attn, sub);
    add_sublayer(xp, subp, layer.post_attn_norm, S);
    norm_rows(xp, layer.ffn_norm, S, hidden_, hp);
    layer.gate_up(h, gate_up);
    activate(gate_up.data_ptr<float>(), S, act.data_ptr<float>());
    layer.down(act, sub);
    add_sublayer(xp, subp, layer.post_ffn_norm, S);
  }
  if (!final_norm) return x;
  at::Tensor out = x_in.new_empty({S, hidden_});
  norm_rows(xp, final_norm_, S, hidden_, out.data_ptr<float>());
  return out;
}

}  // namespace zllm_fused
