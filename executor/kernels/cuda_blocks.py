"""Block-quantized matmuls on the GPU (csrc/block_gemv.cu): the Q4_0, Q4_1, Q8_0 and
FP8_E4M3 blocks a quantized checkpoint is laid out in at load (compressed-tensors, GPTQ,
AWQ, fp8: executor/weights/quantized/to_blocks.py), the same bytes the CPU kernels read.

    linear_into(x, qweight, ggml_type, out)   out = x W^T, W held as blocks [n, bytes per row]
    dequantize(qweight, ggml_type, in_features, dtype)   W as [n, in] in the element type

A call of at most GEMV_MAX_ROWS rows (decode) multiplies the blocks in place, MAX_ROWS rows a
launch, each weight decoded in registers: a step reads the blocks' bytes (once per launch),
not a 16-bit copy. A longer call (prefill) dequantizes the matrix into a temporary of the
element type and multiplies on cuBLAS: its time is the GEMM's, the temporary lives for one
call, and the KV pool's sizing keeps room for the largest (gpu_memory.py). Planning yields KernelLaunch
records, which the CPU tests run through the kernel emulator (csrc/emu).
"""

from __future__ import annotations

import numpy as np
import torch

from zllm.executor.kernels.cuda import (
    _DTYPE_TAG,
    CudaKernelError,
    KernelLaunch,
    _aligned16,
    _ptr,
    run_launches,
)

SOURCE = "block_gemv.cu"
THREADS = 128  # csrc/block_gemv.cu kBlockGemvThreads
ROWS_PER_BLOCK = THREADS // 32  # output rows of one thread block: a warp each
MAX_ROWS = 16  # kBlockGemvMaxRows: input rows of one gemv launch
# Rows up to which a call takes gemv launches (MAX_ROWS at a time, each reading the blocks
# again); past it the dequantized matrix and cuBLAS read fewer bytes than more passes.
GEMV_MAX_ROWS = 32
VALUES_PER_BLOCK = 32
# ggml type id -> bytes of one 32-value block (FP8_E4M3 = 100 is zllm's own, cpu.py's).
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 100: 34}


def supported(ggml_type: int) -> bool:
    return ggml_type in BLOCK_BYTES


def _check_blocks(qweight: torch.Tensor, ggml_type: int, in_features: int) -> int:
    """Blocks per row, once qweight is a contiguous uint8 [n, row bytes] of that type."""
    if ggml_type not in BLOCK_BYTES:
        raise CudaKernelError(f"ggml type {ggml_type} has no GPU kernel (have {list(BLOCK_BYTES)})")
    if in_features % VALUES_PER_BLOCK:
        raise CudaKernelError(
            f"{in_features} columns are not whole {VALUES_PER_BLOCK}-value blocks"
        )
    blocks = in_features // VALUES_PER_BLOCK
    row_bytes = blocks * BLOCK_BYTES[ggml_type]
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != row_bytes:
        raise CudaKernelError(
            f"blocks must be uint8 [rows, {row_bytes}], got {qweight.dtype} {list(qweight.shape)}"
        )
    if not qweight.is_contiguous() or qweight.data_ptr() % 2:
        raise CudaKernelError("blocks must be contiguous and start at an even address")
    return blocks


def plan_block_gemv(
    x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, out: torch.Tensor
) -> list[KernelLaunch]:
    """out [rows, n] (a column slice of a wider tensor is fine) = x [rows, in] W^T, rows at
    most MAX_ROWS."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _DTYPE_TAG:
        raise CudaKernelError(
            f"x must be fp32/fp16/bf16 [rows, in] with contiguous rows, got {x.dtype}"
        )
    blocks = _check_blocks(qweight, ggml_type, x.shape[1])
    rows, n = x.shape[0], qweight.shape[0]
    if rows > MAX_ROWS:
        raise CudaKernelError(f"{rows} rows: one gemv takes at most {MAX_ROWS}")
    if not _aligned16(x, x.stride(0)):
        raise CudaKernelError("x must be 16-byte aligned with a row stride of 16-byte multiples")
    if tuple(out.shape) != (rows, n) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise CudaKernelError(f"out must be {x.dtype} [{rows}, {n}] with contiguous rows")
    if rows == 0 or n == 0:
        return []
    args = (
        _ptr(out),
        np.int64(out.stride(0)),
        _ptr(x),
        np.int64(x.stride(0)),
        np.int32(rows),
        _ptr(qweight),
        np.int64(qweight.shape[1]),
        np.int32(n),
        np.int32(blocks),
    )
    name = f"zllm_block_gemv<{_DTYPE_TAG[x.dtype]}, {ggml_type}>"
    grid = (-(-n // ROWS_PER_BLOCK), 1, 1)
    return [KernelLaunch(SOURCE, name, grid, (THREADS, 1, 1), args)]


def plan_block_dequant(
    qweight: torch.Tensor, ggml_type: int, out: torch.Tensor
) -> list[KernelLaunch]:
    """out [n, in] (contiguous, its element type) = the blocks' values."""
    if out.dim() != 2 or not out.is_contiguous() or out.dtype not in _DTYPE_TAG:
        raise CudaKernelError("out must be a contiguous fp32/fp16/bf16 [rows, in] tensor")
    blocks = _check_blocks(qweight, ggml_type, out.shape[1])
    n = qweight.shape[0]
    if out.shape[0] != n:
        raise CudaKernelError(f"out has {out.shape[0]} rows, the blocks {n}")
    total = n * blocks
    if total == 0:
        return []
    args = (_ptr(out), _ptr(qweight), np.int64(qweight.shape[1]), np.int32(n), np.int32(blocks))
    name = f"zllm_block_dequant<{_DTYPE_TAG[out.dtype]}, {ggml_type}>"
    return [KernelLaunch(SOURCE, name, (-(-total // THREADS), 1, 1), (THREADS, 1, 1), args)]


def dequantize(
    qweight: torch.Tensor, ggml_type: int, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    out = torch.empty(qweight.shape[0], in_features, dtype=dtype, device=qweight.device)
    run_launches(plan_block_dequant(qweight, ggml_type, out), qweight.device)
    return out


def linear_into(
    x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, out: torch.Tensor
) -> torch.Tensor:
    """out [rows, n] = x [rows, in] W^T (out may be a column slice of a wider output)."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        if not _aligned16(x, x.stride(0)) or x.stride(1) != 1:
            x = x.contiguous()
        launches = [
            launch
            for start in range(0, x.shape[0], MAX_ROWS)
            for launch in plan_block_gemv(
                x[start : start + MAX_ROWS], qweight, ggml_type, out[start : start + MAX_ROWS]
            )
        ]
        run_launches(launches, x.device)
        return out
    weight = dequantize(qweight, ggml_type, x.shape[1], x.dtype)
    if out.is_contiguous():
        torch.matmul(x, weight.t(), out=out)
    else:
        out.copy_(x @ weight.t())
    return out
