"""DeepSeek-V2's and DeepSeek-V3's decoder with multi-head latent attention (MLA), over a flat
token batch.

A layer as transformers' DeepseekV2ForCausalLM computes it (its names, its arithmetic):

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))   (or q_proj(x))   [T, heads, nope + rope]
    c_kv|k_pe = kv_a_proj_with_mqa(x)                                   [T, kv_lora_rank + rope]
    latent   = [kv_a_layernorm(c_kv) | rope(k_pe)]    one row per token: what the pool keeps
    out      = o_proj(attention(q_nope, rope(q_pe), latent; kv_b_proj))
    mlp      = down(silu(gate(x)) * up(x))            the first_k_dense_replace dense layers
    moe      = routed(x) + shared_experts(x)          the others (every moe_layer_freq-th)

A mixture-of-experts layer (executor/layers/moe/'s DeepSeek rule): softmax over the
n_routed_experts router logits, the top num_experts_per_tok among the topk_group best groups
(group_limited_greedy; greedy: among all), optionally renormalised, times routed_scaling_factor;
the shared experts are one ungated MLP of n_shared_experts x moe_intermediate_size.
DeepSeek-V3's router instead takes sigmoid scores, chooses by score plus the layer's
e_score_correction_bias among the topk_group groups of the highest two-best sums, and weights by
the unbiased scores (layers/moe/router.py SIGMOID_BIAS_TOPK).

RoPE rotates adjacent pairs of the rope dims (transformers' complex multiply for DeepSeek-V2,
its rope_interleave for V3, llama.cpp's "norm" rope); a V3 config with rope_interleave false
rotates Llama's two halves. kv_b_proj stays one dense [heads, nope + v,
kv_lora_rank] weight whose halves are W_UK and W_UV (executor/attention/mla.py absorbs them in
decode). The softmax scale is (nope + rope) ** -0.5, times mscale(factor, mscale_all_dim) ** 2
under YaRN (DeepSeek's long-context correction, transformers' yarn_apply_mscale).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Iterable, Iterator

import torch
from torch import nn

from zllm.executor.attention.backend import (
    TORCH_ATTENTION,
    AttentionBackend,
    StepAttentionMetadata,
)
from zllm.executor.attention.mla import PagedLatentAttention
from zllm.executor.layers.decoder_stack import DecoderStack
from zllm.executor.layers.linear.dense import empty_linear
from zllm.executor.layers.mlp import GatedMLP
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.checkpoint import per_expert_names, per_expert_weights
from zllm.executor.layers.moe.router import deepseek_rule
from zllm.executor.layers.norms import RMSNorm
from zllm.executor.layers.rope import RotaryEmbedding
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import logits_weight
from zllm.executor.weights.checkpoint_copy import copy_checkpoint
from zllm.model.arch_config import MLAConfig, ModelArchConfig
from zllm.model.families.deepseek_v2 import LATENT_NORM_EPS


def mla_softmax_scale(arch: ModelArchConfig, mla: MLAConfig) -> float:
    """(nope + rope) ** -0.5, with YaRN's mscale_all_dim correction squared (transformers'
    yarn_apply_mscale: any rope type but default that carries mscale_all_dim)."""
    scale = mla.qk_head_dim**-0.5
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    mscale_all_dim = scaling.get("mscale_all_dim")
    factor = scaling.get("factor") or 1.0
    if rope_type != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, rope] rotated by adjacent pairs (x0, x1), (x2, x3), ...: each pair times
    cos + i sin, as transformers' DeepSeek-V2 does in complex numbers. cos/sin [T, 1, rope/2]."""
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, rope] rotated as two halves (x_i, x_{i + rope/2}): Llama's rotate_half,
    a DeepSeek-V3 config's rope_interleave false. cos/sin [T, 1, rope/2]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class DeepseekV2Attention(nn.Module):
    """MLA's projections around PagedLatentAttention (HF's module names)."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None
        self.mla = mla
        self.rope = rope_pairs if mla.rope_interleave else rope_halves
        self.num_heads = arch.num_heads
        hidden, heads = arch.hidden_size, arch.num_heads
        q_width = heads * mla.qk_head_dim
        bias = arch.attention_bias
        self.q_proj: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = empty_linear(hidden, q_width, dtype)
        else:
            self.q_a_proj = empty_linear(hidden, mla.q_lora_rank, dtype, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = empty_linear(mla.q_lora_rank, q_width, dtype)
        self.kv_a_proj_with_mqa = empty_linear(hidden, mla.latent_width, dtype, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype)
        # kv_b_proj's rows per head: W_UK [nope] then W_UV [v], each over the latent.
        self.kv_b = nn.Parameter(
            torch.empty(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank, dtype=dtype)
        )
        self.o_proj = empty_linear(heads * mla.v_head_dim, hidden, dtype, bias=bias)
        self.attn = PagedLatentAttention(
            heads, mla.kv_lora_rank, mla.qk_rope_head_dim, mla_softmax_scale(arch, mla)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepAttentionMetadata,
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split((mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split((mla.kv_lora_rank, mla.qk_rope_head_dim), -1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())[0]
        k_pe = self.rope(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        latent = torch.cat((c_kv, k_pe), dim=-1)
        w_uk, w_uv = self.kv_b.split((mla.qk_nope_head_dim, mla.v_head_dim), dim=1)
        out = self.attn(q_nope, self.rope(q_pe, cos, sin), latent, w_uk, w_uv, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * mla.v_head_dim))


def make_deepseek_mlp(arch: ModelArchConfig, layer: int, dtype: torch.dtype) -> nn.Module:
    """Layer `layer`'s MLP: dense (silu(gate) * up, as DeepseekV2MLP), or routed experts with
    the shared ones beside them (DeepseekV2Moe)."""
    if not arch.is_moe_layer(layer):
        return GatedMLP(arch, dtype)
    shared = arch.moe.shared_expert_intermediate_size
    shared_experts = GatedMLP(arch, dtype, intermediate_size=shared) if shared else None
    return MoEBlock(arch, dtype, deepseek_rule(arch), shared_expert=shared_experts)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = DeepseekV2Attention(arch, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = make_deepseek_mlp(arch, layer, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes and returns (the last sublayer's output, the residual stream before it)."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekV2ForCausalLM(DecoderStack, nn.Module):
    """The model runner's interface, as LlamaForCausalLM's (embed, forward_layers,
    final_norm, compute_logits, load_weights; pipeline stages by layer_indices)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        attention: AttentionBackend = TORCH_ATTENTION,
        tp: TensorParallel = SINGLE,
        pp: PipelineParallel = WHOLE,
    ) -> None:
        """`attention` is not read: MLA attends by executor/attention/mla.py whatever the
        backend (whose metadata, the torch one's, the runner builds: executor/host/layout.py).
        Tensor parallelism is refused before this (the family lacks it:
        zllm/config/capabilities.py)."""
        super().__init__()
        del attention
        if arch.mla is None:
            raise ValueError(f"{arch.architecture}: no multi-head latent attention sizes")
        if tp.enabled:
            raise ValueError("DeepSeek-V2 (MLA) runs on one tensor-parallel rank")
        self.checkpoint_arch = arch
        self.arch = arch
        self.tp = tp
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        )
        # RoPE over the rope dims only: the table of a head of qk_rope_head_dim.
        rope_arch = dataclasses.replace(arch, head_dim=arch.mla.qk_rope_head_dim)
        self.rotary = RotaryEmbedding(rope_arch, dtype)
        self.layer_indices = pp.layer_range(arch.num_layers)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(arch, i, dtype) for i in self.layer_indices
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
        """Hugging Face-named tensors in, one at a time (copy_checkpoint); stacked or fused
        expert tensors cut into each expert's (layers/moe/checkpoint.py). DeepSeek-V3's
        multi-token-prediction block (layers from num_hidden_layers on) is no layer of the
        model: copy_checkpoint skips it as another stage's."""
        if self.arch.moe is not None:
            weights = per_expert_weights(weights)
            served = per_expert_names(served, self.arch.moe.num_experts)
        copy_checkpoint(
            self,
            self._weight_targets(),
            weights,
            recomputed=("rotary_emb.inv_freq",),
            served=served,
        )

    def block_matmul_targets(self) -> Iterator[tuple[nn.Module, str, list[str]]]:
        """(module, attribute, checkpoint names) of the matmuls GGUF blocks or 16-bit rows may
        serve (executor/weights/blocks.py). kv_b_proj stays dense: decode splits it per head.
        The routed experts' are expert_blocks.py's; the shared experts are an MLP's."""
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            projections = ["q_proj"] if attn.q_proj is not None else ["q_a_proj", "q_b_proj"]
            for name in [*projections, "kv_a_proj_with_mqa", "o_proj"]:
                yield attn, name, [f"{p}self_attn.{name}.weight"]
            m = f"{p}mlp."
            if isinstance(mlp, MoEBlock):
                if mlp.shared_expert is None:
                    continue
                mlp, m = mlp.shared_expert, f"{m}shared_experts."
            yield mlp, "gate_up_proj", [f"{m}gate_proj.weight", f"{m}up_proj.weight"]
            yield mlp, "down_proj", [f"{m}down_proj.weight"]

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """Each Hugging Face weight name -> the tensor (or view) it fills."""
        targets = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head.data
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            prefix = f"model.layers.{i}."
            targets |= {prefix + name: t for name, t in _layer_targets(layer).items()}
        return targets


def _layer_targets(layer: DeepseekV2DecoderLayer) -> dict[str, torch.Tensor]:
    attn, mlp = layer.self_attn, layer.mlp
    modules: dict[str, nn.Module] = {
        "self_attn.kv_a_proj_with_mqa": attn.kv_a_proj_with_mqa,
        "self_attn.kv_a_layernorm": attn.kv_a_layernorm,
        "self_attn.o_proj": attn.o_proj,
        "input_layernorm": layer.input_layernorm,
        "post_attention_layernorm": layer.post_attention_layernorm,
    }
    if attn.q_proj is not None:
        modules["self_attn.q_proj"] = attn.q_proj
    else:
        modules |= {
            "self_attn.q_a_proj": attn.q_a_proj,
            "self_attn.q_a_layernorm": attn.q_a_layernorm,
            "self_attn.q_b_proj": attn.q_b_proj,
        }
    targets = {f"{name}.weight": module.weight.data for name, module in modules.items()}
    targets |= {
        f"{name}.bias": module.bias.data
        for name, module in modules.items()
        if getattr(module, "bias", None) is not None
    }
    targets["self_attn.kv_b_proj.weight"] = attn.kv_b.data.view(-1, attn.kv_b.shape[-1])
    if isinstance(mlp, MoEBlock):
        return targets | mlp.checkpoint_targets("mlp.")
    gate, up = mlp.gate_up_proj.weight.data.split(mlp.intermediate_size)
    targets["mlp.gate_proj.weight"], targets["mlp.up_proj.weight"] = gate, up
    targets["mlp.down_proj.weight"] = mlp.down_proj.weight.data
    return targets
