// The types below 4.5 bits a weight that llama.cpp's low-memory presets write, read in their
// blocks as gguf_linear.h reads the others: Q2_K, Q3_K (Q2_K, Q3_K_S/M/L), IQ4_NL, IQ4_XS
// (IQ4_XS, and the IQ2/IQ3 presets' larger matrices) and MXFP4 (gpt-oss). Per type, a
// dequantizer for the panel paths (bit for bit gguf.quants' fp32 values: the same products
// in the same order) and a few-rows format for linear_few_rows (1-2 rows; Q2_K, Q3_K) or
// (1-4 rows; the table types).
//
// Layouts (ggml-common.h), values v of a block:
//   Q2_K   84 B  scales[16] (low nibble: scale, high: min; one per 16 values) | qs[64] | f16 d
//                | f16 dmin.  v = 128 h + 32 j + l: code (qs[32 h + l] >> 2 j) & 3,
//                value (d * sc) * code - dmin * min of sub-block v / 16.
//   Q3_K  110 B  hmask[32] | qs[64] | scales[12] (16 6-bit scales) | f16 d.  Low 2 bits as
//                Q2_K's (at qs), third bit (hmask[v % 32] >> v / 32) & 1; code = low + 4
//                third - 4 (-4..3); value (d * (scale - 32)) * code, a scale per 16 values.
//   IQ4_NL 18 B  f16 d | 16 B nibbles laid out as Q4_0's; value d * kIQ4NL[nibble].
//   IQ4_XS 136 B f16 d | u16 scales_h | scales_l[4] | 8 x 16 B nibbles: group g (32 values)
//                has scale ls = nibble g of scales_l | bits 2 g of scales_h << 4, value
//                (d * (ls - 32)) * kIQ4NL[nibble].
//   MXFP4  17 B  E8M0 exponent e | 16 B nibbles as Q4_0's; value d(e) * kFP4[nibble], with
//                kFP4 twice the E2M1 values and d(e) half of 2^(e - 127).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace zllm_gguf {

// IQ4_NL / IQ4_XS's 16 non-linear levels, and twice FP4 E2M1's values (MXFP4).
alignas(16) inline constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                  1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) inline constexpr int8_t kFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12,
                                                0, -1, -2, -3, -4, -6, -8, -12};

// Each byte (an index 0-15) replaced by table[index]: one shuffle per 32 codes.
inline __m256i lookup16(__m256i indices, const int8_t* table) {
  const __m128i t = _mm_load_si128(reinterpret_cast<const __m128i*>(table));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t), indices);
}

// MXFP4's scale: half of 2^(e - 127) as an fp32 bit pattern (gguf.quants' e8m0_to_fp32_half:
// below e = 2 a subnormal, 2^(e - 128) being under fp32's normal range).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

// Q3_K's 16 scales (6 bits, less 32): scale s takes its low nibble from byte s % 8 (the low
// nibble for s < 8, the high one after) and its top two bits from bits 2 (s / 4) of byte
// 8 + s % 4.
inline void q3_k_scales(const uint8_t* p, float d, float dl[16]) {
  for (int s = 0; s < 16; ++s) {
    const int low = (s < 8 ? p[s] : p[s - 8] >> 4) & 0x0F;
    const int high = (p[8 + s % 4] >> (2 * (s / 4))) & 3;
    // Rounded to fp32 here, as numpy forms d * scale before multiplying by the codes.
    dl[s] = d * static_cast<float>((low | high << 4) - 32);
  }
}

// Q2_K / Q3_K's low two bits of the 32 values of group t (= 4 h + j) of a super-block whose
// 2-bit codes start at qs.
inline __m256i two_bit_codes(const uint8_t* qs, int t) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (t / 4)));
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (t % 4))),
                          _mm256_set1_epi8(3));
}

// out[0..15] = d0 * code + m0, out[16..31] = d1 * code + m1 (two roundings each, numpy's).
inline void store_scaled_halves(__m256i codes, float d0, float m0, float d1, float m1,
                                float* out) {
  __m256 q[4];
  widen(codes, q);
  for (int i = 0; i < 4; ++i) {
    const __m256 dv = _mm256_set1_ps(i < 2 ? d0 : d1), mv = _mm256_set1_ps(i < 2 ? m0 : m1);
    _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(_mm256_mul_ps(dv, q[i]), mv));
  }
}

inline void store_scaled_halves(__m256i codes, float d0, float d1, float* out) {
  __m256 q[4];
  widen(codes, q);
  for (int i = 0; i < 4; ++i)
    _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_set1_ps(i < 2 ? d0 : d1), q[i]));
}

// --- One row of K values -> fp32, per type (gguf.quants' dequantize_blocks) ----------------

// value = dl * q - ml, written as + (-ml), the same IEEE result.
inline void dequant_row_q2_k(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 84;
    const float d = half_to_float(blk + 80), dmin = half_to_float(blk + 82);
    for (int t = 0; t < 8; ++t) {
      const uint8_t s0 = blk[2 * t], s1 = blk[2 * t + 1];
      store_scaled_halves(two_bit_codes(blk + 16, t), d * static_cast<float>(s0 & 0x0F),
                          -(dmin * static_cast<float>(s0 >> 4)),
                          d * static_cast<float>(s1 & 0x0F),
                          -(dmin * static_cast<float>(s1 >> 4)), out + b * kSuper + 32 * t);
    }
  }
}

inline void dequant_row_q3_k(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 110;
    float dl[16];
    q3_k_scales(blk + 96, half_to_float(blk + 108), dl);
    const __m256i hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
    for (int t = 0; t < 8; ++t) {
      // Bit t of each hmask byte to bit 2 (a 16-bit shift keeps each byte's bits in that
      // byte once masked).
      const __m256i third = _mm256_slli_epi16(
          _mm256_and_si256(_mm256_srl_epi16(hmask, _mm_cvtsi32_si128(t)), _mm256_set1_epi8(1)),
          2);
      const __m256i codes = _mm256_sub_epi8(_mm256_or_si256(two_bit_codes(blk + 32, t), third),
                                            _mm256_set1_epi8(4));
      store_scaled_halves(codes, dl[2 * t], dl[2 * t + 1], out + b * kSuper + 32 * t);
    }
  }
}

inline void dequant_row_iq4_nl(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * 18;
    store_scaled(lookup16(nibbles_32(blk + 2), kIQ4NL), half_to_float(blk), out + b * kBlock);
  }
}

// IQ4_XS's scale of group g: nibble g of scales_l, two bits of scales_h on top, less 32.
inline int iq4_xs_scale(const uint8_t* blk, int g) {
  uint16_t high;
  std::memcpy(&high, blk + 2, 2);
  return (((blk[4 + g / 2] >> (4 * (g % 2))) & 0x0F) | (((high >> (2 * g)) & 3) << 4)) - 32;
}

inline void dequant_row_iq4_xs(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const uint8_t* blk = row + b * 136;
    const float d = half_to_float(blk);
    for (int g = 0; g < 8; ++g)
      store_scaled(lookup16(nibbles_32(blk + 8 + 16 * g), kIQ4NL),
                   d * static_cast<float>(iq4_xs_scale(blk, g)), out + b * kSuper + 32 * g);
  }
}

inline void dequant_row_mxfp4(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* blk = row + b * 17;
    store_scaled(lookup16(nibbles_32(blk + 1), kFP4), e8m0_half(blk[0]), out + b * kBlock);
  }
}

// --- Few input rows (linear_few_rows in gguf_linear.h) ---------------------------------------

// The table types: a 32-value group's codes looked up as bytes (one shuffle) and widened, the
// group's scale applied to its dot product.
template <int MR>
inline void add_table_group(const uint8_t* nibbles, const int8_t* table, float d,
                            const FewRowsInput& in, int g, RowSums<MR>& sums) {
  __m256 q[4];
  widen(lookup16(nibbles_32(nibbles), table), q);
  add_group<MR>(q, d, in, g, sums);
}

struct FewIQ4_NL {
  static constexpr int64_t kValues = kBlock, kBytes = 18;
  static constexpr bool kOffset = false;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even, RowSums<MR>&) {
    add_table_group<MR>(blk + 2, kIQ4NL, half_to_float(blk), in, 0, even);
  }
};

struct FewMXFP4 {
  static constexpr int64_t kValues = kBlock, kBytes = 17;
  static constexpr bool kOffset = false;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even, RowSums<MR>&) {
    add_table_group<MR>(blk + 1, kFP4, e8m0_half(blk[0]), in, 0, even);
  }
};

struct FewIQ4_XS {
  static constexpr int64_t kValues = kSuper, kBytes = 136;
  static constexpr bool kOffset = false;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even,
                  RowSums<MR>& odd) {
    const float d = half_to_float(blk);
    for (int g = 0; g < 8; ++g)
      add_table_group<MR>(blk + 8 + 16 * g, kIQ4NL, d * static_cast<float>(iq4_xs_scale(blk, g)),
                          in, g, g % 2 ? odd : even);
  }
};

// Q2_K / Q3_K: as FewQ6_K (gguf_linear.h), each 8 bytes of 2-bit codes are widened once and
// serve 8 values of all four groups of a 128-value half, summed side by side (four dot
// products per row) and scaled per 16 values. Q2_K's minima (also per 16 values) go to the
// offset with per-16 sums of x (kSumValues).
template <bool kThirdBit>
struct FewQ23_K {
  static constexpr int64_t kValues = kSuper, kBytes = kThirdBit ? 110 : 84;
  static constexpr bool kOffset = !kThirdBit;
  static constexpr int64_t kSumValues = 16;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even,
                  RowSums<MR>& odd) {
    float dl[16], ml[16];
    if constexpr (kThirdBit) {
      q3_k_scales(blk + 96, half_to_float(blk + 108), dl);
    } else {
      const float d = half_to_float(blk + 80), dmin = half_to_float(blk + 82);
      for (int s = 0; s < 16; ++s) {
        dl[s] = d * static_cast<float>(blk[s] & 0x0F);
        ml[s] = dmin * static_cast<float>(blk[s] >> 4);
      }
    }
    const uint8_t* qs = blk + (kThirdBit ? 32 : 16);
    const __m256i three = _mm256_set1_epi32(3), four = _mm256_set1_epi32(4);
    // Unrolled, so every shift count below is a constant.
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
      for (int quarter = 0; quarter < 2; ++quarter) {  // values 0-15, then 16-31, of each group
        __m256 dot[4][MR];
#pragma GCC unroll 2
        for (int part = 2 * quarter; part < 2 * quarter + 2; ++part) {
          const __m256i bytes = widen8_u(qs + 32 * h + 8 * part);
          __m256i hmask;
          if constexpr (kThirdBit) hmask = widen8_u(blk + 8 * part);
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            __m256i codes = _mm256_and_si256(_mm256_srli_epi32(bytes, 2 * j), three);
            if constexpr (kThirdBit) {
              // Bit t = 4 h + j of the hmask byte to bit 2, then the code less 4.
              const int t = 4 * h + j;
              const __m256i third =
                  t >= 2 ? _mm256_srli_epi32(hmask, t - 2) : _mm256_slli_epi32(hmask, 2 - t);
              codes = _mm256_sub_epi32(_mm256_or_si256(codes, _mm256_and_si256(third, four)),
                                       four);
            }
            const __m256 q = to_float(codes);
            for (int i = 0; i < MR; ++i) {
              const __m256 xv = _mm256_loadu_ps(in.x + i * in.ldx + 128 * h + 32 * j + 8 * part);
              dot[j][i] = part % 2 ? _mm256_fmadd_ps(q, xv, dot[j][i]) : _mm256_mul_ps(q, xv);
            }
          }
        }
        for (int j = 0; j < 4; ++j) {
          const int s = 8 * h + 2 * j + quarter;  // the 16-value sub-block
          const __m256 dv = _mm256_set1_ps(dl[s]);
          RowSums<MR>& sums = j % 2 ? odd : even;
          for (int i = 0; i < MR; ++i) sums.v[i] = _mm256_fmadd_ps(dv, dot[j][i], sums.v[i]);
          if constexpr (!kThirdBit) add_group_offset<MR>(-ml[s], in, s, sums);
        }
      }
    }
  }
};

using FewQ2_K = FewQ23_K<false>;
using FewQ3_K = FewQ23_K<true>;

}  // namespace zllm_gguf
