// Row-wise ops of a Llama-family decoder layer, each one kernel where torch launches several:
// at batch 1 a SmolLM2 decode step is ~1,000 tiny kernels, and RMSNorm (9 in bf16), RoPE
// (7) and SiLU-and-mul (2) were most of them (see BENCHMARKS.md, the GPU profile).
//
//   zllm_rms_norm       out = weight * norm(x [+ residual]); the sum is also written out
//   zllm_rope           rotates q and k in place (rotate-half RoPE, Hugging Face's layout)
//   zllm_rope_cache     the same, then k and v into the paged KV cache (one launch for both)
//   zllm_silu_mul       out = silu(gate) * up from the fused [gate | up] projection
//
// Grids (cuda_layer_ops.py plans them): RMSNorm and RoPE take one thread block per token row
// (grid.x = rows) of as many threads as the row needs (32 to 1024, a power of two: a
// Llama-3-8B row of 4096 is 4 elements a thread, so one row at batch 1 is not one SM's long
// loop); SiLU-and-mul is elementwise, a block per (row, chunk of columns). All arithmetic
// is fp32. Where torch rounds an intermediate to the storage type (bf16/fp16),
// these kernels round it too (`round_to`), and products use __fmul_rn so no multiply-add is
// contracted: RoPE and SiLU-and-mul then give torch's eager bits, and RMSNorm differs only
// in the order its sum of squares is added up.

#include "zllm_common.cuh"

constexpr int kMaxThreads = 1024;

// What storing to and loading from the element type does to a value.
template <typename D>
ZLLM_DEVICE float round_to(float x) {
  return D::to_float(D::from_float(x));
}

// Sum over the block's threads (a multiple of 32); every thread gets the result.
ZLLM_DEVICE float block_sum(float x, float* warp_sums) {
  x = group_sum<32>(x);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) warp_sums[warp] = x;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < (int)blockDim.x / 32; ++w) total += warp_sums[w];
  return total;
}

// out[r] = weight * round(s * rsqrt(mean(s^2) + eps)), s = x[r] (+ residual[r], rounded to
// the element type and written to sum_out[r]): Hugging Face's LlamaRMSNorm after the
// residual add. x rows are x_stride elements apart; every other tensor is [rows, hidden].
// residual and sum_out are both null or both set.
template <typename D>
__global__ void __launch_bounds__(kMaxThreads)
    zllm_rms_norm(typename D::T* __restrict__ out, typename D::T* __restrict__ sum_out,
                  const typename D::T* __restrict__ x, zllm_i64 x_stride,
                  const typename D::T* __restrict__ residual,
                  const typename D::T* __restrict__ weight, int hidden, float eps) {
  __shared__ float warp_sums[kMaxThreads / 32];
  const zllm_i64 row = blockIdx.x;
  const typename D::T* x_row = x + row * x_stride;
  const zllm_i64 base = row * hidden;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = D::to_float(x_row[i]);
    if (residual != nullptr) {
      const typename D::T s = D::from_float(v + D::to_float(residual[base + i]));
      sum_out[base + i] = s;
      v = D::to_float(s);
    }
    squares += __fmul_rn(v, v);
  }
  const float scale = rsqrtf(block_sum(squares, warp_sums) / (float)hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    // Each thread reads back only what it wrote itself: no barrier needed.
    const float v = D::to_float(residual != nullptr ? sum_out[base + i] : x_row[i]);
    const float normed = round_to<D>(__fmul_rn(v, scale));
    out[base + i] = D::from_float(__fmul_rn(D::to_float(weight[i]), normed));
  }
}

// In place, for every head h of row r (q heads and k heads side by side, head h at
// qk + r * token_stride + h * head_stride) and every j < rot_half:
//   x1 = x[j], x2 = x[j + rot_half]
//   x[j] = x1 * cos[j] - x2 * sin[j],  x[j + rot_half] = x2 * cos[j] + x1 * sin[j]
// cos and sin rows (rot_half elements) are cs_stride apart. Elements past 2 * rot_half (a
// partial rotary factor) are left alone.
template <typename D>
ZLLM_DEVICE void rotate_row(typename D::T* __restrict__ qk, zllm_i64 token_stride,
                           zllm_i64 head_stride, int num_heads, int rot_half,
                           const typename D::T* __restrict__ cos,
                           const typename D::T* __restrict__ sin, zllm_i64 cs_stride) {
  const zllm_i64 row = blockIdx.x;
  for (int i = threadIdx.x; i < num_heads * rot_half; i += blockDim.x) {
    const int h = i / rot_half;
    const int j = i - h * rot_half;
    typename D::T* head = qk + row * token_stride + h * head_stride;
    const float c = D::to_float(cos[row * cs_stride + j]);
    const float s = D::to_float(sin[row * cs_stride + j]);
    const float x1 = D::to_float(head[j]);
    const float x2 = D::to_float(head[j + rot_half]);
    head[j] = D::from_float(round_to<D>(__fmul_rn(x1, c)) - round_to<D>(__fmul_rn(x2, s)));
    head[j + rot_half] =
        D::from_float(round_to<D>(__fmul_rn(x2, c)) + round_to<D>(__fmul_rn(x1, s)));
  }
}

template <typename D>
__global__ void __launch_bounds__(kMaxThreads)
    zllm_rope(typename D::T* __restrict__ qk, zllm_i64 token_stride, zllm_i64 head_stride,
              int num_heads, int rot_half, const typename D::T* __restrict__ cos,
              const typename D::T* __restrict__ sin, zllm_i64 cs_stride) {
  rotate_row<D>(qk, token_stride, head_stride, num_heads, rot_half, cos, sin, cs_stride);
}

// zllm_rope over row r's q heads and its num_kv_heads k heads (after them), then the row's
// rotated k and its v into the paged KV cache at slot_mapping[r] (kv_cache.cu's layout:
// [2, num_slots, num_kv_heads, head_dim], K then V; a slot outside [0, num_slots) is not
// written): a layer's RoPE and cache write in one launch instead of two, which at batch 1
// are two of a decode step's ~11 kernels per layer. v rows are v_token_stride apart, its
// heads v_head_stride; head_dim elements each, contiguous.
template <typename D>
__global__ void __launch_bounds__(kMaxThreads)
    zllm_rope_cache(typename D::T* __restrict__ qk, zllm_i64 token_stride, zllm_i64 head_stride,
                    int num_heads, int num_kv_heads, int head_dim, int rot_half,
                    const typename D::T* __restrict__ cos, const typename D::T* __restrict__ sin,
                    zllm_i64 cs_stride, const typename D::T* __restrict__ v,
                    zllm_i64 v_token_stride, zllm_i64 v_head_stride,
                    typename D::T* __restrict__ kv_cache,
                    const zllm_i64* __restrict__ slot_mapping, zllm_i64 num_slots) {
  rotate_row<D>(qk, token_stride, head_stride, num_heads + num_kv_heads, rot_half, cos, sin,
                cs_stride);
  __syncthreads();  // the k heads other threads rotated are read back below
  const zllm_i64 row = blockIdx.x;
  const zllm_i64 slot = slot_mapping[row];
  if (slot < 0 || slot >= num_slots) return;  // padding (-1) or not a slot of this cache
  const zllm_i64 width = (zllm_i64)num_kv_heads * head_dim;
  typename D::T* k_dst = kv_cache + slot * width;
  typename D::T* v_dst = k_dst + num_slots * width;
  const typename D::T* k_src = qk + row * token_stride + num_heads * head_stride;
  const typename D::T* v_src = v + row * v_token_stride;
  for (int i = threadIdx.x; i < num_kv_heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim;
    const int d = i - h * head_dim;
    k_dst[i] = k_src[h * head_stride + d];
    v_dst[i] = v_src[h * v_head_stride + d];
  }
}

// out[r, i] = round(silu(gate)) * up with gate = gate_up[r, i], up = gate_up[r, inter + i];
// gate_up rows are in_stride elements apart, out is [rows, inter]. Block (r, c) computes
// columns [c * blockDim.x, (c + 1) * blockDim.x) of row r.
template <typename D>
__global__ void __launch_bounds__(kMaxThreads)
    zllm_silu_mul(typename D::T* __restrict__ out, const typename D::T* __restrict__ gate_up,
                  zllm_i64 in_stride, int inter) {
  const zllm_i64 row = blockIdx.x;
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const typename D::T* in = gate_up + row * in_stride;
  const float g = D::to_float(in[i]);
  const float silu = round_to<D>(g / (1.0f + expf(-g)));
  out[row * inter + i] = D::from_float(__fmul_rn(silu, D::to_float(in[inter + i])));
}

#ifdef ZLLM_INSTANTIATE_ALL
#define ZLLM_LAYER_OPS(D)                                                             \
  (void*)&zllm_rms_norm<D>, (void*)&zllm_rope<D>, (void*)&zllm_rope_cache<D>, \
      (void*)&zllm_silu_mul<D>
void* zllm_layer_ops_kernel(int i) {
  static void* const kernels[] = {ZLLM_LAYER_OPS(DtypeF32), ZLLM_LAYER_OPS(DtypeF16),
                                  ZLLM_LAYER_OPS(DtypeBF16)};
  return kernels[i];
}
#endif
