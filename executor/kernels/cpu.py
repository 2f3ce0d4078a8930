"""zllm's CPU kernels (csrc/cpu/), a torch C++ extension compiled at install or at first use.

    dense_linear(x, w[, bias])                x @ W^T, fp32 W (1-8 rows)            csrc/cpu/dense_rows.h
    gguf_linear(x, qweight, ggml_type)        x @ W^T, W in GGUF blocks           csrc/cpu/gguf_linear.cpp
    gguf_linear_into(x, qweight, ggml_type, y)    the same, into a column slice of y
    gguf_linear_int8(x, qweight, ggml_type[, y])  x rounded to int8 per 32 values   csrc/cpu/gguf_int8.cpp
    gguf_linear_bf16_into(x16, qweight, ggml_type, y)  bf16 GEMM over panels of W   csrc/cpu/gguf_gemm.cpp
    gguf_dequantize(qweight, ggml_type, K)    the fp32 values that kernel multiplies by
    set_lattice_tables(types, grids, ksigns)  gguf-py's IQ1-IQ3 grids, handed over by load()
                                              (hand_lattice_tables)          csrc/cpu/gguf_lattice.h
    cpu_isa(), set_cpu_isa(name)              AVX-512 VNNI or AVX2 for the kernels with both
                                              ($ZLLM_CPU_ISA)                  csrc/cpu/cpu_isa.h
    paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale[, window, sinks])
                                              one new token per sequence       csrc/cpu/paged_attention.h
    rms_norm_rows, rope_rows_, gated_activation_rows   a layer's row-wise ops  csrc/cpu/row_ops.h
                                              (executor/kernels/cpu_layer_ops.py)
    DecodeStack, FusedMatmul                  a whole decode step's layers     csrc/cpu/decode_stack.h
                                              in one call (executor/graphs/fused_decode.py)

csrc/cpu/ops.cpp binds them; each kernel is its own translation unit (csrc/cpu/ops.h names
them), compiled in parallel with only the ATen headers it needs.

Built at install (`pip install -e .` with torch already installed: setup.py runs
executor/kernels/cpu_build.py, which puts the library in executor/kernels/prebuilt/), or else
at first use (torch.utils.cpp_extension.load: a C++ compiler and ninja, ~1 min on 2 cores),
once per machine: then the library is cached under torch's extensions directory
($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Either way it is named after the
sources, flags and torch version (cpu_build.library_name), so a library found is this build,
and a later process imports it in a fraction of a second. The instruction set is chosen at
run time (cpu_isa.h): a library built on one x86-64 machine runs on another.

The kernels run on torch's own OpenMP pool (at::parallel_for; the library links the same
libgomp torch loaded), so they never add threads that compete with torch's for the cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import gguf.quants as gguf_quants
import numpy as np
import torch

from zllm.executor.kernels import cpu_build
from zllm.executor.kernels.csrc_dir import CSRC_DIR
from zllm.model.progress import Progress

logger = logging.getLogger(__name__)

# ggml type ids the kernel reads in their blocks: the types llama.cpp's presets write (Q4_K_M,
# for one, holds Q4_K, Q6_K, Q5_0 and Q8_0 matrices; Q3_K_M Q3_K, Q4_K, Q5_K; the IQ presets
# their IQ1-IQ3 matrices beside IQ4_XS or IQ4_NL ones; the ternary presets TQ1_0/TQ2_0;
# gpt-oss MXFP4), NVFP4, and 16-bit weights (F16/BF16 files, the matrices of bf16/fp16
# checkpoints), widened to fp32 in registers. Every type gguf-py dequantizes but F32.
FP8_E4M3 = 100
SUPPORTED_GGML_TYPES = {
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
    40: "NVFP4",
}
# Every block type the kernel reads: GGUF's, and zllm's own FP8_E4M3 (no GGUF type: an fp8
# checkpoint's e4m3 values, 32 with their fp16 scale in Q8_0's 34-byte layout;
# executor/weights/quantized/to_blocks.py).
KERNEL_TYPES = {**SUPPORTED_GGML_TYPES, FP8_E4M3: "FP8_E4M3"}
# The lattice types' codebooks (csrc/cpu/gguf_lattice.h): the grids of these types and
# IQ2_XXS's ksigns are the GGUF format's constants, owned by gguf-py, whose dequantizer the
# kernel matches bit for bit. load() hands them to the library once per process
# (set_lattice_tables) rather than the C++ keeping a copy that could drift from gguf-py's.
LATTICE_GRIDS = {t: SUPPORTED_GGML_TYPES[t] for t in (16, 17, 22, 18, 21, 19, 29)}
# The types gguf_linear_int8 reads (integer dots: csrc/cpu/gguf_int8.cpp). 16-bit weights keep
# float dots, and so do the low-bit types under gguf-int8 (IQ4_NL, IQ4_XS, MXFP4, the IQ1-IQ3,
# TQ and NVFP4 types: no integer path yet, they take the float kernel); Q2_K and Q3_K have one
# (csrc/cpu/kquant_int8.h).
INT8_GGML_TYPES = frozenset({2, 3, 6, 7, 8, 10, 11, 12, 13, 14})


# $ZLLM_CPU_ISA: "avx2" forces the AVX2 code where an AVX-512 VNNI variant exists (tests
# and A/B timings of both paths on one machine), "avx512vnni" the variant (refused on a CPU
# without it); "auto" (the default) takes the best the CPU has. The library reads it at
# first use; set_cpu_isa changes it in a running process.
CPU_ISA_CHOICES = ("auto", "avx2", "avx512vnni")
AVX512_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # /proc/cpuinfo's names


def enabled() -> bool:
    """False when $ZLLM_CPU_KERNELS is 0: the engine then picks no kernel by itself (an
    explicit --quantization gguf still builds them). For A/B measurements and debugging."""
    return os.environ.get("ZLLM_CPU_KERNELS", "1") != "0"


class CpuKernelError(RuntimeError):
    """The CPU kernels cannot be built or cannot run on this machine."""


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split())


def cpu_supports_kernels() -> bool:
    """AVX2, FMA and F16C, which the kernels are compiled for."""
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def cpu_has_avx512_vnni() -> bool:
    """AVX-512 F/BW/VL and VNNI, which the kernels' wider variants use (the library asks the
    CPU itself, cpu_isa(); Linux lists a feature only where the OS saves its registers)."""
    return set(AVX512_VNNI_FLAGS) <= cpu_flags()


@functools.cache
def load() -> ModuleType:
    """The compiled extension, given gguf-py's lattice tables; builds it on first use. Raises
    CpuKernelError when it can't."""
    module = _load_library()
    hand_lattice_tables(module)
    return module


def hand_lattice_tables(module: ModuleType) -> None:
    """Give the library gguf-py's lattice grids (int8: every value is a small integer) and
    IQ2_XXS's ksigns; until then it refuses those types."""
    types, grids = [], []
    for ggml_type, name in LATTICE_GRIDS.items():
        quant = getattr(gguf_quants, name)
        quant.init_grid()
        values = np.asarray(quant.grid, dtype=np.float32).reshape(quant.grid_shape)
        as_int8 = values.astype(np.int8)
        if not np.array_equal(as_int8, values):
            raise CpuKernelError(f"gguf-py's {name} grid holds values that are not int8")
        types.append(ggml_type)
        grids.append(torch.from_numpy(np.ascontiguousarray(as_int8)))
    ksigns = torch.frombuffer(bytearray(gguf_quants.IQ2_XXS.ksigns), dtype=torch.uint8)
    module.set_lattice_tables(types, grids, ksigns)


def _load_library() -> ModuleType:
    """The extension as built (or found built) for these sources and flags."""
    if not cpu_supports_kernels():
        raise CpuKernelError("the CPU kernels need an x86-64 CPU with AVX2, FMA and F16C")
    isa = os.environ.get("ZLLM_CPU_ISA", "auto") or "auto"
    if isa not in CPU_ISA_CHOICES:
        raise CpuKernelError(f"ZLLM_CPU_ISA={isa!r}: expected one of {CPU_ISA_CHOICES}")
    if isa == "avx512vnni" and not cpu_has_avx512_vnni():
        raise CpuKernelError("ZLLM_CPU_ISA=avx512vnni: this CPU lacks AVX-512 F/BW/VL or VNNI")
    if not (CSRC_DIR / "cpu").is_dir():
        raise CpuKernelError(f"kernel sources not found in {CSRC_DIR} (set ZLLM_CSRC_DIR)")
    # The library the install built, when it was built from these very sources for this torch.
    name = cpu_build.library_name(CSRC_DIR, torch.__version__)
    prebuilt = cpu_build.import_built(name, cpu_build.PREBUILT_DIR / f"{name}.so")
    if prebuilt is not None:
        return prebuilt
    try:
        cpu_build.check_toolchain()
    except cpu_build.BuildError as exc:
        raise CpuKernelError(str(exc)) from exc
    from torch.utils import cpp_extension

    # In torch's cache the name also says where the sources are (library_name's `where`).
    name = cpu_build.library_name(CSRC_DIR, torch.__version__, where=True)
    # A build takes a minute, a cached one well under the second after which Progress
    # shows anything: only a real build shows its spinner (or, without a terminal, log lines).
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, False))  # (creates it)
        library = build_dir / f"{name}.so"
        with exclusive_build(build_dir):
            built = cpu_build.import_built(name, library)
            if built is not None:
                return built
            with Progress("Building the CPU kernels (csrc/cpu, once per machine)", logger=logger):
                return cpu_build.build(name, build_dir, CSRC_DIR)
    except Exception as exc:  # compiler errors, an unwritable directory, ...
        raise CpuKernelError(f"building the CPU kernels failed: {exc}") from exc


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build directory for one loader at a time (TP ranks and DP engines load at once).

    torch's own guard is a `lock` file that every later load waits on until it goes, so a
    build killed midway (Ctrl-C or kill -9 in a first start's first minute) left every later
    start waiting forever. Ours is an flock, which the kernel drops when its holder dies: once
    we hold it no other build of ours is running, and a `lock` file still there is a dead
    build's, removed."""
    with open(build_dir / "zllm-build.flock", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # waits while another process builds or loads
        baton = build_dir / "lock"
        if baton.exists():
            logger.warning("removing the lock file a killed CPU-kernel build left: %s", baton)
            baton.unlink(missing_ok=True)
        yield  # the flock goes with the file's close


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] fp32 @ weight [N, K]^T (+ bias): csrc/cpu/dense_rows.h's kernel at 1-8 rows
    (AVX-512 or AVX2, the same bits), torch's matmul otherwise."""
    return load().dense_linear(x, weight, bias)


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """x [M, K] fp32 @ dequantize(qweight [N, row bytes])^T -> [M, N] fp32."""
    return load().gguf_linear(x, qweight, ggml_type)


def gguf_linear_into(
    x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, y: torch.Tensor
) -> None:
    """y[:] = x @ dequantize(qweight)^T; y [M, N] may be a column slice of a wider output."""
    load().gguf_linear_into(x, qweight, ggml_type, y)


def gguf_linear_int8(
    x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, y: torch.Tensor | None = None
) -> torch.Tensor:
    """As gguf_linear with x rounded to int8 per 32 values and integer dot products
    (llama.cpp-style arithmetic; `--quantization gguf-int8`). Into y when given."""
    if y is None:
        return load().gguf_linear_int8(x, qweight, ggml_type)
    load().gguf_linear_int8_into(x, qweight, ggml_type, y)
    return y


def gguf_linear_bf16_into(
    x16: torch.Tensor, qweight: torch.Tensor, ggml_type: int, y: torch.Tensor
) -> None:
    """y[:] = x16 @ dequantize(qweight)^T through torch's bf16 GEMM (AMX where the CPU has
    it): W's values rounded to bf16 a panel of rows at a time, x16 bf16 [M, K], fp32 sums,
    each output rounded to bf16; y fp32 [M, N] may be a column slice of a wider output."""
    load().gguf_linear_bf16_into(x16, qweight, ggml_type, y)


def moe_experts_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    groups: tuple[list[int], list[int]],
    int8_max_rows: int,
    y: torch.Tensor,
) -> None:
    """y = x through the chosen experts, in one parallel region (csrc/cpu/moe_experts.cpp):
    groups = (experts, starts), rows starts[g]:starts[g + 1] through experts[g]'s matrix."""
    load().moe_experts_linear(x, blocks, ggml_type, groups[0], groups[1], int8_max_rows, y)


def cpu_isa() -> str:
    """The instruction set of the kernels with an AVX-512 variant (csrc/cpu/kquant_int8.h):
    "avx512vnni" on a CPU with AVX-512 F/BW/VL and VNNI unless forced, else "avx2"."""
    return load().cpu_isa()


def set_cpu_isa(name: str) -> str:
    """Force "avx2" or "avx512vnni" (where the CPU has it), or "auto" (the best it has), for
    this process; returns the choice, which set_cpu_isa(cpu_isa()) restores."""
    return load().set_cpu_isa(name)


def block_size(ggml_type: int) -> tuple[int, int]:
    """(values, bytes) of one block of a type the kernel reads (GGUF's, or zllm's FP8_E4M3)."""
    if ggml_type == FP8_E4M3:
        return 32, 34
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def row_bytes(ggml_type: int, columns: int) -> int | None:
    """The bytes of a row of `columns` values in blocks of that type (None: not whole blocks)."""
    block_values, block_bytes = block_size(ggml_type)
    return None if columns % block_values else columns // block_values * block_bytes


def gguf_dequantize(qweight: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    return load().gguf_dequantize(qweight, ggml_type, in_features)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """q [S, H, D] (one token per sequence) attending to its context in kv_cache -> [S, H, D].

    kv_cache [2, num_blocks, block_size, kv_heads, D] fp32 contiguous; block_tables int64
    [S, max_blocks]; seq_lens int64 [S] (the context, this token included). With a sliding
    `window`, each sequence attends to its last `window` positions and its table starts at the
    block holding the first of them (attention.py's windowed decode batch). `sinks` fp32 [H]:
    each head's attention sink logit, in the softmax's denominator (executor/attention/sinks.py).
    With a `chunk` (Llama 4's chunked layers), each sequence attends to the positions of its
    own chunk of that many tokens, its table starting at the block holding the chunk's first
    (the kernel takes it as a negative window).
    """
    span = -chunk if chunk else (window or 0)
    return load().paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, span, sinks)


if __name__ == "__main__":  # python -m zllm.executor.kernels.cpu: build now (e.g. in CI)
    logging.basicConfig(level=logging.INFO)
    load()
    print("zllm CPU kernels ready")
