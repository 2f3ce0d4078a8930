"""Llama 4's text decoder over a flat token batch, as transformers' Llama4ForCausalLM computes it
(zllm/model/families/llama4.py says what its config holds):

    x = x + self_attn(input_layernorm(x))
    x = x + mlp(post_attention_layernorm(x))    experts (MoE layers) or a dense MLP

    rotating layers  q, k rotated by adjacent pairs, then each head RMS-normalised (no weight)
    NoPE layers      no rotation; q times log1p(floor((position + 1) / floor_scale)) *
                     attn_scale + 1
    experts          the top k router logits; each chosen expert takes x times its logit's
                     sigmoid; their outputs summed beside the shared expert's

The checkpoints hold q/k rows in Meta's pair layout; at load each head's rows move to the
two-halves layout the attention layer rotates (the same permutation of q and k leaves every
dot product as it was), so the rotating layers run as Llama's. The head norm goes before the
rotation here, after it in transformers: a rotation keeps each head's norm, so they agree.
A GGUF file's (or a 16-bit checkpoint's) q/k blocks move alike, a row of blocks at a time
(`block_rows`), so q/k/v read their blocks as every other matmul does.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator

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
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.checkpoint import per_expert_names, per_expert_weights
from zllm.executor.layers.moe.router import TOPK_SIGMOID, MoERule
from zllm.executor.layers.norms import HeadL2Norm, RMSNorm
from zllm.executor.layers.rope import RotaryEmbedding
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import logits_weight
from zllm.executor.weights.checkpoint_copy import copy_checkpoint
from zllm.model.arch_config import ModelArchConfig

EXPERTS_RULE = MoERule(router=TOPK_SIGMOID, shared_expert_gated=False, scale_inputs=True)


class Llama4DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, dtype: torch.dtype, attention: AttentionBackend, layer: int
    ) -> None:
        super().__init__()
        fields = arch.family_fields
        self.rope = layer not in arch.nope_layers
        self.temperature = not self.rope and fields.temperature_tuning
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(arch, dtype, attention)
        if self.rope and fields.qk_norm:
            self.self_attn.qk_norm = HeadL2Norm(arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        if arch.is_moe_layer(layer):
            shared = GatedMLP(arch, dtype, intermediate_size=arch.moe.moe_intermediate_size)
            self.mlp: nn.Module = MoEBlock(arch, dtype, EXPERTS_RULE, shared_expert=shared)
        else:
            self.mlp = GatedMLP(arch, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_scale: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        if self.rope:
            x = self.self_attn(x, cos, sin, kv_cache, meta)
        else:
            scale = q_scale if self.temperature else None
            x = self.self_attn(x, None, None, kv_cache, meta, q_scale=scale)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Llama4ForCausalLM(DecoderStack, nn.Module):
    """The model runner's interface, as LlamaForCausalLM's."""

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
            raise ValueError("Llama 4's experts run on one tensor rank")
        self.checkpoint_arch = arch
        self.arch = arch
        self.tp = tp
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        )
        self.rotary = RotaryEmbedding(arch, dtype)
        self.layer_indices = pp.layer_range(arch.num_layers)
        self.layers = nn.ModuleList(
            Llama4DecoderLayer(arch, dtype, attention, i) for i in self.layer_indices
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = logits_weight(arch, dtype, tp)
        self.logits_proj: nn.Module | None = None
        self.embed_rows: nn.Module | None = None
        self.requires_grad_(False)

    def position_inputs(self, positions: torch.Tensor) -> list[tuple]:
        """Each layer's (cos, sin, q_scale): the NoPE layers' query scale of each token's
        position beside the one rotary table."""
        cos, sin = self.rotary.lookup(positions)
        fields = self.arch.family_fields
        floors = torch.floor((positions.float() + 1.0) / fields.floor_scale)
        q_scale = torch.log1p(floors) * fields.attn_scale + 1.0
        return [(cos, sin, q_scale)] * len(self.layers)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], served: Container[str] = frozenset()
    ) -> None:
        """transformers' names (feed_forward.*, the experts fused and transposed) or a GGUF
        file's (already ours) in; each q/k head's rows from pairs to halves."""
        weights = per_expert_weights(self._canonical(weights))
        if self.arch.moe is not None:
            served = per_expert_names(served, self.arch.moe.num_experts)
        copy_checkpoint(
            self,
            self._weight_targets(),
            weights,
            recomputed=("rotary_emb.inv_freq",),
            served=served,
        )

    def _canonical(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.replace(".feed_forward.router.", ".mlp.gate.")
            name = name.replace(".feed_forward.", ".mlp.")
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                tensor = tensor.transpose(-1, -2)  # [E, in, out] -> [E, out, in]
            else:
                tensor = self.block_rows(name, tensor)
            yield name, tensor

    def block_matmul_targets(self) -> Iterator[tuple[nn.Module, str, list[str]]]:
        """(module, attribute, checkpoint names) GGUF blocks may serve: the attention's, the
        dense or shared MLP's (the experts read theirs in the MoE layer)."""
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            p = f"model.layers.{i}."
            qkv = [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
            yield layer.self_attn, "qkv_proj", qkv
            yield layer.self_attn, "o_proj", [f"{p}self_attn.o_proj.weight"]
            mlp, m = layer.mlp, f"{p}mlp."
            if isinstance(mlp, MoEBlock):
                mlp, m = mlp.shared_expert, f"{m}shared_expert."
            yield mlp, "gate_up_proj", [f"{m}gate_proj.weight", f"{m}up_proj.weight"]
            yield mlp, "down_proj", [f"{m}down_proj.weight"]

    def block_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor's rows as this model holds them, fp32 values or rows of blocks
        alike: each q/k head's from pairs to halves (the rest as stored)."""
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return _pairs_to_halves(rows, self.arch.num_heads, self.arch.head_dim)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return _pairs_to_halves(rows, self.arch.num_kv_heads, self.arch.head_dim)
        return rows

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        targets = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head.data
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            targets |= {
                f"{p}input_layernorm.weight": layer.input_layernorm.weight.data,
                f"{p}post_attention_layernorm.weight": layer.post_attention_layernorm.weight.data,
            }
            targets |= attn.checkpoint_targets(f"{p}self_attn.")
            targets |= mlp.checkpoint_targets(f"{p}mlp.")  # (experts or a dense MLP)
        return targets


def _pairs_to_halves(tensor: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Each head's rows (x0, x1), (x2, x3), ... -> (x0, x2, ... | x1, x3, ...)."""
    rows = tensor.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2)
    return rows.reshape(tensor.shape).contiguous()
