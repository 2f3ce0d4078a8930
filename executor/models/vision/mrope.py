"""Qwen2.5-VL's multimodal RoPE positions: each token turns the rotary frequencies by three
positions (time, row, column), one per section of them (layers/rope.py RotaryEmbedding).

A text token's three positions are equal: its index in the sequence, less what the images
before it saved. An image of rows x columns tokens (zllm/model/image_tokens.py) starting where
the next text position would be, s, puts its token k at (s, s + k // columns, s + k % columns)
and moves the text after it on to s + max(rows, columns), so each image shifts every later
position by max(rows, columns) - rows x columns, generated tokens included. (transformers'
Qwen2_5_VLModel.get_rope_index, for still images.)

The KV cache's slots still follow each token's index (step_inputs.py); only the rotation
reads these positions. A step with no image token in it gets one shifted position per token,
so decode steps keep the one-position paths (the fused CPU stack, CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zllm.executor.requests.state import RequestState
from zllm.model.image_tokens import ImageGrid
from zllm.protocol import PlacedImage


def request_positions(
    images: Sequence[PlacedImage], grid: ImageGrid, start: int, end: int
) -> np.ndarray:
    """int64 [3, end - start]: the (time, row, column) positions of a request's tokens
    [start, end), given its images (in prompt order)."""
    index = np.arange(start, end, dtype=np.int64)
    out = np.repeat(index[None], 3, axis=0)
    shift = 0  # what the images so far moved the positions after them by
    for image in images:
        rows, columns = grid.merged(image.image.width, image.image.height)
        inside = (index >= image.offset) & (index < image.end)
        if inside.any():
            k = index[inside] - image.offset
            first = image.offset + shift
            out[0, inside] = first
            out[1, inside] = first + k // columns
            out[2, inside] = first + k % columns
        shift += max(rows, columns) - image.length
        after = index >= image.end
        out[:, after] = index[after] + shift
    return out


class MRopePositions:
    """A step's rotary positions for an M-RoPE model."""

    def __init__(self, grid: ImageGrid) -> None:
        self.grid = grid

    def for_step(
        self,
        states: Sequence[RequestState],
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        positions: np.ndarray,
    ) -> np.ndarray:
        """int64 [T] (every token's three positions agree) or [3, T], for the flat batch
        whose token indices are `positions` (step_inputs.token_positions)."""
        if not any(st.images for st in states):
            return positions
        out = np.repeat(positions[None], 3, axis=0)
        first = 0
        for st, q_len, seq_len in zip(states, query_lens, seq_lens, strict=True):
            if st.images:
                out[:, first : first + q_len] = request_positions(
                    st.images, self.grid, seq_len - q_len, seq_len
                )
            first += q_len
        if (out[0] == out[1]).all() and (out[0] == out[2]).all():
            return out[0].copy()
        return out
