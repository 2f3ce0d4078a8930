"""Paged attention on the GPU: our CUDA kernels for the cache write, decode and prefill.

Same contract as executor/attention/paged.py (the KV cache of one layer is
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, slot = block_id * block_size + offset;
the step's new tokens arrive flat and grouped by sequence), with metadata shaped for the
kernels instead of for CPU gathers:

    tokens      | a0 a1 a2 a3 | b0 | c0 c1 | d0 |
    query_lens  |      4      |  1 |   2   |  1 |      b and d decode, a prefills, c is a chunk
    decode      |             | b  |       | d  |  -> csrc/paged_attention.cu, one launch
    prefill     |      a      |    |   c   |    |  -> one varlen call (cuda_prefill.py)

- Cache write: csrc/kv_cache.cu, one launch for K and V of every token (slot -1 skipped),
  before either attention kernel reads the cache.
- Decode (query length 1): the split-K paged kernel, reading K/V in place through the block
  tables. With `CudaAttentionMetadata.for_decode` (all decode, tensors already on the GPU)
  this path makes no host-device copy and no sync, so it can be captured in a CUDA graph.
- Prefill (query length > 1: whole prompts, chunks after cached context, prompts after a
  prefix hit): every such sequence in one varlen call (executor/attention/cuda_prefill.py: torch's
  FlashAttention over K/V gathered from the cache in bf16/fp16, csrc/paged_prefill.cu
  reading the cache in place otherwise), lower-right causal.
- Sliding windows (Gemma 3's local layers, Mistral): both kernels take the window, so such
  layers stay on these kernels (table entries before a window are never read).
- Attention sinks (gpt-oss: a logit per head in the softmax's denominator): both kernels
  take them; such layers' prefills take csrc/paged_prefill.cu in every dtype, since
  FlashAttention's varlen call has no sink.

`ZLLM_CUDA_PREFILL=sdpa` runs prefills as before the varlen call, one SDPA call per
prefilling sequence (attention.py's `PagedAttentionBase`), for A/B measurements;
`ZLLM_CUDA_PREFILL=kernel` keeps bf16/fp16 on csrc/paged_prefill.cu.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right

from zllm.executor.attention.backend import AttentionBackend
from zllm.executor.attention.cuda_prefill import PrefillBatch, paged_prefill_attention, prefill_mode
from zllm.executor.attention.metadata import (
    PrefillChunk,
    StepLayout,
    build_prefill_chunks,
    padded_tables,
    to_device,
)
from zllm.executor.attention.paged import PagedAttentionBase
from zllm.executor.kernels.cuda import DecodeWorkspace, paged_decode_attention, write_kv_cache


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
    # The prefilling sequences (query length > 1), for the one varlen launch per layer.
    prefill: PrefillBatch | None
    block_size: int
    window: int = 0  # sliding window of these layers (0: none)
    workspace: DecodeWorkspace = field(default_factory=DecodeWorkspace)
    # ZLLM_CUDA_PREFILL=sdpa only: per-sequence SDPA chunks instead of `prefill`.
    sdpa_chunks: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.decode_token_indices is None and self.prefill is None and not self.sdpa_chunks

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
        """Same arguments as AttentionMetadata.build (block tables may hold -1 before a
        sliding window: the kernels never read those entries)."""
        layout = StepLayout.check(query_lens, seq_lens, block_tables, slot_mapping, block_size)
        q_lens, ctx_lens = layout.query_lens, layout.seq_lens
        decode_ids = np.flatnonzero(q_lens == 1)
        dec_lens = ctx_lens[decode_ids]
        max_dec_len = int(dec_lens.max(initial=0))
        tables = padded_tables([block_tables[i] for i in decode_ids], dec_lens, block_size)
        all_decode = len(decode_ids) == len(q_lens)
        prefill_ids = np.flatnonzero(q_lens > 1)
        prefill, chunks = None, []
        mode = prefill_mode() if len(prefill_ids) else None  # (decode steps read no env)
        if len(prefill_ids) and mode != "sdpa":
            prefill = PrefillBatch.build(
                layout.query_start_loc[prefill_ids],
                q_lens[prefill_ids],
                ctx_lens[prefill_ids],
                [block_tables[i] for i in prefill_ids.tolist()],
                block_size,
                device,
                sliding_window,
                mode,
            )
        elif len(prefill_ids):
            chunks = build_prefill_chunks(
                layout, block_tables, block_size, device, causal_lower_right, sliding_window
            )
        return cls(
            slot_mapping=to_device(layout.slot_mapping, device),
            block_tables=to_device(tables, device),
            seq_lens=to_device(dec_lens.astype(np.int32), device),
            max_decode_seq_len=max_dec_len,
            decode_token_indices=(
                None if all_decode else to_device(layout.query_start_loc[decode_ids], device)
            ),
            prefill=prefill,
            block_size=block_size,
            window=int(sliding_window or 0),
            sdpa_chunks=chunks,
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
        window: int = 0,
    ) -> CudaAttentionMetadata:
        """A decode-only batch over tensors already on the GPU (CUDA graphs' static buffers)."""
        return cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            max_decode_seq_len=max_seq_len,
            decode_token_indices=None,
            prefill=None,
            block_size=block_size,
            window=window,
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
        kv_written: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, heads, head_dim], key/value [T, kv_heads, head_dim] -> [T, heads, head_dim].
        `kv_written`: the model wrote key and value to the cache already (rope_into_cache).
        `sinks`: fp32 [heads], the layer's attention sink logits (gpt-oss), or None."""
        if not kv_written:
            write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return self._decode(query, kv_cache, meta, sinks)

        out = query.new_empty(query.shape)
        idx = meta.decode_token_indices
        if meta.num_decodes and idx is not None:  # idx is None only when all are decodes
            decoded = self._decode(query.index_select(0, idx), kv_cache, meta, sinks)
            out.index_copy_(0, idx, decoded)
        if meta.prefill is not None:
            paged_prefill_attention(query, kv_cache, meta.prefill, self.scale, out, sinks=sinks)
        self._attend_prefills(out, query, key, value, kv_cache, meta.sdpa_chunks, sinks)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: CudaAttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_decode_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            self.scale,
            max_seq_len=meta.max_decode_seq_len,
            workspace=meta.workspace,
            window=meta.window,
            sinks=sinks,
        )


CUDA_ATTENTION = AttentionBackend(
    name="cuda",
    description="csrc CUDA kernels: cache write, split-K decode, varlen prefill",
    make_layer=CudaPagedAttention,
    build_metadata=CudaAttentionMetadata.build,
)
