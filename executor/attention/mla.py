"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV pool, in plain torch.

Per token the pool holds one latent row shared by every head: c_kv (kv_lora_rank values, after
the latent norm) and the rotated shared key k_pe (qk_rope_head_dim). The pool's contract stays
the one every executor shares, [2, num_blocks, block_size, kv_heads, width]: the latent is one
KV head whose row is split over the two planes, so a block's bytes are exactly the latent's
(zllm/model/arch_config.py: num_kv_heads 1, head_dim latent_width / 2) and the tiers, transfers
and prefix cache move MLA blocks as they move any other:

    kv_cache[2, num_blocks, block_size, 1, latent_width / 2]
    a slot's latent row  | c_kv (kv_lora_rank)               | k_pe (rope) |
                         |<- plane 0 (K) ->|<- plane 1 (V) ------------------>|

Head h's key and value come from the latent through kv_b_proj's rows for h (W_UK[h]
[qk_nope, kv_lora_rank], W_UV[h] [v_head_dim, kv_lora_rank]):

    k[h] = [W_UK[h] c_kv | k_pe]      v[h] = W_UV[h] c_kv

Prefill chunks up-project their context's latents to per-head K/V and attend in SDPA (as
transformers computes it: heads of qk_nope + rope against v_head_dim). Decode rows absorb W_UK
into the query and W_UV into the output instead, so they attend over the latents as they lie
in the cache: one KV head of latent_width for keys and kv_lora_rank for values, the heads
taking SDPA's query-length axis:

    q_lat[h] = [q_nope[h] W_UK[h] | q_pe[h]]          [heads, latent_width]
    o_lat[h] = softmax(q_lat[h] . latents^T * scale) latents[:, :kv_lora_rank]
    out[h]   = W_UV[h] o_lat[h]                        [heads, v_head_dim]

Both read the step's AttentionMetadata (executor/attention/metadata.py): chunked prefill,
prefix-cache hits (a chunk gathers its context's latents by slot) and decode batches with a
few tokens per row (speculative decoding's verify) alike. Under --kv-cache-dtype each plane's
half row is stored as any KV head's row of that width is (executor/kv/quant.py: bf16/fp16, or
int8 with a scale per group), and a fresh prompt attends over its latents rounded as stored,
as a later step or a prefix hit reads them. CUDA and CPU kernels for the latent cache are not
written: this is the path on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zllm.executor.attention.metadata import AttentionMetadata, DecodeBatch, PrefillChunk
from zllm.executor.kv.quant import as_stored, narrow, widen


class PagedLatentAttention:
    """One MLA layer's attention: write the new latents into the pool, attend through it."""

    def __init__(
        self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float
    ) -> None:
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.latent_width = kv_lora_rank + qk_rope_head_dim
        self.scale = scale

    def __call__(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q_nope [T, heads, qk_nope], q_pe [T, heads, rope] (rotated), latent [T, latent_width]
        (c_kv normed | k_pe rotated), w_uk [heads, qk_nope, kv_lora_rank], w_uv [heads,
        v_head_dim, kv_lora_rank] -> [T, heads, v_head_dim]."""
        write_latents(latent, kv_cache, meta.slot_mapping)
        decode = meta.decode
        if decode is not None and decode.is_whole_batch:
            return self._decode(q_nope, q_pe, w_uk, w_uv, kv_cache, decode, meta.block_size)
        out = q_nope.new_empty((*q_nope.shape[:2], w_uv.shape[1]))
        if decode is not None:
            decoded = self._decode(q_nope, q_pe, w_uk, w_uv, kv_cache, decode, meta.block_size)
            out.index_copy_(0, decode.token_indices, decoded)
        for chunk in meta.prefills:
            span = slice(chunk.token_start, chunk.token_end)
            out[span] = self._prefill(
                q_nope[span], q_pe[span], latent[span], w_uk, w_uv, kv_cache, chunk
            )
        return out

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        """A chunk's heads over its context's latents, up-projected: [q_len, heads, v]."""
        if chunk.context_slots is not None:  # after cached context: read it all back
            latent = read_latents(kv_cache, chunk.context_slots, self.latent_width, q_nope.dtype)
        else:
            latent = stored_latents(latent, kv_cache.dtype)
        c_kv, k_pe = latent[:, : self.kv_lora_rank], latent[:, self.kv_lora_rank :]
        k_nope = torch.matmul(c_kv, w_uk.transpose(1, 2))  # [heads, L, qk_nope]
        value = torch.matmul(c_kv, w_uv.transpose(1, 2))  # [heads, L, v]
        key = torch.cat((k_nope, k_pe.expand(self.num_heads, -1, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [heads, q_len, qk]
        causal = chunk.attn_mask is None  # the chunk is the whole context
        out = F.scaled_dot_product_attention(
            query[None], key[None], value[None], chunk.attn_mask, is_causal=causal, scale=self.scale
        )
        return out[0].transpose(0, 1)

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        kv_cache: torch.Tensor,
        decode: DecodeBatch,
        block_size: int,
    ) -> torch.Tensor:
        """Every decode row absorbed over its gathered latents: [rows, heads, v]."""
        if not decode.is_whole_batch:
            q_nope = q_nope.index_select(0, decode.token_indices)
            q_pe = q_pe.index_select(0, decode.token_indices)
        num_rows = q_nope.shape[0]
        # [heads, rows, qk_nope] x [heads, qk_nope, kv_lora_rank] -> [rows, heads, kv_lora_rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_pe), dim=-1).unsqueeze(1)  # [rows, 1, heads, latent]
        latents = self._gather_rows(kv_cache, decode, num_rows, block_size, query.dtype)
        out_latent = F.scaled_dot_product_attention(
            query,
            latents.unsqueeze(1),  # [rows, 1, padded_len, latent]: one KV head
            latents[..., : self.kv_lora_rank].unsqueeze(1),
            decode.attn_mask,  # [rows, 1, 1, padded_len]: the same keys for every head
            scale=self.scale,
        )[:, 0]
        # [heads, rows, kv_lora_rank] x [heads, kv_lora_rank, v] -> [rows, heads, v]
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _gather_rows(
        self,
        kv_cache: torch.Tensor,
        decode: DecodeBatch,
        num_rows: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Each row's blocks' latents as `dtype`, padded to the longest: [rows, padded_len,
        latent].
        Whole blocks per plane with one index_select each (see DecodeBatch), into the step's
        workspace, which the layers share; padding reads block 0 under the mask."""
        blocks = kv_cache.view(2, kv_cache.shape[1], -1)
        shape = (2, decode.block_ids.shape[0], blocks.shape[2])
        planes = decode.workspace
        if planes is None or planes.shape != shape or planes.dtype != kv_cache.dtype:
            planes = decode.workspace = kv_cache.new_empty(shape)
        torch.index_select(blocks[0], 0, decode.block_ids, out=planes[0])
        torch.index_select(blocks[1], 0, decode.block_ids, out=planes[1])
        planes = planes.view(2, num_rows, decode.max_blocks * block_size, kv_cache.shape[-1])
        return _joined(planes[0], planes[1], self.latent_width, dtype)


def write_latents(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' latent rows [T, latent_width] at their slots, half per plane, each
    half as the cache stores a row of its width."""
    _, num_blocks, block_size, _, stored_width = kv_cache.shape
    slots = kv_cache.view(2, num_blocks * block_size, stored_width)
    half = latent.shape[-1] // 2
    slots[0].index_copy_(0, slot_mapping, narrow(latent[:, :half], kv_cache.dtype))
    slots[1].index_copy_(0, slot_mapping, narrow(latent[:, half:], kv_cache.dtype))


def read_latents(
    kv_cache: torch.Tensor, slots: torch.Tensor, latent_width: int, dtype: torch.dtype
) -> torch.Tensor:
    """The latent rows [len(slots), latent_width] at these slots, as `dtype`."""
    planes = kv_cache.view(2, -1, kv_cache.shape[-1])
    first, second = planes[0].index_select(0, slots), planes[1].index_select(0, slots)
    return _joined(first, second, latent_width, dtype)


def _joined(
    first: torch.Tensor, second: torch.Tensor, latent_width: int, dtype: torch.dtype
) -> torch.Tensor:
    """Latent rows [..., latent_width] as `dtype` from their two stored halves."""
    half = latent_width // 2
    return torch.cat((widen(first, dtype, half), widen(second, dtype, half)), dim=-1)


def stored_latents(latent: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The latent rows [T, latent_width] rounded as the cache stores them (each half alone)."""
    if cache_dtype == latent.dtype:  # (the cache keeps the model's dtype: nothing rounds)
        return latent
    half = latent.shape[-1] // 2
    return torch.cat(
        (as_stored(latent[:, :half], cache_dtype), as_stored(latent[:, half:], cache_dtype)), -1
    )
