"""GGUF types the CPU kernel has no block reader for, held as 16-bit rows.

IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (lattice codebooks of 256-2,048
entries), TQ1_0, TQ2_0 (ternary) and NVFP4: gguf-py dequantizes each matrix at load, a few
rows at a time (never a whole fp32 matrix), into F16 rows, which the kernel widens to fp32 in
registers as it does a 16-bit file's (csrc/cpu/gguf_linear.h). Two bytes a weight, half an
fp32 copy's (the file's 1.6-4.5 bits stay on disk). F16 keeps 11 significant bits: NVFP4's
values exactly, the others' to a relative 2^-11; a matrix with a value past F16's range
(65,504) is held as BF16 instead (8 bits, fp32's range).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from zllm.model.progress import Progress

logger = logging.getLogger(__name__)

HELD_AS_16_BIT = {
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    21: "IQ3_S",
    22: "IQ2_S",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    40: "NVFP4",
}
F16, BF16 = 1, 30  # ggml type ids of the rows held
_DTYPES = {F16: torch.float16, BF16: torch.bfloat16}
NAMES = {F16: "F16", BF16: "BF16"}
CHUNK_BYTES = 16 << 20  # fp32 values dequantized at a time


def hold_as_16_bit_(raw: dict[str, tuple[int, torch.Tensor]]) -> None:
    """Replace each matrix of a held type in `raw` (name -> (ggml type, uint8 blocks [rows,
    bytes per row])) by its 16-bit rows, in place; each one's blocks are dropped once done."""
    held = [name for name, (ggml_type, _) in raw.items() if ggml_type in HELD_AS_16_BIT]
    if not held:
        return
    types = sorted({HELD_AS_16_BIT[raw[name][0]] for name in held})
    total = sum(raw[name][1].numel() for name in held)
    description = f"Dequantizing {', '.join(types)} matrices to 16-bit rows"
    with Progress(description, total=total, unit="B", logger=logger) as progress:
        for name in held:
            ggml_type, blocks = raw[name]
            raw[name] = as_16_bit_rows(blocks, ggml_type)
            progress.advance(blocks.numel())


def as_16_bit_rows(blocks: torch.Tensor, ggml_type: int) -> tuple[int, torch.Tensor]:
    """A held type's blocks, uint8 [rows, bytes per row], as (F16 or BF16, uint8 [rows, 2 x
    columns]): gguf-py's fp32 values rounded to nearest even."""
    for held in (F16, BF16):
        rows = _rows_in(blocks, GGMLQuantizationType(ggml_type), _DTYPES[held])
        if rows is not None:
            return held, rows.view(torch.uint8)
    raise AssertionError("BF16 holds every fp32 value")


def _rows_in(
    blocks: torch.Tensor, ggml_type: GGMLQuantizationType, dtype: torch.dtype
) -> torch.Tensor | None:
    """The values in `dtype`, or None where one that is finite in fp32 is not in it."""
    block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
    num_rows, columns = blocks.shape[0], blocks.shape[1] // block_bytes * block_values
    out = torch.empty(num_rows, columns, dtype=dtype)
    step = max(1, CHUNK_BYTES // (4 * max(columns, 1)))
    source = blocks.numpy()
    for start in range(0, num_rows, step):
        values = torch.from_numpy(
            np.ascontiguousarray(dequantize(source[start : start + step], ggml_type))
        ).reshape(-1, columns)
        rounded = values.to(dtype)
        if (rounded.isinf() & values.isfinite()).any():
            return None
        out[start : start + step] = rounded
    return out
