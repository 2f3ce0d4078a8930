"""The step every rotary decoder of ours takes, whatever its layers hold: embed the tokens
(or read a pipeline stage's incoming stream), run the layers over the paged KV cache, the
final norm, and float32 logits gathered across tensor-parallel ranks. Llama's family,
gpt-oss and DeepSeek-V2 share it; their own modules say what a layer is.

A model using it holds `layers` (each called as layer(x, residual, cos, sin, kv_cache,
metadata) -> (x, residual)), `rotary` (cos/sin by position; None: no position embedding, the
layers get None), optionally `sliding_rotary` (the table of the layers whose `is_sliding` is
true, as Gemma 3's local layers and OLMo 3's unscaled sliding ones), `norm` (a
residual-adding RMSNorm), `embed_tokens` and `lm_head` (None: tied), `embed_rows` and
`logits_proj` (the block- or row-reading modules quantization puts in place, else None),
`arch` and `tp`. A family whose layers take other position-derived inputs overrides
`position_inputs` (Llama 4's NoPE query scale), never the loop over the layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from zllm.executor.attention.backend import StepAttentionMetadata, metadata_per_layer
from zllm.executor.layers.linear.dense import dense_rows_linear
from zllm.executor.parallel.shards import gather_logits


class DecoderStack:
    """forward = embed, forward_layers, final_norm; and compute_logits (a mixin for an
    nn.Module holding the attributes the module docstring names)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: StepAttentionMetadata | Sequence[StepAttentionMetadata],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, one row per new token.

        `attn_metadata`: one per layer, or one for all (attention_backend.metadata_per_layer).
        """
        x, residual = self.forward_layers(
            self.embed(input_ids), positions, kv_caches, attn_metadata
        )
        return self.final_norm(x, residual)

    def forward_layers(
        self,
        stream: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: StepAttentionMetadata | Sequence[StepAttentionMetadata],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This model's layers (a pipeline stage's: forward() is embed, forward_layers,
        final_norm) over the residual stream entering them (the embeddings at the first
        layer). Returns the last sublayer's output and the residual before it: their sum is
        the stream the next stage takes."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        metas = metadata_per_layer(attn_metadata, len(self.layers))
        inputs = self.position_inputs(positions)
        x, residual = stream, None
        for layer, args, kv_cache, meta in zip(self.layers, inputs, kv_caches, metas, strict=True):
            x, residual = layer(x, residual, *args, kv_cache, meta)
        return x, residual

    def position_inputs(self, positions: torch.Tensor) -> list[tuple]:
        """Per layer, what it takes from the tokens' positions (between `residual` and
        `kv_cache` in its call): the (cos, sin) of its rotary table, a sliding layer's from
        `sliding_rotary` where the model has one. Each table is looked up once per step."""
        tables = (None, None) if self.rotary is None else self.rotary.lookup(positions)
        sliding_rotary = getattr(self, "sliding_rotary", None)  # (nn.Module raises if unset)
        if sliding_rotary is None:
            return [tables] * len(self.layers)
        sliding = sliding_rotary.lookup(positions)
        return [sliding if layer.is_sliding else tables for layer in self.layers]

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows (from GGUF blocks once quantization set embed_rows)."""
        if self.embed_rows is not None:
            return self.embed_rows(input_ids)
        return F.embedding(input_ids, self.embed_tokens)

    # Set by use_dense_rows_ (an fp32 model on CPU): the logits of decode-sized calls take the
    # few-rows kernel as the layers' matmuls do (the tied embedding is no module to swap).
    dense_logits = False

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        if self.logits_proj is not None:
            logits = self.logits_proj(hidden_states).float()
        else:
            weight = self.embed_tokens if self.lm_head is None else self.lm_head
            if self.dense_logits and hidden_states.dtype == weight.dtype == torch.float32:
                logits = dense_rows_linear(hidden_states, weight)
            else:
                logits = F.linear(hidden_states, weight).float()
        return gather_logits(logits, self.arch.vocab_size, self.tp)
