"""Paged attention on the GPU: our CUDA kernels for the cache write and decode, SDPA for prefill.

Same contract as executor/attention.py (the KV cache of one layer is
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, slot = block_id * block_size + offset;
the step's new tokens arrive flat and grouped by sequence), with metadata shaped for the
kernels instead of for CPU gathers:

    tokens      | a0 a1 a2 a3 | b0 | c0 c1 | d0 |
    query_lens  |      4      |  1 |   2   |  1 |      b and d decode, a prefills, c is a chunk
    decode      |             | b  |       | d  |  -> csrc/paged_attention.cu, one launch
    prefills    | a: causal SDPA over its new K/V   | c: SDPA over the cached context
                                                       gathered by slot, lower-right causal

- Cache write: csrc/kv_cache.cu, one launch for K and V of every token (slot -1 skipped).
- Decode (query length 1): the split-K paged kernel, reading K/V in place through the block
  tables. With `CudaAttentionMetadata.for_decode` (all decode, tensors already on the GPU)
  this path makes no host-device copy and no sync, so it can be captured in a CUDA graph.
- Prefill of a whole prompt: `scaled_dot_product_attention(is_causal=True)` on the new K/V.
- Chunked prefill (cached context before the chunk): K/V of the whole context gathered from
  the cache by slot (after the chunk's own K/V were written), then SDPA with
  `torch.nn.attention.bias.causal_lower_right(q_len, context_len)`: query j sits at position
  context_len - q_len + j. Correctness first: one SDPA call per prefilling sequence.

The step layout checks, the prefill chunks and the prefill SDPA are attention.py's
(`StepLayout`, `build_prefill_chunks`, `PagedAttentionBase`); only the chunk mask differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right

from zllm.executor.attention import PagedAttentionBase
from zllm.executor.attention_backend import AttentionBackend
from zllm.executor.attention_metadata import (
    PrefillChunk,
    StepLayout,
    build_prefill_chunks,
    to_device,
)
from zllm.executor.cuda_kernels import DecodeWorkspace, paged_decode_attention, write_kv_cache


@dataclass(slots=True)
class CudaAttentionMetadata:
    """A flat batch of T new tokens from S sequences, split into decodes and prefills."""

    slot_mapping: torch.Tensor  # int64 [T], cache slot per new token (-1: padding, skipped)
    # The decode sequences (query length 1), in batch order:
    block_tables: torch.Tensor  # int32 [S_dec, max_blocks], padded with 0
    seq_lens: torch.Tensor  # int32 [S_dec], context length including the new token
    max_decode_seq_len: int  # host bound on seq_lens (sets the split-K partition count)
    # Where each decode token sits in the flat batch; None when every token is a decode.
    decode_token_indices: torch.Tensor | None
    # Chunks after cached context attend under causal_lower_right(q_len, context_len).
    prefills: list[PrefillChunk]
    block_size: int
    workspace: DecodeWorkspace = field(default_factory=DecodeWorkspace)

    @property
    def num_decodes(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.decode_token_indices is None and not self.prefills

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int] | np.ndarray,
        block_size: int,
        device: torch.device | str,
        sliding_window: int | None = None,
    ) -> CudaAttentionMetadata:
        """Same arguments as AttentionMetadata.build; no sliding windows yet (the kernels read
        each context from position 0), so choose_attention_backend keeps such models off it."""
        if sliding_window is not None:
            raise ValueError("the CUDA attention backend has no sliding-window support yet")
        layout = StepLayout.check(query_lens, seq_lens, block_tables, slot_mapping, block_size)
        q_lens, ctx_lens = layout.query_lens, layout.seq_lens
        decode_ids = np.flatnonzero(q_lens == 1)
        dec_lens = ctx_lens[decode_ids]
        max_dec_len = int(dec_lens.max(initial=0))
        width = max(1, -(-max_dec_len // block_size))
        tables = np.zeros((len(decode_ids), width), dtype=np.int32)
        for row, i in enumerate(decode_ids.tolist()):
            n = -(-int(ctx_lens[i]) // block_size)
            tables[row, :n] = block_tables[i][:n]
        all_decode = len(decode_ids) == len(q_lens)
        return cls(
            slot_mapping=to_device(layout.slot_mapping, device),
            block_tables=to_device(tables, device),
            seq_lens=to_device(dec_lens.astype(np.int32), device),
            max_decode_seq_len=max_dec_len,
            decode_token_indices=(
                None if all_decode else to_device(layout.query_start_loc[decode_ids], device)
            ),
            prefills=build_prefill_chunks(
                layout, block_tables, block_size, device, causal_lower_right
            ),
            block_size=block_size,
        )

    @classmethod
    def for_decode(
        cls,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        max_seq_len: int,
        workspace: DecodeWorkspace,
    ) -> CudaAttentionMetadata:
        """A decode-only batch over tensors already on the GPU (CUDA graphs' static buffers)."""
        return cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            max_decode_seq_len=max_seq_len,
            decode_token_indices=None,
            prefills=[],
            block_size=block_size,
            workspace=workspace,
        )


class CudaPagedAttention(PagedAttentionBase):
    """One layer's attention on the GPU: the CUDA attention backend's layer."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: CudaAttentionMetadata,
    ) -> torch.Tensor:
        """query [T, heads, head_dim], key/value [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
        write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return self._decode(query, kv_cache, meta)

        out = query.new_empty(query.shape)
        idx = meta.decode_token_indices
        if meta.num_decodes and idx is not None:  # idx is None only when all are decodes
            out.index_copy_(0, idx, self._decode(query.index_select(0, idx), kv_cache, meta))
        self._attend_prefills(out, query, key, value, kv_cache, meta.prefills)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: CudaAttentionMetadata
    ) -> torch.Tensor:
        return paged_decode_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            self.scale,
            max_seq_len=meta.max_decode_seq_len,
            workspace=meta.workspace,
        )


CUDA_ATTENTION = AttentionBackend(
    name="cuda",
    description="csrc CUDA kernels for the cache write and decode, SDPA for prefill",
    make_layer=CudaPagedAttention,
    build_metadata=CudaAttentionMetadata.build,
)
