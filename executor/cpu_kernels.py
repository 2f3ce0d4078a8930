"""zllm's CPU kernels (csrc/cpu/), built at first use as a torch C++ extension.

    gguf_linear(x, qweight, ggml_type)   x @ W^T with W in GGUF Q4_1 / Q8_0 blocks   csrc/cpu/gguf_linear.cpp
    gguf_dequantize(qweight, ggml_type, K)   the fp32 values that kernel multiplies by

Built with torch.utils.cpp_extension.load (needs a C++ compiler and ninja, ~35 s on 2 cores),
once per machine: the library is cached under torch's extensions directory
($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) and later processes load it in a
fraction of a second. A build at install time is not used because it would need torch inside
pip's isolated build environment, which pulls the registry's multi-GB CUDA torch.

The kernels run on torch's own OpenMP pool (at::parallel_for; the library links the same
libgomp torch loaded), so they never add threads that compete with torch's for the cores.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC_DIR = Path(os.environ.get("ZLLM_CSRC_DIR") or Path(__file__).resolve().parents[1] / "csrc")
SOURCES = ("cpu/gguf_linear.cpp",)
# -ffp-contract=off: dequantization must compute d*q + m with two roundings, as gguf.quants
# does, so the kernel's weights equal the fp32 reference weights bit for bit.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)

# ggml type ids the kernel reads.
GGML_Q4_1 = 3
GGML_Q8_0 = 8
SUPPORTED_GGML_TYPES = (GGML_Q4_1, GGML_Q8_0)


class CpuKernelError(RuntimeError):
    """The CPU kernels cannot be built or cannot run on this machine."""


def cpu_supports_kernels() -> bool:
    """AVX2, FMA and F16C, which the kernels are compiled for."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((line for line in flags.splitlines() if line.startswith("flags")), "")
    return all(f in line.split() for f in ("avx2", "fma", "f16c"))


@functools.cache
def load() -> ModuleType:
    """The compiled extension; builds it on first use. Raises CpuKernelError when it can't."""
    if not cpu_supports_kernels():
        raise CpuKernelError("the CPU kernels need an x86-64 CPU with AVX2, FMA and F16C")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise CpuKernelError("the CPU kernels need a C++ compiler (c++ on PATH, or $CXX)")
    from torch.utils import cpp_extension

    sources = [str(CSRC_DIR / s) for s in SOURCES]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise CpuKernelError(f"kernel sources not found: {missing} (set ZLLM_CSRC_DIR)")
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name="zllm_cpu_kernels",
            sources=sources,
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            verbose=False,
        )
    except Exception as exc:  # compiler errors, missing ninja, ...
        raise CpuKernelError(f"building the CPU kernels failed: {exc}") from exc
    elapsed = time.perf_counter() - start
    if elapsed > 2:
        logger.info("Built the CPU kernels (csrc/cpu) in %.1f s", elapsed)
    return module


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """x [M, K] fp32 @ dequantize(qweight [N, row bytes])^T -> [M, N] fp32."""
    return load().gguf_linear(x, qweight, ggml_type)


def gguf_dequantize(qweight: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    return load().gguf_dequantize(qweight, ggml_type, in_features)


if __name__ == "__main__":  # python -m zllm.executor.cpu_kernels: build now (e.g. in CI)
    logging.basicConfig(level=logging.INFO)
    load()
    print("zllm CPU kernels ready")
