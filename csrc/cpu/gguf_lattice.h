// The GGUF types below 2.6 bits a weight that llama.cpp's IQ1-IQ3 and ternary presets write,
// and NVFP4, read in their blocks as gguf_lowbit.h reads the others: IQ2_XXS, IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (lattice codebooks: each index names a row of 4 or 8 small
// integers), TQ1_0, TQ2_0 (ternary: BitNet-style models) and NVFP4 (E2M1 codes, E4M3 scales
// per 16 values). Per type, a dequantizer for the panel paths (bit for bit gguf.quants' fp32
// values) and a few-rows format for linear_few_rows (1-4 rows), both built on one decoder
// per 32-value sub-block: its 32 codes as signed bytes in one register, and its scales.
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
// that could drift from the first. Until then these types are refused (lattice_tables_ready).

#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_lowbit.h"

namespace zllm_gguf {

// Each grid row as its int8 values packed in one integer (8 values: u64; 4: u32), so a
// sub-block's rows gather into one register with a few scalar loads.
struct LatticeTables {
  uint64_t iq2_xxs[256], iq2_xs[512], iq2_s[1024], iq1_s[2048], iq1_m[2048];
  uint32_t iq3_xxs[256], iq3_s[512];
  uint64_t ksign_bytes[128];  // ksigns[i] spread: byte j is -1 where its bit j is set, else 1
};
inline LatticeTables g_lattice;  // static storage, filled once by set_lattice_tables
inline std::atomic<bool> g_lattice_ready{false};

inline bool is_lattice_type(int64_t qtype) {
  return qtype == kIQ2_XXS || qtype == kIQ2_XS || qtype == kIQ2_S || qtype == kIQ3_XXS ||
         qtype == kIQ3_S || qtype == kIQ1_S || qtype == kIQ1_M;
}

// One 32-value sub-block: its codes (signed bytes), the scale of each 16 values, and (IQ1)
// the delta added to each 8 values' codes before scaling.
struct SubBlock {
  __m256i codes;
  float scale[2];
  float delta[4];
};

// Sign bytes (+-1) for 32 values from 4 bytes of sign bits: byte j takes bit j % 8 of byte
// j / 8.
inline __m256i spread_signs(uint32_t bits) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), pick);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(set, _mm256_set1_epi8(1));  // -1 (0xFF) or 1
}

inline __m256i rows8(const uint64_t* grid, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3) {
  return _mm256_setr_epi64x(static_cast<int64_t>(grid[i0]), static_cast<int64_t>(grid[i1]),
                            static_cast<int64_t>(grid[i2]), static_cast<int64_t>(grid[i3]));
}

inline __m256i ksigns4(uint32_t packed) {  // four 7-bit ksigns indices, 7 bits apart
  const uint64_t* s = g_lattice.ksign_bytes;
  return rows8(s, packed & 127, (packed >> 7) & 127, (packed >> 14) & 127, (packed >> 21) & 127);
}

// The value of a grid code times a sign is (scale * grid) * sign in gguf.quants; negating the
// code first (psignb) gives the same fp32 result, since rounding to nearest is symmetric.
// Every grid value of the signed types is non-zero, so no -0 differs either.

// d * (0.5 + s) * 0.25 (IQ2) or * 0.5 (IQ3_XXS): numpy's order, each product rounded to fp32.
inline float half_step_scale(float d, uint32_t s, float step) {
  return d * (0.5f + static_cast<float>(s)) * step;
}

struct IQ2_XXS {
  static constexpr int64_t kValues = kSuper, kBytes = 66;
  static constexpr bool kDelta = false;
  static SubBlock sub_block(const uint8_t* blk, int ib) {
    uint32_t aux[2];
    std::memcpy(aux, blk + 2 + 8 * ib, 8);
    const __m256i rows = rows8(g_lattice.iq2_xxs, aux[0] & 255, (aux[0] >> 8) & 255,
                               (aux[0] >> 16) & 255, aux[0] >> 24);
    const float db = half_step_scale(half_to_float(blk), aux[1] >> 28, 0.25f);
    return {_mm256_sign_epi8(rows, ksigns4(aux[1])), {db, db}, {}};
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
  static SubBlock sub_block(const uint8_t* blk, int ib) {
    uint16_t q[4];
    std::memcpy(q, blk + 2 + 8 * ib, 8);
    const uint64_t* grid = g_lattice.iq2_xs;
    const uint64_t* s = g_lattice.ksign_bytes;
    SubBlock out;
    out.codes = _mm256_sign_epi8(rows8(grid, q[0] & 511, q[1] & 511, q[2] & 511, q[3] & 511),
                                 rows8(s, q[0] >> 9, q[1] >> 9, q[2] >> 9, q[3] >> 9));
    nibble_scales(half_to_float(blk), blk[66 + ib], out.scale);
    return out;
  }
};

struct IQ2_S {
  static constexpr int64_t kValues = kSuper, kBytes = 82;
  static constexpr bool kDelta = false;
  static SubBlock sub_block(const uint8_t* blk, int ib) {
    const uint8_t* qs = blk + 2 + 4 * ib;
    const uint32_t qh = blk[66 + ib];
    uint32_t signs;
    std::memcpy(&signs, blk + 34 + 4 * ib, 4);
    SubBlock out;
    out.codes = _mm256_sign_epi8(rows8(g_lattice.iq2_s, qs[0] | (qh & 3) << 8,
                                       qs[1] | (qh & 12) << 6, qs[2] | (qh & 48) << 4,
                                       qs[3] | (qh & 192) << 2),
                                 spread_signs(signs));
    nibble_scales(half_to_float(blk), blk[74 + ib], out.scale);
    return out;
  }
};

// IQ3: eight 4-value rows per sub-block.
inline __m256i rows4(const uint32_t* grid, const uint32_t index[8]) {
  return _mm256_setr_epi32(
      static_cast<int>(grid[index[0]]), static_cast<int>(grid[index[1]]),
      static_cast<int>(grid[index[2]]), static_cast<int>(grid[index[3]]),
      static_cast<int>(grid[index[4]]), static_cast<int>(grid[index[5]]),
      static_cast<int>(grid[index[6]]), static_cast<int>(grid[index[7]]));
}

struct IQ3_XXS {
  static constexpr int64_t kValues = kSuper, kBytes = 98;
  static constexpr bool kDelta = false;
  static SubBlock sub_block(const uint8_t* blk, int ib) {
    const uint8_t* qs = blk + 2 + 8 * ib;
    uint32_t aux;
    std::memcpy(&aux, blk + 66 + 4 * ib, 4);
    const uint32_t index[8] = {qs[0], qs[1], qs[2], qs[3], qs[4], qs[5], qs[6], qs[7]};
    const float db = half_step_scale(half_to_float(blk), aux >> 28, 0.5f);
    return {_mm256_sign_epi8(rows4(g_lattice.iq3_xxs, index), ksigns4(aux)), {db, db}, {}};
  }
};

struct IQ3_S {
  static constexpr int64_t kValues = kSuper, kBytes = 110;
  static constexpr bool kDelta = false;
  static SubBlock sub_block(const uint8_t* blk, int ib) {
    const uint8_t* qs = blk + 2 + 8 * ib;
    const uint32_t qh = blk[66 + ib];
    uint32_t index[8];
    for (int k = 0; k < 8; ++k) index[k] = qs[k] | ((qh >> k) & 1) << 8;
    uint32_t signs;
    std::memcpy(&signs, blk + 74 + 4 * ib, 4);
    const uint32_t s = (blk[106 + ib / 2] >> (4 * (ib % 2))) & 15;
    const float db = half_to_float(blk) * static_cast<float>(1 + 2 * s);
    return {_mm256_sign_epi8(rows4(g_lattice.iq3_s, index), spread_signs(signs)), {db, db}, {}};
  }
};

// IQ1: codes -1, 0, 1 and a delta of +-1/8 added before the scale.
constexpr float kIQ1Delta = 0.125f;

struct IQ1_S {
  static constexpr int64_t kValues = kSuper, kBytes = 50;
  static constexpr bool kDelta = true;
  static SubBlock sub_block(const uint8_t* blk, int ib) {
    const uint8_t* qs = blk + 2 + 4 * ib;
    uint16_t h;
    std::memcpy(&h, blk + 34 + 2 * ib, 2);
    const uint32_t q = h;
    const float dl = half_to_float(blk) * static_cast<float>(2 * ((q >> 12) & 7) + 1);
    const float delta = q & 0x8000 ? -kIQ1Delta : kIQ1Delta;
    return {rows8(g_lattice.iq1_s, qs[0] | (q & 7) << 8, qs[1] | (q & 56) << 5,
                  qs[2] | (q & 448) << 2, qs[3] | (q & 3584) >> 1),
            {dl, dl},
            {delta, delta, delta, delta}};
  }
};

struct IQ1_M {
  static constexpr int64_t kValues = kSuper, kBytes = 56;
  static constexpr bool kDelta = true;
  // d's 16 bits are the top nibbles of the four scale words (the first's lowest).
  static float d(const uint16_t sc[4]) {
    const uint16_t bits = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) |
                                                ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000));
    return _cvtsh_ss(bits);
  }
  static SubBlock sub_block(const uint8_t* blk, int ib) {
    const uint8_t* qs = blk + 4 * ib;
    uint16_t sc[4];
    std::memcpy(sc, blk + 48, 8);
    SubBlock out;
    uint32_t index[4];
    for (int l = 0; l < 4; ++l) {
      const uint32_t nibble = (blk[32 + 2 * ib + l / 2] >> (4 * (l % 2))) & 15;
      index[l] = qs[l] | (nibble & 7) << 8;
      out.delta[l] = nibble & 8 ? -kIQ1Delta : kIQ1Delta;
    }
    out.codes = rows8(g_lattice.iq1_m, index[0], index[1], index[2], index[3]);
    const float dv = d(sc);
    for (int h = 0; h < 2; ++h) {
      const int t = 2 * ib + h;  // the 16-value scale
      out.scale[h] = dv * static_cast<float>(2 * ((sc[t / 4] >> (3 * (t % 4))) & 7) + 1);
    }
    return out;
  }
};

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
  // Values 0-159: digit ib of qs[0..31] (sub-blocks 0-4); 160-239: digit j of qs[32..47] as
  // values 160 + 16 j + i; 240-255: digit j of qh[0..3] as values 240 + 4 j + i.
  static SubBlock sub_block(const uint8_t* blk, int ib) {
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
    const float d = half_to_float(blk + 52);
    return {ternary_digits(bytes, mults), {d, d}, {}};
  }
};

struct TQ2_0 {
  static constexpr int64_t kValues = kSuper, kBytes = 66;
  static constexpr bool kDelta = false;
  static SubBlock sub_block(const uint8_t* blk, int ib) {
    const float d = half_to_float(blk + 64);
    return {_mm256_sub_epi8(two_bit_codes(blk, ib), _mm256_set1_epi8(1)), {d, d}, {}};
  }
};

// NVFP4's UE4M3 scale, halved (gguf.quants' ue4m3_to_fp32): 0 and 0x7F read as 0; exponent
// 0 is subnormal, m * 2^-9; else (1 + m / 8) * 2^(e - 7). Every result is exact in fp32.
inline float ue4m3_half(uint8_t x) {
  if (x == 0 || x == 0x7F) return 0.0f;
  const int e = (x >> 3) & 15, m = x & 7;
  return e == 0 ? std::ldexp(static_cast<float>(m), -10)
                : std::ldexp(static_cast<float>(8 + m), e - 11);
}

struct NVFP4 {
  static constexpr int64_t kValues = 64, kBytes = 36;
  static constexpr bool kDelta = false;
  // Sub-block ib: 16 bytes at 4 + 16 ib, two 16-value groups of 8 bytes each (the low
  // nibbles, then the high ones).
  static SubBlock sub_block(const uint8_t* blk, int ib) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4 + 16 * ib));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256i nibbles =
        _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
    return {lookup16(nibbles, kFP4), {ue4m3_half(blk[2 * ib]), ue4m3_half(blk[2 * ib + 1])}, {}};
  }
};

// --- One row of K values -> fp32 (gguf.quants' dequantize_blocks) ---------------------------

// Per 8 values: scale * code, or scale * (code + delta), each step rounded as numpy does.
template <class Type>
inline void dequant_row_sub_blocks(const uint8_t* row, int64_t K, float* out) {
  constexpr int kSubBlocks = Type::kValues / kBlock;
  for (int64_t b = 0; b < K / Type::kValues; ++b) {
    const uint8_t* blk = row + b * Type::kBytes;
    for (int ib = 0; ib < kSubBlocks; ++ib) {
      const SubBlock sub = Type::sub_block(blk, ib);
      __m256 q[4];
      widen(sub.codes, q);
      float* o = out + b * Type::kValues + kBlock * ib;
      for (int i = 0; i < 4; ++i) {
        __m256 v = q[i];
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
    constexpr int kSubBlocks = Type::kValues / kBlock;
    for (int ib = 0; ib < kSubBlocks; ++ib) {
      const SubBlock sub = Type::sub_block(blk, ib);
      __m256 q[4];
      widen(sub.codes, q);
      if constexpr (Type::kDelta)
        for (int i = 0; i < 4; ++i) q[i] = _mm256_add_ps(q[i], _mm256_set1_ps(sub.delta[i]));
      RowSums<MR>& sums = ib % 2 ? odd : even;
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
  }
};

}  // namespace zllm_gguf

// Bound as set_lattice_tables: the grids of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and
// IQ1_M (each int8 [rows, 8 or 4], by ggml type id) and IQ2_XXS's ksigns (uint8 [128]), from
// gguf.quants (executor/kernels/cpu.py). All at once: the types are served only after.
inline void set_lattice_tables(const std::vector<int64_t>& types,
                               const std::vector<torch::Tensor>& grids,
                               const torch::Tensor& ksigns) {
  using namespace zllm_gguf;
  TORCH_CHECK(types.size() == grids.size(), "one grid per type");
  LatticeTables& t = g_lattice;
  struct Slot {
    int64_t qtype, rows, cols;
    void* out;
  };
  const Slot slots[] = {{kIQ2_XXS, 256, 8, t.iq2_xxs}, {kIQ2_XS, 512, 8, t.iq2_xs},
                        {kIQ2_S, 1024, 8, t.iq2_s},    {kIQ3_XXS, 256, 4, t.iq3_xxs},
                        {kIQ3_S, 512, 4, t.iq3_s},     {kIQ1_S, 2048, 8, t.iq1_s},
                        {kIQ1_M, 2048, 8, t.iq1_m}};
  TORCH_CHECK(types.size() == std::size(slots), "set_lattice_tables takes all ",
              std::size(slots), " lattice grids at once");
  for (const Slot& slot : slots) {
    size_t i = 0;
    while (i < types.size() && types[i] != slot.qtype) ++i;
    TORCH_CHECK(i < types.size(), "no grid for ggml type ", slot.qtype);
    const torch::Tensor& grid = grids[i];
    TORCH_CHECK(grid.scalar_type() == torch::kInt8 && grid.is_contiguous() && grid.dim() == 2 &&
                    grid.size(0) == slot.rows && grid.size(1) == slot.cols,
                "the grid of ggml type ", slot.qtype, " must be contiguous int8 [", slot.rows,
                ", ", slot.cols, "]");
    std::memcpy(slot.out, grid.data_ptr<int8_t>(), slot.rows * slot.cols);
  }
  TORCH_CHECK(ksigns.scalar_type() == torch::kUInt8 && ksigns.is_contiguous() &&
                  ksigns.dim() == 1 && ksigns.size(0) == 128,
              "ksigns must be contiguous uint8 [128]");
  const uint8_t* signs = ksigns.data_ptr<uint8_t>();
  for (int i = 0; i < 128; ++i) {
    uint64_t spread = 0;
    for (int j = 0; j < 8; ++j) spread |= uint64_t{(signs[i] >> j) & 1 ? 0xFFu : 0x01u} << (8 * j);
    t.ksign_bytes[i] = spread;
  }
  g_lattice_ready.store(true);
}
