// Block-quantized matmuls on the GPU: the blocks a quantized checkpoint is laid out in at
// load (executor/weights/quantized/to_blocks.py; the CPU kernels read the same bytes), read
// as they are, never widened in memory for a decode step.
//
//   zllm_block_gemv     out[m, o] = sum_i x[m, i] w[o, i]   for up to 16 rows of x
//   zllm_block_dequant  w as the element type, [out, in]   (a prefill's GEMM then runs on it)
//
// Types (ggml ids, 32 values a block, the fp16 scale d first):
//   Q4_0      (2)   18 bytes: d, 16 bytes of nibbles      w = d (q - 8)
//   Q4_1      (3)   20 bytes: d, m (fp16), 16 of nibbles  w = d q + m
//   Q8_0      (8)   34 bytes: d, 32 int8                  w = d q
//   FP8_E4M3  (100) 34 bytes: d, 32 e4m3 codes            w = d e4m3(q)   (zllm's own type)
// Nibbles as GGUF holds them: byte j's low nibble is value j, its high nibble value j + 16.
// Each weight is computed as gguf.quants (and the CPU kernel) computes it: a product, then
// for Q4_1 an add, each rounded in fp32 (__fmul_rn keeps them from contracting into an FMA),
// so the values multiplied are the CPU path's bit for bit; only the order of the sums differs.
//
// zllm_block_gemv: grid = ceil(out / 4), block = 128 threads. A warp takes one output row;
// its lanes take the row's blocks in turn (lane l: blocks l, l + 32, ...), decode each into 32
// floats in registers and multiply them with every input row's 32 values (x is small and stays
// in cache), so the weights are read once for all rows. The block bytes are read in 16-bit
// words: every block starts at an even byte (the sizes are even), no wider alignment holds.
// out may be a column slice of a wider output (out_stride; a fused matmul's part).
//
// zllm_block_dequant: one thread per block, grid = ceil(blocks / 128).

#include "zllm_common.cuh"

constexpr int kBlockGemvThreads = 128;
constexpr int kBlockGemvMaxRows = 16;  // cuda_blocks.py MAX_ROWS
constexpr int kValuesPerBlock = 32;

constexpr int kQ4_0 = 2;
constexpr int kQ4_1 = 3;
constexpr int kQ8_0 = 8;
constexpr int kFP8_E4M3 = 100;

template <int TYPE>
struct BlockBytes {
  static constexpr int value = TYPE == kQ4_0 ? 18 : TYPE == kQ4_1 ? 20 : 34;
};

ZLLM_DEVICE float half_at(const zllm_u16* words, int i) { return DtypeF16::to_float(words[i]); }

// An e4m3 code (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, S.1111.111
// is NaN) as the float it holds: exact.
ZLLM_DEVICE float e4m3_to_float(unsigned int code) {
  const unsigned int sign = (code & 0x80u) << 24;
  const unsigned int exponent = (code >> 3) & 0xfu;
  const unsigned int mantissa = code & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return __uint_as_float(0x7fc00000u);
  if (exponent == 0) {  // subnormal: mantissa * 2^-9
    const float value = (float)mantissa * 0.001953125f;
    return sign ? -value : value;
  }
  return __uint_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// The 32 values of the block at `block` (an even address) into w.
template <int TYPE>
ZLLM_DEVICE void decode_block(const unsigned char* block, float* w) {
  const zllm_u16* words = reinterpret_cast<const zllm_u16*>(block);
  const float d = half_at(words, 0);
  if constexpr (TYPE == kQ4_0 || TYPE == kQ4_1) {
    const int first = TYPE == kQ4_0 ? 1 : 2;  // the nibbles' first word
    const float m = TYPE == kQ4_1 ? half_at(words, 1) : 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const unsigned int two = words[first + j];  // bytes 2j, 2j + 1
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const unsigned int byte = (two >> (8 * k)) & 0xffu;
        const int lo = (int)(byte & 0xfu), hi = (int)(byte >> 4);
        if constexpr (TYPE == kQ4_0) {
          w[2 * j + k] = __fmul_rn(d, (float)(lo - 8));
          w[2 * j + k + 16] = __fmul_rn(d, (float)(hi - 8));
        } else {
          w[2 * j + k] = __fmul_rn(d, (float)lo) + m;
          w[2 * j + k + 16] = __fmul_rn(d, (float)hi) + m;
        }
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const unsigned int two = words[1 + j];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const unsigned int byte = (two >> (8 * k)) & 0xffu;
        const float q = TYPE == kQ8_0 ? (float)(signed char)byte : e4m3_to_float(byte);
        w[2 * j + k] = __fmul_rn(d, q);
      }
    }
  }
}

template <typename D, int TYPE>
__global__ void __launch_bounds__(kBlockGemvThreads)
    zllm_block_gemv(typename D::T* __restrict__ out, zllm_i64 out_stride,
                    const typename D::T* __restrict__ x, zllm_i64 x_stride, int rows,
                    const unsigned char* __restrict__ w, zllm_i64 row_bytes, int out_features,
                    int blocks_per_row) {
  using T = typename D::T;
  constexpr int kElems = PackTraits<D>::kElems;
  const int lane = threadIdx.x % 32;
  const int o = blockIdx.x * (kBlockGemvThreads / 32) + threadIdx.x / 32;
  if (o >= out_features) return;  // the whole warp
  const unsigned char* w_row = w + (zllm_i64)o * row_bytes;
  float acc[kBlockGemvMaxRows];
#pragma unroll
  for (int m = 0; m < kBlockGemvMaxRows; ++m) acc[m] = 0.0f;
  for (int b = lane; b < blocks_per_row; b += 32) {
    float wv[kValuesPerBlock];
    decode_block<TYPE>(w_row + (zllm_i64)b * BlockBytes<TYPE>::value, wv);
#pragma unroll
    for (int m = 0; m < kBlockGemvMaxRows; ++m) {
      if (m < rows) {
        const T* xr = x + m * x_stride + b * kValuesPerBlock;
#pragma unroll
        for (int p = 0; p < kValuesPerBlock; p += kElems) {
          float xv[kElems];
          load_pack<D>(xr + p, xv);
#pragma unroll
          for (int k = 0; k < kElems; ++k) acc[m] += wv[p + k] * xv[k];
        }
      }
    }
  }
  // Unrolled with a test rather than bounded by `rows`, so acc stays in registers; `rows`
  // is the same for the whole warp, so every lane takes the same shuffles.
#pragma unroll
  for (int m = 0; m < kBlockGemvMaxRows; ++m) {
    if (m < rows) {
      const float sum = group_sum<32>(acc[m]);
      if (lane == 0) out[m * out_stride + o] = D::from_float(sum);
    }
  }
}

template <typename D, int TYPE>
__global__ void __launch_bounds__(kBlockGemvThreads)
    zllm_block_dequant(typename D::T* __restrict__ out, const unsigned char* __restrict__ w,
                       zllm_i64 row_bytes, int out_features, int blocks_per_row) {
  const zllm_i64 index = (zllm_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (index >= (zllm_i64)out_features * blocks_per_row) return;
  const zllm_i64 row = index / blocks_per_row;
  const int b = (int)(index % blocks_per_row);
  float wv[kValuesPerBlock];
  decode_block<TYPE>(w + row * row_bytes + (zllm_i64)b * BlockBytes<TYPE>::value, wv);
  typename D::T* dst = out + row * ((zllm_i64)blocks_per_row * kValuesPerBlock) + b * kValuesPerBlock;
#pragma unroll
  for (int i = 0; i < kValuesPerBlock; ++i) dst[i] = D::from_float(wv[i]);
}

#ifdef ZLLM_INSTANTIATE_ALL
#define ZLLM_BLOCK_KERNELS(D)                                                             \
  (void*)&zllm_block_gemv<D, kQ4_0>, (void*)&zllm_block_gemv<D, kQ4_1>,                   \
      (void*)&zllm_block_gemv<D, kQ8_0>, (void*)&zllm_block_gemv<D, kFP8_E4M3>,           \
      (void*)&zllm_block_dequant<D, kQ4_0>, (void*)&zllm_block_dequant<D, kQ4_1>,         \
      (void*)&zllm_block_dequant<D, kQ8_0>, (void*)&zllm_block_dequant<D, kFP8_E4M3>
void* zllm_block_kernel(int i) {
  static void* const kernels[] = {ZLLM_BLOCK_KERNELS(DtypeF32), ZLLM_BLOCK_KERNELS(DtypeF16),
                                  ZLLM_BLOCK_KERNELS(DtypeBF16)};
  return kernels[i];
}
#endif
