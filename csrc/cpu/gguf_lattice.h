// The GGUF types that llama.cpp's IQ1-IQ3 and ternary presets write (1.56-3.44 bits a weight),
// and NVFP4, read in their blocks as gguf_lowbit.h reads the others: IQ2_XXS, IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (lattice codebooks: each index names a row of 4 or 8 small
// integers), TQ1_0, TQ2_0 (ternary: BitNet-style models) and NVFP4 (E2M1 codes, E4M3 scales
// per 16 values). Per type, a dequantizer for the panel paths (bit for bit gguf.quants' fp32
// values) and a few-rows format for linear_few_rows (1-4 rows), both built on one decoder
// per 32-value sub-block: its weights before scaling as four fp32 vectors (signed grid rows,
// or codes), and its scales.
//
// Layouts (ggml-common.h; gguf.quants' dequantize_blocks), 256 values a block unless said:
//   IQ2_XXS  66 B  f16 d | 8 x (u32 grid | u32 signs): sub-block ib's u32 grid holds four
//                  8-value rows of the 256-row grid; its u32 signs four 7-bit indices into
//                  ksigns (a sign byte each) and, in the top 4 bits, s: value
//                  ((d * (0.5 + s) * 0.25) * grid) * sign.
//   IQ2_XS   74 B  f16 d | 32 x u16 (9-bit row of the 512-row grid, 7-bit ksigns index) |
//                  scales[8] (a nibble per 16 values), as IQ2_XXS's formula.
//   IQ2_S    82 B  f16 d | qs[32] | signs[32] | qh[8] | scales[8]: row qs[i] | 2 bits of qh
//                  (1024-row grid), sign byte signs[i], a scale nibble per 16 values.
//   IQ3_XXS  98 B  f16 d | qs[64] (4-value rows of the 256-row grid) | 8 x u32 (four ksigns
//                  indices, s in the top 4 bits): ((d * (0.5 + s) * 0.5) * grid) * sign.
//   IQ3_S   110 B  f16 d | qs[64] | qh[8] (the 9th index bit) | signs[32] | scales[4]:
//                  ((d * (1 + 2 s)) * grid) * sign, a scale nibble per 32 values.
//   IQ1_S    50 B  f16 d | qs[32] | 8 x u16 qh: per 32 values 3 more index bits per row
//                  (2048-row grid of -1, 0, 1), s (bits 12-14) and the delta's sign (bit
//                  15): (d * (2 s + 1)) * (grid + delta), delta = +-1/8.
//   IQ1_M    56 B  qs[32] | qh[16] (a nibble per 8 values: 3 index bits, the delta's sign) |
//                  4 x u16 scales: 3 bits per 16 values, d's 16 bits in their top nibbles.
//   TQ1_0    54 B  qs[48] | qh[4] | f16 d: five (qs) or four (qh) base-3 digits per byte,
//                  digit j = ((u8)(byte * 3^j) * 3) >> 8; value d * (digit - 1).
//   TQ2_0    66 B  qs[64] | f16 d: 2-bit codes laid out as Q2_K's; value d * (code - 1).
//   NVFP4    36 B  per 64 values: 4 UE4M3 scales | 4 x 8 B nibbles (values 0-7 the low
//                  nibbles, 8-15 the high ones); value (scale / 2) * kFP4[nibble].
//
// The lattice grids and ksigns are the format's constants, and gguf-py (the reference the
// kernels match bit for bit) owns them: executor/kernels/cpu.py hands them over once per
// process from gguf.quants (set_lattice_tables) rather than this file keeping a second copy
// that could drift from the first. Until then these types are refused (g_lattice_ready).

#pragma once

#include <immintrin.h>
#include "aten_lite.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_lowbit.h"

namespace zllm_gguf {

// The grids' rows as fp32 (exact: small integers), so a row of 8 values is one aligned
// vector load and a row of 4 half of one, with no widening: building the codes in bytes
// and widening them (one shuffle-port instruction per 8 values, and as many to gather the
// rows) bound the few-rows loop at 1.2-1.8x Q4_K's time; fp32 rows cost 64 KB for IQ1's
// 2,048 rows, read at random but mostly from L1/L2.
struct LatticeTables {
  alignas(32) float iq2_xxs[256][8], iq2_xs[512][8], iq2_s[1024][8], iq1_s[2048][8],
      iq1_m[2048][8];
  alignas(32) float iq3_xxs[256][4], iq3_s[512][4];
  alignas(32) uint32_t ksign_masks[128][8];  // ksigns[i]: lane j's sign bit set where bit j is
};
inline LatticeTables g_lattice;  // static storage, filled once by set_lattice_tables
inline std::atomic<bool> g_lattice_ready{false};

inline bool is_lattice_type(int64_t qtype) {
  return qtype == kIQ2_XXS || qtype == kIQ2_XS || qtype == kIQ2_S || qtype == kIQ3_XXS ||
         qtype == kIQ3_S || qtype == kIQ1_S || qtype == kIQ1_M;
}

// Lane j's fp32 sign bit set where bit j of a byte is (the sign bytes of IQ2_S / IQ3_S; the
// ksigns masks are built from it too).
struct SignMasks {
  alignas(32) uint32_t of[256][8];
};
constexpr SignMasks make_sign_masks() {
  SignMasks masks{};
  for (int byte = 0; byte < 256; ++byte)
    for (int j = 0; j < 8; ++j) masks.of[byte][j] = (byte >> j) & 1 ? 0x80000000u : 0u;
  return masks;
}
inline constexpr SignMasks kSignMasks = make_sign_masks();

// One 32-value sub-block: its weights before scaling (the signed grid values, or codes) per
// 8 values, the scale of each 16 values, and (IQ1) the delta added to each 8 values.
struct SubBlock {
  __m256 w[4];
  float scale[2];
  float delta[4];
};

inline __m256 sign_mask(const uint32_t* mask) {
  return _mm256_load_ps(reinterpret_cast<const float*>(mask));
}

// An 8-value grid row with the signs of `mask` (a lane's sign bit flipped where set). The
// reference's value is (scale * grid) * sign; scale * (grid * sign) is the same fp32 number,
// rounding to nearest being symmetric (and no grid value is 0, so no -0 differs either).
inline __m256 signed_row(const float* row, const uint32_t* mask) {
  return _mm256_xor_ps(_mm256_load_ps(row), sign_mask(mask));
}

// Two 4-value rows (IQ3), as signed_row.
inline __m256 signed_rows(const float* row0, const float* row1, const uint32_t* mask) {
  const __m256 rows = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(row0)),
                                           _mm_load_ps(row1), 1);
  return _mm256_xor_ps(rows, sign_mask(mask));
}

inline const uint32_t* ksign_mask(uint32_t packed, int l) {  // l-th 7-bit index, 7 bits apart
  return g_lattice.ksign_masks[(packed >> (7 * l)) & 127];
}

// The row `offset` bytes into a table. IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S build their rows'
// byte offsets for the whole block at once, 8 side by side in a register, into an array
// the sub-blocks read: index by index in scalar code (shifts, masks, scaling) they were most
// of the few-rows loop's instructions (IQ3_S: 1.7x Q4_K's time at one row, 1.3x this way).
template <class Table>
inline const float* row_at(const Table& table, uint32_t offset) {
  return reinterpret_cast<const float*>(reinterpret_cast<const char*>(table) + offset);
}

// d * (0.5 + s) * 0.25 (IQ2) or * 0.5 (IQ3_XXS): numpy's order, each product rounded to fp32.
inline float half_step_scale(float d, uint32_t s, float step) {
  return d * (0.5f + static_cast<float>(s)) * step;
}

// Each type reads one block: what the whole block shares (d) once, then its sub-blocks.
struct IQ2_XXS {
  static constexpr int64_t kValues = kSuper, kBytes = 66;
  static constexpr bool kDelta = false;
  const uint8_t* blk;
  float d;
  explicit IQ2_XXS(const uint8_t* block) : blk(block), d(half_to_float(block)) {}
  SubBlock sub_block(int ib) const {
    uint32_t aux[2];
    std::memcpy(aux, blk + 2 + 8 * ib, 8);
    SubBlock out;
    for (int l = 0; l < 4; ++l)
      out.w[l] = signed_row(g_lattice.iq2_xxs[(aux[0] >> (8 * l)) & 255], ksign_mask(aux[1], l));
    out.scale[0] = out.scale[1] = half_step_scale(d, aux[1] >> 28, 0.25f);
    return out;
  }
};

// IQ2_XS / IQ2_S: a scale nibble per 16 values, sub-block ib's two in byte ib of scales.
inline void nibble_scales(float d, uint8_t byte, float scale[2]) {
  scale[0] = half_step_scale(d, byte & 15, 0.25f);
  scale[1] = half_step_scale(d, byte >> 4, 0.25f);
}

struct IQ2_XS {
  static constexpr int64_t kValues = kSuper, kBytes = 74;
  static constexpr bool kDelta = false;
  const uint8_t* blk;
  float d;
  alignas(32) uint32_t offset[32], sign_offset[32];  // of row i's grid row and ksigns mask
  explicit IQ2_XS(const uint8_t* block) : blk(block), d(half_to_float(block)) {
    for (int g = 0; g < 4; ++g) {
      const __m256i q = _mm256_cvtepu16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * g)));
      const __m256i row = _mm256_and_si256(q, _mm256_set1_epi32(511));
      _mm256_store_si256(reinterpret_cast<__m256i*>(offset + 8 * g), _mm256_slli_epi32(row, 5));
      _mm256_store_si256(reinterpret_cast<__m256i*>(sign_offset + 8 * g),
                         _mm256_slli_epi32(_mm256_srli_epi32(q, 9), 5));
    }
  }
  SubBlock sub_block(int ib) const {
    SubBlock out;
    for (int l = 0; l < 4; ++l) {
      const int i = 4 * ib + l;
      out.w[l] = signed_row(row_at(g_lattice.iq2_xs, offset[i]),
                            reinterpret_cast<const uint32_t*>(
                                row_at(g_lattice.ksign_masks, sign_offset[i])));
    }
    nibble_scales(d, blk[66 + ib], out.scale);
    return out;
  }
};

struct IQ2_S {
  static constexpr int64_t kValues = kSuper, kBytes = 82;
  static constexpr bool kDelta = false;
  const uint8_t* blk;
  float d;
  alignas(32) uint32_t offset[32];  // row i: (qs[i] | 2 bits of qh[i / 4] << 8) * 32
  explicit IQ2_S(const uint8_t* block) : blk(block), d(half_to_float(block)) {
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    for (int g = 0; g < 4; ++g) {  // rows 8 g ... 8 g + 7: qh bytes 2 g, 2 g + 1
      uint16_t qh;
      std::memcpy(&qh, block + 66 + 2 * g, 2);
      const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(qh), shifts),
                                            _mm256_set1_epi32(3));
      const __m256i row = _mm256_or_si256(widen8_u(block + 2 + 8 * g), _mm256_slli_epi32(high, 8));
      _mm256_store_si256(reinterpret_cast<__m256i*>(offset + 8 * g), _mm256_slli_epi32(row, 5));
    }
  }
  SubBlock sub_block(int ib) const {
    const uint8_t* signs = blk + 34 + 4 * ib;
    SubBlock out;
    for (int l = 0; l < 4; ++l)
      out.w[l] = signed_row(row_at(g_lattice.iq2_s, offset[4 * ib + l]), kSignMasks.of[signs[l]]);
    nibble_scales(d, blk[74 + ib], out.scale);
    return out;
  }
};

struct IQ3_XXS {
  static constexpr int64_t kValues = kSuper, kBytes = 98;
  static constexpr bool kDelta = false;
  const uint8_t* blk;
  float d;
  alignas(32) uint32_t offset[64];  // row k: qs[k] * 16
  explicit IQ3_XXS(const uint8_t* block) : blk(block), d(half_to_float(block)) {
    for (int g = 0; g < 8; ++g)
      _mm256_store_si256(reinterpret_cast<__m256i*>(offset + 8 * g),
                         _mm256_slli_epi32(widen8_u(block + 2 + 8 * g), 4));
  }
  SubBlock sub_block(int ib) const {
    uint32_t aux;
    std::memcpy(&aux, blk + 66 + 4 * ib, 4);
    SubBlock out;
    for (int l = 0; l < 4; ++l)
      out.w[l] = signed_rows(row_at(g_lattice.iq3_xxs, offset[8 * ib + 2 * l]),
                             row_at(g_lattice.iq3_xxs, offset[8 * ib + 2 * l + 1]),
                             ksign_mask(aux, l));
    out.scale[0] = out.scale[1] = half_step_scale(d, aux >> 28, 0.5f);
    return out;
  }
};

struct IQ3_S {
  static constexpr int64_t kValues = kSuper, kBytes = 110;
  static constexpr bool kDelta = false;
  const uint8_t* blk;
  float d;
  alignas(32) uint32_t offset[64];  // row k: (qs[k] | bit k % 8 of qh[k / 8] << 8) * 16
  explicit IQ3_S(const uint8_t* block) : blk(block), d(half_to_float(block)) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
    for (int g = 0; g < 8; ++g) {
      const __m256i bit = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(block[66 + g]), lanes), one);
      const __m256i row = _mm256_or_si256(widen8_u(block + 2 + 8 * g), _mm256_slli_epi32(bit, 8));
      _mm256_store_si256(reinterpret_cast<__m256i*>(offset + 8 * g), _mm256_slli_epi32(row, 4));
    }
  }
  SubBlock sub_block(int ib) const {
    const uint8_t* signs = blk + 74 + 4 * ib;
    SubBlock out;
    for (int l = 0; l < 4; ++l)
      out.w[l] = signed_rows(row_at(g_lattice.iq3_s, offset[8 * ib + 2 * l]),
                             row_at(g_lattice.iq3_s, offset[8 * ib + 2 * l + 1]),
                             kSignMasks.of[signs[l]]);
    const uint32_t s = (blk[106 + ib / 2] >> (4 * (ib % 2))) & 15;
    out.scale[0] = out.scale[1] = d * static_cast<float>(1 + 2 * s);
    return out;
  }
};

// IQ1: codes -1, 0, 1 and a delta of +-1/8 added before the scale; `negative` is 0 or the
// sign bit (built without a branch: the signs are random, a branch would mispredict half of
// them).
inline float iq1_delta(uint32_t negative) {
  const uint32_t bits = 0x3E000000u | negative;  // 0.125f, its sign bit set where negative
  float delta;
  std::memcpy(&delta, &bits, 4);
  return delta;
}

struct IQ1_S {
  static constexpr int64_t kValues = kSuper, kBytes = 50;
  static constexpr bool kDelta = true;
  const uint8_t* blk;
  float d;
  explicit IQ1_S(const uint8_t* block) : blk(block), d(half_to_float(block)) {}
  SubBlock sub_block(int ib) const {
    const uint8_t* qs = blk + 2 + 4 * ib;
    uint16_t h;
    std::memcpy(&h, blk + 34 + 2 * ib, 2);
    const uint32_t q = h;
    SubBlock out;
    for (int l = 0; l < 4; ++l) {
      out.w[l] = _mm256_load_ps(g_lattice.iq1_s[qs[l] | ((q >> (3 * l)) & 7) << 8]);
      out.delta[l] = iq1_delta((q & 0x8000) << 16);
    }
    out.scale[0] = out.scale[1] = d * static_cast<float>(2 * ((q >> 12) & 7) + 1);
    return out;
  }
};

struct IQ1_M {
  static constexpr int64_t kValues = kSuper, kBytes = 56;
  static constexpr bool kDelta = true;
  const uint8_t* blk;
  uint64_t scales;  // the four scale words
  float d;
  // Each of the 32 rows' index (qs | 3 bits of its qh nibble << 8) and delta (the nibble's
  // bit 3), built for the whole block side by side: one by one they were most of the loop.
  alignas(32) uint32_t index[32];
  alignas(32) uint32_t delta_bits[32];
  explicit IQ1_M(const uint8_t* block) : blk(block) {
    std::memcpy(&scales, block + 48, 8);
    // d's 16 bits are the top nibbles of the four scale words (the first's lowest).
    const uint64_t top = scales & 0xF000F000F000F000ULL;
    d = _cvtsh_ss(static_cast<uint16_t>((top >> 12) | (top >> 24) | (top >> 36) | (top >> 48)));
    // Row i's nibble: the low one of qh[i / 2] for even i, the high one for odd.
    const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qh, mask), hi = _mm_and_si128(_mm_srli_epi16(qh, 4), mask);
    alignas(16) uint8_t nibbles[32];
    _mm_store_si128(reinterpret_cast<__m128i*>(nibbles), _mm_unpacklo_epi8(lo, hi));
    _mm_store_si128(reinterpret_cast<__m128i*>(nibbles + 16), _mm_unpackhi_epi8(lo, hi));
    for (int r = 0; r < 32; r += 8) {
      const __m256i nibble = widen8_u(nibbles + r);
      const __m256i high = _mm256_slli_epi32(_mm256_and_si256(nibble, _mm256_set1_epi32(7)), 8);
      _mm256_store_si256(reinterpret_cast<__m256i*>(index + r),
                         _mm256_or_si256(widen8_u(block + r), high));
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nibble, _mm256_set1_epi32(8)), 28);
      _mm256_store_si256(reinterpret_cast<__m256i*>(delta_bits + r),
                         _mm256_or_si256(sign, _mm256_set1_epi32(0x3E000000)));  // +-0.125f
    }
  }
  SubBlock sub_block(int ib) const {
    SubBlock out;
    for (int l = 0; l < 4; ++l) {
      out.w[l] = _mm256_load_ps(g_lattice.iq1_m[index[4 * ib + l]]);
      std::memcpy(&out.delta[l], &delta_bits[4 * ib + l], 4);
    }
    for (int h = 0; h < 2; ++h) {
      const int t = 2 * ib + h;  // the 16-value scale: 3 bits at bit 3 (t % 4) of word t / 4
      out.scale[h] = d * static_cast<float>(2 * ((scales >> (16 * (t / 4) + 3 * (t % 4))) & 7) + 1);
    }
    return out;
  }
};

// The types whose codes are bytes (ternary, NVFP4): 32 in one register, widened.
inline SubBlock from_codes(__m256i codes, float scale0, float scale1) {
  SubBlock out;
  widen(codes, out.w);
  out.scale[0] = scale0;
  out.scale[1] = scale1;
  return out;
}

// TQ1_0: the base-3 digit of each byte that `mults` (3^j, as bytes) picks, less 1.
inline __m256i ternary_digits(__m256i bytes, __m256i mults) {
  const __m256i zero = _mm256_setzero_si256(), low = _mm256_set1_epi16(0xFF),
                three = _mm256_set1_epi16(3);
  auto digit = [&](__m256i b, __m256i m) {  // ((u8)(b * m) * 3) >> 8 in 16-bit lanes
    const __m256i product = _mm256_and_si256(_mm256_mullo_epi16(b, m), low);
    return _mm256_srli_epi16(_mm256_mullo_epi16(product, three), 8);
  };
  // unpack and pack pair up within each 128-bit lane, so the bytes come back in order.
  const __m256i lo = digit(_mm256_unpacklo_epi8(bytes, zero), _mm256_unpacklo_epi8(mults, zero));
  const __m256i hi = digit(_mm256_unpackhi_epi8(bytes, zero), _mm256_unpackhi_epi8(mults, zero));
  return _mm256_sub_epi8(_mm256_packus_epi16(lo, hi), _mm256_set1_epi8(1));
}

struct TQ1_0 {
  static constexpr int64_t kValues = kSuper, kBytes = 54;
  static constexpr bool kDelta = false;
  const uint8_t* blk;
  float d;
  explicit TQ1_0(const uint8_t* block) : blk(block), d(half_to_float(block + 52)) {}
  // Values 0-159: digit ib of qs[0..31] (sub-blocks 0-4); 160-239: digit j of qs[32..47] as
  // values 160 + 16 j + i; 240-255: digit j of qh[0..3] as values 240 + 4 j + i.
  SubBlock sub_block(int ib) const {
    static constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
    __m256i bytes, mults;
    if (ib < 5) {
      bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
      mults = _mm256_set1_epi8(static_cast<char>(kPow3[ib]));
    } else {
      const __m128i tail = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32));
      const int j = 2 * (ib - 5);  // sub-blocks 5, 6: digits j, j + 1 of qs[32..47]
      if (ib < 7) {
        bytes = _mm256_set_m128i(tail, tail);
        mults = _mm256_set_m128i(_mm_set1_epi8(static_cast<char>(kPow3[j + 1])),
                                 _mm_set1_epi8(static_cast<char>(kPow3[j])));
      } else {  // digit 4 of qs[32..47], then digits 0-3 of qh[0..3]
        uint32_t qh;
        std::memcpy(&qh, blk + 48, 4);
        bytes = _mm256_set_m128i(_mm_set1_epi32(static_cast<int>(qh)), tail);
        mults = _mm256_set_m128i(_mm_setr_epi8(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27),
                                 _mm_set1_epi8(81));
      }
    }
    return from_codes(ternary_digits(bytes, mults), d, d);
  }
};

struct TQ2_0 {
  static constexpr int64_t kValues = kSuper, kBytes = 66;
  static constexpr bool kDelta = false;
  const uint8_t* blk;
  float d;
  explicit TQ2_0(const uint8_t* block) : blk(block), d(half_to_float(block + 64)) {}
  SubBlock sub_block(int ib) const {
    return from_codes(_mm256_sub_epi8(two_bit_codes(blk, ib), _mm256_set1_epi8(1)), d, d);
  }
};

// NVFP4's UE4M3 scales, halved (gguf.quants' ue4m3_to_fp32), for each byte x: 0 and 0x7F
// read as 0; exponent e = 0 is subnormal, m * 2^-9; else (1 + m / 8) * 2^(e - 7) (bit 7 is
// ignored). Every one is exact in fp32. A table: a lookup per 16 values, no branch.
inline const std::array<float, 256> kUE4M3Half = [] {
  std::array<float, 256> table{};
  for (int x = 0; x < 256; ++x) {
    const int e = (x >> 3) & 15, m = x & 7;
    if (x == 0 || x == 0x7F) continue;
    if (e == 0) {
      table[x] = static_cast<float>(m) * 0.0009765625f;  // m * 2^-10
    } else {  // (1 + m / 8) * 2^(e - 8): exponent e - 8, mantissa m / 8
      const uint32_t bits = static_cast<uint32_t>(e + 119) << 23 | static_cast<uint32_t>(m) << 20;
      std::memcpy(&table[x], &bits, 4);
    }
  }
  return table;
}();

struct NVFP4 {
  static constexpr int64_t kValues = 64, kBytes = 36;
  static constexpr bool kDelta = false;
  const uint8_t* blk;
  explicit NVFP4(const uint8_t* block) : blk(block) {}
  // Sub-block ib: 16 bytes at 4 + 16 ib, two 16-value groups of 8 bytes each (the low
  // nibbles, then the high ones).
  SubBlock sub_block(int ib) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4 + 16 * ib));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256i nibbles =
        _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
    const float* scales = kUE4M3Half.data();
    return from_codes(lookup16(nibbles, kFP4), scales[blk[2 * ib]], scales[blk[2 * ib + 1]]);
  }
};

// --- One row of K values -> fp32 (gguf.quants' dequantize_blocks) ---------------------------

// Per 8 values: scale * code, or scale * (code + delta), each step rounded as numpy does.
template <class Type>
inline void dequant_row_sub_blocks(const uint8_t* row, int64_t K, float* out) {
  constexpr int kSubBlocks = Type::kValues / kBlock;
  for (int64_t b = 0; b < K / Type::kValues; ++b) {
    const Type block(row + b * Type::kBytes);
    for (int ib = 0; ib < kSubBlocks; ++ib) {
      const SubBlock sub = block.sub_block(ib);
      float* o = out + b * Type::kValues + kBlock * ib;
      for (int i = 0; i < 4; ++i) {
        __m256 v = sub.w[i];
        if constexpr (Type::kDelta) v = _mm256_add_ps(v, _mm256_set1_ps(sub.delta[i]));
        _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(_mm256_set1_ps(sub.scale[i / 2]), v));
      }
    }
  }
}

// --- Few input rows (linear_few_rows in gguf_linear.h) ---------------------------------------
// Per sub-block the codes become floats once (plus the delta, IQ1), are dotted with each
// row's 32 x values, and each 16 values' scale applies to its dot product.
template <class Type>
struct FewSubBlocks {
  static constexpr int64_t kValues = Type::kValues, kBytes = Type::kBytes;
  static constexpr bool kOffset = false;
  template <int MR>
  static void add(const uint8_t* blk, const FewRowsInput& in, RowSums<MR>& even,
                  RowSums<MR>& odd) {
    // Sub-blocks in pairs, so which sums each one adds to is known at compile time (chosen
    // at run time, the sums went through memory: a store and a load per sub-block).
    const Type block(blk);
    for (int ib = 0; ib < Type::kValues / kBlock; ib += 2) {
      add_sub_block<MR>(block.sub_block(ib), in, ib, even);
      add_sub_block<MR>(block.sub_block(ib + 1), in, ib + 1, odd);
    }
  }
  template <int MR>
  static void add_sub_block(const SubBlock& sub, const FewRowsInput& in, int ib,
                            RowSums<MR>& sums) {
    __m256 q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = Type::kDelta ? _mm256_add_ps(sub.w[i], _mm256_set1_ps(sub.delta[i])) : sub.w[i];
    const __m256 d0 = _mm256_set1_ps(sub.scale[0]), d1 = _mm256_set1_ps(sub.scale[1]);
    for (int i = 0; i < MR; ++i) {
      const float* xg = in.x + i * in.ldx + kBlock * ib;
      const __m256 dot0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xg + 8),
                                          _mm256_mul_ps(q[0], _mm256_loadu_ps(xg)));
      const __m256 dot1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xg + 24),
                                          _mm256_mul_ps(q[2], _mm256_loadu_ps(xg + 16)));
      sums.v[i] = _mm256_fmadd_ps(d1, dot1, _mm256_fmadd_ps(d0, dot0, sums.v[i]));
    }
  }
};

}  // namespace zllm_gguf
