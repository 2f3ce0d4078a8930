// Small AVX2 helpers shared by the CPU kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace zllm_simd {

// The sum of a vector's 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// An IEEE half at p (GGUF block scales), unaligned, as a float.
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

}  // namespace zllm_simd
