// y = x @ W^T with W kept in its GGUF block-quantized form, x and y fp32.
// Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-value blocks) and Q4_K, Q5_K, Q6_K (256-value
// super-blocks), the ones llama.cpp's common presets write; the low-bit presets' Q2_K, Q3_K,
// IQ4_NL, IQ4_XS and MXFP4 (their dequantizers and few-rows formats: gguf_lowbit.h); the
// lattice (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), ternary (TQ1_0, TQ2_0) and
// NVFP4 types (gguf_lattice.h); F16 and BF16 rows. One code path (AVX2, FMA, F16C) on every
// CPU: $ZLLM_CPU_ISA / set_cpu_isa choose only the integer K-quant kernels' variant
// (kquant_int8.h).
//
// Why: at small batches a decode step is bound by reading the weights. fp32 weights are
// 4 bytes a value; these types are 0.56-1.06, so the same step reads 4-7x fewer bytes, and
// the weights take the file's size in memory.
// The panel paths dequantize the weights into a panel exactly as gguf.quants does it (fp32 products
// and sums in numpy's order, no FMA contraction: built with -ffp-contract=off), so the values
// it multiplies are bit for bit the fp32 reference weights; only the summation order differs
// from a BLAS GEMM. The few-rows path multiplies the same values, rounded differently: each
// block's scale and offset apply to its dot product, not to each weight.
//
// Loop structure of the panel paths (one thread per run of output rows, torch's thread pool):
//   for each chunk of input rows that stays in L2 (its transposed copy, from 16 rows):
//     for each panel of weight rows (output features): dequantize them (a few KB to tens of KB)
//       16 rows and up: 16 x 6 outer-product tiles, per k two vectors of x (x^T[k][m..m+15])
//         times six broadcast weights, twelve accumulators, no horizontal sums;
//       5-15 rows (3-15 for Q5_0, Q5_1, Q6_K): 4 x 3 dot-product tiles over 3 dequantized
//         rows (the outer-product tile would pad to 16 rows; measured).
// Each weight byte is read from memory once per call whatever M is, and dequantized once per
// chunk of x (up to 256 rows).
// At one to four input rows (two for Q5_0, Q5_1, Q6_K, Q2_K, Q3_K) a path that writes no
// panel (linear_few_rows) is faster.

#include "gguf_linear.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "aten_lite.h"
#include "dense_rows.h"
#include "gguf_checks.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace zllm_gguf {

// --- 5 to 15 input rows (3 to 15 for Q5_0/Q5_1/Q6_K): dot-product tiles --------------------
// y[m, n0 + j] = sum_k x[m, k] * w[j][k] for MR rows m and NR dequantized rows w.
template <int MR, int NR>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum(acc[i][j]);
}

// Every input row against NR dequantized weight rows, MR input rows per register tile.
template <int MR, int NR>
void panel(const float* x, int64_t M, int64_t ldx, const float* w, int64_t K, float* y,
           int64_t ldy) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, NR>(x + m * ldx, ldx, w, K, y + m * ldy, ldy);
  switch (M - m) {
    case 3: tile<3, NR>(x + m * ldx, ldx, w, K, y + m * ldy, ldy); break;
    case 2: tile<2, NR>(x + m * ldx, ldx, w, K, y + m * ldy, ldy); break;
    case 1: tile<1, NR>(x + m * ldx, ldx, w, K, y + m * ldy, ldy); break;
    default: break;
  }
}

// y [M, N] = x [M, K] @ W^T, NR weight rows dequantized at a time, MR x NR dot-product tiles:
// for 5-15 input rows (3-15 for Q5_0, Q5_1, Q6_K), where the outer-product tiles below would
// pad to 16 rows (measured).
template <int MR, int NR>
void linear_dot(const float* x, int64_t M, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                int64_t N, int64_t K, DequantRow dequant, float* y, int64_t ldy) {
  const int64_t num_panels = (N + NR - 1) / NR;
  // A chunk of panels per task: enough work (~64K weights) to hide the pool's overhead.
  const int64_t grain = std::max<int64_t>(1, 65536 / (NR * K));
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(NR * K);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * NR;
      const int64_t nr = std::min<int64_t>(NR, N - n0);
      for (int64_t j = 0; j < nr; ++j) dequant(w + (n0 + j) * row_bytes, K, buf.data() + j * K);
      if (nr == NR) {
        panel<MR, NR>(x, M, ldx, buf.data(), K, y + n0, ldy);
      } else {
        for (int64_t j = 0; j < nr; ++j)
          panel<MR, 1>(x, M, ldx, buf.data() + j * K, K, y + n0 + j, ldy);
      }
    }
  });
}

// --- 16 input rows and more (prefill, large decode batches): outer-product tiles ------
// The problem is turned around: for each k, a vector of 8 input rows' x[m, k] times one
// weight w[n, k] broadcast adds into y[m..m+7, n]. No horizontal sums, and per k a 16 x 6 tile
// loads two vectors of x and six scalars of w for twelve FMAs (the dot-product tile above
// loads seven vectors for twelve, four of them x's from L2).
constexpr int kPanelRows = 12;  // weight rows dequantized per panel (two 6-row tiles)
constexpr int kRowBlock = 16;   // input rows per transposed block: two ymm of x per k

// Input rows a chunk holds: its transposed copy (rows x K fp32, at most 384 KB up to K = 6144)
// and a panel (12 x K) should stay in L2 (512 KB here) while the panels go by, and a chunk as
// long as that, since each chunk dequantizes every weight again: 144-160 rows at K = 576-640,
// 96 at 1024, 64 at 1536. Past K = 6144 the 16-row floor outgrows L2 (the tiles then stream
// from L3; K-blocking would fix it, but measured slower at the K <= 1536 of our models).
inline int64_t chunk_rows(int64_t K) {
  return std::clamp<int64_t>(98304 / K / kRowBlock * kRowBlock, kRowBlock, 256);
}

// Eight rows' x[r][k..k+7] (r < live; zeros for the rest) stored as eight columns: out[c * 16
// + r] = x[r][k + c], one 8 x 8 transpose in registers.
inline void transpose8(const float* x, int64_t ldx, int64_t live, float* out) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = i < live ? _mm256_loadu_ps(x + i * ldx) : _mm256_setzero_ps();
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // r_i0 r_(i+1)0 r_i1 r_(i+1)1 | lanes 4-5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // columns 2-3 | 6-7
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));      // column 0 | 4
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));  // column 1 | 5
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));  // 2 | 6
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));  // 3 | 7
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(out + c * kRowBlock, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
    _mm256_storeu_ps(out + (c + 4) * kRowBlock, _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
  }
}

// x's rows [0, rows) as blocks of 16 rows, each [K][16], zero-padded past the last row
// (K is a multiple of 32: whole GGUF blocks).
inline void pack_transposed(const float* x, int64_t rows, int64_t ldx, int64_t K, float* xt) {
  for (int64_t b = 0; b * kRowBlock < rows; ++b) {
    float* block = xt + b * kRowBlock * K;
    for (int half = 0; half < 2; ++half) {
      const int64_t m = b * kRowBlock + half * 8;
      const int64_t live = std::clamp<int64_t>(rows - m, 0, 8);
      const float* src = live > 0 ? x + m * ldx : x;  // no pointer past x's rows
      for (int64_t k = 0; k < K; k += 8)
        transpose8(src + k, ldx, live, block + k * kRowBlock + half * 8);
    }
  }
}

// y[i, j] = sum_k xt[k][i] * w[j][k] for i < rows (at most 8 * NV) and j < cols (at most NJ):
// NV vectors of input rows by NJ dequantized weight rows, NV * NJ accumulators. Each output is
// one lane's sum over k in order, so a row's result does not depend on the rows beside it.
// GCC 12 keeps the NV * NJ accumulators in registers only when every loop over them is
// unrolled before it scalarizes the array (the pragmas, the epilogue's included) and the tile
// is not inlined into linear_panels' lambda; otherwise it stores each one to the stack after
// every FMA, which halved the speed (checked in the assembly).
template <int NV, int NJ>
__attribute__((noinline)) void outer_tile(const float* xt, const float* w, int64_t K, float* y,
                                          int64_t ldy, int64_t rows, int64_t cols) {
  __m256 acc[NJ][NV];
#pragma GCC unroll 16
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 xv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) xv[v] = _mm256_loadu_ps(xt + k * kRowBlock + 8 * v);
#pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) {
      const __m256 wv = _mm256_broadcast_ss(w + j * K + k);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_fmadd_ps(xv[v], wv, acc[j][v]);
    }
  }
  alignas(32) float out[NJ][8 * NV];
#pragma GCC unroll 16
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm256_store_ps(out[j] + 8 * v, acc[j][v]);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) y[i * ldy + j] = out[j][i];
}

// y [M, N] = x [M, K] @ W^T: 12 weight rows dequantized at a time into an fp32 panel, which
// every input row of the chunk then meets in 16 x 6 tiles (8 x 12 for a last block of <= 8).
inline void linear_panels(const float* x, int64_t M, int64_t ldx, const uint8_t* w,
                          int64_t row_bytes, int64_t N, int64_t K, DequantRow dequant, float* y,
                          int64_t ldy) {
  const int64_t num_panels = (N + kPanelRows - 1) / kPanelRows;
  // A chunk of panels per task: enough work (~64K weights) to hide the pool's overhead.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kPanelRows * K));
  const int64_t max_rows = chunk_rows(K);
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
    // Left uninitialized (both are written before they are read): zeroing the chunk buffer
    // (up to 384 KB) per call cost a tenth of a 16-row call when it was always that size.
    const std::unique_ptr<float[]> panel(new float[kPanelRows * K]);
    const int64_t xt_rows = std::min(max_rows, (M + kRowBlock - 1) / kRowBlock * kRowBlock);
    const std::unique_ptr<float[]> xt(new float[xt_rows * K]);
    // Input rows in chunks that stay in L2 while this task's panels go by; each panel is
    // dequantized once per chunk, a small cost beside a chunk's FMAs. Without chunks a
    // prefill of 2048 rows would stream all of x from L3 per panel.
    for (int64_t m0 = 0; m0 < M; m0 += max_rows) {
      const int64_t rows = std::min(max_rows, M - m0);
      pack_transposed(x + m0 * ldx, rows, ldx, K, xt.get());
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanelRows;
        const int64_t cols = std::min<int64_t>(kPanelRows, N - n0);
        for (int64_t j = 0; j < cols; ++j)
          dequant(w + (n0 + j) * row_bytes, K, panel.get() + j * K);
        // The last panel's missing rows are never stored, but they are multiplied: zeros keep
        // uninitialized memory (NaNs, denormals that slow FMAs) out of the tiles.
        std::fill(panel.get() + cols * K, panel.get() + kPanelRows * K, 0.0f);
        float* yp = y + m0 * ldy + n0;
        int64_t m = 0;
        for (; rows - m > 8; m += kRowBlock) {
          const int64_t r = std::min<int64_t>(kRowBlock, rows - m);
          outer_tile<2, 6>(xt.get() + m * K, panel.get(), K, yp + m * ldy, ldy, r,
                           std::min<int64_t>(6, cols));
          if (cols > 6)
            outer_tile<2, 6>(xt.get() + m * K, panel.get() + 6 * K, K, yp + m * ldy + 6, ldy,
                             r, cols - 6);
        }
        if (m < rows)
          outer_tile<1, 12>(xt.get() + m * K, panel.get(), K, yp + m * ldy, ldy, rows - m,
                            cols);
      }
    }
  });
}

// --- Few input rows (decode of 1-4 sequences) ----------------------------------------------
// Memory- and conversion-bound, so no fp32 panel is written. Per 32-value group the codes
// become float vectors once, shared by the MR rows, and the scale and offset apply per group
// (per 16 values for Q6_K), not per value:
//   sum_k (d q_k + m) x_k = d * sum_k q_k x_k + m * sum_k x_k
// with sum_k x_k per group computed once per call. Same weight values, different rounding.
// Codes are widened 8 bytes at a time to 32-bit lanes (vpmovzxbd, one shuffle) and split into
// nibbles and high bits with lane-wise and/shift afterwards: the shuffle port bounds these
// loops, and unpacking a register of 32 int8 codes would cost 7 shuffles where this costs 2-4
// (measured: building the codes byte-wise first, as the dequantizers do, was 1.1-1.3x slower).

// The 32-value types: a block is one group. Value j < 16 is byte j's low nibble, j >= 16 byte
// j - 16's high one; Q5's fifth bit of value j is bit j of a little-endian uint32. Q4_0 and
// Q5_0's codes are centred, d (q - 8) or d (q - 16): the - 8 d goes to the offset, which is
// cheaper per group than a subtraction per value.
template <bool kFifthBit, bool kOwnOffset>
struct FewQ4_5 {
  static constexpr int64_t kValues = kBlock;
  static constexpr int64_t kBytes = 2 + (kOwnOffset ? 2 : 0) + (kFifthBit ? 4 : 0) + 16;
  static constexpr bool kOffset = true;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even, RowSums<MR>&) {
    const uint8_t* nibbles = blk + kBytes - 16;
    const __m256i b0 = widen8_u(nibbles), b1 = widen8_u(nibbles + 8);
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256i codes[4] = {_mm256_and_si256(b0, low), _mm256_and_si256(b1, low),
                        _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
    if constexpr (kFifthBit) {
      uint32_t bits;
      std::memcpy(&bits, blk + (kOwnOffset ? 4 : 2), 4);
      // Lane l of codes[j] wants bit 8 j + l of bits at bit 4: shifted down by 8 j + l from
      // bits << 4 for j < 3, by 8 j + l - 4 = 20 + l from bits for j = 3 (bits << 4 has lost
      // its top four).
      const __m256i up = _mm256_set1_epi32(static_cast<int>(bits << 4));
      const __m256i same = _mm256_set1_epi32(static_cast<int>(bits));
      const __m256i bit = _mm256_set1_epi32(0x10);
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      for (int j = 0; j < 4; ++j) {
        const __m256i fifth =
            j < 3 ? _mm256_srlv_epi32(up, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * j)))
                  : _mm256_srlv_epi32(same, _mm256_add_epi32(lanes, _mm256_set1_epi32(20)));
        codes[j] = _mm256_or_si256(codes[j], _mm256_and_si256(fifth, bit));
      }
    }
    __m256 q[4];
    for (int j = 0; j < 4; ++j) q[j] = to_float(codes[j]);
    const float d = half_to_float(blk);
    add_group<MR>(q, d, in, 0, even);
    const float m = kOwnOffset ? half_to_float(blk + 2) : -(kFifthBit ? 16.f : 8.f) * d;
    add_group_offset<MR>(m, in, 0, even);
  }
};

using FewQ4_0 = FewQ4_5<false, false>;
using FewQ4_1 = FewQ4_5<false, true>;
using FewQ5_0 = FewQ4_5<true, false>;
using FewQ5_1 = FewQ4_5<true, true>;

struct FewQ8_0 {
  static constexpr int64_t kValues = kBlock, kBytes = kQ8_0Bytes;
  static constexpr bool kOffset = false;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even, RowSums<MR>&) {
    __m256 q[4];
    for (int j = 0; j < 4; ++j) q[j] = to_float(widen8_s(blk + 2 + 8 * j));
    add_group<MR>(q, half_to_float(blk), in, 0, even);
  }
};

// zllm's FP8_E4M3 blocks: Q8_0's layout, e4m3 values for codes.
struct FewE4M3 {
  static constexpr int64_t kValues = kBlock, kBytes = kQ8_0Bytes;
  static constexpr bool kOffset = false;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even, RowSums<MR>&) {
    __m256 q[4];
    widen_e4m3(blk + 2, q);
    add_group<MR>(q, half_to_float(blk) * kE4M3Rescale, in, 0, even);
  }
};

// F16 / BF16: 32 values widened in registers; no scale (d = 1), no offset.
template <bool kBrain>
struct Few16 {
  static constexpr int64_t kValues = kBlock, kBytes = 64;
  static constexpr bool kOffset = false;
  // A 16-bit matrix is 2 bytes a weight, read once per call at few rows: at 2-4 rows the
  // loop waits on DRAM with the hardware prefetcher alone. Asking for the block 4 KB ahead
  // took 16-25% off a Llama-1B token's matmuls at 2 rows (512 B-2 KB: less); at one row it
  // gained nothing (0.95-1.05x at 0.5-4 KB), so one row does not ask (BENCHMARKS.md).
  static constexpr int64_t kPrefetchBytes = 4096;
  static constexpr int kPrefetchMinRows = 2;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even, RowSums<MR>&) {
    __m256 q[4];
    for (int j = 0; j < 4; ++j) q[j] = kBrain ? widen_bf16(blk + 16 * j) : widen_f16(blk + 16 * j);
    add_group<MR>(q, 1.f, in, 0, even);
  }
};

// Q4_K / Q5_K: sub-blocks 2c and 2c + 1 are the low and high nibbles of the same 32 bytes
// (Q5_K: bit s of its 32 qh bytes is sub-block s's fifth bit), so each byte is widened once
// for the pair.
template <bool kFifthBit>
struct FewQ45_K {
  static constexpr int64_t kValues = kSuper, kBytes = kFifthBit ? 176 : 144;
  static constexpr bool kOffset = true;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even,
                  RowSums<MR>& odd) {
    float dsc[8], dm[8];
    k_scales_mins(blk + 4, half_to_float(blk), half_to_float(blk + 2), dsc, dm);
    const uint8_t* nibbles = blk + (kFifthBit ? 48 : 16);
    const __m256i low = _mm256_set1_epi32(0x0F), bit = _mm256_set1_epi32(0x10);
    __m256i high[4];
    if constexpr (kFifthBit)
      for (int j = 0; j < 4; ++j) high[j] = widen8_u(blk + 16 + 8 * j);
    for (int c = 0; c < 4; ++c) {
      __m256i bytes[4];
      for (int j = 0; j < 4; ++j) bytes[j] = widen8_u(nibbles + 32 * c + 8 * j);
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * c + half;
        __m256 q[4];
        for (int j = 0; j < 4; ++j) {
          __m256i codes =
              half ? _mm256_srli_epi32(bytes[j], 4) : _mm256_and_si256(bytes[j], low);
          if constexpr (kFifthBit) {
            // Bit s to bit 4.
            const __m256i fifth = s <= 4 ? _mm256_slli_epi32(high[j], 4 - s)
                                         : _mm256_srli_epi32(high[j], s - 4);
            codes = _mm256_or_si256(codes, _mm256_and_si256(fifth, bit));
          }
          q[j] = to_float(codes);
        }
        RowSums<MR>& sums = half ? odd : even;
        add_group<MR>(q, dsc[s], in, s, sums);
        add_group_offset<MR>(-dm[s], in, s, sums);
      }
    }
  }
};

// Q6_K: per half h of 128 values, group g (32 values) takes its low nibbles from bytes
// 64 h + 32 (g % 2) (low nibble for g < 2) and its high 2 bits from bits 2 g of bytes
// 128 + 32 h; a scale per 16 values. Widening 8 bytes of each of the three byte runs serves
// 8 values of all four groups, so the groups are summed side by side (four dot products per
// row) and scaled every 16 values.
struct FewQ6_K {
  static constexpr int64_t kValues = kSuper, kBytes = 210;
  static constexpr bool kOffset = false;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even,
                  RowSums<MR>& odd) {
    const float d = half_to_float(blk + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const __m256i low = _mm256_set1_epi32(0x0F), top = _mm256_set1_epi32(0x30),
                  bias = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; ++h) {
      for (int quarter = 0; quarter < 2; ++quarter) {  // values 0-15, then 16-31, of each group
        __m256 dot[4][MR];
        for (int j = 2 * quarter; j < 2 * quarter + 2; ++j) {
          const __m256i l0 = widen8_u(blk + 64 * h + 8 * j);
          const __m256i l1 = widen8_u(blk + 64 * h + 32 + 8 * j);
          const __m256i hb = widen8_u(blk + 128 + 32 * h + 8 * j);
          // Group g: its nibble | bits 2 g, 2 g + 1 of hb moved to bits 4-5.
          auto with_high = [&](__m256i nibble, __m256i high_at_4) {
            return _mm256_or_si256(nibble, _mm256_and_si256(high_at_4, top));
          };
          const __m256i codes[4] = {
              with_high(_mm256_and_si256(l0, low), _mm256_slli_epi32(hb, 4)),
              with_high(_mm256_and_si256(l1, low), _mm256_slli_epi32(hb, 2)),
              with_high(_mm256_srli_epi32(l0, 4), hb),
              with_high(_mm256_srli_epi32(l1, 4), _mm256_srli_epi32(hb, 2))};
          for (int g = 0; g < 4; ++g) {
            const __m256 q = to_float(_mm256_sub_epi32(codes[g], bias));
            for (int i = 0; i < MR; ++i) {
              const __m256 xv = _mm256_loadu_ps(in.x + i * in.ldx + 128 * h + 32 * g + 8 * j);
              dot[g][i] = j % 2 ? _mm256_fmadd_ps(q, xv, dot[g][i]) : _mm256_mul_ps(q, xv);
            }
          }
        }
        for (int g = 0; g < 4; ++g) {
          // The reference rounds d * scale to fp32 before multiplying by the codes.
          const __m256 dv =
              _mm256_set1_ps(d * static_cast<float>(scales[2 * (4 * h + g) + quarter]));
          RowSums<MR>& sums = g % 2 ? odd : even;
          for (int i = 0; i < MR; ++i) sums.v[i] = _mm256_fmadd_ps(dv, dot[g][i], sums.v[i]);
        }
      }
    }
  }
};

// Software prefetch of `blocks` blocks Format::kPrefetchBytes ahead of blk, a line (64 bytes)
// at a time, for the formats that ask for it at MR rows. Past a row's end it fetches the next
// row's start (rows are contiguous); past the matrix's end nothing: a prefetch never faults.
template <class Format, class = void>
struct Prefetch {  // none
  static constexpr int64_t kBytes = 0;
  static constexpr int kMinRows = 0;
};
template <class Format>
struct Prefetch<Format, std::void_t<decltype(Format::kPrefetchBytes)>> {
  static constexpr int64_t kBytes = Format::kPrefetchBytes;
  static constexpr int kMinRows = Format::kPrefetchMinRows;
};

// The values each per-row sum of x covers, for the offsets: 32, or the format's kSumValues.
template <class Format, class = void>
struct SumValues {
  static constexpr int64_t kValue = kBlock;
};
template <class Format>
struct SumValues<Format, std::void_t<decltype(Format::kSumValues)>> {
  static constexpr int64_t kValue = Format::kSumValues;
};

template <class Format, int MR>
inline void prefetch_ahead(const uint8_t* blk, int blocks) {
  using P = Prefetch<Format>;
  if constexpr (P::kBytes > 0 && MR >= P::kMinRows) {
    const uint8_t* ahead = blk + P::kBytes;
    for (int64_t line = 0; line < blocks * Format::kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
  }
}

template <int MR, class Format>
void linear_few_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                     int64_t N, int64_t K, float* y, int64_t ldy) {
  const int64_t num_blocks = K / Format::kValues;
  constexpr int64_t kGroupsPerBlock = Format::kValues / kBlock;
  // Per-row sums of x per offset group (only the offset types need them).
  constexpr int64_t kSum = SumValues<Format>::kValue, kSumsPerBlock = Format::kValues / kSum;
  const int64_t num_sums = K / kSum;
  std::vector<float> xsum(Format::kOffset ? MR * num_sums : 0);
  for (int i = 0; Format::kOffset && i < MR; ++i)
    for (int64_t g = 0; g < num_sums; ++g) {
      float sum = 0.f;
      for (int k = 0; k < kSum; ++k) sum += x[i * ldx + g * kSum + k];
      xsum[i * num_sums + g] = sum;
    }
  auto input = [&](int64_t b) {
    return FewRowsInput{x + b * Format::kValues, ldx,
                        xsum.data() + (Format::kOffset ? b * kSumsPerBlock : 0), num_sums};
  };
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w + n * row_bytes;
      RowSums<MR> even, odd;
      for (int i = 0; i < MR; ++i) {
        even.v[i] = odd.v[i] = _mm256_setzero_ps();
        even.offset[i] = odd.offset[i] = 0.f;
      }
      int64_t b = 0;
      if constexpr (kGroupsPerBlock == 1) {
        // One group a block: consecutive blocks alternate.
        for (; b + 2 <= num_blocks; b += 2) {
          prefetch_ahead<Format, MR>(row + b * Format::kBytes, 2);
          Format::template add<MR>(row + b * Format::kBytes, input(b), even, odd);
          Format::template add<MR>(row + (b + 1) * Format::kBytes, input(b + 1), odd, even);
        }
      }
      for (; b < num_blocks; ++b)
        Format::template add<MR>(row + b * Format::kBytes, input(b), even, odd);
      for (int i = 0; i < MR; ++i)
        y[i * ldy + n] =
            hsum(_mm256_add_ps(even.v[i], odd.v[i])) + (even.offset[i] + odd.offset[i]);
    }
  });
}

// The few-rows kernel for a type at M rows, or nullptr where the panel path is faster.
// Measured on 2 AVX2 cores (benchmarks/gguf_types.py shapes, BENCHMARKS.md): the few-rows
// kernel is faster at 1-2 rows for every type and at 3-4 for all but Q5_0, Q5_1 and Q6_K,
// whose codes cost more to build per value (the panel builds them once per 64 rows); for
// those it is level with the panel at 3-4 rows. Q2_K and Q3_K (2048 x 1024, one thread):
// the few-rows kernel took 1.1-1.6x the panel's time at 3-4 rows, so 1-2 only. gguf_lattice.h's
// types (2048 x 2048, one thread): 0.7-1.4x Q4_K's few-rows time at 1-4 rows, and at 4 rows
// 0.65-0.85x what their panel path takes at 5, so 1-4.
using FewRowsKernel = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t,
                               float*, int64_t);

template <class Format, int kMaxRows>
inline FewRowsKernel few_rows_for(int64_t M) {
  switch (M) {
    case 1: return linear_few_rows<1, Format>;
    case 2: return linear_few_rows<2, Format>;
    default: break;
  }
  // if constexpr: a row count the type never takes is not compiled.
  if constexpr (kMaxRows >= 3)
    if (M == 3) return linear_few_rows<3, Format>;
  if constexpr (kMaxRows >= 4)
    if (M == 4) return linear_few_rows<4, Format>;
  return nullptr;
}

inline FewRowsKernel few_rows_kernel(int64_t qtype, int64_t M) {
  switch (qtype) {
    case kQ4_0: return few_rows_for<FewQ4_0, 4>(M);
    case kQ4_1: return few_rows_for<FewQ4_1, 4>(M);
    case kQ5_0: return few_rows_for<FewQ5_0, 2>(M);
    case kQ5_1: return few_rows_for<FewQ5_1, 2>(M);
    case kQ8_0: return few_rows_for<FewQ8_0, 4>(M);
    case kFP8_E4M3: return few_rows_for<FewE4M3, 4>(M);
    case kQ4_K: return few_rows_for<FewQ45_K<false>, 4>(M);
    case kQ5_K: return few_rows_for<FewQ45_K<true>, 4>(M);
    case kQ6_K: return few_rows_for<FewQ6_K, 2>(M);
    case kQ2_K: return few_rows_for<FewQ2_K, 2>(M);
    case kQ3_K: return few_rows_for<FewQ3_K, 2>(M);
    case kIQ4_NL: return few_rows_for<FewIQ4_NL, 4>(M);
    case kIQ4_XS: return few_rows_for<FewIQ4_XS, 4>(M);
    case kMXFP4: return few_rows_for<FewMXFP4, 4>(M);
    case kIQ2_XXS: return few_rows_for<FewSubBlocks<IQ2_XXS>, 4>(M);
    case kIQ2_XS: return few_rows_for<FewSubBlocks<IQ2_XS>, 4>(M);
    case kIQ2_S: return few_rows_for<FewSubBlocks<IQ2_S>, 4>(M);
    case kIQ3_XXS: return few_rows_for<FewSubBlocks<IQ3_XXS>, 4>(M);
    case kIQ3_S: return few_rows_for<FewSubBlocks<IQ3_S>, 4>(M);
    case kIQ1_S: return few_rows_for<FewSubBlocks<IQ1_S>, 4>(M);
    case kIQ1_M: return few_rows_for<FewSubBlocks<IQ1_M>, 4>(M);
    case kTQ1_0: return few_rows_for<FewSubBlocks<TQ1_0>, 4>(M);
    case kTQ2_0: return few_rows_for<FewSubBlocks<TQ2_0>, 4>(M);
    case kNVFP4: return few_rows_for<FewSubBlocks<NVFP4>, 4>(M);
    case kF16: return few_rows_for<Few16<false>, 4>(M);
    case kBF16: return few_rows_for<Few16<true>, 4>(M);
    default: return nullptr;
  }
}

}  // namespace zllm_gguf

using namespace zllm_gguf;

namespace zllm_gguf {

// y [M, N] = x [M, K] @ W^T on checked pointers (K > 0): the kernel each row count takes.
// Every output is computed alone (a weight row against an x row), so a call over a slice of
// W's rows gives those outputs' bits (csrc/cpu/moe_experts.cpp splits W's rows so).
void linear_rows(const float* xp, int64_t M, int64_t ldx, const uint8_t* wp,
                 int64_t row_bytes, int64_t qtype, const BlockFormat& format, int64_t N,
                 int64_t K, float* yp, int64_t ldy) {
  if (const zllm_dense::DenseRowsKernel wide = zllm_dense::sixteen_rows_kernel(qtype, M)) {
    // F16/BF16 at 1-8 rows with AVX-512: dense_rows.h (the rows are plain 16-bit values).
    wide(xp, ldx, wp, N, K, yp, ldy);
  } else if (const zllm_dense::BlockRowsKernel blocks = zllm_dense::block_rows_kernel(qtype, M)) {
    // Q4_0, Q8_0, FP8_E4M3 at 1-8 rows with AVX-512: dense_rows.h's tiles over blocks.
    blocks(xp, ldx, wp, row_bytes, N, K, yp, ldy);
  } else if (const FewRowsKernel few_rows = few_rows_kernel(qtype, M)) {
    few_rows(xp, ldx, wp, row_bytes, N, K, yp, ldy);
  } else if (M < kRowBlock) {
    // Dequantize 3 weight rows into an fp32 panel and run 4 x 3 dot-product tiles over it.
    linear_dot<4, 3>(xp, M, ldx, wp, row_bytes, N, K, format.dequant, yp, ldy);
  } else {
    // Dequantize 12 weight rows into an fp32 panel once and run outer-product register tiles
    // over it, so each weight's conversion is shared by every input row of a chunk.
    linear_panels(xp, M, ldx, wp, row_bytes, N, K, format.dequant, yp, ldy);
  }
}

}  // namespace zllm_gguf

// y [M, N] = x [M, K] @ W^T into y, whose rows may be strided (a column slice of a wider
// output: one fused matmul whose parts are of different types writes each part's columns).
void gguf_linear_into(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                      at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu() && y.device().is_cpu(),
              "the GGUF kernels run on CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const BlockFormat& format = checked_blocks(qweight, qtype, K);
  check_output(y, M, N);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum (and the chunk sizes below divide by K)
    y.zero_();
    return;
  }
  linear_rows(x.data_ptr<float>(), M, x.stride(0), qweight.data_ptr<uint8_t>(), qweight.size(1),
              qtype, format, N, K, y.data_ptr<float>(), y.stride(0));
}

// x: fp32 [M, K] (rows contiguous), qweight: uint8 [N, bytes per row], returns fp32 [M, N].
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be fp32 [M, K]");
  auto y = x.new_empty({x.size(0), qweight.size(0)});
  gguf_linear_into(x, qweight, qtype, y);
  return y;
}

// The fp32 values the kernel multiplies by: [N, K]. For tests, the embedding's looked-up
// rows, and the load-time check that the blocks are the weights the fp32 path holds.
at::Tensor gguf_dequantize(const at::Tensor& qweight, int64_t qtype, int64_t K) {
  const DequantRow dequant = checked_blocks(qweight, qtype, K).dequant;
  const int64_t N = qweight.size(0);
  auto out = qweight.new_empty({N, K}, qweight.options().dtype(at::kFloat));
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequant(wp + n * qweight.size(1), K, op + n * K);
  });
  return out;
}

// Bound as set_lattice_tables: the grids of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and
// IQ1_M (each int8 [rows, 8 or 4], by ggml type id) and IQ2_XXS's ksigns (uint8 [128]), from
// gguf.quants (executor/kernels/cpu.py). All at once: the types are served only after.
void set_lattice_tables(const std::vector<int64_t>& types,
                        const std::vector<at::Tensor>& grids,
                        const at::Tensor& ksigns) {
  using namespace zllm_gguf;
  TORCH_CHECK(types.size() == grids.size(), "one grid per type");
  LatticeTables& t = g_lattice;
  struct Slot {
    int64_t qtype, rows, cols;
    float* out;
  };
  const Slot slots[] = {{kIQ2_XXS, 256, 8, t.iq2_xxs[0]}, {kIQ2_XS, 512, 8, t.iq2_xs[0]},
                        {kIQ2_S, 1024, 8, t.iq2_s[0]},    {kIQ3_XXS, 256, 4, t.iq3_xxs[0]},
                        {kIQ3_S, 512, 4, t.iq3_s[0]},     {kIQ1_S, 2048, 8, t.iq1_s[0]},
                        {kIQ1_M, 2048, 8, t.iq1_m[0]}};
  TORCH_CHECK(types.size() == std::size(slots), "set_lattice_tables takes all ",
              std::size(slots), " lattice grids at once");
  for (const Slot& slot : slots) {
    size_t i = 0;
    while (i < types.size() && types[i] != slot.qtype) ++i;
    TORCH_CHECK(i < types.size(), "no grid for ggml type ", slot.qtype);
    const at::Tensor& grid = grids[i];
    TORCH_CHECK(grid.scalar_type() == at::kChar && grid.is_contiguous() && grid.dim() == 2 &&
                    grid.size(0) == slot.rows && grid.size(1) == slot.cols,
                "the grid of ggml type ", slot.qtype, " must be contiguous int8 [", slot.rows,
                ", ", slot.cols, "]");
    const int8_t* values = grid.data_ptr<int8_t>();
    for (int64_t v = 0; v < slot.rows * slot.cols; ++v) slot.out[v] = values[v];
  }
  TORCH_CHECK(ksigns.scalar_type() == at::kByte && ksigns.is_contiguous() &&
                  ksigns.dim() == 1 && ksigns.size(0) == 128,
              "ksigns must be contiguous uint8 [128]");
  const uint8_t* signs = ksigns.data_ptr<uint8_t>();
  for (int i = 0; i < 128; ++i)
    std::memcpy(t.ksign_masks[i], kSignMasks.of[signs[i]], sizeof(t.ksign_masks[i]));
  g_lattice_ready.store(true);
}
