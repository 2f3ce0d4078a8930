"""Paged attention over a flat batch of new tokens, in plain torch (the CPU reference path).

KV cache of one layer (the fixed contract every executor shares):

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]    index 0 = K, 1 = V
                                          (int8: head_dim and its scales, kv_quant.py)
    slot = block_id * block_size + offset_in_block

A step's new tokens arrive flat and grouped by sequence, without padding:

    tokens      | a0 a1 a2 a3 | b0 | c0 c1 | d0 |
    query_lens  |      4      |  1 |   2   |  1 |      b and d decode, a prefills, c is a chunk
    seq_lens    |      4      | 57 |  130  |  9 |      context after this step (cached + new)

Query token j of a sequence with query length q and context length L sits at position
L - q + j and attends to context positions 0..L - q + j. Decode sequences (q == 1) run as one
padded, masked call; the others run one by one. A short run of new tokens after cached
context (q <= MAX_QUERY_AS_DECODE: a speculative decoding step verifying its proposals) joins
the decode call as q rows, row j with context L - q + j + 1: every new K/V is in the cache
before anything attends, so each row reads exactly what its position may see.

The step's metadata (`AttentionMetadata`: which rows decode, which prefill, the slots) is
built in attention_metadata.py. Shared with the GPU path (attention_cuda.py):
`StepLayout.check`, which validates a step's lists once for either metadata kind, the
prefill chunks (`build_prefill_chunks`), and `PagedAttentionBase`, the head layout and the
SDPA prefill both layers use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zllm.executor.attention.metadata import (
    AttentionMetadata,
    DecodeBatch,
    PrefillChunk,
)
from zllm.executor.attention.sinks import sink_attention
from zllm.executor.kv.quant import as_stored, narrow, widen

# `enable_gqa` arrived in torch 2.5; older versions get the KV heads repeated instead.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K and V ([T, kv_heads, head_dim]) at their cache slots, as the
    cache stores them (--kv-cache-dtype: kv_quant.narrow)."""
    _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape
    slots = kv_cache.view(2, num_blocks * block_size, num_kv_heads, width)
    slots[0].index_copy_(0, slot_mapping, narrow(key, kv_cache.dtype))
    slots[1].index_copy_(0, slot_mapping, narrow(value, kv_cache.dtype))


class PagedAttentionBase:
    """What every backend's layer shares: the head layout, and prefill through SDPA.

    A chunk that follows cached context gathers that context's K/V from the cache by slot
    (after the chunk's own K/V were written) and attends under the chunk's mask; a fresh
    prompt attends causally over its new K/V. A layer with attention sinks (gpt-oss: `sinks`
    [heads], each head's sink logit, passed with every call) attends by executor/attention/
    sinks.py instead of SDPA.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None
    ) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} is not a multiple of {num_kv_heads=}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale

    def _attend_prefills(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        prefills: list[PrefillChunk],
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Write each chunk's attention output into its rows of `out`."""
        if not prefills:
            return
        slots = kv_cache.view(2, -1, self.num_kv_heads, kv_cache.shape[-1])
        for chunk in prefills:
            out[chunk.token_start : chunk.token_end] = self._prefill(
                query, key, value, slots, chunk, sinks
            )

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
        chunk: PrefillChunk,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        span = slice(chunk.token_start, chunk.token_end)
        q = query[span].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, D]
        if chunk.context_slots is None:  # the new tokens are the whole context
            # Over what the cache holds (--kv-cache-dtype), as a later chunk would read it.
            k, v = as_stored(key[span], slots.dtype), as_stored(value[span], slots.dtype)
        else:
            k = widen(slots[0].index_select(0, chunk.context_slots), query.dtype, self.head_dim)
            v = widen(slots[1].index_select(0, chunk.context_slots), query.dtype, self.head_dim)
        k = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context_len, D]
        v = v.transpose(0, 1).unsqueeze(0)
        out = self._sdpa(q, k, v, chunk.attn_mask, sinks)
        return out[0].transpose(0, 1)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, heads, q, d] x [B, kv_heads, L, d]; no mask means causal with q == L."""
        if sinks is not None:
            return sink_attention(q, k, v, mask, self.scale, sinks)
        causal = mask is None
        if self.num_heads == self.num_kv_heads:
            return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=self.scale)
        if _SDPA_HAS_GQA:  # flash attention reads the shared KV heads as they are
            return F.scaled_dot_product_attention(
                q, k, v, mask, is_causal=causal, scale=self.scale, enable_gqa=True
            )
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=self.scale)


class PagedAttention(PagedAttentionBase):
    """One layer's attention in torch: write the new K/V into the paged cache, attend through it.

    `decode_kernel` (the CPU-kernel backend gives zllm.executor.kernels.cpu.paged_decode_attention)
    reads decode attention in place from the cache instead of the gather + SDPA below, which
    stays the reference and the path for other devices.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        decode_kernel: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.decode_kernel = decode_kernel

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_written: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, heads, head_dim], key/value [T, kv_heads, head_dim] -> [T, heads, head_dim].
        `kv_written`: the model wrote key and value to the cache already. `sinks`: fp32
        [heads], the layer's attention sink logits (gpt-oss), or None."""
        if not kv_written:
            write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        decode = meta.decode
        window, chunk = meta.sliding_window, meta.attention_chunk
        if decode is not None and decode.is_whole_batch:
            return self._decode(query, kv_cache, decode, meta.block_size, window, sinks, chunk)

        out = query.new_empty(query.shape)
        if decode is not None:
            decoded = self._decode(query, kv_cache, decode, meta.block_size, window, sinks, chunk)
            out.index_copy_(0, decode.token_indices, decoded)
        self._attend_prefills(out, query, key, value, kv_cache, meta.prefills, sinks)
        return out

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        decode: DecodeBatch,
        block_size: int,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        q = query if decode.is_whole_batch else query.index_select(0, decode.token_indices)
        num_seqs = q.shape[0]
        if self.decode_kernel is not None:
            tables = decode.block_ids.view(num_seqs, decode.max_blocks)
            return self.decode_kernel(
                q, kv_cache, tables, decode.seq_lens, self.scale, sliding_window, sinks, chunk
            )
        if decode.exact:
            return self._decode_rows_exactly(q, kv_cache, decode, block_size, sinks)
        blocks = kv_cache.view(2, kv_cache.shape[1], -1)
        shape = (2, decode.block_ids.shape[0], blocks.shape[2])
        kv = decode.workspace
        if kv is None or kv.shape != shape or kv.dtype != kv_cache.dtype:
            kv = decode.workspace = kv_cache.new_empty(shape)
        torch.index_select(blocks[0], 0, decode.block_ids, out=kv[0])
        torch.index_select(blocks[1], 0, decode.block_ids, out=kv[1])
        # [2, S_dec, padded_len, kv_heads, head_dim] -> K, V as [S_dec, kv_heads, padded_len, hd]
        padded_len = decode.max_blocks * block_size
        kv = kv.view(2, num_seqs, padded_len, self.num_kv_heads, kv_cache.shape[-1])
        kv = widen(kv, q.dtype, self.head_dim)  # a 16-bit or int8 cache as activations
        out = self._sdpa(
            q.unsqueeze(2), kv[0].transpose(1, 2), kv[1].transpose(1, 2), decode.attn_mask, sinks
        )
        return out.squeeze(2)

    def _decode_rows_exactly(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        decode: DecodeBatch,
        block_size: int,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One SDPA per row over exactly the keys its mask admits (its window included)."""
        slots = kv_cache.view(2, -1, self.num_kv_heads, kv_cache.shape[-1])
        tables = decode.block_ids.view(q.shape[0], decode.max_blocks)
        cols = torch.arange(decode.max_blocks * block_size, device=q.device)
        offsets = torch.arange(block_size, device=q.device)
        all_slots = (tables[:, :, None] * block_size + offsets).flatten(1)
        out = torch.empty_like(q)
        for row in range(q.shape[0]):
            keep = cols[decode.attn_mask[row, 0, 0]]
            row_slots = all_slots[row, keep]
            k = widen(slots[0].index_select(0, row_slots), q.dtype, self.head_dim)
            v = widen(slots[1].index_select(0, row_slots), q.dtype, self.head_dim)
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            everything = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool, device=q.device)
            out[row] = self._sdpa(q[row][None, :, None], k, v, everything, sinks)[0, :, 0]
        return out
