"""OLMo 2's and OLMo 3's decoder over a flat token batch, as transformers' Olmo2/Olmo3ForCausalLM
computes it (its names):

    h = x + post_attention_layernorm(self_attn(x))       post-norm: no norm before a sublayer
    x = h + post_feedforward_layernorm(mlp(h))
    self_attn: q = q_norm(q_proj(x)), k = k_norm(k_proj(x)) over all heads at once, then RoPE

OLMo 3's sliding layers (arch.layer_types) attend within the window and rotate by the plain
table of the model's base; its full layers by the table with rope_scaling (transformers gives
the scaling to the full layers only).

A layer returns (its MLP's normed output, the stream before it), so DecoderStack's final
residual-adding norm sees their sum, as any of our decoders' layers do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterable

import torch
from torch import nn

from zllm.executor.attention.backend import (
    TORCH_ATTENTION,
    AttentionBackend,
    StepAttentionMetadata,
)
from zllm.executor.layers.attention import SelfAttention
from zllm.executor.layers.decoder_stack import DecoderStack
from zllm.executor.layers.mlp import GatedMLP
from zllm.executor.layers.norms import RMSNorm
from zllm.executor.layers.rope import RotaryEmbedding
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import logits_weight
from zllm.executor.weights.checkpoint_copy import copy_checkpoint
from zllm.model.arch_config import ModelArchConfig


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, dtype: torch.dtype, attention: AttentionBackend, layer: int
    ) -> None:
        super().__init__()
        self.is_sliding = arch.is_sliding(layer)  # picks the unscaled RoPE table
        self.self_attn = SelfAttention(arch, dtype, attention)  # (arch.qk_norm_whole)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = GatedMLP(arch, dtype)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes and returns (the last sublayer's output, the stream before it)."""
        stream = x if residual is None else x + residual
        attended = self.post_attention_layernorm(self.self_attn(stream, cos, sin, kv_cache, meta))
        stream = stream + attended[0]
        return self.post_feedforward_layernorm(self.mlp(stream))[0], stream


class Olmo2ForCausalLM(DecoderStack, nn.Module):
    """The model runner's interface, as LlamaForCausalLM's (embed, forward_layers, final_norm,
    compute_logits, load_weights; pipeline stages by layer_indices)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        attention: AttentionBackend = TORCH_ATTENTION,
        tp: TensorParallel = SINGLE,
        pp: PipelineParallel = WHOLE,
    ) -> None:
        """Tensor parallelism is refused before this (the family lacks it)."""
        super().__init__()
        if tp.enabled:
            raise ValueError("OLMo's q/k norms span every head: it runs on one tensor rank")
        self.checkpoint_arch = arch
        self.arch = arch
        self.tp = tp
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        )
        self.rotary = RotaryEmbedding(arch, dtype)
        plain = dataclasses.replace(arch, rope_scaling=None, rope_freq_factors=None)
        self.sliding_rotary = RotaryEmbedding(plain, dtype) if arch.layer_types else None
        self.layer_indices = pp.layer_range(arch.num_layers)
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(arch, dtype, attention, i) for i in self.layer_indices
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = logits_weight(arch, dtype, tp)
        # Set by quantization (GGUF blocks): as LlamaForCausalLM's.
        self.logits_proj: nn.Module | None = None
        self.embed_rows: nn.Module | None = None
        self.requires_grad_(False)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], served: Container[str] = frozenset()
    ) -> None:
        copy_checkpoint(
            self,
            self._weight_targets(),
            weights,
            recomputed=("rotary_emb.inv_freq",),
            served=served,
        )

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """Each Hugging Face weight name -> the tensor (a row slice for fused ones) it fills."""
        targets = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head.data
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            targets |= attn.checkpoint_targets(f"{p}self_attn.")
            targets |= mlp.checkpoint_targets(f"{p}mlp.")
            targets |= {
                f"{p}post_attention_layernorm.weight": layer.post_attention_layernorm.weight.data,
                f"{p}post_feedforward_layernorm.weight": (
                    layer.post_feedforward_layernorm.weight.data
                ),
            }
        return targets
