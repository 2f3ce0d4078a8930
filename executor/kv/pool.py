"""The KV pool as the tiers and transfers see it: whole blocks, every tensor's slice for one
block id, gathered out and scattered back (executor/kv/connector.py, executor/kv/transfer.py).

A block has one or two parts. The target's: one tensor per layer of the (single) KV cache
group, [2, num_blocks, block_size, kv_heads, row_width] each. With speculative decoding's
draft_model, the draft's too: it keeps its KV under the target's block ids, in tensors of
its own shape and dtype (executor/spec_decode/draft_model.py), so a prefix-cache hit is a
hit for both, and a block a tier or a producer hands back must bring both back::

    target only   [layers, 2, block_size, kv_heads, row_width]   the pool's dtype (as ever)
    with a draft  [nbytes] uint8: the target's part as above, then the draft's
                  [draft_layers, 2, block_size, draft_kv_heads, head_dim] of its dtype

A two-part block is bytes because the parts differ in shape and may differ in dtype (an int8
cache beside the draft's model dtype); each part is viewed in place as its own typed tensor,
so moving a block is still one copy per layer, and the single-model block is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _part_shape(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """One block of a part: [layers, 2, block_size, kv_heads, row_width]."""
    _, _, block_size, kv_heads, width = tensors[0].shape
    return (len(tensors), 2, block_size, kv_heads, width)


def _part_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return torch.Size(_part_shape(tensors)).numel() * tensors[0].element_size()


class KVPool:
    """The model runner's KV tensors (and a draft model's), a whole block at a time."""

    def __init__(self, tensors: list[torch.Tensor], draft: Sequence[torch.Tensor] = ()) -> None:
        self.tensors = tensors  # replaced when sleep mode reallocates the pool
        # The draft model's KV tensors: replaced with its proposer (made again on waking).
        self.draft: list[torch.Tensor] = list(draft)

    def _parts(self) -> list[list[torch.Tensor]]:
        return [self.tensors, self.draft] if self.draft else [self.tensors]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """What one block is to a tier: the target's typed block, or a two-part block's bytes."""
        if not self.draft:
            return _part_shape(self.tensors)
        return (self.block_nbytes,)

    @property
    def block_dtype(self) -> torch.dtype:
        return torch.uint8 if self.draft else self.tensors[0].dtype

    @property
    def block_nbytes(self) -> int:
        """The bytes of one block: every layer's K and V, the draft's layers' too."""
        return sum(_part_nbytes(part) for part in self._parts())

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, *block_shape] copies of the blocks, on the CPU (into `out` when given)."""
        if out is None:
            out = torch.empty((len(block_ids), *self.block_shape), dtype=self.block_dtype)
        for part, view in zip(self._parts(), self._part_views(out), strict=True):
            index = torch.tensor(block_ids, dtype=torch.int64, device=part[0].device)
            for layer, kv in enumerate(part):
                view[:, layer].copy_(kv.index_select(1, index).transpose(0, 1))
        return out

    def scatter(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write [n, *block_shape] into the pool blocks `block_ids`."""
        for part, view in zip(self._parts(), self._part_views(blocks), strict=True):
            index = torch.tensor(block_ids, dtype=torch.int64, device=part[0].device)
            for layer, kv in enumerate(part):
                kv.index_copy_(1, index, view[:, layer].transpose(0, 1).to(kv.device))

    def _part_views(self, blocks: torch.Tensor) -> list[torch.Tensor]:
        """Each part of [n, *block_shape] blocks as [n, *its block shape] of its dtype (views:
        writing one writes the blocks)."""
        if not self.draft:
            return [blocks]
        views, start = [], 0
        for part in self._parts():
            nbytes = _part_nbytes(part)
            # A view as a wider dtype needs the part's offset and the row length to be
            # multiples of its element size (at most 4): every part's bytes are, being
            # 2 (K and V) x an even row's bytes (kv_dtypes.py) x layers x slots x heads.
            raw = blocks.view(len(blocks), -1)[:, start : start + nbytes]
            views.append(raw.view(part[0].dtype).view(len(blocks), *_part_shape(part)))
            start += nbytes
        return views
