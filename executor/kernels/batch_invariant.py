"""Batch-invariant execution (`--deterministic`): a sequence's numbers do not depend on what
else shares its step.

What varies with the batch on CPU, and what this mode does about it:

- **Matmuls.** A BLAS GEMM picks its blocking (and so the order in which it sums over K) from
  the matrix shapes: the same row multiplied inside a 1-row and a 64-row call can differ in
  the last bits. Here every fp32 matmul runs in calls of exactly `TILE_ROWS` rows (the last
  tile zero-padded), so each row always goes through the same kernel with the same blocking;
  a GEMM's row never reads another row, so the other rows' values cannot matter. The GGUF
  kernel (`csrc/cpu/gguf_linear.cpp`) has a separate path for 1-4 rows (different rounding):
  in tiles it always takes its panel path.
- **Attention.** Prefill chunks went through SDPA over the chunk, whose reduction order
  depends on the chunk's length; here every query token attends as a decode row (the paged
  kernel, or SDPA over exactly its own context): the same computation for a position
  whether it is prefilled whole, in chunks of any size, after a prefix-cache hit, after a
  preemption, or decoded.
- **Logits** go through the same tiles (`tiled_logits`).
- **Experts** (executor/layers/moe/): each expert's matmuls over the rows routed to it run
  in the same tiles (`ExpertMatrices.tile_rows`), and a token's experts are summed in expert
  order whatever else shares the step.

Row-wise work (RMSNorm, RoPE, activations, softmax) already reduces each row on its own.
The contract is tested in tests/test_batch_invariance.py, with an inverse test showing the
default path does differ.

This module is the tiling itself (`tiled`); executor/layers/linear/tiled.py puts a model's
matmul modules through it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TILE_ROWS = 8


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn over x [T, K] in calls of exactly TILE_ROWS rows; the result's rows as fn's."""
    rows = x.shape[0]
    if rows == TILE_ROWS:
        return fn(x)
    padded = -(-rows // TILE_ROWS) * TILE_ROWS
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, *x.shape[1:])])
    return torch.cat([fn(tile) for tile in x.split(TILE_ROWS)])[:rows]
