// A decode step through the whole decoder stack in one call:
// the fused fast path of executor/graphs/fused_decode.py for Llama-family and Gemma 3 models on CPU.
//
// Why: at batch 1 the module path spends more time dispatching ~3,500 small torch ops a step
// (norms, RoPE, slicing, cache writes, activations: ~7 ms of SmolLM2's 18 ms forward on two
// cores) than on anything but the matmuls. Here each layer is a handful of loops over the
// step's rows between the same matmul and attention kernels the module path calls
// (gguf_linear.h, gguf_int8.h, paged_attention.h; MKL for fp32 weights), so the step costs
// about its matmuls.
//
// Rows: one per new token, each with its own position, context length and block table (a
// decode step's one token per sequence, or a verify step's few); every row's K/V is in the
// cache before any row attends, and a row attends up to its own position.
// Per layer, S rows, residual stream x [S, hidden]:
//   pre-norm (Llama):  h = norm(x);  qkv = h Wqkv^T (+b);  [q/k head norms];  RoPE;  K, V -> cache;
//                      a = attention;  x += a Wo^T;  h = norm(x);  x += down(act(gate) * up)
//   sandwich (Gemma):  as above, but each sublayer's output is normed before the residual add
//                      (post_attention / post_feedforward norms), and h = pre_feedforward norm.
// Norms are RMSNorm in fp32 with the weight as given (Gemma's 1 + w is folded in by Python).
// Norms, RoPE and activations are row_ops.h's, which the modules call on CPU too, so the
// step's results are the module path's bit for bit (tests/test_fused_decode.py).

#pragma once

#include "aten_lite.h"

#include "dense_rows.h"
#include "gguf_int8.h"
#include "gguf_linear.h"
#include "paged_attention.h"
#include "row_ops.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace zllm_fused {

// y = x W^T (+ b): GGUF parts (each its own type, writing its own output columns) or one fp32
// weight. gguf-int8 sets int8_max_rows: calls of at most that many rows use integer dots.
struct Matmul {
  std::vector<at::Tensor> blocks;  // uint8 [rows_i, bytes per row], in output-column order
  std::vector<int64_t> types;         // ggml type of each part
  at::Tensor dense;                // fp32 [N, K] when there are no GGUF parts
  at::Tensor bias;                 // fp32 [N] or undefined
  int64_t in_features = 0, out_features = 0, int8_max_rows = 0;

  Matmul(std::vector<at::Tensor> blocks_, std::vector<int64_t> types_,
         std::optional<at::Tensor> dense_, std::optional<at::Tensor> bias_,
         int64_t in_features_, int64_t int8_max_rows_)
      : blocks(std::move(blocks_)), types(std::move(types_)), in_features(in_features_),
        int8_max_rows(int8_max_rows_) {
    TORCH_CHECK(blocks.size() == types.size(), "one ggml type per GGUF part");
    TORCH_CHECK(blocks.empty() != !dense_.has_value(), "give GGUF parts or a dense weight");
    if (dense_) {
      dense = dense_->contiguous();
      TORCH_CHECK(dense.dim() == 2 && dense.scalar_type() == at::kFloat &&
                      dense.size(1) == in_features,
                  "dense weight must be fp32 [N, in_features]");
      out_features = dense.size(0);
    }
    for (const auto& part : blocks) {
      TORCH_CHECK(part.dim() == 2 && part.scalar_type() == at::kByte && part.is_contiguous(),
                  "GGUF parts must be contiguous uint8 [rows, bytes per row]");
      out_features += part.size(0);
    }
    if (bias_) {
      bias = bias_->contiguous();
      TORCH_CHECK(bias.dim() == 1 && bias.size(0) == out_features &&
                      bias.scalar_type() == at::kFloat,
                  "bias must be fp32 [out_features]");
    }
  }

  // x [S, in] contiguous -> y [S, out] contiguous. Each call is what the module path's
  // nn.Linear / GGUFLinear / GGUFSplitLinear computes.
  void operator()(const at::Tensor& x, at::Tensor& y) const;  // decode_stack.cpp
};

using zllm_rows::Activation;
using zllm_rows::kGeluTanh;
using zllm_rows::kSilu;

struct Layer {
  at::Tensor attn_norm, ffn_norm;            // pre-norms: input, before the MLP
  at::Tensor post_attn_norm, post_ffn_norm;  // sandwich only: on each sublayer's output
  at::Tensor q_norm, k_norm;                 // per-head norms [head_dim], or undefined
  Matmul qkv, o, gate_up, down;
  int64_t rope_table;  // index into DecodeStack::rope_tables; -1: no rotation (a NoPE layer)
  double scale;        // attention scale
};

class DecodeStack {
 public:
  DecodeStack(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t rotary_dim, int64_t intermediate, double eps, bool sandwich,
              int64_t activation, at::Tensor final_norm)
      : hidden_(hidden), heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim),
        rotary_dim_(rotary_dim), intermediate_(intermediate), eps_(static_cast<float>(eps)),
        sandwich_(sandwich), activation_(activation), final_norm_(checked_norm(final_norm, hidden)) {
    TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv_heads");
    TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim, "rotary_dim must be even, <= head_dim");
    TORCH_CHECK(head_dim % 8 == 0, "head_dim must be a multiple of 8");
    TORCH_CHECK(activation == kSilu || activation == kGeluTanh, "unknown activation");
  }

  // A RoPE table [positions, rotary_dim]: cos of the rotary_dim / 2 frequencies, then sin.
  int64_t add_rope_table(at::Tensor table) {
    TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat &&
                    table.size(1) == rotary_dim_,
                "rope table must be fp32 [positions, rotary_dim]");
    rope_tables_.push_back(table.contiguous());
    return static_cast<int64_t>(rope_tables_.size()) - 1;
  }

  void add_layer(at::Tensor attn_norm, at::Tensor ffn_norm,
                 std::optional<at::Tensor> post_attn_norm,
                 std::optional<at::Tensor> post_ffn_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, const Matmul& qkv, const Matmul& o,
                 const Matmul& gate_up, const Matmul& down, int64_t rope_table, double scale) {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    TORCH_CHECK(qkv.in_features == hidden_ && qkv.out_features == q_size + 2 * kv_size,
                "qkv must map hidden -> q + 2 kv");
    TORCH_CHECK(o.in_features == q_size && o.out_features == hidden_, "o must map q -> hidden");
    TORCH_CHECK(gate_up.in_features == hidden_ && gate_up.out_features == 2 * intermediate_,
                "gate_up must map hidden -> 2 intermediate");
    TORCH_CHECK(down.in_features == intermediate_ && down.out_features == hidden_,
                "down must map intermediate -> hidden");
    TORCH_CHECK(rope_table >= -1 && rope_table < static_cast<int64_t>(rope_tables_.size()),
                "unknown rope table");
    TORCH_CHECK(post_attn_norm.has_value() == sandwich_ && post_ffn_norm.has_value() == sandwich_,
                "post-sublayer norms go with the sandwich layout only");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k head norms come together");
    Layer layer{checked_norm(attn_norm, hidden_),
                checked_norm(ffn_norm, hidden_),
                post_attn_norm ? checked_norm(*post_attn_norm, hidden_) : at::Tensor(),
                post_ffn_norm ? checked_norm(*post_ffn_norm, hidden_) : at::Tensor(),
                q_norm ? checked_norm(*q_norm, head_dim_) : at::Tensor(),
                k_norm ? checked_norm(*k_norm, head_dim_) : at::Tensor(),
                qkv,
                o,
                gate_up,
                down,
                rope_table,
                scale};
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [S, hidden]: the tokens' embeddings (scaled as the model scales them); positions [S].
  // Layer l reads cache kv_caches[l] through step metadata meta_of_layer[l]: block_tables[m]
  // [S, max_blocks] (window-trimmed when windows[m] > 0), slots[m] [S] its new K/V's slots;
  // seq_lens [S] the contexts with this token. Returns the final norm's output [S, hidden];
  // without final_norm the residual stream after the last layer (a pipeline stage before the
  // last passes it on; x_in is then the stream the stage before passed).
  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& positions,
                     const std::vector<at::Tensor>& kv_caches,
                     const std::vector<int64_t>& meta_of_layer,
                     const std::vector<at::Tensor>& block_tables,
                     const std::vector<at::Tensor>& slots,
                     const std::vector<int64_t>& windows, const at::Tensor& seq_lens,
                     bool final_norm);  // decode_stack.cpp

 private:
  static at::Tensor checked_norm(const at::Tensor& w, int64_t n) {
    TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.scalar_type() == at::kFloat,
                "norm weight must be fp32 [", n, "]");
    return w.contiguous();
  }

  static void check_rows(const at::Tensor& t, int64_t S, const char* what) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == S && t.scalar_type() == at::kLong &&
                    t.is_contiguous() && t.device().is_cpu(),
                what, " must be contiguous int64 [S] on CPU");
  }

  void norm_rows(const float* x, const at::Tensor& w, int64_t S, int64_t n, float* out) const {
    const float* wp = w.data_ptr<float>();
    for (int64_t s = 0; s < S; ++s) zllm_rows::rms_norm(x + s * n, wp, n, eps_, out + s * n);
  }

  // x += sub, or x += norm(sub) in the sandwich layout.
  void add_sublayer(float* x, float* sub, const at::Tensor& post_norm, int64_t S) const {
    if (post_norm.defined()) norm_rows(sub, post_norm, S, hidden_, sub);
    for (int64_t i = 0; i < S * hidden_; ++i) x[i] = sub[i] + x[i];
  }

  // Qwen 3 / Gemma 3: an RMSNorm over each query and each key head, before RoPE.
  void head_norms(float* qkv, int64_t S, int64_t ld, const Layer& layer) const {
    const float* qw = layer.q_norm.data_ptr<float>();
    const float* kw = layer.k_norm.data_ptr<float>();
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
        float* head = qkv + s * ld + h * head_dim_;
        zllm_rows::rms_norm(head, h < heads_ ? qw : kw, head_dim_, eps_, head);
      }
  }

  // Rotate the first rotary_dim dims of every q and k head (zllm_rows::rotate).
  void rope(float* qkv, int64_t S, int64_t ld, const int64_t* pos,
            const at::Tensor& table) const {
    const int64_t half = rotary_dim_ / 2;
    for (int64_t s = 0; s < S; ++s) {
      const float* cos = table.data_ptr<float>() + pos[s] * rotary_dim_;
      for (int64_t h = 0; h < heads_ + kv_heads_; ++h)
        zllm_rows::rotate(qkv + s * ld + h * head_dim_, cos, cos + half, half);
    }
  }

  // The rows' K and V into their cache slots, at the cache's type (--kv-cache-dtype).
  void write_cache(const float* qkv, int64_t S, int64_t ld, const int64_t* slot,
                   const zllm_attn::PagedCache& cache) const {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const int64_t row = kv_heads_ * cache.head_stride;  // a slot's elements in the cache
    zllm_attn::with_elements(cache, cache.k, [&](auto* k) {
      using E = std::remove_pointer_t<decltype(k)>;
      E* v = static_cast<E*>(cache.v);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < kv_heads_; ++h) {
          const float* src = qkv + s * ld + q_size + h * head_dim_;
          const int64_t dst = slot[s] * row + h * cache.head_stride;
          zllm_attn::store_row(k + dst, src, head_dim_, cache.group_shift);
          zllm_attn::store_row(v + dst, src + kv_size, head_dim_, cache.group_shift);
        }
    });
  }

  void activate(const float* gate_up, int64_t S, float* out) const {
    zllm_rows::gated_activation(gate_up, S, 2 * intermediate_, intermediate_,
                                static_cast<Activation>(activation_), out);
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, rotary_dim_, intermediate_;
  float eps_;
  bool sandwich_;
  int64_t activation_;
  at::Tensor final_norm_;
  std::vector<at::Tensor> rope_tables_;
  std::vector<Layer> layers_;
};

}  // namespace zllm_fused
