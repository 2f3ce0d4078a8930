// A tiny CUDA emulator for the CPU-only tests: runs zllm's kernel sources on the host so
// their indexing, shared memory, barriers and warp shuffles can be checked against a
// reference on machines without a GPU. It emulates only what zllm's kernels use.
//
// Each thread block runs on its own, its CUDA threads as cooperative fibers (ucontext) that
// switch only at synchronisation points:
//
//   __syncthreads()     a barrier over the block's threads
//   __shfl_xor_sync     the warp's lanes publish into exchange slots between two warp barriers
//   __shared__          `static`: blocks run one at a time, so one copy serves each block
//
// A fiber that returns leaves its barriers, as an exited GPU thread does; a block whose
// fibers all wait forever (a barrier some threads never reach) aborts with a message.
#pragma once

#define ZLLM_HOST_EMU 1

#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define ZLLM_DEVICE inline
#define __global__
#define __device__
#define __host__
#define __forceinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

// One emulated thread runs at a time, so plain globals serve as the built-in variables.
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace zllm_emu {

struct Barrier {
  int expected = 0;
  int arrived = 0;
  unsigned generation = 0;
};

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  dim3 tid;
  Barrier* waiting = nullptr;  // the barrier it sleeps on, until its generation moves
  unsigned waiting_generation = 0;
  bool done = false;
};

struct Block {
  std::vector<Fiber> fibers;
  Barrier sync;
  std::vector<Barrier> warps;
  std::vector<float> lanes;  // shuffle exchange, one slot per thread
  ucontext_t scheduler;
  int running = -1;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
};

inline Block* current = nullptr;

inline int linear_tid() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

inline void release_if_full(Barrier& b) {
  if (b.arrived >= b.expected) {
    b.arrived = 0;
    ++b.generation;
  }
}

inline void arrive_and_wait(Barrier& b) {
  Fiber& self = current->fibers[current->running];
  ++b.arrived;
  const unsigned generation = b.generation;
  release_if_full(b);
  if (b.generation != generation) return;  // the last to arrive goes straight on
  self.waiting = &b;
  self.waiting_generation = generation;
  swapcontext(&self.context, &current->scheduler);
}

inline void fiber_main() {
  Block& block = *current;
  const int t = block.running;
  block.body(block.body_arg);
  // Exited: leave the barriers so the others are not waiting for this thread.
  Fiber& self = block.fibers[t];
  self.done = true;
  --block.sync.expected;
  release_if_full(block.sync);
  Barrier& warp = block.warps[t / 32];
  --warp.expected;
  release_if_full(warp);
  swapcontext(&self.context, &block.scheduler);
}

inline void run_block(Block& block, dim3 block_dim) {
  const int n = (int)block.fibers.size();
  for (int t = 0; t < n; ++t) {
    Fiber& f = block.fibers[t];
    f.tid = {t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y)};
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_main, 0);
  }
  int remaining = n;
  while (remaining > 0) {
    bool progressed = false;
    for (int t = 0; t < n; ++t) {
      Fiber& f = block.fibers[t];
      if (f.done) continue;
      if (f.waiting != nullptr) {
        if (f.waiting->generation == f.waiting_generation) continue;
        f.waiting = nullptr;
      }
      block.running = t;
      threadIdx = f.tid;
      swapcontext(&block.scheduler, &f.context);
      progressed = true;
      if (f.done) --remaining;
    }
    if (!progressed) {
      std::fprintf(stderr, "cuda_host_emu: deadlock in block (%u, %u, %u)\n", blockIdx.x,
                   blockIdx.y, blockIdx.z);
      std::abort();
    }
  }
}

// Runs body(arg) (a call of the __global__ function) for every thread of the grid.
inline void launch(dim3 grid, dim3 block_dim, void (*body)(void*), void* arg) {
  const int n = block_dim.x * block_dim.y * block_dim.z;
  Block block;
  block.fibers.resize(n);
  for (Fiber& f : block.fibers) f.stack.resize(256 * 1024);
  block.lanes.resize(n);
  block.body = body;
  block.body_arg = arg;
  blockDim = block_dim;
  gridDim = grid;
  current = &block;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = {bx, by, bz};
        block.sync = Barrier{n, 0, 0};
        block.warps.assign((n + 31) / 32, Barrier{});
        for (int w = 0; w * 32 < n; ++w) block.warps[w].expected = n - w * 32 < 32 ? n - w * 32 : 32;
        for (Fiber& f : block.fibers) {
          f.done = false;
          f.waiting = nullptr;
        }
        run_block(block, block_dim);
      }
  current = nullptr;
}

}  // namespace zllm_emu

inline void __syncthreads() { zllm_emu::arrive_and_wait(zllm_emu::current->sync); }

inline float __shfl_xor_sync(unsigned /*mask*/, float x, int offset) {
  zllm_emu::Block& b = *zllm_emu::current;
  const int t = zllm_emu::linear_tid();
  b.lanes[t] = x;
  zllm_emu::arrive_and_wait(b.warps[t / 32]);
  const float y = b.lanes[(t - t % 32) + ((t % 32) ^ offset)];
  zllm_emu::arrive_and_wait(b.warps[t / 32]);  // no slot is overwritten before it is read
  return y;
}

// Multiply without contraction into a fused multiply-add (the host compiler is built with
// -ffp-contract=off by the emulator's build line, so a plain product is already one).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float zllm_emu_half_to_float(unsigned short h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
}
inline unsigned short zllm_emu_float_to_half(float f) {
  const _Float16 x = (_Float16)f;
  unsigned short h;
  std::memcpy(&h, &x, 2);
  return h;
}
