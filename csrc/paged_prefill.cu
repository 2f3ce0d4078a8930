// Paged-attention prefill: every prefilling sequence of a step in one launch (varlen over the
// packed tokens), each query reading its keys from the paged KV cache, so whole prompts,
// chunks after cached context (chunked prefill) and prompts after a prefix-cache hit take the
// same path. The step's own K/V are already in the cache (csrc/kv_cache.cu runs first).
//
// Data layout (all row-major):
//   q             [T, num_heads, HEAD_DIM]    token and head strides passed in, dim contiguous
//   out           [T, num_heads, HEAD_DIM]    contiguous; only the prefill tokens' rows written
//   kv_cache      [2, num_slots, num_kv_heads, HEAD_DIM]    0 = K, 1 = V
//   block_tables  int32 or int64 [P, max_blocks], one row per prefilling sequence
//   seqs          int32 [P, 3]: first token in q/out, query count, context length (the
//                 sequence's tokens so far, this step's included)
//   tiles         int32 [num_tiles, 2]: prefilling sequence, first query of the tile in it
//
// Query j of sequence p sits at context position ctx_len - q_len + j and sees keys k with
// k <= that position and, with a sliding window W > 0, position - k < W (Hugging Face's band).
//
// Work split: grid = (num_tiles, num_heads), block = 128 threads. A block owns kRows query
// tokens of one sequence for one query head and walks their keys in tiles of kKeys (as many
// as fit kTileFloats floats of shared memory: 64 keys at HEAD_DIM 64, 16 at 256), with the
// online softmax (flash-attention's running max and sum per query row):
//
//   1. the tile's slots from the block table; K rows -> shared memory as fp32
//   2. scores = q . k (q pre-scaled by scale * log2(e): softmax in the log2 domain), masked
//   3. per query row (8 lanes each): new max, p = exp2(s - max), rescale factor of the past
//   4. V rows -> the same shared buffer; acc = acc * rescale + P @ V in fp32 registers
//   5. out = acc / sum
//
// Attention sinks (gpt-oss; `sinks` fp32 [num_heads], else null): head h's sink logit joins
// each query's softmax denominator and brings no value, so it starts the online softmax as a
// key already seen: running max = the sink, running sum = 1, accumulator 0.
//
// Plain fp32 FMAs on CUDA cores, no tensor cores: a prefill of a few thousand tokens is a few
// milliseconds of arithmetic at most at SmolLM2's size, where one SDPA call per sequence per
// layer cost a Python call and a launch each.

#include "zllm_common.cuh"

constexpr int kPrefillThreads = 128;
constexpr int kRowLanes = 8;                                // threads per query row (softmax)
constexpr int kRows = kPrefillThreads / kRowLanes;          // query tokens per block: 16
constexpr int kTileFloats = 4096;                           // one K or V tile: kKeys * HEAD_DIM
constexpr float kPrefillLog2e = 1.4426950408889634f;
constexpr float kMasked = -3.0e38f;                         // a masked score (below any logit)

ZLLM_DEVICE int prefill_min(int a, int b) { return a < b ? a : b; }
ZLLM_DEVICE int prefill_max(int a, int b) { return a > b ? a : b; }

template <typename D, int HEAD_DIM>
__global__ void __launch_bounds__(kPrefillThreads)
    zllm_paged_prefill(typename D::T* __restrict__ out, const typename D::T* __restrict__ q,
                       zllm_i64 q_token_stride, zllm_i64 q_head_stride,
                       const typename D::T* __restrict__ kv_cache, zllm_i64 num_slots,
                       const void* __restrict__ block_tables, int block_tables_int64,
                       zllm_i64 block_table_stride, const int* __restrict__ seqs,
                       const int* __restrict__ tiles, int num_heads, int num_kv_heads,
                       int block_size, float scale, int window,
                       const float* __restrict__ sinks) {
  using T = typename D::T;
  constexpr int kKeys = kTileFloats / HEAD_DIM;
  constexpr int kStride = HEAD_DIM + 1;  // padded rows: lanes reading different keys differ in bank
  constexpr int kAcc = kRows * HEAD_DIM / kPrefillThreads;  // output elements per thread
  static_assert(kRows * HEAD_DIM % kPrefillThreads == 0, "head_dim must be a multiple of 8");

  __shared__ float q_tile[kRows * kStride];
  __shared__ float kv_tile[kKeys * kStride];  // the key tile's K rows, then its V rows
  __shared__ float probs[kRows * kKeys];      // scores, then probabilities
  __shared__ zllm_i64 slots[kKeys];
  __shared__ float row_max[kRows];
  __shared__ float row_sum[kRows];
  __shared__ float row_rescale[kRows];

  const int tid = threadIdx.x;
  const int head = blockIdx.y;
  const int seq = tiles[2 * blockIdx.x];
  const int first_query = tiles[2 * blockIdx.x + 1];
  const int first_token = seqs[3 * seq];
  const int q_len = seqs[3 * seq + 1];
  const int ctx_len = seqs[3 * seq + 2];
  const int rows = prefill_min(kRows, q_len - first_query);
  const int first_pos = ctx_len - q_len + first_query;  // context position of query row 0
  const int last_key = first_pos + rows - 1;
  const int first_key = window > 0 ? prefill_max(0, first_pos - window + 1) : 0;
  const int kv_head = head / (num_heads / num_kv_heads);
  const zllm_i64 table_row = (zllm_i64)seq * block_table_stride;
  const zllm_i64 kv_row = (zllm_i64)num_kv_heads * HEAD_DIM;  // elements per cache slot

  const float q_scale = scale * kPrefillLog2e;
  for (int i = tid; i < kRows * HEAD_DIM; i += kPrefillThreads) {
    const int m = i / HEAD_DIM, d = i % HEAD_DIM;
    float x = 0.0f;
    if (m < rows) {
      const zllm_i64 token = first_token + first_query + m;
      x = D::to_float(q[token * q_token_stride + head * q_head_stride + d]) * q_scale;
    }
    q_tile[m * kStride + d] = x;
  }
  if (tid < kRows) {
    row_max[tid] = sinks != nullptr ? sinks[head] * kPrefillLog2e : kMasked;
    row_sum[tid] = sinks != nullptr ? 1.0f : 0.0f;
  }
  float acc[kAcc];
#pragma unroll
  for (int j = 0; j < kAcc; ++j) acc[j] = 0.0f;

  for (int key0 = first_key; key0 <= last_key; key0 += kKeys) {
    const int num_keys = prefill_min(kKeys, last_key - key0 + 1);
    __syncthreads();  // the last tile's V rows and probabilities are consumed
    // 1. slots, then K rows
    if (tid < num_keys) {
      const int pos = key0 + tid;
      const zllm_i64 block =
          load_index(block_tables, block_tables_int64, table_row + pos / block_size);
      slots[tid] = block * block_size + pos % block_size;
    }
    __syncthreads();
    for (int i = tid; i < kKeys * HEAD_DIM; i += kPrefillThreads) {
      const int n = i / HEAD_DIM, d = i % HEAD_DIM;
      kv_tile[n * kStride + d] =
          n < num_keys ? D::to_float(kv_cache[slots[n] * kv_row + kv_head * HEAD_DIM + d]) : 0.0f;
    }
    __syncthreads();
    // 2. scores
    for (int e = tid; e < kRows * kKeys; e += kPrefillThreads) {
      const int m = e / kKeys, n = e % kKeys;
      const int query_pos = first_pos + m, key_pos = key0 + n;
      float s = kMasked;
      if (m < rows && n < num_keys && key_pos <= query_pos &&
          (window <= 0 || query_pos - key_pos < window)) {
        s = 0.0f;
        const float* qr = q_tile + m * kStride;
        const float* kr = kv_tile + n * kStride;
#pragma unroll 8
        for (int d = 0; d < HEAD_DIM; ++d) s += qr[d] * kr[d];
      }
      probs[e] = s;
    }
    __syncthreads();
    // 3. online softmax, one query row per kRowLanes lanes; 4a. V rows load meanwhile
    {
      const int m = tid / kRowLanes, sub = tid % kRowLanes;
      const float old_max = row_max[m];  // read before the shuffles; lane 0 writes after them
      float* row = probs + m * kKeys;
      float tile_max = kMasked;
      for (int n = sub; n < num_keys; n += kRowLanes) tile_max = fmaxf(tile_max, row[n]);
      const float new_max = fmaxf(old_max, group_max<kRowLanes>(tile_max));
      float sum = 0.0f;
      for (int n = sub; n < num_keys; n += kRowLanes) {
        const float p = row[n] > kMasked ? exp2f(row[n] - new_max) : 0.0f;
        row[n] = p;
        sum += p;
      }
      sum = group_sum<kRowLanes>(sum);
      if (sub == 0) {
        const float rescale = exp2f(old_max - new_max);  // 0 after a first real score; 1 if none
        row_max[m] = new_max;
        row_sum[m] = row_sum[m] * rescale + sum;
        row_rescale[m] = rescale;
      }
    }
    for (int i = tid; i < kKeys * HEAD_DIM; i += kPrefillThreads) {
      const int n = i / HEAD_DIM, d = i % HEAD_DIM;
      kv_tile[n * kStride + d] =
          n < num_keys ? D::to_float(kv_cache[(num_slots + slots[n]) * kv_row + kv_head * HEAD_DIM + d])
                       : 0.0f;
    }
    __syncthreads();
    // 4b. acc = acc * rescale + P @ V; thread tid owns outputs tid + 128 j (row-major [m][d])
#pragma unroll
    for (int j = 0; j < kAcc; ++j) {
      const int i = tid + j * kPrefillThreads;
      const int m = i / HEAD_DIM, d = i % HEAD_DIM;
      const float* p = probs + m * kKeys;
      float a = acc[j] * row_rescale[m];
      for (int n = 0; n < num_keys; ++n) a += p[n] * kv_tile[n * kStride + d];
      acc[j] = a;
    }
  }
  // 5. normalise and store (row_sum is final: written before the loop's last barrier)
#pragma unroll
  for (int j = 0; j < kAcc; ++j) {
    const int i = tid + j * kPrefillThreads;
    const int m = i / HEAD_DIM, d = i % HEAD_DIM;
    if (m < rows) {
      const zllm_i64 token = first_token + first_query + m;
      out[(token * num_heads + head) * HEAD_DIM + d] = D::from_float(acc[j] / row_sum[m]);
    }
  }
}

#ifdef ZLLM_INSTANTIATE_ALL
// Offline builds (the nvcc test) instantiate every variant cuda_prefill.py can ask for.
#define ZLLM_PREFILL_VARIANTS(D)                                                         \
  (void*)&zllm_paged_prefill<D, 64>, (void*)&zllm_paged_prefill<D, 80>,                 \
      (void*)&zllm_paged_prefill<D, 96>, (void*)&zllm_paged_prefill<D, 112>,            \
      (void*)&zllm_paged_prefill<D, 128>, (void*)&zllm_paged_prefill<D, 256>
void* zllm_paged_prefill_kernel(int i) {
  static void* const kernels[] = {ZLLM_PREFILL_VARIANTS(DtypeF32), ZLLM_PREFILL_VARIANTS(DtypeF16),
                                  ZLLM_PREFILL_VARIANTS(DtypeBF16)};
  return kernels[i];
}
#endif
