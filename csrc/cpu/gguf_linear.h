// y = x @ W^T with W kept in its GGUF block-quantized form (Q4_1 or Q8_0), x and y fp32.
//
// Why: at small batches a decode step is bound by reading the weights. fp32 weights are
// 4 bytes a value; Q4_1 is 0.625 and Q8_0 1.0625, so the same step reads 4-6x fewer bytes.
// The weights are dequantized in registers/L1 exactly as gguf.quants does it (fp32 d*q + m,
// no FMA contraction: built with -ffp-contract=off), so the values multiplied are bit for bit
// the fp32 reference weights; only the summation order differs from a BLAS GEMM.
//
// Loop structure (one thread per chunk of output rows, torch's own thread pool):
//   for each panel of NR output rows:
//     dequantize the NR rows (NR x K fp32, a few KB: stays in L1)
//     for each tile of MR input rows: MR x NR dot products over K, 8 lanes at a time,
//       accumulators in registers (MR * NR ymm), x rows streamed from L1/L2.
// Each weight byte is read from memory once per call whatever M is, and dequantized once.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "simd.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace zllm_gguf {

using zllm_simd::half_to_float;
using zllm_simd::hsum;

constexpr int kBlock = 32;       // values per GGUF block (Q4_1 and Q8_0)
constexpr int kQ4_1Bytes = 20;   // f16 d, f16 m, 16 bytes of nibbles
constexpr int kQ8_0Bytes = 34;   // f16 d, 32 int8
constexpr int64_t kRowChunk = 64;  // input rows per L2-resident chunk (panel path)

enum QType : int64_t { kQ4_1 = 3, kQ8_0 = 8 };  // ggml_type ids

// One Q4_1 row of K values -> fp32. Value j of a block is the low nibble of byte j (j < 16)
// or the high nibble of byte j - 16.
void dequant_row_q4_1(const uint8_t* row, int64_t K, float* out) {
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * kQ4_1Bytes;
    const __m256 d = _mm256_set1_ps(half_to_float(blk));
    const __m256 m = _mm256_set1_ps(half_to_float(blk + 2));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    const __m128i lo = _mm_and_si128(bytes, low_mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
    float* o = out + b * kBlock;
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
      _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(d, q), m));
    }
  }
}

void dequant_row_q8_0(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * kQ8_0Bytes;
    const __m256 d = _mm256_set1_ps(half_to_float(blk));
    float* o = out + b * kBlock;
    for (int i = 0; i < 4; ++i) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
      _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(d, q));
    }
  }
}

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

using DequantRow = void (*)(const uint8_t*, int64_t, float*);

// y [M, N] = x [M, K] @ W^T, NR weight rows dequantized at a time, MR x NR register tiles.
template <int MR, int NR>
void linear(const float* x, int64_t M, int64_t ldx, const uint8_t* w, int64_t row_bytes,
            int64_t N, int64_t K, DequantRow dequant, float* y) {
  const int64_t num_panels = (N + NR - 1) / NR;
  // A chunk of panels per task: enough work (~64K weights) to hide the pool's overhead.
  const int64_t grain = std::max<int64_t>(1, 65536 / (NR * K));
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(NR * K);
    // Input rows in chunks that stay in L2 (64 x K fp32: 147 KB at K = 576) while this task's
    // panels go by; each panel is dequantized once per chunk, a small cost beside 64 rows of
    // FMAs. Without chunks a prefill of 2048 rows would stream all of x from L3 per panel.
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t mc = std::min<int64_t>(kRowChunk, M - m0);
      const float* xc = x + m0 * ldx;
      float* yc = y + m0 * N;
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * NR;
        const int64_t nr = std::min<int64_t>(NR, N - n0);
        for (int64_t j = 0; j < nr; ++j)
          dequant(w + (n0 + j) * row_bytes, K, buf.data() + j * K);
        if (nr == NR) {
          panel<MR, NR>(xc, mc, ldx, buf.data(), K, yc + n0, N);
        } else {
          for (int64_t j = 0; j < nr; ++j)
            panel<MR, 1>(xc, mc, ldx, buf.data() + j * K, K, yc + n0 + j, N);
        }
      }
    }
  });
}

// Few input rows (decode of 1-2 sequences): memory- and conversion-bound, so no fp32 panel
// is written. Per block the 32 codes become 4 float vectors once, shared by the MR rows, and
// the scale and offset apply per block, not per value:
//   sum_k (d q_k + m) x_k = d * sum_k q_k x_k + m * sum_k x_k
// with sum_k x_k per block computed once per call. Same weight values, different rounding.
template <int MR>
void linear_few_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                     int64_t N, int64_t K, bool q4_1, float* y) {
  const int64_t num_blocks = K / kBlock;
  // Per-row block sums of x (only Q4_1's offset needs them).
  std::vector<float> xsum(q4_1 ? MR * num_blocks : 0);
  for (int i = 0; q4_1 && i < MR; ++i)
    for (int64_t b = 0; b < num_blocks; ++b) {
      float sum = 0.f;
      for (int k = 0; k < kBlock; ++k) sum += x[i * ldx + b * kBlock + k];
      xsum[i * num_blocks + b] = sum;
    }
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w + n * row_bytes;
      __m256 acc[MR];
      float offset[MR];
      for (int i = 0; i < MR; ++i) {
        acc[i] = _mm256_setzero_ps();
        offset[i] = 0.f;
      }
      for (int64_t b = 0; b < num_blocks; ++b) {
        __m256 q[4];
        const uint8_t* blk;
        if (q4_1) {
          blk = row + b * kQ4_1Bytes;
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
          const __m128i lo = _mm_and_si128(bytes, low_mask);
          const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
          q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
          q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
          q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
          q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        } else {
          blk = row + b * kQ8_0Bytes;
          for (int j = 0; j < 4; ++j)
            q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * j))));
        }
        const __m256 d = _mm256_set1_ps(half_to_float(blk));
        const float m = q4_1 ? half_to_float(blk + 2) : 0.f;
        for (int i = 0; i < MR; ++i) {
          const float* xb = x + i * ldx + b * kBlock;
          __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
          dot = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), dot);
          dot = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), dot);
          dot = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), dot);
          acc[i] = _mm256_fmadd_ps(d, dot, acc[i]);
          if (q4_1) offset[i] += m * xsum[i * num_blocks + b];
        }
      }
      for (int i = 0; i < MR; ++i) y[i * N + n] = hsum(acc[i]) + offset[i];
    }
  });
}

}  // namespace zllm_gguf

using namespace zllm_gguf;

// x: fp32 [M, K] (rows contiguous), qweight: uint8 [N, bytes per row], returns fp32 [M, N].
torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be fp32 [M, K]");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kUInt8 &&
                  qweight.is_contiguous(),
              "qweight must be contiguous uint8 [N, bytes per row]");
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "unsupported ggml type ", qtype);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t block_bytes = qtype == kQ4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(K % kBlock == 0 && qweight.size(1) == K / kBlock * block_bytes,
              "qweight row bytes do not match K=", K);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const int64_t row_bytes = qweight.size(1);
  float* yp = y.data_ptr<float>();
  const auto dequant = qtype == kQ4_1 ? dequant_row_q4_1 : dequant_row_q8_0;

  const bool q4_1 = qtype == kQ4_1;
  switch (M) {
    // Measured on 2 AVX2 cores: 1.2x faster than the panel path at one row, even at two,
    // slower from three on.
    case 1: linear_few_rows<1>(xp, ldx, wp, row_bytes, N, K, q4_1, yp); break;
    case 2: linear_few_rows<2>(xp, ldx, wp, row_bytes, N, K, q4_1, yp); break;
    // More rows: dequantize NR weight rows into an fp32 panel once and run 4 x 3 register
    // tiles over it, so each weight's conversion is shared by every input row.
    default: linear<4, 3>(xp, M, ldx, wp, row_bytes, N, K, dequant, yp);
  }
  return y;
}

// The fp32 values the kernel multiplies by: [N, K]. For tests and for building the fp32 copy
// used by large batches, so both paths see identical weights.
torch::Tensor gguf_dequantize(const torch::Tensor& qweight, int64_t qtype, int64_t K) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kUInt8 &&
                  qweight.is_contiguous(),
              "qweight must be contiguous uint8 [N, bytes per row]");
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "unsupported ggml type ", qtype);
  const int64_t block_bytes = qtype == kQ4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(K % kBlock == 0 && qweight.size(1) == K / kBlock * block_bytes,
              "qweight row bytes do not match K=", K);
  const int64_t N = qweight.size(0);
  auto out = torch::empty({N, K}, torch::kFloat32);
  const auto dequant = qtype == kQ4_1 ? dequant_row_q4_1 : dequant_row_q8_0;
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequant(wp + n * qweight.size(1), K, op + n * K);
  });
  return out;
}
