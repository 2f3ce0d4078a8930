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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from zllm.executor.cuda_kernels import DecodeWorkspace, paged_decode_attention, write_kv_cache

# `enable_gqa` arrived in torch 2.5; older versions get the KV heads repeated instead.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(slots=True)
class CudaPrefill:
    """One sequence with more than one new token."""

    token_start: int  # its new tokens are [token_start, token_end) of the flat batch
    token_end: int
    context_len: int
    # Cache slots of the whole context (int64 [context_len]), or None when the chunk is the
    # whole context (plain causal attention over the new K/V).
    context_slots: torch.Tensor | None


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
    prefills: list[CudaPrefill]
    block_size: int
    workspace: DecodeWorkspace = field(default_factory=DecodeWorkspace)
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

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
    ) -> CudaAttentionMetadata:
        """Same arguments as AttentionMetadata.build."""
        num_seqs = len(query_lens)
        if len(seq_lens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError(
                f"query_lens, seq_lens and block_tables must have one entry per sequence, "
                f"got {num_seqs}, {len(seq_lens)}, {len(block_tables)}"
            )
        q_lens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
        ctx_lens = np.asarray(seq_lens, dtype=np.int64).reshape(num_seqs)
        if (q_lens < 1).any() or (q_lens > ctx_lens).any():
            raise ValueError(f"need 1 <= query_len <= seq_len, got {query_lens} and {seq_lens}")
        for table, n in zip(block_tables, ctx_lens.tolist(), strict=True):
            if len(table) * block_size < n:
                raise ValueError("a block table holds fewer slots than its sequence's context")
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start[1:])
        slots = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
        if slots.shape[0] != query_start[-1]:
            raise ValueError(
                f"slot_mapping has {slots.shape[0]} slots for {query_start[-1]} tokens"
            )

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        decode_ids = np.flatnonzero(q_lens == 1)
        dec_lens = ctx_lens[decode_ids]
        max_dec_len = int(dec_lens.max(initial=0))
        width = max(1, -(-max_dec_len // block_size))
        tables = np.zeros((len(decode_ids), width), dtype=np.int32)
        for row, i in enumerate(decode_ids.tolist()):
            n = -(-int(ctx_lens[i]) // block_size)
            tables[row, :n] = block_tables[i][:n]

        prefills = []
        for i in np.flatnonzero(q_lens > 1).tolist():
            start, q_len, ctx_len = int(query_start[i]), int(q_lens[i]), int(ctx_lens[i])
            ctx_slots = None
            if q_len < ctx_len:
                table = np.asarray(block_tables[i][: -(-ctx_len // block_size)], dtype=np.int64)
                ctx_slots = to_dev(
                    (table[:, None] * block_size + np.arange(block_size)).reshape(-1)[:ctx_len]
                )
            prefills.append(CudaPrefill(start, start + q_len, ctx_len, ctx_slots))

        all_decode = len(decode_ids) == num_seqs
        return cls(
            slot_mapping=to_dev(slots),
            block_tables=to_dev(tables),
            seq_lens=to_dev(dec_lens.astype(np.int32)),
            max_decode_seq_len=max_dec_len,
            decode_token_indices=None if all_decode else to_dev(query_start[decode_ids]),
            prefills=prefills,
            block_size=block_size,
            query_lens_cpu=q_lens.tolist(),
            seq_lens_cpu=ctx_lens.tolist(),
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


class CudaPagedAttention:
    """One layer's attention on the GPU; a drop-in for attention.PagedAttention."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None
    ) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} is not a multiple of {num_kv_heads=}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale

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
        if meta.num_decodes:
            idx = meta.decode_token_indices
            out.index_copy_(0, idx, self._decode(query.index_select(0, idx), kv_cache, meta))
        if meta.prefills:
            slots = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
            for chunk in meta.prefills:
                out[chunk.token_start : chunk.token_end] = self._prefill(
                    query, key, value, slots, chunk
                )
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

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
        chunk: CudaPrefill,
    ) -> torch.Tensor:
        span = slice(chunk.token_start, chunk.token_end)
        q = query[span].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, D]
        if chunk.context_slots is None:
            k, v, mask = key[span], value[span], None
        else:
            k = slots[0].index_select(0, chunk.context_slots)
            v = slots[1].index_select(0, chunk.context_slots)
            mask = causal_lower_right(q.shape[2], chunk.context_len)
        k = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context_len, D]
        v = v.transpose(0, 1).unsqueeze(0)
        gqa = {}
        if self.num_heads != self.num_kv_heads:
            if _SDPA_HAS_GQA:
                gqa = {"enable_gqa": True}  # flash attention reads the shared KV heads as is
            else:
                group = self.num_heads // self.num_kv_heads
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, **gqa
        )
        return out[0].transpose(0, 1)


def use_cuda_attention(model: torch.nn.Module) -> int:
    """Swap every layer's PagedAttention for CudaPagedAttention; returns how many were swapped."""
    from zllm.executor.attention import PagedAttention

    swapped = 0
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if isinstance(attn, PagedAttention):
            module.attn = CudaPagedAttention(
                attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale
            )
            swapped += 1
    return swapped
