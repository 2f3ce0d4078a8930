// Paged-attention decode: one new query token per sequence attends to its whole context,
// read from the paged KV cache through the sequence's block table.
//
// Data layout (all row-major):
//   q             [S, num_heads, HEAD_DIM]    token and head strides passed in, dim contiguous
//   kv_cache      [2, num_blocks, block_size, num_kv_heads, HEAD_DIM]  = [2, num_slots, kv, D]
//   block_tables  int32 or int64 [S, >= ceil(seq_len / block_size)]
//   seq_lens      int32 or int64 [S]            context length, the new token included
//   out           [S, num_heads, HEAD_DIM]    contiguous
//   context position p of sequence s lives in slot block_tables[s][p / bs] * bs + p % bs
//
// Work split (split-K over the context, "flash-decoding"):
//
//   grid = (num_kv_heads * splits, S, max_partitions)      block = 128 threads (4 warps)
//
//   blockIdx.z cuts the context into partitions of `partition_size` tokens (a power of two,
//   32 to kMaxPartitionSize = 512, chosen by cuda_kernels.plan_decode), so that a few
//   sequences, or one, still spread over many SMs: one block walks its partition's tokens in
//   a loop whose every turn waits on a global load, so 512 tokens per block left a batch of
//   one on a handful of SMs, latency-bound (42 us per layer for SmolLM2 at 512 tokens).
//   Many sequences fill the GPU by themselves and take the longest partitions (fewer
//   partial results to combine). blockIdx.x picks a KV head and the query heads
//   that share it (GQA): the block reads each K/V row once and uses it for up to GROUP
//   query heads (`splits` > 1 only when a KV head has more than 8 query heads).
//
//   Inside a block, a token's head row (HEAD_DIM elements) is read by a "lane group" of
//   kLanes threads, 16 bytes per thread per load, so a warp reads 32 / kLanes rows at once:
//
//     warp lanes  | 0 .. kLanes-1 | kLanes .. 2*kLanes-1 | ...
//     token       |      t        |        t + 1        | ...     (bf16, D=128: kLanes = 16)
//
//   1. q * scale * log2(e) -> registers (GROUP x this thread's slice of D)
//   2. scores: dot products over the slice, summed across the lane group with shuffles;
//      written to shared memory as logits[GROUP][partition_size]
//   3. per query head: max and sum of exp2(logit - max) over the partition (one warp each);
//      logits become probabilities in place
//   4. P @ V: each lane group accumulates its tokens' V rows in fp32 registers, then the lane
//      groups and warps are summed through shuffles and shared memory
//   5. one partition: write out / sum. Several: write the normalised partial output with its
//      max and sum; zllm_paged_decode_reduce rescales and combines them:
//         out = sum_p exp2(m_p - M) * l_p * o_p / sum_p exp2(m_p - M) * l_p,  M = max_p m_p
//
// Softmax runs in the log2 domain (exp2 is one instruction); all accumulation is fp32.
//
// Attention sinks (gpt-oss; `sinks` fp32 [num_heads], else null): head h's sink logit joins
// its softmax denominator once and brings no value. One partition folds it into its own
// max and sum (step 3); split contexts fold it in zllm_paged_decode_reduce:
//    out = sum_p w_p o_p / (exp2(sink - M) + sum_p w_p),  M = max(sink, max_p m_p)

#include "zllm_common.cuh"

constexpr int kMaxPartitionSize = 512;  // context tokens per split-K partition, at most
constexpr int kNumThreads = 128;
constexpr int kNumWarps = kNumThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegHuge = -3.0e38f;  // below any finite logit, avoids INFINITY's header

__host__ __device__ constexpr int ceil_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

ZLLM_DEVICE int imin(int a, int b) { return a < b ? a : b; }

// The first context position a decode query sees: with a sliding window W > 0 the query at
// position seq_len - 1 sees only its last W positions (Hugging Face's band), else all.
ZLLM_DEVICE int window_start(int seq_len, int window) {
  return window > 0 && seq_len > window ? seq_len - window : 0;
}

// How one token's head row is spread over a lane group.
template <typename D, int HEAD_DIM>
struct DecodeTile {
  static constexpr int kVec = PackTraits<D>::kElems;  // elements per 16-byte load
  static_assert(HEAD_DIM % kVec == 0, "head_dim must be a multiple of 16 bytes");
  static constexpr int kUnits = HEAD_DIM / kVec;                     // 16-byte units per row
  static constexpr int kLanes = kUnits < 32 ? ceil_pow2(kUnits) : 32;  // threads per token
  static constexpr int kLoads = (kUnits + kLanes - 1) / kLanes;      // units per thread
  static constexpr int kElems = kLoads * kVec;                       // elements per thread
  static constexpr int kTokensPerWarp = 32 / kLanes;
  static constexpr int kTokensPerIter = kNumThreads / kLanes;
};

template <typename D, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kNumThreads)
    zllm_paged_decode(typename D::T* __restrict__ out, float* __restrict__ partial_out,
                      float* __restrict__ partial_max, float* __restrict__ partial_sum,
                      const typename D::T* __restrict__ q, zllm_i64 q_seq_stride,
                      zllm_i64 q_head_stride, const typename D::T* __restrict__ kv_cache,
                      zllm_i64 num_slots, const void* __restrict__ block_tables,
                      int block_tables_int64, zllm_i64 block_table_stride,
                      const void* __restrict__ seq_lens, int seq_lens_int64, int num_heads,
                      int num_kv_heads, int block_size, int max_partitions, int heads_per_block,
                      float scale, int partition_size, int window,
                      const float* __restrict__ sinks) {
  using T = typename D::T;
  using Tile = DecodeTile<D, HEAD_DIM>;
  constexpr int kVec = Tile::kVec;
  constexpr int kUnits = Tile::kUnits;
  constexpr int kLanes = Tile::kLanes;
  constexpr int kLoads = Tile::kLoads;
  constexpr int kElems = Tile::kElems;

  // Shared memory: the partition's logits, later reused to sum the warps' outputs.
  constexpr int kLogitFloats = GROUP * kMaxPartitionSize;
  constexpr int kReduceFloats = kNumWarps * GROUP * HEAD_DIM;
  __shared__ float scratch[kLogitFloats > kReduceFloats ? kLogitFloats : kReduceFloats];
  __shared__ int block_ids[kMaxPartitionSize];  // the partition's block-table entries
  __shared__ float head_max[GROUP];
  __shared__ float head_sum[GROUP];

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % kLanes;  // position inside the token's lane group
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;

  // Which query heads this block serves: [first_head, first_head + num_block_heads).
  const int group_size = num_heads / num_kv_heads;
  const int splits = (group_size + heads_per_block - 1) / heads_per_block;
  const int kv_head = blockIdx.x / splits;
  const int first_head = kv_head * group_size + (blockIdx.x % splits) * heads_per_block;
  const int num_block_heads = imin(heads_per_block, (kv_head + 1) * group_size - first_head);
  if (num_block_heads <= 0) return;

  const int seq_len = (int)load_index(seq_lens, seq_lens_int64, seq);
  if (seq_len <= 0) {  // nothing to attend to: define the output as zeros
    if (partition == 0) {
      for (int i = tid; i < num_block_heads * HEAD_DIM; i += kNumThreads)
        out[((zllm_i64)seq * num_heads + first_head) * HEAD_DIM + i] = D::from_float(0.0f);
    }
    return;
  }
  // A sliding window (> 0) keeps the last `window` positions: the partitions cover those.
  const int first_pos = window_start(seq_len, window);
  const int num_partitions =
      imin((seq_len - first_pos + partition_size - 1) / partition_size, max_partitions);
  if (partition >= num_partitions) return;
  const bool single = num_partitions == 1;
  const int start = first_pos + partition * partition_size;
  const int num_tokens = imin(partition_size, seq_len - start);

  // Stage the block ids covering [start, start + num_tokens) in shared memory, so loading a
  // row costs one dependent global load instead of two.
  const int first_block = start / block_size;
  const int num_blocks = (start + num_tokens - 1) / block_size - first_block + 1;
  const zllm_i64 table_row = (zllm_i64)seq * block_table_stride + first_block;
  for (int i = tid; i < num_blocks; i += kNumThreads)
    block_ids[i] = (int)load_index(block_tables, block_tables_int64, table_row + i);

  // 1. This thread's slice of each query head, pre-scaled so the scores are log2-domain.
  float q_reg[GROUP][kElems];
  const float q_scale = scale * kLog2e;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int unit = l * kLanes + lane;
      float* dst = &q_reg[g][l * kVec];
      if (g < num_block_heads && unit < kUnits) {
        load_pack<D>(q + seq * q_seq_stride + (first_head + g) * q_head_stride + unit * kVec, dst);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dst[e] *= q_scale;
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) dst[e] = 0.0f;
      }
    }
  }
  __syncthreads();  // block_ids ready

  // 2. Scores. The loop bound is uniform per warp (the shuffles need all 32 lanes); lane
  // groups past the end compute zeros and store nothing.
  const zllm_i64 row_elems = (zllm_i64)num_kv_heads * HEAD_DIM;  // one slot of K or V
  const T* k_base = kv_cache + (zllm_i64)kv_head * HEAD_DIM;
  const T* v_base = k_base + num_slots * row_elems;
  const int token_in_warp = (tid % 32) / kLanes;
  for (int base = warp * Tile::kTokensPerWarp; base < num_tokens; base += Tile::kTokensPerIter) {
    const int t = base + token_in_warp;
    float dot[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) dot[g] = 0.0f;
    if (t < num_tokens) {
      const int pos = start + t;
      const zllm_i64 slot =
          (zllm_i64)block_ids[pos / block_size - first_block] * block_size + pos % block_size;
      const T* k_row = k_base + slot * row_elems;
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        const int unit = l * kLanes + lane;
        if (unit < kUnits) {
          float k[kVec];
          load_pack<D>(k_row + unit * kVec, k);
#pragma unroll
          for (int g = 0; g < GROUP; ++g)
#pragma unroll
            for (int e = 0; e < kVec; ++e) dot[g] += q_reg[g][l * kVec + e] * k[e];
        }
      }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) dot[g] = group_sum<kLanes>(dot[g]);
    if (t < num_tokens && lane == 0) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) scratch[g * partition_size + t] = dot[g];
    }
  }
  __syncthreads();

  // 3. Softmax statistics, one warp per query head (heads past num_block_heads have zero
  // scores: harmless, and it keeps every probability finite). A sink counts here when this
  // partition is the whole context.
  for (int g = warp; g < GROUP; g += kNumWarps) {
    float* row = scratch + g * partition_size;
    const bool sink_here = sinks != nullptr && single && g < num_block_heads;
    const float sink = sink_here ? sinks[first_head + g] * kLog2e : kNegHuge;
    float m = kNegHuge;
    for (int t = tid % 32; t < num_tokens; t += 32) m = fmaxf(m, row[t]);
    m = fmaxf(group_max<32>(m), sink);
    float sum = 0.0f;
    for (int t = tid % 32; t < num_tokens; t += 32) {
      const float p = exp2f(row[t] - m);
      row[t] = p;
      sum += p;
    }
    sum = group_sum<32>(sum);
    if (sink_here) sum += exp2f(sink - m);
    if (tid % 32 == 0) {
      head_max[g] = m;
      head_sum[g] = sum;
    }
  }
  __syncthreads();

  // 4. P @ V into fp32 registers: this thread's slice of every head, over its tokens.
  float acc[GROUP][kElems];
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
#pragma unroll
    for (int i = 0; i < kElems; ++i) acc[g][i] = 0.0f;
  for (int t = tid / kLanes; t < num_tokens; t += Tile::kTokensPerIter) {
    const int pos = start + t;
    const zllm_i64 slot =
        (zllm_i64)block_ids[pos / block_size - first_block] * block_size + pos % block_size;
    const T* v_row = v_base + slot * row_elems;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int unit = l * kLanes + lane;
      if (unit < kUnits) {
        float v[kVec];
        load_pack<D>(v_row + unit * kVec, v);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
          const float p = scratch[g * partition_size + t];
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[g][l * kVec + e] += p * v[e];
        }
      }
    }
  }
  // Sum over the lane groups of the warp: lanes owning the same slice differ in the lane
  // bits at and above kLanes.
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
#pragma unroll
    for (int i = 0; i < kElems; ++i)
#pragma unroll
      for (int offset = 16; offset >= kLanes; offset /= 2)
        acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], offset);
  __syncthreads();  // every warp is done reading probabilities: scratch is free again

  // Lane group 0 of each warp publishes the warp's sums as scratch[warp][g][d].
  if (tid % 32 < kLanes) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        const int unit = l * kLanes + lane;
        if (unit < kUnits) {
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            scratch[(warp * GROUP + g) * HEAD_DIM + unit * kVec + e] = acc[g][l * kVec + e];
        }
      }
  }
  __syncthreads();

  // 5. Sum the warps; write the output, or this partition's share of it.
  for (int i = tid; i < num_block_heads * HEAD_DIM; i += kNumThreads) {
    const int g = i / HEAD_DIM;
    const int d = i - g * HEAD_DIM;
    float value = 0.0f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) value += scratch[(w * GROUP + g) * HEAD_DIM + d];
    value /= head_sum[g];
    const zllm_i64 head_row = (zllm_i64)seq * num_heads + first_head + g;
    if (single) {
      out[head_row * HEAD_DIM + d] = D::from_float(value);
    } else {
      const zllm_i64 part = head_row * max_partitions + partition;
      partial_out[part * HEAD_DIM + d] = value;
      if (d == 0) {
        partial_max[part] = head_max[g];
        partial_sum[part] = head_sum[g];
      }
    }
  }
}

// Combines the partitions of sequences longer than one partition (the others were written
// by zllm_paged_decode directly). Grid: (num_heads, S); block: (128,).
template <typename D>
__global__ void __launch_bounds__(kNumThreads)
    zllm_paged_decode_reduce(typename D::T* __restrict__ out,
                             const float* __restrict__ partial_out,
                             const float* __restrict__ partial_max,
                             const float* __restrict__ partial_sum,
                             const void* __restrict__ seq_lens, int seq_lens_int64,
                             int num_heads, int head_dim, int max_partitions,
                             int partition_size, int window, const float* __restrict__ sinks) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = (int)load_index(seq_lens, seq_lens_int64, seq);
  const int num_partitions = imin(
      (seq_len - window_start(seq_len, window) + partition_size - 1) / partition_size,
      max_partitions);
  if (num_partitions <= 1) return;

  const zllm_i64 head_row = (zllm_i64)seq * num_heads + head;
  const zllm_i64 first = head_row * max_partitions;
  const float sink = sinks != nullptr ? sinks[head] * kLog2e : kNegHuge;
  float m = sink;
  for (int p = 0; p < num_partitions; ++p) m = fmaxf(m, partial_max[first + p]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    float denom = sinks != nullptr ? exp2f(sink - m) : 0.0f;
    for (int p = 0; p < num_partitions; ++p) {
      // The partition's weight: its softmax sum, rescaled from its own max to the global one.
      const float w = exp2f(partial_max[first + p] - m) * partial_sum[first + p];
      acc += w * partial_out[(first + p) * head_dim + d];
      denom += w;
    }
    out[head_row * head_dim + d] = D::from_float(acc / denom);
  }
}

#ifdef ZLLM_INSTANTIATE_ALL
// Offline builds (the nvcc test) instantiate every variant cuda_kernels.py can ask for; at
// run time NVRTC instantiates only the ones named in `name_expressions`.
#define ZLLM_DECODE_VARIANTS(D, HD)                                                   \
  (void*)&zllm_paged_decode<D, HD, 1>, (void*)&zllm_paged_decode<D, HD, 2>,          \
      (void*)&zllm_paged_decode<D, HD, 4>, (void*)&zllm_paged_decode<D, HD, 8>
#define ZLLM_DTYPE_VARIANTS(D)                                                                \
  ZLLM_DECODE_VARIANTS(D, 64), ZLLM_DECODE_VARIANTS(D, 80), ZLLM_DECODE_VARIANTS(D, 96),      \
      ZLLM_DECODE_VARIANTS(D, 112), ZLLM_DECODE_VARIANTS(D, 128),                             \
      ZLLM_DECODE_VARIANTS(D, 256), (void*)&zllm_paged_decode_reduce<D>
void* zllm_paged_attention_kernel(int i) {
  static void* const kernels[] = {ZLLM_DTYPE_VARIANTS(DtypeF32), ZLLM_DTYPE_VARIANTS(DtypeF16),
                                  ZLLM_DTYPE_VARIANTS(DtypeBF16)};
  return kernels[i];
}
#endif
