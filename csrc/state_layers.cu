// A hybrid model's state layers on the GPU, for a step's decode rows (one new token per
// sequence): each row's slot of the state pool updated in place, with the arithmetic of
// executor/layers/causal_conv.py, gated_delta_rule.py and mamba2_scan.py (fp32, as the pool).
//
//   zllm_causal_conv_decode   out[b, c] = silu(w[c] . [window, x[b, c]] + bias[c]); the
//                             window conv[slot[b], c, :] moves on by one
//   zllm_gated_delta_decode   per (row, value head): S = d S + k (beta (v - d S^T k))^T,
//                             out = S^T q, with q and k L2-normalised by the host (q scaled)
//   zllm_mamba2_decode        per (row, head): S = exp(dt A) S + B (dt x)^T,
//                             out = S^T C + D x
//
// One thread per output value (a row's channel, or a head's value column j): each reads its
// column of the slot's state (key_dim or state_size values, stride value_dim: coalesced
// across the warp's consecutive columns), so no thread waits for another and no shared
// memory is needed. The gated norms after the rules run as torch ops.
//
// Layouts (contiguous fp32): conv [slots, C, K - 1]; weight [C, K]; x [B, C];
// gated delta: q, k [B, key_heads, key_dim]; v [B, heads, value_dim]; g, beta [B, heads];
// state [slots, heads, key_dim, value_dim]; mamba2: x [B, heads, head_dim]; Bm, Cm [B,
// groups, state_size]; dt [B, heads]; A, D [heads]; state [slots, heads, state_size,
// head_dim]. slots int64 [B].

#include "zllm_common.cuh"

constexpr int kStateThreads = 128;

extern "C" __global__ void __launch_bounds__(kStateThreads)
    zllm_causal_conv_decode(float* __restrict__ out, const float* __restrict__ x,
                            float* __restrict__ conv, const zllm_i64* __restrict__ slots,
                            const float* __restrict__ weight, const float* __restrict__ bias,
                            zllm_i64 rows, int channels, int kernel) {
  const zllm_i64 task = (zllm_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (task >= rows * channels) return;
  const zllm_i64 b = task / channels;
  const int c = (int)(task - b * channels);
  float* window = conv + (slots[b] * channels + c) * (kernel - 1);
  const float* w = weight + (zllm_i64)c * kernel;
  const float input = x[task];
  float sum = bias == nullptr ? 0.0f : bias[c];
  for (int i = 0; i < kernel - 1; ++i) sum += w[i] * window[i];
  sum += w[kernel - 1] * input;
  for (int i = 0; i + 1 < kernel - 1; ++i) window[i] = window[i + 1];
  if (kernel > 1) window[kernel - 2] = input;
  out[task] = sum / (1.0f + expf(-sum));
}

extern "C" __global__ void __launch_bounds__(kStateThreads)
    zllm_gated_delta_decode(float* __restrict__ out, const float* __restrict__ q,
                            const float* __restrict__ k, const float* __restrict__ v,
                            const float* __restrict__ g, const float* __restrict__ beta,
                            float* __restrict__ state, const zllm_i64* __restrict__ slots,
                            zllm_i64 rows, int heads, int key_heads, int key_dim, int value_dim,
                            int tiled) {
  const zllm_i64 task = (zllm_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (task >= rows * heads * value_dim) return;
  const int j = (int)(task % value_dim);
  const zllm_i64 bh = task / value_dim;
  const int h = (int)(bh % heads);
  const zllm_i64 b = bh / heads;
  const int kh = tiled ? h % key_heads : h / (heads / key_heads);
  const float* qh = q + (b * key_heads + kh) * key_dim;
  const float* kk = k + (b * key_heads + kh) * key_dim;
  float* S = state + (slots[b] * heads + h) * (zllm_i64)key_dim * value_dim + j;
  const float decay = expf(g[bh]);
  float recalled = 0.0f;
  for (int i = 0; i < key_dim; ++i) recalled += kk[i] * S[(zllm_i64)i * value_dim];
  const float delta = beta[bh] * (v[bh * value_dim + j] - decay * recalled);
  float o = 0.0f;
  for (int i = 0; i < key_dim; ++i) {
    const float updated = decay * S[(zllm_i64)i * value_dim] + kk[i] * delta;
    S[(zllm_i64)i * value_dim] = updated;
    o += qh[i] * updated;
  }
  out[task] = o;
}

extern "C" __global__ void __launch_bounds__(kStateThreads)
    zllm_mamba2_decode(float* __restrict__ out, const float* __restrict__ x,
                       const float* __restrict__ Bm, const float* __restrict__ Cm,
                       const float* __restrict__ dt, const float* __restrict__ A,
                       const float* __restrict__ D, float* __restrict__ state,
                       const zllm_i64* __restrict__ slots, zllm_i64 rows, int heads,
                       int head_dim, int groups, int state_size) {
  const zllm_i64 task = (zllm_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (task >= rows * heads * head_dim) return;
  const int j = (int)(task % head_dim);
  const zllm_i64 bh = task / head_dim;
  const int h = (int)(bh % heads);
  const zllm_i64 b = bh / heads;
  const int grp = h / (heads / groups);
  const float* Bg = Bm + (b * groups + grp) * state_size;
  const float* Cg = Cm + (b * groups + grp) * state_size;
  float* S = state + (slots[b] * heads + h) * (zllm_i64)state_size * head_dim + j;
  const float step = dt[bh];
  const float decay = expf(step * A[h]);
  const float xj = x[task];
  const float scaled = step * xj;
  float o = D[h] * xj;
  for (int i = 0; i < state_size; ++i) {
    const float updated = decay * S[(zllm_i64)i * head_dim] + Bg[i] * scaled;
    S[(zllm_i64)i * head_dim] = updated;
    o += Cg[i] * updated;
  }
  out[task] = o;
}
