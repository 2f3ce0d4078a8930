// A Gated DeltaNet state layer's one-token step (executor/layers/gated_delta_rule.py
// recurrent_step's arithmetic), for the decode rows of a step: every (sequence, value head)
// reads its slot's recurrent state once, decays and updates it in place, and reads its output
// from the new state, where torch's eager ops gather the slots' states, make five passes over
// them and scatter them back.
//
// Per value head, with S [key_dim, value_dim] the slot's state, k and q L2-normalised (q also
// scaled by key_dim^-1/2), d = exp(g):
//     m     = d * S^T k                   what the decayed state recalls for k
//     delta = beta * (v - m)
//     S     = d * S + k delta^T           (in place)
//     out   = S^T q
// and, given the gate z and the norm's weight w, the layer's gated RMSNorm of out:
//     out   = w * out / rms(out) * silu(z)
// Also the one-input step of the causal conv before it (causal_conv_decode_), and Mamba-2's
// one-token step (mamba2_decode_, executor/layers/mamba2_scan.py scan_step's arithmetic).

#include "aten_lite.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// x / sqrt(sum(x^2) + eps), the FLA library's and transformers' l2norm, times `scale`.
void l2_normalized(const float* x, int64_t n, float scale, float* out) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = scale / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
}

}  // namespace

// One new input per sequence through the depthwise causal conv: x [B, C] after each row's
// window conv[slot] [C, K - 1] (oldest first), weight [C, K], bias [C] or none ->
// silu(conv + bias) [B, C]; each window moves on by one, in place.
at::Tensor causal_conv_decode_(const at::Tensor& x, at::Tensor& conv, const at::Tensor& slots,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1),
              "x must be [B, C] and weight [C, K]");
  const int64_t B = x.size(0), C = x.size(1), K = weight.size(1);
  TORCH_CHECK(conv.dim() == 3 && conv.size(1) == C && conv.size(2) == K - 1 && conv.is_contiguous(),
              "conv must be contiguous [slots, C, K - 1]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong,
              "slots must be int64 [B]");
  const at::Tensor& pool = conv;
  for (const at::Tensor* t : {&x, &weight, &pool})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "x, conv and weight must be contiguous fp32 on the CPU");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == C && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "bias must be contiguous fp32 [C]");
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < conv.size(0), "a slot outside the state pool");
  auto out = x.new_empty({B, C});
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* cp = conv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * C, 256, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / C, c = task % C;
      float* window = cp + (slot[b] * C + c) * (K - 1);
      const float* w = wp + c * K;
      const float input = xp[b * C + c];
      float sum = bp != nullptr ? bp[c] : 0.0f;
      for (int64_t i = 0; i < K - 1; ++i) sum += w[i] * window[i];
      sum += w[K - 1] * input;
      for (int64_t i = 0; i + 1 < K - 1; ++i) window[i] = window[i + 1];
      if (K > 1) window[K - 2] = input;
      op[b * C + c] = sum / (1.0f + std::exp(-sum));
    }
  });
  return out;
}

at::Tensor gated_delta_decode_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                               const at::Tensor& slots, bool tiled,
                               const std::optional<at::Tensor>& gate,
                               const std::optional<at::Tensor>& norm_weight, double eps) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "q, k must be [B, key_heads, key_dim] and v [B, heads, value_dim]");
  const int64_t B = q.size(0), key_heads = q.size(1), key_dim = q.size(2);
  const int64_t heads = v.size(1), value_dim = v.size(2);
  TORCH_CHECK(heads % key_heads == 0, "value heads must be a multiple of key heads");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == heads && state.size(2) == key_dim &&
                  state.size(3) == value_dim && state.is_contiguous(),
              "state must be contiguous [slots, heads, key_dim, value_dim]");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == B && g.size(1) == heads && beta.sizes() == g.sizes(),
              "g and beta must be [B, heads]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong,
              "slots must be int64 [B]");
  const at::Tensor& pool = state;
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta, &pool})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "the step's tensors must be contiguous fp32 on the CPU");
  const int64_t num_slots = state.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "a slot outside the state pool");

  auto out = v.new_empty({B, heads, value_dim});
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t per_key_head = heads / key_heads;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(key_dim));
  const int64_t head_elems = key_dim * value_dim;
  // With `gate` [B, heads, value_dim] and `norm_weight` [value_dim]: each head's output
  // normed, times the weight and silu(gate) (the layer's gated RMSNorm), in the same task.
  const bool gated = gate.has_value();
  TORCH_CHECK(gated == norm_weight.has_value(), "gate and norm_weight go together");
  if (gated) {
    TORCH_CHECK(gate->sizes() == v.sizes() && gate->is_contiguous() &&
                    gate->scalar_type() == at::kFloat,
                "gate must be contiguous fp32 [B, heads, value_dim]");
    TORCH_CHECK(norm_weight->dim() == 1 && norm_weight->size(0) == value_dim &&
                    norm_weight->is_contiguous() && norm_weight->scalar_type() == at::kFloat,
                "norm_weight must be contiguous fp32 [value_dim]");
  }
  const float* zp = gated ? gate->data_ptr<float>() : nullptr;
  const float* nw = gated ? norm_weight->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);

  at::parallel_for(0, B * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(key_dim), kn(key_dim), recalled(value_dim), delta(value_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads;
      const int64_t kh = tiled ? h % key_heads : h / per_key_head;
      l2_normalized(qp + (b * key_heads + kh) * key_dim, key_dim, q_scale, qn.data());
      l2_normalized(kp + (b * key_heads + kh) * key_dim, key_dim, 1.0f, kn.data());
      float* S = sp + (slot[b] * heads + h) * head_elems;
      const float decay = std::exp(gp[b * heads + h]);
      const float rate = bp[b * heads + h];
      const float* vh = vp + (b * heads + h) * value_dim;
      float* oh = op + (b * heads + h) * value_dim;
      std::fill(recalled.begin(), recalled.end(), 0.0f);
      for (int64_t i = 0; i < key_dim; ++i) {
        const float ki = kn[i];
        const float* row = S + i * value_dim;
        for (int64_t j = 0; j < value_dim; ++j) recalled[j] += ki * row[j];
      }
      for (int64_t j = 0; j < value_dim; ++j) {
        delta[j] = rate * (vh[j] - decay * recalled[j]);
        oh[j] = 0.0f;
      }
      for (int64_t i = 0; i < key_dim; ++i) {
        const float ki = kn[i], qi = qn[i];
        float* row = S + i * value_dim;
        for (int64_t j = 0; j < value_dim; ++j) {
          const float updated = decay * row[j] + ki * delta[j];
          row[j] = updated;
          oh[j] += qi * updated;
        }
      }
      if (gated) {
        float squares = 0.0f;
        for (int64_t j = 0; j < value_dim; ++j) squares += oh[j] * oh[j];
        const float inv = 1.0f / std::sqrt(squares / static_cast<float>(value_dim) + e);
        const float* zh = zp + (b * heads + h) * value_dim;
        for (int64_t j = 0; j < value_dim; ++j)
          oh[j] = nw[j] * (oh[j] * inv) * (zh[j] / (1.0f + std::exp(-zh[j])));
      }
    }
  });
  return out;
}

// Mamba-2's one-token step for a step's decode rows. Per head h (reading B and C of its group,
// heads / groups consecutive heads to a group), with S [state_size, head_dim] the slot's
// state, dt > 0 the head's step and a = exp(dt * A) its decay:
//     S   = a * S + B (dt x)^T              (in place)
//     out = S^T C + D * x
at::Tensor mamba2_decode_(const at::Tensor& x, const at::Tensor& B_in, const at::Tensor& C_in,
                          const at::Tensor& dt, const at::Tensor& A, const at::Tensor& D,
                          at::Tensor& state, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 3 && B_in.dim() == 3 && C_in.sizes() == B_in.sizes() &&
                  B_in.size(0) == x.size(0),
              "x must be [B, heads, head_dim] and B, C [B, groups, state_size]");
  const int64_t rows = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t groups = B_in.size(1), state_size = B_in.size(2);
  TORCH_CHECK(heads % groups == 0, "heads must be a multiple of groups");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == heads && state.size(2) == state_size &&
                  state.size(3) == head_dim && state.is_contiguous(),
              "state must be contiguous [slots, heads, state_size, head_dim]");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == rows && dt.size(1) == heads,
              "dt must be [B, heads]");
  TORCH_CHECK(A.dim() == 1 && A.size(0) == heads && D.sizes() == A.sizes(),
              "A and D must be [heads]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == rows && slots.scalar_type() == at::kLong,
              "slots must be int64 [B]");
  const at::Tensor& pool = state;
  for (const at::Tensor* t : {&x, &B_in, &C_in, &dt, &A, &D, &pool})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "the step's tensors must be contiguous fp32 on the CPU");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < state.size(0), "a slot outside the state pool");

  auto out = x.new_empty({rows, heads, head_dim});
  const float* xp = x.data_ptr<float>();
  const float* bp = B_in.data_ptr<float>();
  const float* cp = C_in.data_ptr<float>();
  const float* dtp = dt.data_ptr<float>();
  const float* ap = A.data_ptr<float>();
  const float* dp = D.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t per_group = heads / groups;
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scaled(head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads, grp = h / per_group;
      const float step = dtp[b * heads + h];
      const float decay = std::exp(step * ap[h]);
      const float* xh = xp + (b * heads + h) * head_dim;
      const float* Bg = bp + (b * groups + grp) * state_size;
      const float* Cg = cp + (b * groups + grp) * state_size;
      float* S = sp + (slot[b] * heads + h) * state_size * head_dim;
      float* oh = op + (b * heads + h) * head_dim;
      for (int64_t j = 0; j < head_dim; ++j) {
        scaled[j] = step * xh[j];
        oh[j] = dp[h] * xh[j];
      }
      for (int64_t i = 0; i < state_size; ++i) {
        const float bi = Bg[i], ci = Cg[i];
        float* row = S + i * head_dim;
        for (int64_t j = 0; j < head_dim; ++j) {
          const float updated = decay * row[j] + bi * scaled[j];
          row[j] = updated;
          oh[j] += ci * updated;
        }
      }
    }
  });
  return out;
}
