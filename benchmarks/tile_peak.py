"""What the GGUF panel path's register tile can reach on this machine (issue 20): the ceiling
its prefill matmuls are measured against.

`outer_tile<2, 6>` from csrc/cpu/gguf_linear.cpp (16 input rows x 6 weight rows, twelve
accumulators) is called in a loop over data that stays in L1/L2, as the panel path calls it
(a 64 x K transposed chunk of x, a 12 x K panel), with no dequantization, packing or thread
pool: GFLOP/s on one core, then on every core at once (one OS thread each, the GIL released).

    python benchmarks/tile_peak.py            # ~1 min to build, seconds to run
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from torch.utils.cpp_extension import load_inline

from zllm.executor.kernels.cpu_build import CFLAGS, LDFLAGS

# The float kernel's unit itself (its tiles are not in a header: only that unit instantiates them).
HEADER = Path(__file__).resolve().parents[1] / "csrc" / "cpu" / "gguf_linear.cpp"

SOURCE = f"""
#include <chrono>

#include "{HEADER}"

// Seconds for `iters` passes of 16 x 12 tiles over a 64-row chunk, K deep.
double time_tiles(int64_t K, int64_t iters) {{
  std::vector<float> xt(64 * K, 1.0f), panel(12 * K, 0.5f), y(64 * 12);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it)
    for (int64_t m = 0; m < 64; m += 16)
      for (int64_t j = 0; j < 12; j += 6)
        zllm_gguf::outer_tile<2, 6>(xt.data() + m * K, panel.data() + j * K, K,
                                    y.data() + m * 12 + j, 12, 16, 6);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("time_tiles", &time_tiles, py::call_guard<py::gil_scoped_release>());
}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=640, help="depth (SmolLM2 576, Gemma 3 640)")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=2, help="cores to load at once")
    args = parser.parse_args()
    module = load_inline(
        "zllm_tile_peak",
        cpp_sources=SOURCE,
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        with_pytorch_error_handling=False,
    )
    flops = 2.0 * 64 * 12 * args.k * args.iters
    module.time_tiles(args.k, args.iters // 10)  # warm up
    for _ in range(3):
        one = module.time_tiles(args.k, args.iters)
        seconds: list[float] = []

        def work(into: list[float] = seconds) -> None:
            into.append(module.time_tiles(args.k, args.iters))

        workers = [threading.Thread(target=work) for _ in range(args.threads)]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        wall = time.perf_counter() - start
        print(
            f"K={args.k}: one core {flops / one / 1e9:.1f} GFLOP/s; {args.threads} at once "
            f"{args.threads * flops / wall / 1e9:.1f} GFLOP/s in all "
            f"({', '.join(f'{flops / s / 1e9:.1f}' for s in seconds)} each)"
        )


if __name__ == "__main__":
    main()
