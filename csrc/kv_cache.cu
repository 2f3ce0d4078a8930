// Writes a step's new K and V into the paged KV cache, both in one launch.
//
//   key, value   [T, num_kv_heads, head_dim]     any token/head strides, last dim contiguous
//   slot_mapping int64 [T]                       slot = block_id * block_size + offset; -1 skips
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim]   contiguous, 0 = K, 1 = V
//
// Viewed as [2, num_slots, num_kv_heads, head_dim], token t's heads go to row slot_mapping[t]
// of each half. One thread block per token; its threads stride over the token's
// num_kv_heads * head_dim elements, 16 bytes at a time when every address allows it (the
// host checks alignment and passes `vectorized`), else one element at a time. Slots outside
// [0, num_slots) (the -1 of padding rows) are skipped, never written.
//
// The copy is a pure byte move, so the element type only sets the element size; the entry
// points exist per dtype to keep the host side uniform and self-describing.

#include "zllm_common.cuh"

template <typename T>
ZLLM_DEVICE void copy_token(const T* __restrict__ src, zllm_i64 head_stride, T* __restrict__ dst,
                            int num_kv_heads, int head_dim, bool vectorized) {
  if (vectorized) {
    constexpr int kVec = 16 / (int)sizeof(T);
    const int units_per_head = head_dim / kVec;
    for (int i = threadIdx.x; i < num_kv_heads * units_per_head; i += blockDim.x) {
      const int head = i / units_per_head;
      const int unit = i - head * units_per_head;
      *reinterpret_cast<Pack16*>(dst + (zllm_i64)head * head_dim + unit * kVec) =
          *reinterpret_cast<const Pack16*>(src + head * head_stride + unit * kVec);
    }
  } else {
    for (int i = threadIdx.x; i < num_kv_heads * head_dim; i += blockDim.x) {
      const int head = i / head_dim;
      const int d = i - head * head_dim;
      dst[(zllm_i64)head * head_dim + d] = src[head * head_stride + d];
    }
  }
}

template <typename T>
ZLLM_DEVICE void write_kv_cache(const T* __restrict__ key, const T* __restrict__ value,
                                T* __restrict__ kv_cache, const zllm_i64* __restrict__ slot_mapping,
                                zllm_i64 key_token_stride, zllm_i64 key_head_stride,
                                zllm_i64 value_token_stride, zllm_i64 value_head_stride,
                                int num_kv_heads, int head_dim, zllm_i64 num_slots,
                                bool vectorized) {
  const zllm_i64 token = blockIdx.x;
  const zllm_i64 slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // padding (-1) or not a slot of this cache
  const zllm_i64 row = (zllm_i64)num_kv_heads * head_dim;  // elements per slot
  T* k_dst = kv_cache + slot * row;
  T* v_dst = k_dst + num_slots * row;  // the V half starts num_slots rows later
  copy_token(key + token * key_token_stride, key_head_stride, k_dst, num_kv_heads, head_dim,
             vectorized);
  copy_token(value + token * value_token_stride, value_head_stride, v_dst, num_kv_heads, head_dim,
             vectorized);
}

// Grid: (num_tokens); block: (128,) or any size. Strides are in elements.
#define ZLLM_WRITE_KV_CACHE_ENTRY(NAME, TYPE)                                                   \
  extern "C" __global__ void NAME(const TYPE* key, const TYPE* value, TYPE* kv_cache,            \
                                  const zllm_i64* slot_mapping, zllm_i64 key_token_stride,      \
                                  zllm_i64 key_head_stride, zllm_i64 value_token_stride,        \
                                  zllm_i64 value_head_stride, int num_kv_heads, int head_dim,   \
                                  zllm_i64 num_slots, int vectorized) {                         \
    write_kv_cache<TYPE>(key, value, kv_cache, slot_mapping, key_token_stride, key_head_stride, \
                         value_token_stride, value_head_stride, num_kv_heads, head_dim,         \
                         num_slots, vectorized != 0);                                           \
  }

ZLLM_WRITE_KV_CACHE_ENTRY(zllm_write_kv_cache_f32, float)
ZLLM_WRITE_KV_CACHE_ENTRY(zllm_write_kv_cache_f16, zllm_u16)
ZLLM_WRITE_KV_CACHE_ENTRY(zllm_write_kv_cache_bf16, zllm_u16)
