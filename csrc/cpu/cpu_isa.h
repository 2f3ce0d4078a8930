// Which instruction set the kernels with a wider variant use, chosen once at run time.
//
// Why: the extension is compiled for AVX2 (executor/kernels/cpu.py's CFLAGS) so it runs on any
// x86-64 CPU the engine supports, but CPUs with AVX-512 VNNI (Zen 4, Ice Lake and later) sum
// int8 products twice as wide and fuse the int16 -> int32 step. Functions using it are
// compiled per function (ZLLM_TARGET_AVX512) and called only when this says so.
//
// $ZLLM_CPU_ISA=avx2 (read at first use) or set_cpu_isa("avx2") forces the AVX2 code on any
// CPU: the tests compare both paths on one machine, and A/B timings can run either. "auto",
// the default, takes AVX-512 VNNI where the CPU has it.

#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#define ZLLM_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace zllm_isa {

enum Isa : int { kAvx2 = 0, kAvx512Vnni = 1 };

// F and BW for 512-bit byte/word arithmetic, VL for the 256-bit forms of it, VNNI for
// VPDPWSSD. libgcc's check includes the OS saving the zmm state (XCR0), not just CPUID.
inline bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// "avx2" forces AVX2, "avx512vnni" AVX-512 VNNI (false where the CPU lacks it); "auto" (or
// empty) takes the best the CPU has. False for anything else.
inline bool isa_from_name(const std::string& name, int* isa) {
  if (name == "avx2") {
    *isa = kAvx2;
    return true;
  }
  if (name == "avx512vnni") {
    *isa = kAvx512Vnni;
    return cpu_has_avx512_vnni();
  }
  if (name.empty() || name == "auto") {
    *isa = cpu_has_avx512_vnni() ? kAvx512Vnni : kAvx2;
    return true;
  }
  return false;
}

// The choice, initialised from $ZLLM_CPU_ISA on first use (executor/kernels/cpu.py rejects an
// unknown or unsupported value before any kernel runs; here one falls back to "auto").
inline std::atomic<int>& isa_choice() {
  static std::atomic<int> choice([] {
    const char* env = std::getenv("ZLLM_CPU_ISA");
    int isa = kAvx2;
    if (!isa_from_name(env ? env : "", &isa)) isa_from_name("auto", &isa);
    return isa;
  }());
  return choice;
}

inline bool use_avx512_vnni() {
  return isa_choice().load(std::memory_order_relaxed) == kAvx512Vnni;
}

inline const char* isa_name(int isa) { return isa == kAvx512Vnni ? "avx512vnni" : "avx2"; }

}  // namespace zllm_isa
