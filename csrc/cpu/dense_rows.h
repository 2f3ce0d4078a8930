// y [M, N] = x [M, K] @ W^T for fp32 W at decode-sized M (1-8 rows), with AVX-512 or AVX2.
//
// Why: an fp32 checkpoint's decode step multiplies a few rows by every matrix, a stream of
// 4 bytes a weight that should take the memory's time at any row count up to ~8. MKL's sgemm
// takes its one-row time at 1-2 rows but 2-3x it from 4 rows (SmolLM2-135M's matrices, 2
// threads: 14 ms a step at 1 row, 35 ms at 8; BENCHMARKS.md "The fastest arithmetic by
// default"). Here each weight row is loaded once per 16 values and multiplied into MR rows'
// accumulators held in registers (MR x NR of them: NR weight rows at a time), so the work per
// weight byte is MR fused multiply-adds: in 512-bit lanes, or on an AVX2 CPU in two 256-bit
// halves of the same 16 lanes (1.9x MKL at one row, 2-3x at 2-8 rows on a Zen 3:
// BENCHMARKS.md "fp32 decode rows on AVX2").
//
// Each output is one weight row's dot product with one x row, summed in 16 lanes and then
// across them: its bits do not depend on M, on which rows share the call, or on the ISA.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include "aten_lite.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_isa.h"
#include "simd.h"

namespace zllm_dense {

ZLLM_TARGET_AVX512 inline float lane_sum(__m512 v) { return _mm512_reduce_add_ps(v); }

// How 16 weights become 16 fp32 lanes (exactly: every format widens without rounding).
struct F32Weights {
  using Elem = float;
  ZLLM_TARGET_AVX512 static __m512 load(const Elem* p) { return _mm512_loadu_ps(p); }
  ZLLM_TARGET_AVX512 static __m512 load(const Elem* p, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, p);
  }
};
struct BF16Weights {  // a bfloat16 is an fp32's upper half
  using Elem = uint16_t;
  ZLLM_TARGET_AVX512 static __m512 widen(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  ZLLM_TARGET_AVX512 static __m512 load(const Elem* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ZLLM_TARGET_AVX512 static __m512 load(const Elem* p, __mmask16 m) {
    return widen(_mm256_maskz_loadu_epi16(m, p));
  }
};
struct F16Weights {
  using Elem = uint16_t;
  ZLLM_TARGET_AVX512 static __m512 load(const Elem* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ZLLM_TARGET_AVX512 static __m512 load(const Elem* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
};

// NR weight rows against MR x rows (nr of the NR rows exist: the last tile of a matrix may be
// short); K % 16 values of each row are masked loads.
template <int MR, int NR, class W>
ZLLM_TARGET_AVX512 inline void dense_tile(const float* x, int64_t ldx,
                                          const typename W::Elem* w, int64_t K, float* y,
                                          int64_t ldy, int nr) {
  const typename W::Elem* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = w + (j < nr ? j : 0) * K;  // a short tile repeats row 0
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = W::load(rows[j] + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = W::load(rows[j] + k, tail);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < nr; ++j) y[i * ldy + j] = lane_sum(acc[i][j]);
}

// Enough independent accumulators to cover the FMA latency at one row. More than 4 rows run
// as passes of at most 4 over the same NR weight rows, the later passes reading them from L1:
// 8 rows in one pass (8 x 3 accumulators) ran no faster than MKL.
template <int MR>
constexpr int kWeightRows = MR == 1 ? 8 : MR == 2 ? 6 : 4;

// The tiles of an N-row weight matrix over the threads, NR rows at a time; x rows past the
// fourth run as a second pass over the same weight rows. tile(rows, first, n0, nr) runs one
// tile for `rows` (a std::integral_constant) x rows from x row `first` against weight rows
// n0 .. n0 + nr.
template <int MR, class Tile>
inline void for_each_tile(int64_t N, const Tile& tile) {
  constexpr int NR = kWeightRows<MR>;
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR;
      const int nr = static_cast<int>(N - n0 < NR ? N - n0 : NR);
      tile(std::integral_constant<int, (MR <= 4 ? MR : 4)>{}, 0, n0, nr);
      if constexpr (MR > 4) tile(std::integral_constant<int, MR - 4>{}, 4, n0, nr);
    }
  });
}

// w: N rows of K weights (W's element type), contiguous.
template <int MR, class W>
ZLLM_TARGET_AVX512 void dense_rows(const float* x, int64_t ldx, const void* w_, int64_t N,
                                   int64_t K, float* y, int64_t ldy) {
  const auto* w = static_cast<const typename W::Elem*>(w_);
  for_each_tile<MR>(N, [&](auto rows, int first, int64_t n0, int nr) {
    dense_tile<decltype(rows)::value, kWeightRows<MR>, W>(x + first * ldx, ldx, w + n0 * K, K,
                                                          y + first * ldy + n0, ldy, nr);
  });
}

using DenseRowsKernel = void (*)(const float*, int64_t, const void*, int64_t, int64_t, float*,
                                 int64_t);

// pick(std::integral_constant<int, M>) for M in 1-8 (a kernel instantiated per row count),
// else nullptr.
template <class Kernel, class Pick>
inline Kernel for_rows(int64_t M, const Pick& pick) {
  switch (M) {
    case 1: return pick(std::integral_constant<int, 1>{});
    case 2: return pick(std::integral_constant<int, 2>{});
    case 3: return pick(std::integral_constant<int, 3>{});
    case 4: return pick(std::integral_constant<int, 4>{});
    case 5: return pick(std::integral_constant<int, 5>{});
    case 6: return pick(std::integral_constant<int, 6>{});
    case 7: return pick(std::integral_constant<int, 7>{});
    case 8: return pick(std::integral_constant<int, 8>{});
    default: return nullptr;
  }
}

template <class W>
inline DenseRowsKernel kernel_for(int64_t M) {
  return for_rows<DenseRowsKernel>(M,
                                [](auto mr) { return dense_rows<decltype(mr)::value, W>; });
}

// --- AVX2: the same sums in two 8-lane halves ----------------------------------------------
//
// Each 16-lane accumulator of the tiles above is two here, lanes 0-7 and 8-15 of every 16
// values, each lane the same chain of fused multiply-adds; the halves are reduced in
// _mm512_reduce_add_ps's order (GCC: high half + low half, then 4 + 4, 2 + 2, 1 + 1, which is
// zllm_simd::hsum of hi + lo). So an AVX2 CPU's outputs are the AVX-512 kernel's bits, and
// neither depends on M. A tail of K % 16 values runs from zero-padded copies (the AVX-512
// tile's masked loads read zeros there too).

inline float lane_sum(__m256 lo, __m256 hi) { return zllm_simd::hsum(_mm256_add_ps(hi, lo)); }

struct F32Weights8 {
  using Elem = float;
  static __m256 load(const Elem* p) { return _mm256_loadu_ps(p); }
};

// One 16-value step of NR weight rows against MR x rows (x rows ldx apart).
template <int MR, int NR, class W>
inline void dense_step8(const float* x, int64_t ldx, const typename W::Elem* const* rows,
                        __m256 (&acc)[MR][NR][2]) {
  for (int h = 0; h < 2; ++h) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = W::load(rows[j] + 8 * h);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + 8 * h);
      for (int j = 0; j < NR; ++j) acc[i][j][h] = _mm256_fmadd_ps(xv, wv[j], acc[i][j][h]);
    }
  }
}

template <int MR, int NR, class W>
inline void dense_tile8(const float* x, int64_t ldx, const typename W::Elem* w, int64_t K,
                        float* y, int64_t ldy, int nr) {
  using Elem = typename W::Elem;
  const Elem* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = w + (j < nr ? j : 0) * K;  // a short tile repeats row 0
  __m256 acc[MR][NR][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const Elem* at[NR];
    for (int j = 0; j < NR; ++j) at[j] = rows[j] + k;
    dense_step8<MR, NR, W>(x + k, ldx, at, acc);
  }
  if (k < K) {
    const int64_t rest = K - k;
    Elem wpad[NR][16] = {};
    float xpad[MR][16] = {};
    const Elem* at[NR];
    for (int j = 0; j < NR; ++j) {
      std::memcpy(wpad[j], rows[j] + k, rest * sizeof(Elem));
      at[j] = wpad[j];
    }
    for (int i = 0; i < MR; ++i) std::memcpy(xpad[i], x + i * ldx + k, rest * sizeof(float));
    dense_step8<MR, NR, W>(&xpad[0][0], 16, at, acc);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < nr; ++j) y[i * ldy + j] = lane_sum(acc[i][j][0], acc[i][j][1]);
}

// AVX2's 16 registers hold MR x NR x 2 accumulators, NR weights and an x: passes of at most
// kPassRows8 x rows over NR weight rows (the later passes read them from L1). On a Zen 3 (2
// threads, SmolLM2's and a 1B's matrices) passes of 3 rows ran no faster than 2.
constexpr int kPassRows8 = 2;
template <int MR>
constexpr int kWeightRows8 = MR == 1 ? 4 : 2;

template <int MR, class W>
void dense_rows8(const float* x, int64_t ldx, const void* w_, int64_t N, int64_t K, float* y,
                 int64_t ldy) {
  const auto* w = static_cast<const typename W::Elem*>(w_);
  constexpr int P = MR < kPassRows8 ? MR : kPassRows8;
  constexpr int NR = kWeightRows8<P>;
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR;
      const int nr = static_cast<int>(N - n0 < NR ? N - n0 : NR);
      int first = 0;
      for (; first + P <= MR; first += P)
        dense_tile8<P, NR, W>(x + first * ldx, ldx, w + n0 * K, K, y + first * ldy + n0, ldy, nr);
      if constexpr (MR % P != 0)
        dense_tile8<MR % P, NR, W>(x + first * ldx, ldx, w + n0 * K, K, y + first * ldy + n0,
                                   ldy, nr);
    }
  });
}

template <class W>
inline DenseRowsKernel kernel_for8(int64_t M) {
  return for_rows<DenseRowsKernel>(M,
                                [](auto mr) { return dense_rows8<decltype(mr)::value, W>; });
}

// The kernel for M rows of fp32 weights (1-8 rows: AVX-512's, else AVX2's), else nullptr.
inline DenseRowsKernel dense_rows_kernel(int64_t M) {
  return zllm_isa::use_avx512_vnni() ? kernel_for<F32Weights>(M) : kernel_for8<F32Weights8>(M);
}

// The same for 16-bit rows (ggml F16 = 1, BF16 = 30: gguf_linear.h's linear_rows takes it
// ahead of its AVX2 few-rows loop).
inline DenseRowsKernel sixteen_rows_kernel(int64_t qtype, int64_t M) {
  // AVX2 keeps gguf_linear.h's few-rows loop: the two-halves kernel over BF16 rows, timed
  // against it alternately on a Zen 3, was 1.14x at one row but 0.82-0.95x at 2-8 (each pass
  // widens the rows again), and F16's 0.9x at 1-4 rows; one kernel must serve every row count
  // (a row's bits may not depend on the rows beside it).
  if (!zllm_isa::use_avx512_vnni()) return nullptr;
  if (qtype == 30) return kernel_for<BF16Weights>(M);
  if (qtype == 1) return kernel_for<F16Weights>(M);
  return nullptr;
}

// --- 32-value blocks with one fp16 scale: Q4_0, Q8_0 and zllm's FP8_E4M3 ----------------------
//
// The same tiles over quantized rows: each block's 32 weights are widened to two 16-lane fp32
// registers and scaled (d x code, exact in fp32: a code of at most 8 bits times an fp16), then
// multiplied into the MR rows' accumulators. The AVX2 few-rows loop (gguf_linear.h) widens 8 values per instruction and
// spent more time converting than the memory took to stream at one row (Q4_0: 11 GB/s against
// Q4_K's integer tiles' 16, BENCHMARKS.md "Quantized checkpoints"); here a block's widening is
// shared by the MR rows and runs 16 lanes wide.

struct Q4_0Block {
  static constexpr int64_t kBytes = 18;
  ZLLM_TARGET_AVX512 static void load(const uint8_t* blk, __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(zllm_simd::half_to_float(blk));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(bytes, mask), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), eight);
    w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
    w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
  }
};
struct Q8_0Block {
  static constexpr int64_t kBytes = 34;
  ZLLM_TARGET_AVX512 static void load(const uint8_t* blk, __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(zllm_simd::half_to_float(blk));
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes))));
    w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1))));
  }
};
struct E4M3Block {  // gguf_linear.h widen_e4m3's bit move, 32 lanes at once
  static constexpr int64_t kBytes = 34;
  ZLLM_TARGET_AVX512 static void load(const uint8_t* blk, __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(zllm_simd::half_to_float(blk) * 256.f);
    const __m512i bytes =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)));
    const __m512i half = _mm512_or_si512(
        _mm512_slli_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(0x80)), 8),
        _mm512_slli_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(0x7F)), 7));
    w[0] = _mm512_mul_ps(d, _mm512_cvtph_ps(_mm512_castsi512_si256(half)));
    w[1] = _mm512_mul_ps(d, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)));
  }
};

template <int MR, int NR, class B>
ZLLM_TARGET_AVX512 inline void block_tile(const float* x, int64_t ldx, const uint8_t* w,
                                          int64_t row_bytes, int64_t K, float* y, int64_t ldy,
                                          int nr) {
  const uint8_t* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = w + (j < nr ? j : 0) * row_bytes;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512 wv[NR][2];
    for (int j = 0; j < NR; ++j) B::load(rows[j] + b * B::kBytes, wv[j]);
    for (int i = 0; i < MR; ++i) {
      const __m512 x0 = _mm512_loadu_ps(x + i * ldx + 32 * b);
      const __m512 x1 = _mm512_loadu_ps(x + i * ldx + 32 * b + 16);
      for (int j = 0; j < NR; ++j) {
        acc[i][j] = _mm512_fmadd_ps(x0, wv[j][0], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(x1, wv[j][1], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < nr; ++j) y[i * ldy + j] = lane_sum(acc[i][j]);
}

template <int MR, class B>
ZLLM_TARGET_AVX512 void block_rows(const float* x, int64_t ldx, const uint8_t* w,
                                   int64_t row_bytes, int64_t N, int64_t K, float* y,
                                   int64_t ldy) {
  for_each_tile<MR>(N, [&](auto rows, int first, int64_t n0, int nr) {
    block_tile<decltype(rows)::value, kWeightRows<MR>, B>(
        x + first * ldx, ldx, w + n0 * row_bytes, row_bytes, K, y + first * ldy + n0, ldy, nr);
  });
}

using BlockRowsKernel = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t,
                                 int64_t, float*, int64_t);

template <class B>
inline BlockRowsKernel block_kernel_for(int64_t M) {
  return for_rows<BlockRowsKernel>(M,
                                [](auto mr) { return block_rows<decltype(mr)::value, B>; });
}

// The kernel for M rows of a 32-value block type (ggml Q4_0 = 2, Q8_0 = 8, zllm's FP8_E4M3 =
// 100) where AVX-512 runs it (1-8 rows), else nullptr. Measured per matmul (8192 x 2048, 2
// threads, against the AVX2 few-rows loop and panels): Q4_0 1.1x at 1 row, 1.5x at 8; Q8_0
// level at 1, 1.55x at 8; FP8_E4M3 1.1x at 1, 1.1x at 8. Q4_1 is not taken: 0.75x at one row
// (its offset costs an FMA per 16 values here; the AVX2 loop sums x once per block instead).
inline BlockRowsKernel block_rows_kernel(int64_t qtype, int64_t M) {
  if (!zllm_isa::use_avx512_vnni()) return nullptr;
  switch (qtype) {
    case 2: return block_kernel_for<Q4_0Block>(M);
    case 8: return block_kernel_for<Q8_0Block>(M);
    case 100: return block_kernel_for<E4M3Block>(M);
    default: return nullptr;
  }
}

// y [M, N] = x [M, K] @ w^T (+ bias) for fp32 x (rows contiguous) and w [N, K] contiguous: the
// kernel above at 1-8 rows where AVX-512 runs it, torch's matmul (MKL) otherwise. The module
// path (executor/layers/linear/dense.py) and the fused decode stack both call it, so a decode
// step's bits do not depend on which of them ran it.
void dense_linear_into(const at::Tensor& x, const at::Tensor& w,
                       const at::Tensor& bias, at::Tensor& y);

}  // namespace zllm_dense
