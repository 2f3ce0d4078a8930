// One row of GGUF blocks -> fp32 per type (gguf.quants' dequantizers), the code helpers the
// integer kernels share, and each type's block layout (block_format). Light enough for
// every translation unit that reads blocks; the matmul kernels are gguf_linear.cpp's.

#pragma once

#include <immintrin.h>

#include "gguf_blocks.h"
#include "gguf_lattice.h"
#include "gguf_lowbit.h"
#include "simd.h"

#include <cstdint>
#include <cstring>

namespace zllm_gguf {

// Q5's fifth bits: byte j = 0x10 if bit j of the little-endian uint32 at p is set, else 0.
inline __m256i fifth_bits_32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  // Each 128-bit lane holds the 4 bytes repeated; byte j takes byte j / 8 of them...
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), pick);
  // ...and tests its bit j % 8.
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// --- One row of K values -> fp32, per type (gguf.quants' dequantize_blocks) ----------------

inline void dequant_row_q4_0(const uint8_t* row, int64_t K, float* out) {  // f16 d, 16 B nibbles
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * 18;
    const __m256i codes = _mm256_sub_epi8(nibbles_32(blk + 2), _mm256_set1_epi8(8));
    store_scaled(codes, half_to_float(blk), out + b * kBlock);
  }
}

inline void dequant_row_q4_1(const uint8_t* row, int64_t K, float* out) {  // f16 d, f16 m, nibbles
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * kQ4_1Bytes;
    store_scaled_offset(nibbles_32(blk + 4), half_to_float(blk), half_to_float(blk + 2),
                        out + b * kBlock);
  }
}

inline void dequant_row_q5_0(const uint8_t* row, int64_t K, float* out) {  // f16 d, u32 qh, nibbles
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * 22;
    const __m256i codes = _mm256_or_si256(nibbles_32(blk + 6), fifth_bits_32(blk + 2));
    store_scaled(_mm256_sub_epi8(codes, _mm256_set1_epi8(16)), half_to_float(blk),
                 out + b * kBlock);
  }
}

inline void dequant_row_q5_1(const uint8_t* row, int64_t K, float* out) {  // d, m, u32 qh, nibbles
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * 24;
    const __m256i codes = _mm256_or_si256(nibbles_32(blk + 8), fifth_bits_32(blk + 4));
    store_scaled_offset(codes, half_to_float(blk), half_to_float(blk + 2), out + b * kBlock);
  }
}

inline void dequant_row_q8_0(const uint8_t* row, int64_t K, float* out) {  // f16 d, 32 int8
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * kQ8_0Bytes;
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    store_scaled(codes, half_to_float(blk), out + b * kBlock);
  }
}

// Q4_K / Q5_K: eight sub-blocks of 32 values, each with a 6-bit scale and a 6-bit min packed
// into 12 bytes: scale s < 4 is the low 6 bits of byte s, min s < 4 of byte s + 4; for s >= 4
// the low (scale) or high (min) nibble of byte s + 4 gives the low 4 bits and the top 2 bits
// of byte s - 4 (scale) or byte s (min) the high 2.
inline void k_scales_mins(const uint8_t* p, float d, float dmin, float dsc[8], float dm[8]) {
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    if (s < 4) {
      sc = p[s] & 63;
      mn = p[s + 4] & 63;
    } else {
      sc = (p[s + 4] & 0x0F) | ((p[s - 4] >> 6) << 4);
      mn = (p[s + 4] >> 4) | ((p[s] >> 6) << 4);
    }
    // Rounded to fp32 here, as numpy forms d * sc before multiplying by the codes.
    dsc[s] = d * static_cast<float>(sc);
    dm[s] = dmin * static_cast<float>(mn);
  }
}

// The codes of one 32-value group of a K-quant super-block, shared by the float dequantizers
// below and the int8 decoders (gguf_int8.h).

// Q4_K (144 B: f16 d, f16 dmin, 12 B scales/mins, 128 B nibbles), sub-block s (0-7): 32
// bytes per pair of sub-blocks, the low nibbles sub-block 2c, the high ones 2c + 1.
inline __m256i q4_k_codes(const uint8_t* blk, int s) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * (s / 2)));
  return _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

// Q5_K (176 B): as Q4_K, with 32 B of fifth bits before the nibbles: bit s of byte j is the
// fifth bit of value j of sub-block s.
inline __m256i q5_k_codes(const uint8_t* blk, int s) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 48 + 32 * (s / 2)));
  const __m256i low = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
  // Bit s of each byte to bit 4 (a 16-bit shift keeps each byte's bits in that byte once
  // masked to bit 0).
  const __m256i fifth = _mm256_slli_epi16(
      _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1)), 4);
  return _mm256_or_si256(low, fifth);
}

// Q6_K (210 B: 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, f16 d), group t
// (0-7) as signed codes (the 6-bit code - 32). Each half h of 128 values reads 64 low-nibble
// bytes and 32 high bytes: value r (< 128) takes the low nibble of byte r % 64 (r < 64) or
// its high nibble, and bits 2 * (r / 32) of high byte r % 32.
inline __m256i q6_k_codes(const uint8_t* blk, int t) {
  const int h = t / 4, g = t % 4;
  const __m256i l =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (g % 2)));
  const __m256i low = _mm256_and_si256(g >= 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0x0F));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
  const __m256i high =
      _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
}

// Q4_K / Q5_K: value = (d * scale) * q - dmin * min, written as + (-dmin * min), the same
// IEEE result.
inline void dequant_row_q4_k(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 144;
    float dsc[8], dm[8];
    k_scales_mins(blk + 4, half_to_float(blk), half_to_float(blk + 2), dsc, dm);
    for (int s = 0; s < 8; ++s)
      store_scaled_offset(q4_k_codes(blk, s), dsc[s], -dm[s], out + b * kSuper + 32 * s);
  }
}

inline void dequant_row_q5_k(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 176;
    float dsc[8], dm[8];
    k_scales_mins(blk + 4, half_to_float(blk), half_to_float(blk + 2), dsc, dm);
    for (int s = 0; s < 8; ++s)
      store_scaled_offset(q5_k_codes(blk, s), dsc[s], -dm[s], out + b * kSuper + 32 * s);
  }
}

// Q6_K: value = (d * scale[value / 16]) * q, two scales per 32-value group.
inline void dequant_row_q6_k(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 210;
    const float d = half_to_float(blk + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    for (int t = 0; t < 8; ++t) {
      __m256 q[4];
      widen(q6_k_codes(blk, t), q);
      float* o = out + b * kSuper + 32 * t;
      for (int i = 0; i < 4; ++i) {
        const __m256 dv = _mm256_set1_ps(d * static_cast<float>(scales[2 * t + i / 2]));
        _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(dv, q[i]));
      }
    }
  }
}

// 8 IEEE halves / bfloat16 values at p, widened to fp32 (exact).
inline __m256 widen_f16(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 widen_bf16(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// 32 e4m3 values (sign, 4 exponent bits biased by 7, 3 mantissa bits) widened to fp32, times
// 2^-8: moved into fp16's bit positions (sign at 15, exponent and mantissa at 7-14) each is
// an fp16 whose exponent bias is 8 larger, subnormals included, which F16C widens exactly.
// The caller multiplies the 2^8 back into the block's scale (exact: a power of two).
inline void widen_e4m3(const uint8_t* p, __m256 q[4]) {
  const __m256i sign_mask = _mm256_set1_epi16(static_cast<int16_t>(0x80));
  const __m256i magnitude_mask = _mm256_set1_epi16(0x7F);
  for (int h = 0; h < 2; ++h) {
    const __m256i bytes =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
    const __m256i half = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_and_si256(bytes, sign_mask), 8),
        _mm256_slli_epi16(_mm256_and_si256(bytes, magnitude_mask), 7));
    q[2 * h] = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    q[2 * h + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
  }
}

constexpr float kE4M3Rescale = 256.f;  // widen_e4m3's 2^-8 undone

inline void dequant_row_e4m3(const uint8_t* row, int64_t K, float* out) {  // f16 d, 32 e4m3
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * kQ8_0Bytes;
    __m256 q[4];
    widen_e4m3(blk + 2, q);
    const __m256 dv = _mm256_set1_ps(half_to_float(blk) * kE4M3Rescale);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * kBlock + 8 * i, _mm256_mul_ps(dv, q[i]));
  }
}

template <bool kBrain>
inline void dequant_row_16(const uint8_t* row, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += 8)
    _mm256_storeu_ps(out + k, kBrain ? widen_bf16(row + 2 * k) : widen_f16(row + 2 * k));
}

using DequantRow = void (*)(const uint8_t*, int64_t, float*);

struct BlockFormat {
  int64_t values;  // per block
  int64_t bytes;   // per block
  DequantRow dequant;
};

// gguf_lattice.h's types: one sub-block decoder per type serves the dequantizer.
template <class Type>
inline BlockFormat lattice_format() {
  return {Type::kValues, Type::kBytes, dequant_row_sub_blocks<Type>};
}

// The layout of a type the kernel reads, or nullptr.
inline const BlockFormat* block_format(int64_t qtype) {
  static const BlockFormat q4_0{kBlock, 18, dequant_row_q4_0}, q4_1{kBlock, 20, dequant_row_q4_1},
      q5_0{kBlock, 22, dequant_row_q5_0}, q5_1{kBlock, 24, dequant_row_q5_1},
      q8_0{kBlock, 34, dequant_row_q8_0}, q4_k{kSuper, 144, dequant_row_q4_k},
      q5_k{kSuper, 176, dequant_row_q5_k}, q6_k{kSuper, 210, dequant_row_q6_k},
      f16{kBlock, 64, dequant_row_16<false>}, bf16{kBlock, 64, dequant_row_16<true>},
      q2_k{kSuper, 84, dequant_row_q2_k}, q3_k{kSuper, 110, dequant_row_q3_k},
      iq4_nl{kBlock, 18, dequant_row_iq4_nl}, iq4_xs{kSuper, 136, dequant_row_iq4_xs},
      mxfp4{kBlock, 17, dequant_row_mxfp4}, fp8_e4m3{kBlock, kQ8_0Bytes, dequant_row_e4m3};
  static const BlockFormat iq2_xxs = lattice_format<IQ2_XXS>(), iq2_xs = lattice_format<IQ2_XS>(),
                           iq2_s = lattice_format<IQ2_S>(), iq3_xxs = lattice_format<IQ3_XXS>(),
                           iq3_s = lattice_format<IQ3_S>(), iq1_s = lattice_format<IQ1_S>(),
                           iq1_m = lattice_format<IQ1_M>(), tq1_0 = lattice_format<TQ1_0>(),
                           tq2_0 = lattice_format<TQ2_0>(), nvfp4 = lattice_format<NVFP4>();
  switch (qtype) {
    case kF16: return &f16;
    case kBF16: return &bf16;
    case kFP8_E4M3: return &fp8_e4m3;
    case kQ4_0: return &q4_0;
    case kQ4_1: return &q4_1;
    case kQ5_0: return &q5_0;
    case kQ5_1: return &q5_1;
    case kQ8_0: return &q8_0;
    case kQ4_K: return &q4_k;
    case kQ5_K: return &q5_k;
    case kQ6_K: return &q6_k;
    case kQ2_K: return &q2_k;
    case kQ3_K: return &q3_k;
    case kIQ4_NL: return &iq4_nl;
    case kIQ4_XS: return &iq4_xs;
    case kMXFP4: return &mxfp4;
    case kIQ2_XXS: return &iq2_xxs;
    case kIQ2_XS: return &iq2_xs;
    case kIQ2_S: return &iq2_s;
    case kIQ3_XXS: return &iq3_xxs;
    case kIQ3_S: return &iq3_s;
    case kIQ1_S: return &iq1_s;
    case kIQ1_M: return &iq1_m;
    case kTQ1_0: return &tq1_0;
    case kTQ2_0: return &tq2_0;
    case kNVFP4: return &nvfp4;
    default: return nullptr;
  }
}

}  // namespace zllm_gguf
