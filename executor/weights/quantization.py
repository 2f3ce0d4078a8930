"""Quantized weights for CPU serving (and a quantized checkpoint's blocks on a GPU too).

GGUF files (`gguf`, the default for one on CPU; `gguf-float`; `gguf-int8`): the decoder's
matmuls, the logits and the embedding lookup read the file's own blocks (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4; IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0, NVFP4: csrc/cpu/gguf_lattice.h; F16, BF16) instead of
fp32 copies, and the fp32 tensors they replace are released after load: the weights take
about the file's size in memory (only F32 matrices stay fp32). Which arithmetic multiplies
them, per type, CPU and call size, is executor/kernels/gguf_arithmetic.py's rule:
- the float kernel (csrc/cpu/gguf_linear.cpp; every type; all of `gguf-float`): the values
  multiplied are bit for bit the fp32 weights the reference path uses (the kernel
  dequantizes as gguf.quants does; tests check it), so only the order of the sums differs.
  Decode-sized calls turn each block's codes into floats in registers and apply the block's
  scale to its dot product; prefill chunks dequantize a few weight rows into a small fp32
  panel and multiply there (outer-product register tiles), with no copy of the matrix;
- integer dots (csrc/cpu/gguf_int8.h, kquant_int8.h; `gguf` where measured faster, all of
  `gguf-int8`): x rounded to int8 per 32 values (per 256 for the K-quants, whose whole
  super-blocks are summed in integers), llama.cpp's arithmetic: accuracy in BENCHMARKS.md.
A fused matmul whose parts the file stores in different types (Gemma 3's q/k in Q5_0 beside v
in Q8_0) runs one kernel call per part, each writing its columns of the output.

Quantized checkpoints (`compressed-tensors`, `gptq`, `awq`, `fp8`: the checkpoint's own
method, zllm/config/quantization.py): their packed codes are laid out once at load as the
same kernels' Q4_0/Q4_1/Q8_0 blocks, or 16-bit rows (executor/weights/quantized/), and from
there served as a GGUF file's blocks are (blocks.py: every block source, a GGUF file, a
16-bit checkpoint or a quantized one, names the tensors it serves before the load and gives
each matmul its module). On a GPU the same modules multiply those blocks through
csrc/block_gemv.cu (layers/linear/gguf.py gpu_layout_, placement.py move_blocks_).

`int8` (opt-in, a plain fp32/16-bit checkpoint): every decoder matmul's weights rounded to
int8 at load, one fp16 scale per 32 values (llama.cpp's Q8_0 blocks, bit for bit as gguf-py
quantizes them), then served as a Q8_0 GGUF file's blocks are, through the same kernel
modules (so tensor ranks, fused decode and deterministic mode compose with it); activations
stay fp32 (the float kernel: Q8_0's integer path is no faster here, gguf_arithmetic.py). The
embedding and the logits stay as loaded; a mixture of experts keeps its routed experts fp32.
(Until issue 59 it was fbgemm's dynamic int8 with one activation scale per call, far from
fp32 on SmolLM2's activation outliers: BENCHMARKS.md.)

`none`: fp32 everywhere, the reference.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zllm.config.quantization import CHECKPOINT_QUANTIZATIONS
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import gguf_arithmetic
from zllm.executor.kernels.gguf_arithmetic import GGUF_METHODS, INTEGER_TYPES, Q8_0
from zllm.executor.layers.linear.gguf import GGUFLinear
from zllm.executor.weights.blocks import (
    decoder_matmul_targets,
    gguf_kernel_plan,
    gguf_matmuls,
    use_gguf_blocks_,
)
from zllm.model.gguf import read_gguf

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = (*GGUF_METHODS, "int8", *CHECKPOINT_QUANTIZATIONS, "none")


def quantize_model_(
    model: nn.Module, method: str, model_path: str | None = None, strict: bool = True
) -> None:
    """Swap the model's matmuls for quantized ones, in place.

    `strict` (the method was asked for): refuse a GGUF file whose decoder matmuls the kernel
    cannot all serve. Not strict (the engine's own choice): serve what it can.
    """
    check_quantization(method, model_path, strict)
    if method in GGUF_METHODS:
        use_gguf_blocks_(model, model_path, method)
    elif method == "int8":
        _int8_model_(model)


def check_quantization(method: str, model_path: str | None, strict: bool = True) -> None:
    """Refuse (ValueError) a method that is unknown or cannot serve this model."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {QUANTIZATION_METHODS}")
    if method in GGUF_METHODS:
        reason = "no model file" if model_path is None else gguf_kernel_plan(model_path, strict)
        if reason is not None:
            raise ValueError(f"--quantization {method} cannot serve this model: {reason}")
    if method == "gguf-int8":
        decoder, head = gguf_matmuls(read_gguf(model_path))
        types = {t for m in [*decoder, head] if m is not None for t in m.types}
        if not {int(t) for t in types} & INTEGER_TYPES:
            names = ", ".join(sorted(t.name for t in types))
            raise ValueError(
                f"--quantization gguf-int8 has no integer path for this file's matrices "
                f"({names}); use gguf or gguf-float"
            )


# The engine's own choice for a bf16/fp16 checkpoint on CPU (not a --quantization choice): its
# matrices stay 16-bit in memory and the kernel widens them to fp32 in registers, so a decode
# step reads half the bytes of an fp32 copy, with the same values (both widen exactly); with
# AMX a bf16 checkpoint's prefills take bf16 GEMMs (gguf_arithmetic.bf16_gemm_rows).
SIXTEEN_BIT = gguf_arithmetic.SIXTEEN_BIT


def sixteen_bit_checkpoint(model_path: str) -> bool:
    """Whether a Hugging Face directory stores its decoder's matrices in bf16 or fp16 (read
    from the safetensors headers, nothing loaded)."""
    from zllm.executor.weights.loader import safetensors_dtypes

    if model_path.endswith(".gguf"):
        return False
    dtypes = safetensors_dtypes(model_path)
    matrices = [d for name, d in dtypes.items() if name.endswith("_proj.weight")]
    return bool(matrices) and all(d in ("BF16", "F16") for d in matrices)


def set_int8_max_rows(model: nn.Module, rows: int) -> int:
    """Make gguf-int8 matmuls take the integer path up to `rows` rows, and no matmul the bf16
    GEMM a prefill would take on a CPU with AMX; returns how many integer-path modules it
    set. `zllm bench accuracy` scores a whole sequence in one prefill with the arithmetic
    decode gives each row (x is rounded per row, so a row's result does not depend on the
    others)."""
    for module in model.modules():
        if getattr(module, "bf16_gemm_rows", 0):
            module.bf16_gemm_rows = 0
    modules = [m for m in model.modules() if getattr(m, "int8_activations", False)]
    for module in modules:
        module.int8_max_rows = rows
    return len(modules)


def q8_0_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """An fp32 matrix [out, in] as Q8_0 blocks (uint8 [out, in / 32 * 34]), as gguf-py's
    quantize gives them (d = max|w| / 127 per 32 values, stored fp16; q = w * (1 / d) rounded
    half away from zero), or None when its rows are not whole blocks."""
    out_features, in_features = weight.shape
    if in_features % 32:
        return None
    blocks = weight.detach().float().reshape(out_features, -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    codes = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    scale = d.half().view(torch.uint8)  # [out, blocks, 2]
    return torch.cat([scale, codes.view(torch.uint8)], dim=-1).reshape(out_features, -1)


def int8_linear(linear: nn.Module) -> GGUFLinear | None:
    """A matmul's weight as Q8_0 blocks in a kernel module (its bias kept), or None when its
    rows are not whole blocks (it then keeps its fp32 weight)."""
    rows = q8_0_rows(linear.weight)
    if rows is None:
        return None
    bias = None if linear.bias is None else linear.bias.data
    return GGUFLinear(rows, Q8_0, linear.weight.shape[1], bias, "gguf-float")


def _int8_model_(model: nn.Module) -> None:
    """Every decoder matmul (the attention's and the MLP's, a shared expert's) as Q8_0 blocks;
    the fp32 weight each replaces is released."""
    cpu_kernels.load()  # build (or load) the extension first: a failure surfaces here, once
    swapped = kept = 0
    for module, attr, _ in decoder_matmul_targets(model):
        new = int8_linear(getattr(module, attr))
        if new is None:
            kept += 1
            continue
        setattr(module, attr, new)
        swapped += 1
    logger.info("int8: %d of %d decoder matmuls in Q8_0 blocks", swapped, swapped + kept)
    if not swapped:
        raise ValueError("--quantization int8: no decoder matmul has rows of whole 32-value blocks")
