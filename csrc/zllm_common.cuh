// Shared helpers of zllm's CUDA kernels: element types, 16-byte packs, warp reductions.
//
// No CUDA header is included on purpose (not even cuda_fp16.h / cuda_bf16.h): the kernels
// are compiled at run time by NVRTC (through CuPy), which then needs no include path, and
// the same sources also build on a host C++ compiler under csrc/emu/cuda_host_emu.h for the
// CPU-only tests. fp16/bf16 values are carried as raw 16-bit patterns and converted here.
//
// cuda_kernels.py pastes this file in place of its #include line before handing a kernel
// source to NVRTC, so CuPy's compile cache (keyed on the source text) sees header edits.
#pragma once

#ifndef ZLLM_HOST_EMU
#define ZLLM_DEVICE __device__ __forceinline__
#endif

typedef long long zllm_i64;
typedef unsigned short zllm_u16;

// ---- element types ----------------------------------------------------------------------------
// Each tag names the storage type of one element and converts to and from fp32, where all
// arithmetic happens.

struct DtypeF32 {
  typedef float T;
  static ZLLM_DEVICE float to_float(float x) { return x; }
  static ZLLM_DEVICE float from_float(float x) { return x; }
};

struct DtypeF16 {
  typedef zllm_u16 T;
  static ZLLM_DEVICE float to_float(zllm_u16 h) {
#ifdef ZLLM_HOST_EMU
    return zllm_emu_half_to_float(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
  }
  static ZLLM_DEVICE zllm_u16 from_float(float f) {
#ifdef ZLLM_HOST_EMU
    return zllm_emu_float_to_half(f);
#else
    zllm_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
  }
};

struct DtypeBF16 {
  typedef zllm_u16 T;
  // bf16 is the top half of an fp32: widening is a shift, narrowing rounds to nearest even
  // (what torch does), keeping NaN a NaN.
  static ZLLM_DEVICE float to_float(zllm_u16 h) { return __uint_as_float(((unsigned int)h) << 16); }
  static ZLLM_DEVICE zllm_u16 from_float(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (zllm_u16)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (zllm_u16)(u >> 16);
  }
};

// ---- 16-byte packs ----------------------------------------------------------------------------
// Global memory is read in 16-byte units (one LDG.128 per thread): 8 fp16/bf16 or 4 fp32
// elements. Callers guarantee 16-byte alignment (cuda_kernels.py checks it).

struct alignas(16) Pack16 {
  unsigned int w[4];
};

template <typename D>
struct PackTraits {
  static constexpr int kElems = 16 / (int)sizeof(typename D::T);
};

// Unpacks the 16 bytes at `p` into PackTraits<D>::kElems floats.
template <typename D>
ZLLM_DEVICE void load_pack(const typename D::T* p, float* out) {
  const Pack16 pack = *reinterpret_cast<const Pack16*>(p);
  if constexpr (sizeof(typename D::T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __uint_as_float(pack.w[i]);
  } else {
    // Little-endian: element 2i is the low half of word i.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = D::to_float((zllm_u16)(pack.w[i] & 0xffffu));
      out[2 * i + 1] = D::to_float((zllm_u16)(pack.w[i] >> 16));
    }
  }
}

// ---- warp reductions --------------------------------------------------------------------------
// Butterfly (xor) reductions over aligned groups of WIDTH lanes (WIDTH a power of two <= 32);
// every lane of the group ends with the result. All 32 lanes of the warp must call them.

template <int WIDTH>
ZLLM_DEVICE float group_sum(float x) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <int WIDTH>
ZLLM_DEVICE float group_max(float x) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// 64-bit or 32-bit integer arrays (block tables, sequence lengths) behind one pointer, so one
// kernel serves torch's int64 default and compact int32 tables without a conversion copy.
ZLLM_DEVICE zllm_i64 load_index(const void* p, bool is_int64, zllm_i64 i) {
  return is_int64 ? static_cast<const zllm_i64*>(p)[i] : (zllm_i64) static_cast<const int*>(p)[i];
}
