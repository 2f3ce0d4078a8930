"""Which arithmetic a matmul over GGUF blocks runs, per GGUF type, instruction set and call size.

Two kernels read the same blocks (executor/layers/linear/gguf.py calls them):
- the float kernel (csrc/cpu/gguf_linear.cpp): the file's values dequantized exactly and
  multiplied in fp32: transformers' arithmetic on the same weights, only the order of the
  sums differs;
- integer dots (csrc/cpu/gguf_int8.h, kquant_int8.h): x rounded to int8 per block (per 256
  values for the K-quants) and multiplied by the codes in integers: llama.cpp's arithmetic,
  which reads the same bytes with less work per byte.

The `--quantization` names that choose:
- `gguf` (the default for a GGUF file on CPU): the faster kernel for each type at each call
  size on the CPU at hand, from FASTEST_INTEGER_ROWS (measured per matmul on both
  instruction sets: BENCHMARKS.md "The fastest arithmetic by default (issue 58)");
- `gguf-float`: the float kernel at every size, for those who want transformers' numbers (the
  parity tests compare tokens bitwise under it);
- `gguf-int8`: integer dots wherever a type has them, whatever they cost (A/B measurements).

16-bit weights (F16/BF16 files, bf16/fp16 checkpoints) have no integer path. Where the CPU
has AMX (Sapphire Rapids and later) a third arithmetic serves the calls of many rows
(prefills, large batches) under the default: torch's bf16 GEMM, which oneDNN runs on AMX
tiles: x rounded to bf16, the weights' values rounded to bf16, fp32 sums, the output rounded
to bf16 (vLLM's CPU arithmetic for a bf16 model). BF16 rows take it from BF16_GEMM_MIN_ROWS
rows (1.2x the float kernel at 8 rows, 4.5x at 64: BENCHMARKS.md "16-bit prefill on AMX");
quantized blocks, dequantized to bf16 a panel at a time (csrc/cpu/gguf_gemm.cpp), from
BLOCK_GEMM_MIN_ROWS (2.8-4.4x the K-quants' integer tiles at 512 rows: "Quantized prefill on
AMX"). `gguf-float`, `gguf-int8` and `--deterministic` (8-row tiles) keep their own sums.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from zllm.executor.kernels import cpu as cpu_kernels

GGUF_METHODS = ("gguf", "gguf-float", "gguf-int8")
# The engine's own choice for a bf16/fp16 checkpoint on CPU (executor/weights/quantization.py):
# its matrices kept as 16-bit rows, read by the same kernels as an F16/BF16 file's.
SIXTEEN_BIT = "16-bit"

ALL_ROWS = 1 << 30

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14
BF16 = 30
# The types with an integer path (gguf_linear_int8 reads them); the low-bit lattice, IQ4, TQ,
# MXFP4 and NVFP4 types have none and keep the float kernel under every name.
INTEGER_TYPES = cpu_kernels.INT8_GGML_TYPES
_K_QUANTS = frozenset({Q2_K, Q3_K, Q4_K, Q6_K})  # whole super-blocks summed in integers

# gguf-int8: the most rows that take integer dots. The block types' integer path reaches its
# limit at 3-4 rows (it quantizes x per call and streams the codes once per row pair); the
# K-quants' (kquant_int8.h: weight tiles that passes of 4-8 rows go over)
# serves every size.
INT8_MAX_ROWS = 4

# `gguf`: per instruction set, the most rows of a call that the integer path serves for each
# type (a type missing takes the float kernel at every size). From benchmarks/gguf_types.py on
# the 2-core dev VM (an Intel Xeon with AVX-512 VNNI, and its AVX2 code forced with
# ZLLM_CPU_ISA=avx2), integer path against float kernel per matmul, on a 4096-row matrix (in
# cache, 1-512 rows) and a 65536-row one (streamed from memory, 1-8 rows): a type takes integer
# dots up to the largest row count where they were faster in both (BENCHMARKS.md, "The fastest
# arithmetic by default"). Q4_0, Q4_1 and Q8_0 keep the float kernel: their integer path is
# level with it at one row (0.7-1.07x) and behind from two, so it would change the arithmetic
# for nothing. With AVX-512 the K-quants' integer tiles win at every size (1.3-1.5x at 512
# rows). The AVX2 K-quant rows come from a real AVX2-only CPU (a Zen 3, 2026-11-30: integer
# path against float kernel alternately in one process, Llama-1B's matrices, 8-512 rows):
# there Q4_K wins at every size and the others until 16 rows (BENCHMARKS.md "AVX2 on a Zen
# 3"); the forced AVX2 code on the Xeon had put Q4_K behind from 64 rows (0.90x at 512).
FASTEST_INTEGER_ROWS: dict[str, dict[int, int]] = {
    "avx512vnni": {
        Q5_0: 2,  # 1.2-1.5x at 1-2 rows, 0.8-1.1x at 4
        Q5_1: 2,
        Q5_K: 4,  # 1.05-1.25x at 4, 0.9x at 8
        Q2_K: ALL_ROWS,  # 1.4x at 512, 3.5-4.8x at 1-4
        Q3_K: ALL_ROWS,  # 1.3x at 512, 2.3-3.3x at 1-4
        Q4_K: ALL_ROWS,  # 1.5x at 512, 2.8-3.1x at 1-4
        Q6_K: ALL_ROWS,  # 1.3x at 512, 2.6-3.0x at 1-4
    },
    "avx2": {
        Q5_0: 2,  # 1.4-1.5x at 1-2 rows, 0.9-1.1x at 4
        Q5_1: 2,
        Q5_K: 4,  # 1.16x at 4, 0.9x at 8
        Q2_K: 16,  # Zen 3: 1.10x at 16, 0.86-0.96x from 32
        Q3_K: 16,  # Zen 3 (passes of 8 rows): 1.04x at 16, 0.84-0.89x from 32
        Q4_K: ALL_ROWS,  # Zen 3: 1.03-1.17x at 32-512 (K = 2048), 1.36-1.54x (K = 8192)
        Q6_K: 16,  # Zen 3 (passes of 8 rows): 1.08-1.19x at 16, 0.84-1.09x from 32
    },
}


def integer_rows(method: str, types: Iterable[int], isa: str | None = None) -> int:
    """The most rows a call of a matmul whose parts are stored in `types` sends to the integer
    path under `method` on instruction set `isa` (default: the one the kernels run; 0: the
    float kernel always). A fused matmul (q/k/v, gate/up) takes one path for all its parts:
    the smallest of their limits."""
    types = set(types)
    if method == "gguf-int8":
        if not types or not types <= INTEGER_TYPES:
            return 0
        return ALL_ROWS if types <= _K_QUANTS else INT8_MAX_ROWS
    if method == "gguf":
        table = FASTEST_INTEGER_ROWS[isa or cpu_kernels.cpu_isa()]
        return min((table.get(t, 0) for t in types), default=0)
    return 0  # gguf-float, 16-bit rows


def describe(method: str, types: Iterable[int]) -> str | None:
    """For the load's log: which of the file's `types` take integer dots or bf16 GEMMs under
    `method` (each type alone; None when none does)."""
    names = cpu_kernels.SUPPORTED_GGML_TYPES
    isa = cpu_kernels.cpu_isa()
    types = set(types)
    cells = []
    for t in sorted(types):
        rows = integer_rows(method, [t], isa)
        if rows:
            cells.append(names[t] if rows >= ALL_ROWS else f"{names[t]} up to {rows} rows")
    parts = [f"integer dots for {', '.join(cells)}"] if cells else []
    if BF16 in types and bf16_gemm_rows(method, [BF16]):
        parts.append(f"BF16 calls of {BF16_GEMM_MIN_ROWS}+ rows as bf16 GEMMs on AMX")
    blocks = types - {BF16} - _NO_BLOCK_GEMM
    if blocks and bf16_gemm_rows(method, blocks):
        parts.append(f"quantized calls of {BLOCK_GEMM_MIN_ROWS}+ rows as bf16 GEMMs on AMX")
    if not parts:
        return None
    return f"{method} ({isa}): {'; '.join(parts)}, the float kernel for the rest"


# The fewest rows of a call that BF16 rows send to torch's bf16 GEMM on a CPU with AMX. Below
# it decode steps keep the float kernel's fp32 sums (and the fused decode step, which calls
# that kernel). A Llama-3.2-1B layer's four BF16 matmuls (BENCHMARKS.md, "16-bit prefill on
# AMX"): the GEMM 0.76-0.88x the kernel's speed at 1-4 rows, 1.20x at 8, 2.5x at 16, 4.5x at 64.
BF16_GEMM_MIN_ROWS = 8
# The same for quantized blocks, whose weights the GEMM's kernel (csrc/cpu/gguf_gemm.cpp)
# dequantizes to bf16 a panel at a time, a cost paid once per call. The 1B Q4_K_M's matrices
# (BENCHMARKS.md, "Quantized prefill on AMX"): against the K-quants' integer tiles 0.4-0.5x at
# 16 rows, 0.8-0.9x at 32, 1.05-1.3x at 64, 1.6-1.9x at 128, 2.8-4.4x at 512; against the
# float kernel (Q8_0, Q4_0, ...) 1.2x at 32. From 64 rows: prefill chunks, not decode steps
# (a c=32 decode step keeps the fused path's integer dots).
BLOCK_GEMM_MIN_ROWS = 64
# What the panels cannot take: fp32 rows (exact in the float kernel, no reason to round them)
# and F16 rows (a file kept in F16 for its 11 mantissa bits; bf16 has 8).
_NO_BLOCK_GEMM = frozenset({0, 1})  # ggml F32, F16


def cpu_has_amx_bf16() -> bool:
    """Whether torch's bf16 GEMM runs on AMX tiles here (oneDNN picks them where the CPU and
    the kernel allow) and the instruction set is not held below AMX: ZLLM_CPU_ISA=avx2 (an
    AVX2 machine's mix, where bf16 GEMMs are emulated and slower than the float kernel) or
    avx512vnni (AVX-512 without AMX: the A/B measurement's other side)."""
    held = (os.environ.get("ZLLM_CPU_ISA") or "auto") != "auto"
    if held or cpu_kernels.cpu_isa() == "avx2":
        return False
    return bool(torch.cpu._is_amx_tile_supported())


def bf16_gemm_rows(method: str, types: Iterable[int], amx: bool | None = None) -> int:
    """The fewest rows of a call of a matmul whose parts are stored in `types` that take the
    bf16 GEMM under `method` (0: never): BF16 rows from BF16_GEMM_MIN_ROWS, quantized blocks
    (dequantized to bf16 a panel at a time) from BLOCK_GEMM_MIN_ROWS. Only under the default
    arithmetic (`gguf-float` keeps transformers' fp32 numbers, `gguf-int8` llama.cpp's), only
    with AMX (`amx`: default, this CPU's); never for F16 or F32 rows."""
    types = set(types)
    if method not in ("gguf", SIXTEEN_BIT) or not types or types & _NO_BLOCK_GEMM:
        return 0
    if amx is None:
        amx = cpu_has_amx_bf16()
    if not amx:
        return 0
    if types == {BF16}:
        return BF16_GEMM_MIN_ROWS
    return BLOCK_GEMM_MIN_ROWS if method == "gguf" else 0
