// y = x @ W^T with W in GGUF blocks and x quantized to int8 per 32 values: llama.cpp-style
// arithmetic, as the opt-in `--quantization gguf-int8`. (llama.cpp itself keeps fp16
// activation scales, 256-value activation blocks for K-quants and offsets from the codes'
// sums; here scales are fp32, blocks 32 values, offsets from x's own sums.)
//
// Why: the float path widens every 4-8 bit code to fp32 before an FMA (8 values per
// instruction); here the codes stay bytes and one VPMADDUBSW multiplies 32 code/activation
// pairs, summing neighbours into int16. It changes the arithmetic (activations rounded to
// 8 bits, one scale per 32 values), so it is a mode with its accuracy measured, not the
// default (BENCHMARKS.md).
//
// Every type is read as groups of 32 values: value_k = a * c_k + b, c_k a signed code (the
// type's code minus its zero point: Q4_0's 8, Q5_0's 16, Q6_K's 32), a the group's scale
// (Q6_K: one per 16 values, so a pair), b an offset (Q4_1/Q5_1's m, the K-quants'
// -dmin * min). With x_k ~ dx * qx_k:
//   sum_k value_k x_k = a * dx * sum_k c_k qx_k + b * sum_k x_k
// the first sum in int32, the second from fp32 block sums of x itself. VPMADDUBSW wants one
// unsigned operand: |c| times qx with c's sign (VPSIGNB). Pair sums stay within int16:
// 2 * 128 * 127 < 32767.

#pragma once

#include <immintrin.h>

#include "gguf_dequant.h"

#include <cstdint>

namespace zllm_gguf_int8 {

using namespace zllm_gguf;

// One group of 32 values of a weight row, decoded.
struct Group {
  float a_lo, a_hi;  // scale of values 0-15 and 16-31 (equal except Q6_K)
  float b;           // offset (multiplies x's block sum)
};

// --- Decoding one weight row into codes and groups, per type --------------------------------

// Writes K signed codes and K / 32 groups.
using DecodeRow = void (*)(const uint8_t* row, int64_t K, int8_t* codes, Group* groups);

inline void store_codes(int8_t* p, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

inline void decode_q4_0(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 18;
    store_codes(codes + g * kBlock, _mm256_sub_epi8(nibbles_32(blk + 2), _mm256_set1_epi8(8)));
    const float d = half_to_float(blk);
    groups[g] = {d, d, 0.0f};
  }
}

inline void decode_q4_1(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 20;
    store_codes(codes + g * kBlock, nibbles_32(blk + 4));
    const float d = half_to_float(blk);
    groups[g] = {d, d, half_to_float(blk + 2)};
  }
}

inline void decode_q5_0(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 22;
    const __m256i codes32 = _mm256_or_si256(nibbles_32(blk + 6), fifth_bits_32(blk + 2));
    store_codes(codes + g * kBlock, _mm256_sub_epi8(codes32, _mm256_set1_epi8(16)));
    const float d = half_to_float(blk);
    groups[g] = {d, d, 0.0f};
  }
}

inline void decode_q5_1(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 24;
    store_codes(codes + g * kBlock, _mm256_or_si256(nibbles_32(blk + 8), fifth_bits_32(blk + 4)));
    const float d = half_to_float(blk);
    groups[g] = {d, d, half_to_float(blk + 2)};
  }
}

inline void decode_q8_0(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t g = 0; g < K / kBlock; ++g) {
    const uint8_t* blk = row + g * 34;
    std::memcpy(codes + g * kBlock, blk + 2, kBlock);  // already signed
    const float d = half_to_float(blk);
    groups[g] = {d, d, 0.0f};
  }
}

inline void decode_q4_k(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 144;
    float dsc[8], dm[8];
    k_scales_mins(blk + 4, half_to_float(blk), half_to_float(blk + 2), dsc, dm);
    for (int s = 0; s < 8; ++s) {
      store_codes(codes + b * kSuper + 32 * s, q4_k_codes(blk, s));
      groups[b * 8 + s] = {dsc[s], dsc[s], -dm[s]};
    }
  }
}

inline void decode_q5_k(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 176;
    float dsc[8], dm[8];
    k_scales_mins(blk + 4, half_to_float(blk), half_to_float(blk + 2), dsc, dm);
    for (int s = 0; s < 8; ++s) {
      store_codes(codes + b * kSuper + 32 * s, q5_k_codes(blk, s));
      groups[b * 8 + s] = {dsc[s], dsc[s], -dm[s]};
    }
  }
}

inline void decode_q6_k(const uint8_t* row, int64_t K, int8_t* codes, Group* groups) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 210;
    const float d = half_to_float(blk + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    for (int t = 0; t < 8; ++t) {
      store_codes(codes + b * kSuper + 32 * t, q6_k_codes(blk, t));
      groups[b * 8 + t] = {d * static_cast<float>(scales[2 * t]),
                           d * static_cast<float>(scales[2 * t + 1]), 0.0f};
    }
  }
}

inline DecodeRow decoder(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return decode_q4_0;
    case kQ4_1: return decode_q4_1;
    case kQ5_0: return decode_q5_0;
    case kQ5_1: return decode_q5_1;
    case kQ8_0: return decode_q8_0;
    case kQ4_K: return decode_q4_k;
    case kQ5_K: return decode_q5_k;
    case kQ6_K: return decode_q6_k;
    default: return nullptr;
  }
}

// y [M, N] = quantize_int8(x) [M, K] @ W^T on checked pointers (gguf_int8.cpp). Every output
// is computed alone (one weight row's codes against one x row's), so a call over a 4-aligned
// slice of W's rows gives those outputs' bits (moe_experts.cpp splits W's rows so).
void linear_int8_rows(const float* xp, int64_t M, int64_t ldx, const uint8_t* wp,
                      int64_t row_bytes, int64_t qtype, DecodeRow decode, int64_t N, int64_t K,
                      float* yp, int64_t ldy);

}  // namespace zllm_gguf_int8

namespace zllm_kquant {

// Q2_K, Q3_K, Q4_K and Q6_K: the types kquant_int8.h's super-block kernel reads.
bool serves(int64_t qtype);

}  // namespace zllm_kquant
