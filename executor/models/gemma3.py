"""Gemma 3 (text) over a flat, unpadded token batch.

What differs from the Llama family (executor/models/llama.py), each as transformers computes it
(the norm, MLP and RoPE modules are executor/layers/'s):

    embeddings     scaled by sqrt(hidden_size), in the model dtype
    norms          RMSNorm with (1 + weight), in fp32; four per layer: before and after the
                   attention and before and after the MLP (the "sandwich")
    attention      q/k RMSNorm per head before RoPE; scale query_pre_attn_scalar ** -0.5;
                   sliding layers use a local RoPE base (10000), global layers the model's
    MLP            GeGLU: gelu(tanh approximation)(gate) * up
    logits         cap * tanh(logits / cap) when final_logit_softcapping is set

The sliding window itself is not applied here: the model runner gives sliding layers
window-limited attention metadata (executor/attention/paged.py) over their own KV cache groups
(zllm/kv/cache_groups.py). q/k/v and gate/up are fused into one GEMM each, as in llama.py.
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
from zllm.executor.layers.activations import ACTIVATIONS
from zllm.executor.layers.attention import qkv_targets
from zllm.executor.layers.decoder_stack import DecoderStack
from zllm.executor.layers.linear.dense import empty_linear
from zllm.executor.layers.mlp import GatedMLP
from zllm.executor.layers.norms import GemmaRMSNorm
from zllm.executor.layers.rope import RotaryEmbedding, rope
from zllm.executor.layers.stack_parts import LayerParts, StackParts
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import local_arch, logits_weight
from zllm.executor.weights.checkpoint_copy import copy_checkpoint
from zllm.model.arch_config import ModelArchConfig


class Gemma3Attention(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        attention: AttentionBackend,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """`arch`: this rank's (executor/parallel/shards.py local_arch): its heads only."""
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = empty_linear(arch.hidden_size, self.q_size + 2 * self.kv_size, dtype)
        self.o_proj = empty_linear(self.q_size, arch.hidden_size, dtype)
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
        scalar = arch.family_fields.query_pre_attn_scalar or arch.head_dim
        self.attn = attention.make_layer(
            arch.num_heads, arch.num_kv_heads, arch.head_dim, scale=scalar**-0.5
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepAttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rope(self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim)), cos, sin)
        k = rope(self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


def _gemma3_mlp(arch: ModelArchConfig, dtype: torch.dtype, tp: TensorParallel) -> GatedMLP:
    """GeGLU (the config's GELU) over the fused [gate | up], as every MLP of ours."""
    if arch.hidden_act not in ACTIVATIONS:
        raise ValueError(f"Gemma 3 activation {arch.hidden_act!r} is not supported")
    return GatedMLP(arch, dtype, tp, activation=arch.hidden_act)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        attention: AttentionBackend,
        is_sliding: bool,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.is_sliding = is_sliding  # picks the local RoPE table
        eps, size = arch.rms_norm_eps, arch.hidden_size
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.self_attn = Gemma3Attention(arch, dtype, attention, tp)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.mlp = _gemma3_mlp(arch, dtype, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepAttentionMetadata,
    ) -> tuple[torch.Tensor, None]:
        """The stream after the layer, and no separate residual (Gemma adds it in the layer:
        DecoderStack's loop passes None back in)."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp_out), None


class Gemma3ForCausalLM(DecoderStack, nn.Module):
    """DecoderStack's step with Gemma's embedding scale, final norm and logit soft-cap; the
    local layers rotate by their own table (`sliding_rotary`)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        attention: AttentionBackend = TORCH_ATTENTION,
        tp: TensorParallel = SINGLE,
        pp: PipelineParallel = WHOLE,
    ) -> None:
        """`arch` is the checkpoint's; with `tp` this rank builds its part (self.arch), with
        `pp` only its stage's layers (self.layers[i] is layer layer_indices[i])."""
        super().__init__()
        if arch.family_fields.attn_logit_softcapping is not None:
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        if arch.num_heads % arch.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={arch.num_heads} must be a multiple of num_kv_heads={arch.num_kv_heads}"
            )
        self.checkpoint_arch = arch
        self.tp = tp
        arch = local_arch(arch, tp)
        self.arch = arch
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        )
        # As transformers: the scale is a tensor cast to the embedding dtype before multiplying.
        self.register_buffer(
            "embed_scale", torch.tensor(arch.hidden_size**0.5).to(dtype), persistent=False
        )
        self.rotary = RotaryEmbedding(arch, dtype)
        local = dataclasses.replace(
            arch,
            rope_theta=arch.family_fields.rope_local_theta or arch.rope_theta,
            rope_scaling=None,
            rope_freq_factors=None,
        )
        self.sliding_rotary = RotaryEmbedding(local, dtype)
        self.layer_indices = pp.layer_range(arch.num_layers)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(arch, dtype, attention, arch.is_sliding(i), tp)
            for i in self.layer_indices
        )
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = logits_weight(arch, dtype, tp)
        # Set by quantization: modules computing logits and looking up embedding rows in place
        # of the fp32 tensors (which it then releases).
        self.logits_proj: nn.Module | None = None
        self.embed_rows: nn.Module | None = None
        self.requires_grad_(False)

    def final_norm(self, x: torch.Tensor, residual: None) -> torch.Tensor:
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' input embeddings: their rows (from GGUF blocks once quantization set
        embed_rows) times embed_scale."""
        return super().embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits, soft-capped when the model says so."""
        logits = super().compute_logits(hidden_states)
        cap = self.arch.family_fields.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def decode_stack_parts(self) -> StackParts:
        """The layers by role, for the fused CPU decode step (layers/stack_parts.py): the
        sandwich norms, the per-head q/k norms, the config's GELU, and the local RoPE table
        of the sliding layers."""
        layers = [
            LayerParts(
                attn_norm=layer.input_layernorm,
                ffn_norm=layer.pre_feedforward_layernorm,
                qkv=layer.self_attn.qkv_proj,
                o=layer.self_attn.o_proj,
                gate_up=layer.mlp.gate_up_proj,
                down=layer.mlp.down_proj,
                attention=layer.self_attn.attn,
                q_norm=layer.self_attn.q_norm,
                k_norm=layer.self_attn.k_norm,
                post_attn_norm=layer.post_attention_layernorm,
                post_ffn_norm=layer.post_feedforward_layernorm,
                local_rope=layer.is_sliding,
            )
            for layer in self.layers
        ]
        return StackParts(
            layers,
            final_norm=self.norm,
            activation=self.arch.hidden_act,
            rope=self.rotary,
            local_rope=self.sliding_rotary,
            sandwich=True,
        )

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], served: Container[str] = frozenset()
    ) -> None:
        """Copy Hugging Face-named tensors in, one at a time; `served`: names the checkpoint
        leaves out (copy_checkpoint)."""
        copy_checkpoint(self, self._weight_targets(), weights, served=served)

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        targets = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if not self.arch.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.data
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            parts = {
                "self_attn.q_norm.weight": attn.q_norm.weight.data,
                "self_attn.k_norm.weight": attn.k_norm.weight.data,
            }
            for norm in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ):
                parts[f"{norm}.weight"] = getattr(layer, norm).weight.data
            targets.update({prefix + name: t for name, t in parts.items()})
            targets |= qkv_targets(f"{prefix}self_attn.", attn.qkv_proj, attn.q_size, attn.kv_size)
            targets[f"{prefix}self_attn.o_proj.weight"] = attn.o_proj.weight.data
            targets |= mlp.checkpoint_targets(f"{prefix}mlp.")
        return targets
