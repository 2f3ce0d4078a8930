// A mixture-of-experts layer's chosen experts on the GPU, for a step's few tokens (decode),
// with no host synchronisation, so the layer can be captured in a CUDA graph.
//
//   zllm_moe_gemv   out[p] = W[e(p)] x[p / pair_div] (+ b[e(p)]) for every (token, expert)
//                   pair p: each chosen expert's rows read once for all its pairs
//
// The host (executor/kernels/cuda_moe.py) hands over the pairs grouped by expert, computed on
// the device by torch (no count ever reaches the host):
//
//   order        [P]      pair indices sorted by expert (a stable sort of the T x k ids)
//   offsets      [E + 1]  expert e's pairs are order[offsets[e] .. offsets[e + 1])
//   expert_list  [E]      the experts that have pairs first (the rest follow, and exit)
//
// grid = (ceil(out_features / kMoeRowsPerBlock), min(P, E)), block = kMoeThreads threads.
// Block (tile, g) serves expert expert_list[g]: each warp takes output rows of the tile, its
// lanes read a weight row in 16-byte packs (coalesced across the warp) and multiply each pack
// with up to kMoePairs pairs' input rows at once (the inputs are small and stay in cache), so
// a weight row is read from memory once per kMoePairs pairs, i.e. once at decode sizes, where
// the layer's time is the bytes of the chosen experts. Sums are fp32, the output rounded once
// to the element type (torch's bf16 matmuls also sum in fp32).
//
// Both operands must be 16-byte aligned with rows a multiple of 16 bytes (cuda_moe.py checks;
// 8 bf16/fp16 or 4 fp32 values).

#include "zllm_common.cuh"

constexpr int kMoeThreads = 128;
constexpr int kMoeRowsPerBlock = 8;  // cuda_moe.py ROWS_PER_BLOCK
constexpr int kMoePairs = 4;         // pairs multiplied per pass over a weight row

template <typename D>
__global__ void __launch_bounds__(kMoeThreads)
    zllm_moe_gemv(typename D::T* __restrict__ out, const typename D::T* __restrict__ x,
                  zllm_i64 x_stride, int pair_div, const typename D::T* __restrict__ w,
                  const typename D::T* __restrict__ bias, const zllm_i64* __restrict__ order,
                  const zllm_i64* __restrict__ offsets, const zllm_i64* __restrict__ expert_list,
                  int out_features, int in_features) {
  using T = typename D::T;
  constexpr int kElems = PackTraits<D>::kElems;
  const zllm_i64 e = expert_list[blockIdx.y];
  const zllm_i64 first = offsets[e];
  const zllm_i64 last = offsets[e + 1];
  if (first == last) return;  // an expert no token chose: its weights are never read
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const T* w_expert = w + e * (zllm_i64)out_features * in_features;
  for (int r = warp; r < kMoeRowsPerBlock; r += kMoeThreads / 32) {
    const int o = blockIdx.x * kMoeRowsPerBlock + r;
    if (o >= out_features) break;  // the same for the whole warp
    const T* w_row = w_expert + (zllm_i64)o * in_features;
    const float b = bias == nullptr ? 0.0f : D::to_float(bias[e * out_features + o]);
    for (zllm_i64 p0 = first; p0 < last; p0 += kMoePairs) {
      const int n = last - p0 < kMoePairs ? (int)(last - p0) : kMoePairs;
      zllm_i64 pair[kMoePairs];
      const T* x_row[kMoePairs];
#pragma unroll
      for (int j = 0; j < kMoePairs; ++j) {
        pair[j] = order[p0 + (j < n ? j : 0)];
        x_row[j] = x + (pair[j] / pair_div) * x_stride;
      }
      float acc[kMoePairs];
#pragma unroll
      for (int j = 0; j < kMoePairs; ++j) acc[j] = 0.0f;
      for (int i = lane * kElems; i < in_features; i += 32 * kElems) {
        float wv[kElems];
        load_pack<D>(w_row + i, wv);
#pragma unroll
        for (int j = 0; j < kMoePairs; ++j) {
          if (j < n) {
            float xv[kElems];
            load_pack<D>(x_row[j] + i, xv);
#pragma unroll
            for (int k = 0; k < kElems; ++k) acc[j] += wv[k] * xv[k];
          }
        }
      }
      // Unrolled with a test (acc and pair stay in registers); n is the same for the
      // whole warp, so every lane takes the same shuffles.
#pragma unroll
      for (int j = 0; j < kMoePairs; ++j) {
        if (j < n) {
          const float sum = group_sum<32>(acc[j]);
          if (lane == 0) out[pair[j] * out_features + o] = D::from_float(sum + b);
        }
      }
    }
  }
}

#ifdef ZLLM_INSTANTIATE_ALL
void* zllm_moe_experts_kernel(int i) {
  static void* const kernels[] = {(void*)&zllm_moe_gemv<DtypeF32>, (void*)&zllm_moe_gemv<DtypeF16>,
                                  (void*)&zllm_moe_gemv<DtypeBF16>};
  return kernels[i];
}
#endif
