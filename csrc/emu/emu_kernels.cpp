// ctypes entry point of the host emulator (see cuda_host_emu.h): launches one of zllm's
// kernels by the name cuda_kernels.py hands NVRTC, with its arguments passed the way
// cuLaunchKernel takes them (an array of pointers to each argument's value).
//
//   g++ -std=c++17 -O1 -ffp-contract=off -shared -fPIC -o emu_kernels.so emu_kernels.cpp
#include <cstring>
#include <map>
#include <string>

#include "cuda_host_emu.h"

#include "../block_gemv.cu"
#include "../kv_cache.cu"
#include "../layer_ops.cu"
#include "../moe_experts.cu"
#include "../paged_attention.cu"
#include "../paged_prefill.cu"
#include "../state_layers.cu"

namespace {

using Args = void* const*;
using Runner = void (*)(void*);

template <typename T>
T arg(Args a, int i) {
  T value;
  std::memcpy(&value, a[i], sizeof(T));
  return value;
}

template <void (*Kernel)(const typename DtypeF32::T*, const float*, float*, const zllm_i64*,
                         zllm_i64, zllm_i64, zllm_i64, zllm_i64, int, int, zllm_i64, int)>
void run_write_f32(void* p) {
  Args a = static_cast<Args>(p);
  Kernel(arg<const float*>(a, 0), arg<const float*>(a, 1), arg<float*>(a, 2),
         arg<const zllm_i64*>(a, 3), arg<zllm_i64>(a, 4), arg<zllm_i64>(a, 5),
         arg<zllm_i64>(a, 6), arg<zllm_i64>(a, 7), arg<int>(a, 8), arg<int>(a, 9),
         arg<zllm_i64>(a, 10), arg<int>(a, 11));
}

template <void (*Kernel)(const zllm_u16*, const zllm_u16*, zllm_u16*, const zllm_i64*, zllm_i64,
                         zllm_i64, zllm_i64, zllm_i64, int, int, zllm_i64, int)>
void run_write_u16(void* p) {
  Args a = static_cast<Args>(p);
  Kernel(arg<const zllm_u16*>(a, 0), arg<const zllm_u16*>(a, 1), arg<zllm_u16*>(a, 2),
         arg<const zllm_i64*>(a, 3), arg<zllm_i64>(a, 4), arg<zllm_i64>(a, 5),
         arg<zllm_i64>(a, 6), arg<zllm_i64>(a, 7), arg<int>(a, 8), arg<int>(a, 9),
         arg<zllm_i64>(a, 10), arg<int>(a, 11));
}

template <typename D, int HEAD_DIM, int GROUP>
void run_decode(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_paged_decode<D, HEAD_DIM, GROUP>(
      arg<T*>(a, 0), arg<float*>(a, 1), arg<float*>(a, 2), arg<float*>(a, 3),
      arg<const T*>(a, 4), arg<zllm_i64>(a, 5), arg<zllm_i64>(a, 6), arg<const T*>(a, 7),
      arg<zllm_i64>(a, 8), arg<const void*>(a, 9), arg<int>(a, 10), arg<zllm_i64>(a, 11),
      arg<const void*>(a, 12), arg<int>(a, 13), arg<int>(a, 14), arg<int>(a, 15),
      arg<int>(a, 16), arg<int>(a, 17), arg<int>(a, 18), arg<float>(a, 19), arg<int>(a, 20),
      arg<int>(a, 21), arg<const float*>(a, 22));
}

template <typename D>
void run_reduce(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_paged_decode_reduce<D>(arg<T*>(a, 0), arg<const float*>(a, 1), arg<const float*>(a, 2),
                              arg<const float*>(a, 3), arg<const void*>(a, 4), arg<int>(a, 5),
                              arg<int>(a, 6), arg<int>(a, 7), arg<int>(a, 8), arg<int>(a, 9),
                              arg<int>(a, 10), arg<const float*>(a, 11));
}

template <typename D, int HEAD_DIM>
void run_prefill(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_paged_prefill<D, HEAD_DIM>(
      arg<T*>(a, 0), arg<const T*>(a, 1), arg<zllm_i64>(a, 2), arg<zllm_i64>(a, 3),
      arg<const T*>(a, 4), arg<zllm_i64>(a, 5), arg<const void*>(a, 6), arg<int>(a, 7),
      arg<zllm_i64>(a, 8), arg<const int*>(a, 9), arg<const int*>(a, 10), arg<int>(a, 11),
      arg<int>(a, 12), arg<int>(a, 13), arg<float>(a, 14), arg<int>(a, 15),
      arg<const float*>(a, 16));
}

template <typename D>
void run_rms_norm(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_rms_norm<D>(arg<T*>(a, 0), arg<T*>(a, 1), arg<const T*>(a, 2), arg<zllm_i64>(a, 3),
                   arg<const T*>(a, 4), arg<const T*>(a, 5), arg<int>(a, 6), arg<float>(a, 7));
}

template <typename D>
void run_rope(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_rope<D>(arg<T*>(a, 0), arg<zllm_i64>(a, 1), arg<zllm_i64>(a, 2), arg<int>(a, 3),
               arg<int>(a, 4), arg<const T*>(a, 5), arg<const T*>(a, 6), arg<zllm_i64>(a, 7));
}

template <typename D>
void run_rope_cache(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_rope_cache<D>(arg<T*>(a, 0), arg<zllm_i64>(a, 1), arg<zllm_i64>(a, 2), arg<int>(a, 3),
                     arg<int>(a, 4), arg<int>(a, 5), arg<int>(a, 6), arg<const T*>(a, 7),
                     arg<const T*>(a, 8), arg<zllm_i64>(a, 9), arg<const T*>(a, 10),
                     arg<zllm_i64>(a, 11), arg<zllm_i64>(a, 12), arg<T*>(a, 13),
                     arg<const zllm_i64*>(a, 14), arg<zllm_i64>(a, 15));
}

template <typename D>
void run_silu_mul(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_silu_mul<D>(arg<T*>(a, 0), arg<const T*>(a, 1), arg<zllm_i64>(a, 2), arg<int>(a, 3));
}

template <typename D>
void run_moe_gemv(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_moe_gemv<D>(arg<T*>(a, 0), arg<const T*>(a, 1), arg<zllm_i64>(a, 2), arg<int>(a, 3),
                   arg<const T*>(a, 4), arg<const T*>(a, 5), arg<const zllm_i64*>(a, 6),
                   arg<const zllm_i64*>(a, 7), arg<const zllm_i64*>(a, 8), arg<int>(a, 9),
                   arg<int>(a, 10));
}

#define MOE(D) {"zllm_moe_gemv<" #D ">", &run_moe_gemv<D>}

template <typename D, int TYPE>
void run_block_gemv(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_block_gemv<D, TYPE>(arg<T*>(a, 0), arg<zllm_i64>(a, 1), arg<const T*>(a, 2),
                           arg<zllm_i64>(a, 3), arg<int>(a, 4), arg<const unsigned char*>(a, 5),
                           arg<zllm_i64>(a, 6), arg<int>(a, 7), arg<int>(a, 8));
}

template <typename D, int TYPE>
void run_block_dequant(void* p) {
  using T = typename D::T;
  Args a = static_cast<Args>(p);
  zllm_block_dequant<D, TYPE>(arg<T*>(a, 0), arg<const unsigned char*>(a, 1), arg<zllm_i64>(a, 2),
                              arg<int>(a, 3), arg<int>(a, 4));
}

#define BLOCK_TYPE(D, TYPE)                                                      \
  {"zllm_block_gemv<" #D ", " #TYPE ">", &run_block_gemv<D, TYPE>},               \
      {"zllm_block_dequant<" #D ", " #TYPE ">", &run_block_dequant<D, TYPE>}
#define BLOCKS(D) BLOCK_TYPE(D, 2), BLOCK_TYPE(D, 3), BLOCK_TYPE(D, 8), BLOCK_TYPE(D, 100)

#define LAYER_OPS(D)                                                             \
  {"zllm_rms_norm<" #D ">", &run_rms_norm<D>}, {"zllm_rope<" #D ">", &run_rope<D>}, \
      {"zllm_rope_cache<" #D ">", &run_rope_cache<D>},                               \
      {"zllm_silu_mul<" #D ">", &run_silu_mul<D>}

#define DECODE(D, HD, G) {"zllm_paged_decode<" #D ", " #HD ", " #G ">", &run_decode<D, HD, G>}
#define DECODE_GROUPS(D, HD) DECODE(D, HD, 1), DECODE(D, HD, 2), DECODE(D, HD, 4), DECODE(D, HD, 8)
#define DECODE_DTYPE(D)                                                                      \
  DECODE_GROUPS(D, 64), DECODE_GROUPS(D, 80), DECODE_GROUPS(D, 128), DECODE_GROUPS(D, 256), \
      {"zllm_paged_decode_reduce<" #D ">", &run_reduce<D>}

void run_conv_decode(void* p) {
  Args a = static_cast<Args>(p);
  zllm_causal_conv_decode(arg<float*>(a, 0), arg<const float*>(a, 1), arg<float*>(a, 2),
                          arg<const zllm_i64*>(a, 3), arg<const float*>(a, 4),
                          arg<const float*>(a, 5), arg<zllm_i64>(a, 6), arg<int>(a, 7),
                          arg<int>(a, 8));
}

void run_gated_delta_decode(void* p) {
  Args a = static_cast<Args>(p);
  zllm_gated_delta_decode(arg<float*>(a, 0), arg<const float*>(a, 1), arg<const float*>(a, 2),
                          arg<const float*>(a, 3), arg<const float*>(a, 4),
                          arg<const float*>(a, 5), arg<float*>(a, 6), arg<const zllm_i64*>(a, 7),
                          arg<zllm_i64>(a, 8), arg<int>(a, 9), arg<int>(a, 10), arg<int>(a, 11),
                          arg<int>(a, 12), arg<int>(a, 13));
}

void run_mamba2_decode(void* p) {
  Args a = static_cast<Args>(p);
  zllm_mamba2_decode(arg<float*>(a, 0), arg<const float*>(a, 1), arg<const float*>(a, 2),
                     arg<const float*>(a, 3), arg<const float*>(a, 4), arg<const float*>(a, 5),
                     arg<const float*>(a, 6), arg<float*>(a, 7), arg<const zllm_i64*>(a, 8),
                     arg<zllm_i64>(a, 9), arg<int>(a, 10), arg<int>(a, 11), arg<int>(a, 12),
                     arg<int>(a, 13));
}

#define PREFILL(D, HD) {"zllm_paged_prefill<" #D ", " #HD ">", &run_prefill<D, HD>}
#define PREFILL_DTYPE(D) PREFILL(D, 64), PREFILL(D, 80), PREFILL(D, 128), PREFILL(D, 256)

const std::map<std::string, Runner>& registry() {
  static const std::map<std::string, Runner> kernels = {
      {"zllm_write_kv_cache_f32", &run_write_f32<zllm_write_kv_cache_f32>},
      {"zllm_write_kv_cache_f16", &run_write_u16<zllm_write_kv_cache_f16>},
      {"zllm_write_kv_cache_bf16", &run_write_u16<zllm_write_kv_cache_bf16>},
      DECODE_DTYPE(DtypeF32),
      DECODE_DTYPE(DtypeF16),
      DECODE_DTYPE(DtypeBF16),
      PREFILL_DTYPE(DtypeF32),
      PREFILL_DTYPE(DtypeF16),
      PREFILL_DTYPE(DtypeBF16),
      LAYER_OPS(DtypeF32),
      LAYER_OPS(DtypeF16),
      LAYER_OPS(DtypeBF16),
      MOE(DtypeF32),
      MOE(DtypeF16),
      MOE(DtypeBF16),
      BLOCKS(DtypeF32),
      BLOCKS(DtypeF16),
      BLOCKS(DtypeBF16),
      {"zllm_causal_conv_decode", &run_conv_decode},
      {"zllm_gated_delta_decode", &run_gated_delta_decode},
      {"zllm_mamba2_decode", &run_mamba2_decode},
  };
  return kernels;
}

}  // namespace

// Returns 0, or -1 when `name` is not a kernel this library was built with.
extern "C" int zllm_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,
                               unsigned bx, unsigned by, unsigned bz, void** args) {
  const auto& kernels = registry();
  const auto it = kernels.find(name);
  if (it == kernels.end()) return -1;
  zllm_emu::launch(dim3{gx, gy, gz}, dim3{bx, by, bz}, it->second, args);
  return 0;
}
