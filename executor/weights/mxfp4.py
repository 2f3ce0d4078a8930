"""MXFP4 (OCP microscaling FP4) as gpt-oss's checkpoints store it: repacked as GGUF's MXFP4
blocks, which the CPU kernel multiplies in place (csrc/cpu/gguf_lowbit.h), or widened.

    checkpoint (transformers' *_blocks, *_scales; OpenAI's layout)
        blocks  uint8 [..., rows, in / 32, 16]: 32 E2M1 codes a block, two a byte: element 2j
                in the low nibble of byte j, element 2j + 1 in its high one
        scales  uint8 [..., rows, in / 32]: the block's E8M0 exponent: x = fp4 * 2^(e - 127)
    GGUF (ggml's block_mxfp4, 17 bytes per 32 values)
        the exponent byte, then 16 bytes: element j in the low nibble of byte j, element
        j + 16 in its high one (ggml's table holds twice the E2M1 values and its scale is
        2^(e - 128): the same products, so the exponent byte is copied as it is)

Both are exact: a code times a power of two is representable in fp32 (and bf16).
"""

from __future__ import annotations

import torch

MXFP4_GGML_TYPE = 39  # GGMLQuantizationType.MXFP4
VALUES_PER_BLOCK = 32
GGUF_BLOCK_BYTES = 17
# E2M1: sign, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] checkpoint bytes -> their 32 codes in order, uint8 [..., 32]."""
    low, high = blocks & 0x0F, blocks >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}"
        )


def gguf_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Checkpoint blocks [..., rows, n, 16] and scales [..., rows, n] -> GGUF MXFP4 rows,
    uint8 [..., rows, n * 17] (what gguf_linear reads for a row of n * 32 values)."""
    _check(blocks, scales)
    codes = _codes(blocks)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    rows = torch.cat((scales.unsqueeze(-1), packed), dim=-1)  # [..., rows, n, 17]
    return rows.flatten(-2).contiguous()


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Checkpoint blocks [..., rows, n, 16] and scales [..., rows, n] -> [..., rows, n * 32]."""
    _check(blocks, scales)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = table[_codes(blocks).long()]  # [..., rows, n, 32]
    exponents = scales.to(torch.int32).unsqueeze(-1) - 127
    return torch.ldexp(values, exponents.float()).flatten(-2).to(dtype)
