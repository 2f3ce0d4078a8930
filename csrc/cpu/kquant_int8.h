// Q2_K, Q3_K, Q4_K and Q6_K matrices against int8 activation rows, one super-block (256 values) at a
// time with no decode pass: `--quantization gguf-int8`'s kernel for these types, decode and
// prefill (gguf_int8.h's generic path decodes each weight row into codes first).
//
// Why: at one row a decode step is a stream of weight bytes, and the generic path spends
// per 32 values a float conversion, a scale product and an FMA besides the integer dot, plus
// a write and a read of the decoded codes: ~4x the machine's read bandwidth for Llama-1B's
// Q4_K_M (BENCHMARKS.md). Here x is rounded to int8 per 256 values (one scale per
// super-block, as llama.cpp's Q8_K), so the super-block's sub-block scales (6-bit Q4_K,
// int8 Q6_K) multiply integer sums and one float FMA per super-block remains.
//
//   Q4_K: value = d * sc_s * q - dmin * m_s, q in 0..15, s the 32-value sub-block
//     sum_k value_k x_k ~ d * dx * sum_s sc_s sum_{k in s} q_k qx_k - dmin * sum_s m_s X_s
//   Q6_K: value = d * sc_t * c, c = q - 32 in -32..31, t the 16-value sub-block
//     sum_k value_k x_k ~ d * dx * sum_t sc_t sum_{k in t} c_k qx_k
//   Q3_K: the same with c = low 2 bits + 4 * hmask bit - 4 in -4..3 and sc_t = 6 bits - 32
//   Q2_K: value = d * sc_t * q - dmin * m_t, q in 0..3, sc_t and m_t 4 bits, t per 16 values:
//     Q4_K's formula with 16-value sub-blocks (X_t: x's exact sums per 16 values)
// with x_k ~ dx * qx_k (qx int8, dx = max|x| / 127 over the 256 values) and X_s the exact
// fp32 sum of x over sub-block s (the offsets do not round x).
//
// Integer ranges: VPMADDUBSW pairs stay within int16 (Q4_K 2 * 15 * 127, Q6_K's |c| <= 32:
// 2 * 32 * 127; Q3_K's |c| <= 4); VPMADDWD by a scale (< 64, or |int8| <= 128) gives at most ~1.1M a lane and
// a super-block's 8 sub-blocks sum well inside int32.
//
// Two instruction sets, chosen per call by cpu_isa.h: AVX2 (q3_k_row / q4_k_row / q6_k_row, any
// CPU the engine runs on) and AVX-512 F/BW/VL + VNNI (q*_k_rows_avx512, compiled
// per function): the same int32 lane sums and float tail, so the same output bits.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "gguf_dequant.h"
#include "gguf_int8.h"

namespace zllm_kquant {

using namespace zllm_gguf;

constexpr int64_t kQ2_KBytes = 84, kQ3_KBytes = 110, kQ4_KBytes = 144, kQ6_KBytes = 210;

// x rounded to int8 per 256 values, with the exact fp32 sum of every 32 values.
struct QuantizedX256 {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, K / 256]
  std::vector<float> sum32;  // [M, K / 32]
  std::vector<float> sum16;  // [M, K / 16], only for Q2_K (its minima are per 16 values)
};

// kQ4_KPairs: each 128 values' 32-value chunks stored in the order 0, 2, 1, 3, so the AVX-512
// Q4_K loop finds next to each other the chunks that 64 bytes of its codes' low nibbles (and
// high ones) multiply. Else x's own order.
enum class XOrder { kNatural, kQ4_KPairs };

inline QuantizedX256 quantize_x256(const float* x, int64_t M, int64_t ldx, int64_t K,
                                   XOrder order = XOrder::kNatural, bool sum16 = false) {
  static constexpr int kPairs[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  const int64_t blocks = K / kSuper, groups = K / kBlock;
  QuantizedX256 out{std::vector<int8_t>(M * K), std::vector<float>(M * blocks),
                    std::vector<float>(M * groups), std::vector<float>(sum16 ? M * K / 16 : 0)};
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * ldx + b * kSuper;
      __m256 amax = _mm256_setzero_ps();
      bool finite = true;
      for (int g = 0; g < kSuper / kBlock; ++g) {
        __m256 total = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          const __m256 v = _mm256_loadu_ps(xb + kBlock * g + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v));
          total = _mm256_add_ps(total, v);
        }
        const float sum = hsum(total);
        finite = finite && std::isfinite(sum);
        out.sum32[m * groups + b * (kSuper / kBlock) + g] = sum;
        for (int half = 0; sum16 && half < 2; ++half) {
          const float* xh = xb + kBlock * g + 16 * half;
          out.sum16[m * (K / 16) + b * 16 + 2 * g + half] =
              hsum(_mm256_add_ps(_mm256_loadu_ps(xh), _mm256_loadu_ps(xh + 8)));
        }
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      // Below FLT_MIN: zeros (127 / max would overflow). A NaN or infinity makes d NaN, so
      // the output is NaN as the float kernel's would be.
      const float max_abs = _mm_cvtss_f32(h) < FLT_MIN ? 0.0f : _mm_cvtss_f32(h);
      out.d[m * blocks + b] = finite ? max_abs / 127.0f : NAN;
      const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
      for (int g = 0; g < kSuper / kBlock; ++g) {
        __m256i q32[4];
        for (int i = 0; i < 4; ++i)
          q32[i] = _mm256_cvtps_epi32(
              _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + kBlock * g + 8 * i), inv),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // int32 -> int8 in order: the packs interleave 128-bit lanes, a permute undoes it.
        const __m256i q8 = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]),
                               _mm256_packs_epi32(q32[2], q32[3])),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        const int at = order == XOrder::kQ4_KPairs ? kPairs[g] : g;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&out.q[m * K + b * kSuper + kBlock * at]),
                            q8);
      }
    }
  return out;
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Q3_K's 16 scales less 32 (-32..31) as signed bytes, from the 12 packed at p (gguf_lowbit.h's
// q3_k_scales, four at a time in 32-bit lanes): scales 4w .. 4w + 3 take their low nibbles
// from word w % 2's low (w < 2) or high nibbles and their top two bits from bits 2w of word 2.
// In registers: scalar words stored and read back as one vector stall the store forwarding,
// and a 16-byte load would read past the last block's 110 bytes.
inline __m128i q3_k_scales_bytes(const uint8_t* p) {
  int32_t w2;
  std::memcpy(&w2, p + 8, 4);
  const __m128i w = _mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), w2, 2);
  const __m128i low = _mm_and_si128(
      _mm_srlv_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(1, 0, 1, 0)), _mm_setr_epi32(0, 0, 4, 4)),
      _mm_set1_epi8(0x0F));
  const __m128i top = _mm_and_si128(
      _mm_srlv_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(2, 2, 2, 2)), _mm_setr_epi32(0, 2, 4, 6)),
      _mm_set1_epi8(3));
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi32(top, 4)), _mm_set1_epi8(32));
}

// Q4_K's 8 sub-block scales and 8 mins (6 bits each, packed in the 12 bytes at p) as bytes of
// one xmm: scales in bytes 0-7, mins in 8-15, a 32-bit word at a time. Byte s of each word:
// scale s = p[s] & 63 and min s = p[s + 4] & 63 for s < 4; for s = 4 + j, the low four bits
// of p[8 + j] (scale) or its high four (min), with the top two bits of p[j] (scale) or
// p[4 + j] (min) above them. It reads 16 bytes at p (4 of the codes after them, unused), in
// 32-bit lanes (AVX2's VPSRLVD; both instruction sets' Q4_K loops use it).
inline __m128i k_scales_mins_xmm(const uint8_t* p) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));  // w0 w1 w2 -
  // Low six bits (words 0, 2 of the output) or the low/high nibbles of w2 (words 1, 3) ...
  const __m128i low = _mm_and_si128(
      _mm_srlv_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  // ... and for words 1, 3 the top two bits of w0 / w1 to bits 4-5: ((w >> 6) & 3) << 4.
  const __m128i top =
      _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                    _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(low, top);
}

// How far ahead the Q4_K loops ask for their blocks (both instruction sets).
constexpr int64_t kPrefetchBytes = 2048;

// Byte-shuffle controls giving every int16 lane scale s (of 8 int16 scales in each 128-bit
// lane): bytes 2s, 2s + 1, repeated.
struct alignas(32) ScaleWord {
  uint8_t bytes[32];
};
inline constexpr ScaleWord scale_word(int s) {
  ScaleWord w{};
  for (int i = 0; i < 32; ++i) w.bytes[i] = static_cast<uint8_t>(2 * s + i % 2);
  return w;
}
inline constexpr ScaleWord kScaleWords[8] = {scale_word(0), scale_word(1), scale_word(2),
                                             scale_word(3), scale_word(4), scale_word(5),
                                             scale_word(6), scale_word(7)};

// out[i] = row . x_i for MR consecutive x rows from m0.
template <int MR>
inline void q4_k_row(const uint8_t* row, const QuantizedX256& qx, int64_t m0, int64_t K,
                     float* out, int64_t ldy) {
  const int64_t blocks = K / kSuper, groups = K / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MR], offset[MR];  // offset: sum over sub-blocks of dmin * min_s * X_s, by lane s
  for (int i = 0; i < MR; ++i) acc[i] = offset[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kQ4_KBytes;
    for (int line = 0; line < kQ4_KBytes; line += 64)  // (as q4_k_rows_avx512)
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
    // The 8 scales as int16 in both 128-bit lanes, so that one in-lane byte shuffle
    // broadcasts scale s: a shuffle a sub-block instead of a byte's extract, move and
    // broadcast, which held the 1-row loop to a third of the AVX-512 one's bandwidth.
    const __m128i scales_mins = k_scales_mins_xmm(blk + 4);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales_mins));
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    const auto sub_blocks = [&](int c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high ones)
      const __m256i v = load32(blk + 16 + 32 * c);
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      // The shuffles' controls from a table: the rolled loop (3-4 rows) built them from c at
      // run time, scalar ors, a move and a broadcast a step.
      const __m256i sc_lo = _mm256_shuffle_epi8(scales, load32(kScaleWords[2 * c].bytes));
      const __m256i sc_hi = _mm256_shuffle_epi8(scales, load32(kScaleWords[2 * c + 1].bytes));
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = qx.q.data() + (m0 + i) * K + b * kSuper + 64 * c;
        const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(xq)), sc_lo);
        const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(xq + 32)), sc_hi);
        isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(p_lo, p_hi));
      }
    };
    if constexpr (MR <= 2) {
      for (int c = 0; c < 4; ++c) sub_blocks(c);
    } else {
      // Not unrolled: with three or four x rows, GCC's unrolled schedule computes every
      // product of the four sub-block pairs before adding any, more live registers than AVX2
      // has (16), and spills them to the stack; the rolled loop keeps them in registers
      // (kernel_ab.py, AVX2: 4-256 rows 1.09-1.26x; one and two rows are faster unrolled;
      // the Q6_K loop rolled alike gained nothing).
#pragma GCC unroll 1
      for (int c = 0; c < 4; ++c) sub_blocks(c);
    }
    const float d = half_to_float(blk);
    const __m256 mins = _mm256_mul_ps(
        _mm256_set1_ps(half_to_float(blk + 2)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(scales_mins, scales_mins))));
    for (int i = 0; i < MR; ++i) {
      const float dx = qx.d[(m0 + i) * blocks + b];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * dx), acc[i]);
      const __m256 xs = _mm256_loadu_ps(qx.sum32.data() + (m0 + i) * groups + b * 8);
      offset[i] = _mm256_fmadd_ps(mins, xs, offset[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldy] = hsum(acc[i]) - hsum(offset[i]);
}

// Q6_K / Q3_K (signed codes, a scale per 16 values): |c| times x with c's sign, summed in
// pairs and scaled by `scale` (int16 lanes: 16 values' scale each), into rows m0.. of isum;
// xq: x's codes for this group in row m0, the next rows K apart.
template <int MR>
inline void add_signed_group(__m256i codes, __m256i scale, const int8_t* xq, int64_t K,
                             __m256i isum[MR]) {
  const __m256i magnitude = _mm256_abs_epi8(codes);
  for (int i = 0; i < MR; ++i) {
    const __m256i signed_x = _mm256_sign_epi8(load32(xq + i * K), codes);
    const __m256i pairs = _mm256_maddubs_epi16(magnitude, signed_x);
    isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(pairs, scale));
  }
}

// A super-block's integer sums into acc: acc += sums * (d * x's scale for this block).
template <int MR>
inline void add_block_sums(const __m256i sums[MR], float d, const QuantizedX256& qx, int64_t m0,
                           int64_t blocks, int64_t b, __m256 acc[MR]) {
  for (int i = 0; i < MR; ++i) {
    const float dx = qx.d[(m0 + i) * blocks + b];
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]), _mm256_set1_ps(d * dx), acc[i]);
  }
}

// A block's 16 int8 scales (one per 16 values: Q6_K, Q3_K, Q2_K's 0..15) as each 32-value
// group t takes them: its pair, scale 2t for the low 128-bit lane and 2t + 1 for the high one.
// A pass of one x row (decode) widens them to int16 once, 0-7 in both lanes of one register
// and 8-15 of another, so that one in-lane byte shuffle gives a group its pair, and prefetches
// the block ahead as q4_k_row does: two bytes' extract, move and broadcast a group held those
// passes well under their bandwidth (kernel_ab.py, AVX2, in cache: Q6_K 1.22-1.40x, Q3_K
// 1.45x, Q2_K 1.67x). Passes of several rows share that cost, and there the two registers
// cost more than they save (Q6_K: 2 rows 0.81x, 4-16 rows 0.88-0.90x): they keep the bytes.
template <int MR>
struct GroupScales {
  __m256i first, second;         // MR == 1
  alignas(16) int8_t bytes[16];  // MR > 1

  GroupScales(const uint8_t* blk, int64_t block_bytes, __m128i scales) {
    if constexpr (MR == 1) {
      for (int64_t line = 0; line < block_bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
      first = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(scales));
      second = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(scales, 8)));
    } else {
      _mm_store_si128(reinterpret_cast<__m128i*>(bytes), scales);
    }
  }

  __m256i pair(int t) const {
    if constexpr (MR == 1) {
      const int w = 2 * t % 8;  // scale 2t's word in its register: bytes 2w, 2w + 1
      const auto word = [](int k) { return static_cast<int16_t>((2 * k + 1) << 8 | 2 * k); };
      return _mm256_shuffle_epi8(
          t < 4 ? first : second,
          _mm256_setr_m128i(_mm_set1_epi16(word(w)), _mm_set1_epi16(word(w + 1))));
    } else {
      return _mm256_setr_m128i(_mm_set1_epi16(bytes[2 * t]), _mm_set1_epi16(bytes[2 * t + 1]));
    }
  }
};

template <int MR>
inline void q6_k_row(const uint8_t* row, const QuantizedX256& qx, int64_t m0, int64_t K,
                     float* out, int64_t ldy) {
  const int64_t blocks = K / kSuper;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kQ6_KBytes;
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    const GroupScales<MR> scales(
        blk, kQ6_KBytes, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    for (int t = 0; t < 8; ++t)
      add_signed_group<MR>(q6_k_codes(blk, t),  // signed, -32..31
                           scales.pair(t), qx.q.data() + m0 * K + b * kSuper + kBlock * t, K,
                           isum);
    add_block_sums<MR>(isum, half_to_float(blk + 208), qx, m0, blocks, b, acc);
  }
  for (int i = 0; i < MR; ++i) out[i * ldy] = hsum(acc[i]);
}

// As q6_k_row: signed codes, a scale per 16 values.
template <int MR>
inline void q3_k_row(const uint8_t* row, const QuantizedX256& qx, int64_t m0, int64_t K,
                     float* out, int64_t ldy) {
  const int64_t blocks = K / kSuper;
  const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), four = _mm256_set1_epi8(4);
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kQ3_KBytes;
    const GroupScales<MR> scales(blk, kQ3_KBytes, q3_k_scales_bytes(blk + 96));
    const __m256i hmask = load32(blk);
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {  // group t = 4h + j: bits 2j of qs half h, bit t of hmask
      const __m256i low = _mm256_and_si256(
          _mm256_srl_epi16(load32(blk + 32 + 32 * (t / 4)), _mm_cvtsi32_si128(2 * (t % 4))), three);
      const __m256i third = _mm256_slli_epi16(
          _mm256_and_si256(_mm256_srl_epi16(hmask, _mm_cvtsi32_si128(t)), one), 2);
      const __m256i codes = _mm256_sub_epi8(_mm256_or_si256(low, third), four);  // -4..3
      add_signed_group<MR>(codes, scales.pair(t), qx.q.data() + m0 * K + b * kSuper + kBlock * t,
                           K, isum);
    }
    add_block_sums<MR>(isum, half_to_float(blk + 108), qx, m0, blocks, b, acc);
  }
  for (int i = 0; i < MR; ++i) out[i * ldy] = hsum(acc[i]);
}

// Q2_K's 16 scales (bytes 0-15 of sc) and 16 minima times dmin (the two halves of mins).
inline __m128i q2_k_scales(const uint8_t* blk, __m256 mins[2]) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  const __m128i m = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
  const __m256 dmin = _mm256_set1_ps(half_to_float(blk + 82));
  mins[0] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)));
  mins[1] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(m, m))));
  return _mm_and_si128(v, _mm_set1_epi8(0x0F));
}

// As q4_k_row with unsigned 2-bit codes (Q3_K's low bits) and a scale and min per 16 values.
template <int MR>
inline void q2_k_row(const uint8_t* row, const QuantizedX256& qx, int64_t m0, int64_t K,
                     float* out, int64_t ldy) {
  const int64_t blocks = K / kSuper;
  const __m256i three = _mm256_set1_epi8(3);
  __m256 acc[MR], offset[MR];
  for (int i = 0; i < MR; ++i) acc[i] = offset[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kQ2_KBytes;
    __m256 mins[2];
    const GroupScales<MR> scales(blk, kQ2_KBytes, q2_k_scales(blk, mins));  // (0..15)
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {  // group t = 4h + j: bits 2j of qs half h
      const __m256i codes = _mm256_and_si256(
          _mm256_srl_epi16(load32(blk + 16 + 32 * (t / 4)), _mm_cvtsi32_si128(2 * (t % 4))), three);
      const __m256i sc = scales.pair(t);
      for (int i = 0; i < MR; ++i) {
        const __m256i xq = load32(qx.q.data() + (m0 + i) * K + b * kSuper + kBlock * t);
        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), sc));
      }
    }
    const float d = half_to_float(blk + 80);
    for (int i = 0; i < MR; ++i) {
      const float dx = qx.d[(m0 + i) * blocks + b];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * dx), acc[i]);
      const float* xs = qx.sum16.data() + (m0 + i) * (K / 16) + b * 16;
      offset[i] = _mm256_fmadd_ps(mins[0], _mm256_loadu_ps(xs), offset[i]);
      offset[i] = _mm256_fmadd_ps(mins[1], _mm256_loadu_ps(xs + 8), offset[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldy] = hsum(acc[i]) - hsum(offset[i]);
}

// ---- AVX-512 (F/BW/VL + VNNI) variant, taken when the CPU has it (cpu_isa.h) ----
//
// The same integers as the AVX2 rows above, 64 values an instruction: a zmm holds two of the
// AVX2 loop's 32-value steps side by side, VPMADDUBSW makes the same int16 pairs, and
// VPDPWSSD (VNNI) does VPMADDWD by the scale and the int32 add in one. Its int32 lane j of the
// low half sums what the AVX2 lane j sums for the first step, the high half for the second,
// so adding the halves at the end of a super-block gives the AVX2 kernel's 8 lane sums
// exactly (integers, no overflow as above); the float tail is then the AVX2 one, operation
// for operation, so both paths return the same bits. Zen 4 runs a zmm op as two 256-bit
// halves, so the gain is in the instructions not issued: the fused add, one load, mask and
// scale vector per 64 values, and Q6_K's code extraction done once per 64.

// VPERMW indices picking a super-block's scales (int16 lanes of the source): int16 lanes
// 0-7 of the result take scale a, 8-15 b, 16-23 c, 24-31 d. Q4_K (a scale per 32 values)
// repeats two, (s, s, s', s'); Q6_K (per 16) takes four in a row.
ZLLM_TARGET_AVX512 inline __m512i lanes_of(int a, int b, int c, int d) {
  return _mm512_set_epi16(d, d, d, d, d, d, d, d, c, c, c, c, c, c, c, c,  //
                          b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
}

// The 8 lane sums the AVX2 kernel would hold: low half + high half.
ZLLM_TARGET_AVX512 inline __m256i fold_halves(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

template <int MR>
ZLLM_TARGET_AVX512 void q4_k_rows_avx512(const uint8_t* w, int64_t row_bytes,
                                         const QuantizedX256& qx, int64_t m0, int64_t K,
                                         int64_t begin, int64_t end, float* y, int64_t ldy) {
  const int64_t blocks = K / kSuper, groups = K / kBlock;
  const __m512i low = _mm512_set1_epi8(0x0F);
  // Step c's scales: sub-blocks 0, 2 / 1, 3 / 4, 6 / 5, 7 (one per half).
  const __m512i pick[4] = {lanes_of(0, 0, 2, 2), lanes_of(1, 1, 3, 3), lanes_of(4, 4, 6, 6),
                           lanes_of(5, 5, 7, 7)};
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MR], offset[MR];
    for (int i = 0; i < MR; ++i) acc[i] = offset[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * kQ4_KBytes;
      // The hardware prefetcher alone leaves this loop waiting on DRAM: asking for the block
      // kPrefetchBytes ahead (14 blocks; past the matrix's end a prefetch is harmless) took
      // 7-8% off a Llama-1B token's matmuls at one row, 10% at two (BENCHMARKS.md); the
      // Q6_K loop, slower per byte, gained nothing in a first try.
      for (int line = 0; line < kQ4_KBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
      const __m128i scales_mins = k_scales_mins_xmm(blk + 4);
      const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(scales_mins));
      __m512i isum[MR];
      for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        // 64 bytes of codes: their low nibbles are sub-blocks 4j and 4j + 2 (j = c / 2), the
        // high ones 4j + 1 and 4j + 3; x (kQ4_KPairs) holds those pairs as 64 bytes each.
        const __m512i v = _mm512_loadu_si512(blk + 16 + 64 * (c / 2));
        const __m512i codes = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(v, 4) : v, low);
        const __m512i scale = _mm512_permutexvar_epi16(pick[c], sc16);
        for (int i = 0; i < MR; ++i) {
          const __m512i xq =
              _mm512_loadu_si512(qx.q.data() + (m0 + i) * K + b * kSuper + 64 * c);
          isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(codes, xq), scale);
        }
      }
      const float d = half_to_float(blk);
      const __m256 mins = _mm256_mul_ps(
          _mm256_set1_ps(half_to_float(blk + 2)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(scales_mins, scales_mins))));
      for (int i = 0; i < MR; ++i) {
        const float dx = qx.d[(m0 + i) * blocks + b];
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_halves(isum[i])),
                                 _mm256_set1_ps(d * dx), acc[i]);
        const __m256 xs = _mm256_loadu_ps(qx.sum32.data() + (m0 + i) * groups + b * 8);
        offset[i] = _mm256_fmadd_ps(mins, xs, offset[i]);
      }
    }
    for (int i = 0; i < MR; ++i) y[i * ldy + n] = hsum(acc[i]) - hsum(offset[i]);
  }
}

// add_signed_group at 512 bits: x negated where c < 0 (no VPSIGNB at 512 bits); where c = 0
// |c| is 0 and the product 0 either way.
template <int MR>
ZLLM_TARGET_AVX512 inline void add_signed_group_avx512(__m512i codes, __m512i scale,
                                                       const int8_t* xq, int64_t K,
                                                       __m512i isum[MR]) {
  const __m512i magnitude = _mm512_abs_epi8(codes), zero = _mm512_setzero_si512();
  const __mmask64 negative = _mm512_movepi8_mask(codes);
  for (int i = 0; i < MR; ++i) {
    const __m512i x = _mm512_loadu_si512(xq + i * K);
    const __m512i xs = _mm512_mask_sub_epi8(x, negative, zero, x);
    isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(magnitude, xs), scale);
  }
}

template <int MR>
ZLLM_TARGET_AVX512 void q6_k_rows_avx512(const uint8_t* w, int64_t row_bytes,
                                         const QuantizedX256& qx, int64_t m0, int64_t K,
                                         int64_t begin, int64_t end, float* y, int64_t ldy) {
  const int64_t blocks = K / kSuper;
  const __m512i nibble = _mm512_set1_epi8(0x0F), two_bits = _mm512_set1_epi8(3);
  // Groups t = 2p and 2p + 1 (32 values each, a scale per 16): scales 4p .. 4p + 3.
  const __m512i pick[4] = {lanes_of(0, 1, 2, 3), lanes_of(4, 5, 6, 7), lanes_of(8, 9, 10, 11),
                           lanes_of(12, 13, 14, 15)};
  // Group t = 4h + g takes bits 2g, 2g + 1 of the high bytes: g = 0, 1 in the step p = 0
  // of half h, 2, 3 in p = 1.
  const __m512i shift[2] = {
      _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1),
      _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)};
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * kQ6_KBytes;
      const __m512i sc16 = _mm512_castsi256_si512(
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
      __m512i isum[MR];
      for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {  // values 128h .. 128h + 127
        // Their low nibbles: 64 bytes, value r the low nibble of byte r (r < 64) or the high
        // nibble of byte r - 64; their high 2-bit pairs: 32 bytes, read by both halves.
        const __m512i l = _mm512_loadu_si512(blk + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(load32(blk + 128 + 32 * h));
        for (int p = 0; p < 2; ++p) {  // groups 4h + 2p, 4h + 2p + 1
          const __m512i lo4 = _mm512_and_si512(p ? _mm512_srli_epi16(l, 4) : l, nibble);
          const __m512i hi2 = _mm512_and_si512(_mm512_srlv_epi16(qh, shift[p]), two_bits);
          const __m512i codes = _mm512_sub_epi8(
              _mm512_or_si512(lo4, _mm512_slli_epi16(hi2, 4)), _mm512_set1_epi8(32));
          const __m512i scale = _mm512_permutexvar_epi16(pick[2 * h + p], sc16);
          add_signed_group_avx512<MR>(
              codes, scale, qx.q.data() + m0 * K + b * kSuper + 128 * h + 64 * p, K, isum);
        }
      }
      __m256i sums[MR];
      for (int i = 0; i < MR; ++i) sums[i] = fold_halves(isum[i]);
      add_block_sums<MR>(sums, half_to_float(blk + 208), qx, m0, blocks, b, acc);
    }
    for (int i = 0; i < MR; ++i) y[i * ldy + n] = hsum(acc[i]);
  }
}

// int16 lanes 0-15 equal to lo, 16-31 to hi: a shift count per 256-bit half.
ZLLM_TARGET_AVX512 inline __m512i halves(int lo, int hi) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)),
                            _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
}

template <int MR>
ZLLM_TARGET_AVX512 void q3_k_rows_avx512(const uint8_t* w, int64_t row_bytes,
                                         const QuantizedX256& qx, int64_t m0, int64_t K,
                                         int64_t begin, int64_t end, float* y, int64_t ldy) {
  const int64_t blocks = K / kSuper;
  const __m512i three = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
  const __m512i four = _mm512_set1_epi8(4);
  // Step p: groups t = 2p (low half) and 2p + 1 (high half), scales 4p .. 4p + 3.
  const __m512i pick[4] = {lanes_of(0, 1, 2, 3), lanes_of(4, 5, 6, 7), lanes_of(8, 9, 10, 11),
                           lanes_of(12, 13, 14, 15)};
  // Group t = 4h + j: its low bits at shift 2j of qs half h, its third bit at shift t.
  const __m512i low_shift[2] = {halves(0, 2), halves(4, 6)};
  const __m512i bit_shift[4] = {halves(0, 1), halves(2, 3), halves(4, 5), halves(6, 7)};
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * kQ3_KBytes;
      for (int line = 0; line < kQ3_KBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
      const __m512i sc16 =
          _mm512_castsi256_si512(_mm256_cvtepi8_epi16(q3_k_scales_bytes(blk + 96)));
      const __m512i hmask = _mm512_broadcast_i64x4(load32(blk));
      __m512i isum[MR];
      for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i qs = _mm512_broadcast_i64x4(load32(blk + 32 + 32 * h));
        for (int q = 0; q < 2; ++q) {
          const int p = 2 * h + q;
          const __m512i low = _mm512_and_si512(_mm512_srlv_epi16(qs, low_shift[q]), three);
          const __m512i third = _mm512_slli_epi16(
              _mm512_and_si512(_mm512_srlv_epi16(hmask, bit_shift[p]), one), 2);
          const __m512i codes = _mm512_sub_epi8(_mm512_or_si512(low, third), four);
          const __m512i scale = _mm512_permutexvar_epi16(pick[p], sc16);
          add_signed_group_avx512<MR>(codes, scale, qx.q.data() + m0 * K + b * kSuper + 64 * p,
                                      K, isum);
        }
      }
      __m256i sums[MR];
      for (int i = 0; i < MR; ++i) sums[i] = fold_halves(isum[i]);
      add_block_sums<MR>(sums, half_to_float(blk + 108), qx, m0, blocks, b, acc);
    }
    for (int i = 0; i < MR; ++i) y[i * ldy + n] = hsum(acc[i]);
  }
}

template <int MR>
ZLLM_TARGET_AVX512 void q2_k_rows_avx512(const uint8_t* w, int64_t row_bytes,
                                         const QuantizedX256& qx, int64_t m0, int64_t K,
                                         int64_t begin, int64_t end, float* y, int64_t ldy) {
  const int64_t blocks = K / kSuper;
  const __m512i three = _mm512_set1_epi8(3);
  // As q3_k_rows_avx512: step p holds groups 2p and 2p + 1, scales 4p .. 4p + 3.
  const __m512i pick[4] = {lanes_of(0, 1, 2, 3), lanes_of(4, 5, 6, 7), lanes_of(8, 9, 10, 11),
                           lanes_of(12, 13, 14, 15)};
  const __m512i low_shift[2] = {halves(0, 2), halves(4, 6)};
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MR], offset[MR];
    for (int i = 0; i < MR; ++i) acc[i] = offset[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * kQ2_KBytes;
      for (int line = 0; line < kQ2_KBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
      __m256 mins[2];
      const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(q2_k_scales(blk, mins)));
      __m512i isum[MR];
      for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i qs = _mm512_broadcast_i64x4(load32(blk + 16 + 32 * h));
        for (int q = 0; q < 2; ++q) {
          const int p = 2 * h + q;
          const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(qs, low_shift[q]), three);
          const __m512i scale = _mm512_permutexvar_epi16(pick[p], sc16);
          for (int i = 0; i < MR; ++i) {
            const __m512i xq =
                _mm512_loadu_si512(qx.q.data() + (m0 + i) * K + b * kSuper + 64 * p);
            isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(codes, xq), scale);
          }
        }
      }
      const float d = half_to_float(blk + 80);
      for (int i = 0; i < MR; ++i) {
        const float dx = qx.d[(m0 + i) * blocks + b];
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_halves(isum[i])),
                                 _mm256_set1_ps(d * dx), acc[i]);
        const float* xs = qx.sum16.data() + (m0 + i) * (K / 16) + b * 16;
        offset[i] = _mm256_fmadd_ps(mins[0], _mm256_loadu_ps(xs), offset[i]);
        offset[i] = _mm256_fmadd_ps(mins[1], _mm256_loadu_ps(xs + 8), offset[i]);
      }
    }
    for (int i = 0; i < MR; ++i) y[i * ldy + n] = hsum(acc[i]) - hsum(offset[i]);
  }
}

// Rows of x sharing one pass over a weight row (its blocks decoded once for them all): 8 with
// AVX-512 (32 zmm). On AVX2 (16 ymm registers) Q4_K and Q2_K rows hold 3 registers each (sums,
// accumulator, minima) and pass 4; Q6_K and Q3_K rows hold 2 and their codes cost more to
// decode, so they pass 8: the decode and scales shared by twice the rows, the accumulators
// spilled only at block ends (a Zen 3, natively: Q6_K 1.16-1.21x at 8-128 rows, Q3_K
// 1.28-1.39x at 8-64; Q4_K and Q2_K at 8 0.93-1.01x: BENCHMARKS.md "AVX2 on a Zen 3").
constexpr int64_t kMaxRowsAvx512 = 8;
inline int64_t max_rows_avx2(int64_t qtype) {
  return qtype == kQ6_K || qtype == kQ3_K ? 8 : 4;
}
// Weight rows every pass of x rows meets before the next tile: a tile stays in L1/L2 while
// the x rows go over it (16 rows of a Q4_K matrix of K = 8192: 74 KB), so many rows (a
// prefill) read each weight byte from memory once, not once per pass.
constexpr int64_t kTileRows = 16;
// x rows (K int8 bytes each) in play at once: their int8 copy stays in L2 beside the tile.
constexpr int64_t kXBlockBytes = 256 << 10;

bool serves(int64_t qtype) {
  return qtype == kQ2_K || qtype == kQ3_K || qtype == kQ4_K || qtype == kQ6_K;
}

// y rows m0 .. m0 + MR (y points at row m0) for weight rows [begin, end).
template <int MR>
inline void rows_pass(bool vnni, int64_t qtype, const uint8_t* w, int64_t row_bytes,
                      const QuantizedX256& qx, int64_t m0, int64_t K, int64_t begin, int64_t end,
                      float* y, int64_t ldy) {
  if (vnni) {
    const auto rows = qtype == kQ4_K   ? q4_k_rows_avx512<MR>
                      : qtype == kQ6_K ? q6_k_rows_avx512<MR>
                      : qtype == kQ3_K ? q3_k_rows_avx512<MR>
                                       : q2_k_rows_avx512<MR>;
    rows(w, row_bytes, qx, m0, K, begin, end, y, ldy);
    return;
  }
  const auto row_dot = qtype == kQ4_K   ? q4_k_row<MR>
                       : qtype == kQ6_K ? q6_k_row<MR>
                       : qtype == kQ3_K ? q3_k_row<MR>
                                        : q2_k_row<MR>;
  for (int64_t n = begin; n < end; ++n) row_dot(w + n * row_bytes, qx, m0, K, y + n, ldy);
}

// y [M, N] (rows ldy apart) = int8(x) @ W^T for a Q2_K, Q3_K, Q4_K or Q6_K W. Every (row, output) sums
// the same integers in the same order whatever M, so a row's bits do not depend on M.
inline void linear(const float* x, int64_t M, int64_t ldx, const uint8_t* w, int64_t row_bytes,
                   int64_t qtype, int64_t N, int64_t K, float* y, int64_t ldy) {
  const bool vnni = zllm_isa::use_avx512_vnni();
  const QuantizedX256 qx =
      quantize_x256(x, M, ldx, K, vnni && qtype == kQ4_K ? XOrder::kQ4_KPairs : XOrder::kNatural,
                    qtype == kQ2_K);
  // A task takes ~64K weights' rows (decode-sized matmuls are a few million weights).
  const int64_t grain = std::max<int64_t>(1, 65536 / K);
  const int64_t pass = vnni ? kMaxRowsAvx512 : max_rows_avx2(qtype);
  const int64_t x_block = std::max<int64_t>(pass, kXBlockBytes / K / pass * pass);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t mb = 0; mb < M; mb += x_block) {
      const int64_t mb_end = std::min(M, mb + x_block);
      for (int64_t n0 = begin; n0 < end; n0 += kTileRows) {
        const int64_t n1 = std::min(end, n0 + kTileRows);
        for (int64_t m = mb; m < mb_end; m += pass) {
          float* ym = y + m * ldy;
          switch (std::min(pass, mb_end - m)) {
            case 1: rows_pass<1>(vnni, qtype, w, row_bytes, qx, m, K, n0, n1, ym, ldy); break;
            case 2: rows_pass<2>(vnni, qtype, w, row_bytes, qx, m, K, n0, n1, ym, ldy); break;
            case 3: rows_pass<3>(vnni, qtype, w, row_bytes, qx, m, K, n0, n1, ym, ldy); break;
            case 4: rows_pass<4>(vnni, qtype, w, row_bytes, qx, m, K, n0, n1, ym, ldy); break;
            case 5: rows_pass<5>(vnni, qtype, w, row_bytes, qx, m, K, n0, n1, ym, ldy); break;
            case 6: rows_pass<6>(vnni, qtype, w, row_bytes, qx, m, K, n0, n1, ym, ldy); break;
            case 7: rows_pass<7>(vnni, qtype, w, row_bytes, qx, m, K, n0, n1, ym, ldy); break;
            default: rows_pass<8>(vnni, qtype, w, row_bytes, qx, m, K, n0, n1, ym, ldy); break;
          }
        }
      }
    }
  });
}

}  // namespace zllm_kquant
