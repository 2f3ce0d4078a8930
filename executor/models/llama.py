"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) over a flat, unpadded token batch.

Per layer, q/k/v are one GEMM into a fused [q | k | v] projection and gate/up are one GEMM into
a fused [gate | up] projection; load_weights fills the fused matrices from Hugging Face's
separate tensors (Phi-3 checkpoints store them fused already). Attention reads and writes the
paged KV cache through the layers of the attention backend the model is built with
(zllm.executor.attention.backend; torch by default). The layers are executor/layers/'s: its
self-attention, gated MLP, mixture of experts, RMS norms, rotary embedding and decoder stack.

What the family members add, each switched on by ModelArchConfig:
  - Qwen2: q/k/v biases (attention_bias);
  - Qwen3: an RMSNorm over each query and key head before RoPE (qk_norm: layers/norms.py QKNorm);
  - Phi-3: LongRoPE scaling, RoPE over part of each head (partial_rotary_factor);
  - Mistral, Phi-3, Qwen2/3: sliding-window layers (the attention metadata windows them);
  - Llama 3.x GGUFs: per-frequency RoPE divisors (rope_freq_factors);
  - Qwen3-MoE, Qwen2-MoE, Mixtral: mixture-of-experts MLPs in the layers ModelArchConfig's
    is_moe_layer names (executor/layers/moe/), Qwen2-MoE's with a shared expert.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

import torch
from torch import nn

from zllm.executor.attention.backend import (
    TORCH_ATTENTION,
    AttentionBackend,
    StepAttentionMetadata,
)
from zllm.executor.layers.attention import SelfAttention
from zllm.executor.layers.decoder_mlp import make_mlp
from zllm.executor.layers.decoder_stack import DecoderStack
from zllm.executor.layers.mlp import GatedMLP
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.checkpoint import per_expert_names, per_expert_weights
from zllm.executor.layers.norms import RMSNorm
from zllm.executor.layers.rope import RotaryEmbedding
from zllm.executor.layers.stack_parts import LayerParts, StackParts
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import local_arch, logits_weight
from zllm.executor.weights.checkpoint_copy import copy_checkpoint
from zllm.model.arch_config import ModelArchConfig
from zllm.model.registry import family_of


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        attention: AttentionBackend,
        tp: TensorParallel = SINGLE,
        layer: int = 0,
    ) -> None:
        """`layer`: its index in the whole model (which MLP it has)."""
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(arch, dtype, attention, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = make_mlp(arch, layer, dtype, tp)
        # False: a NoPE layer (arch.nope_layers), its queries and keys not rotated.
        self.rope = layer not in arch.nope_layers

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: StepAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes and returns (the last sublayer's output, the residual stream before it)."""
        x, residual = self.input_layernorm(x, residual)
        if not self.rope:
            cos = sin = None
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(DecoderStack, nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        attention: AttentionBackend = TORCH_ATTENTION,
        tp: TensorParallel = SINGLE,
        pp: PipelineParallel = WHOLE,
    ) -> None:
        """`attention`: the backend every layer attends with (attention_backend.py). `arch` is
        the checkpoint's; with `tp` this rank builds its part (self.arch: that part's), with
        `pp` only its stage's layers (self.layers[i] is layer layer_indices[i])."""
        super().__init__()
        if arch.num_heads % arch.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={arch.num_heads} must be a multiple of num_kv_heads={arch.num_kv_heads}"
            )
        self.checkpoint_arch = arch
        self.tp = tp
        # Phi-3's checkpoints store qkv_proj and gate_up_proj fused, in our order.
        self.fused_checkpoint = family_of(arch).fused_checkpoint
        arch = local_arch(arch, tp)
        self.arch = arch
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        )
        self.rotary = RotaryEmbedding(arch, dtype)
        self.layer_indices = pp.layer_range(arch.num_layers)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, dtype, attention, tp, i) for i in self.layer_indices
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = logits_weight(arch, dtype, tp)
        # A classifier's head (arch.num_labels rows, whole on every rank): executor/pooling.py
        # reads the last token's hidden state through it.
        self.score = (
            nn.Parameter(torch.empty(arch.num_labels, arch.hidden_size, dtype=dtype))
            if arch.num_labels
            else None
        )
        # Set by quantization: modules computing logits and looking up embedding rows in place
        # of the fp32 tensors (which it then releases).
        self.logits_proj: nn.Module | None = None
        self.embed_rows: nn.Module | None = None
        self.requires_grad_(False)  # inference only; the KV cache writes must not build graphs

    def classify(self, vector: torch.Tensor) -> torch.Tensor:
        """A classifier's logits: its score rows over the pooled (last) hidden state."""
        if self.score is None:
            raise RuntimeError(f"this {self.arch.architecture} model has no score head")
        return self.score.float() @ vector.float()

    def decode_stack_parts(self) -> StackParts:
        """The layers by role, for the fused CPU decode step (layers/stack_parts.py): pre-norm
        layers with SwiGLU MLPs, Qwen 3's head norms where present. Dense layers only: a
        mixture of experts has no gate_up matmul (the fused step refuses those models first)."""
        layers = []
        for layer in self.layers:
            attn, mlp, qk = layer.self_attn, layer.mlp, layer.self_attn.qk_norm
            layers.append(
                LayerParts(
                    attn_norm=layer.input_layernorm,
                    ffn_norm=layer.post_attention_layernorm,
                    qkv=attn.qkv_proj,
                    o=attn.o_proj,
                    gate_up=mlp.gate_up_proj,
                    down=mlp.down_proj,
                    attention=attn.attn,
                    q_norm=None if qk is None else qk.q_norm,
                    k_norm=None if qk is None else qk.k_norm,
                    rope=layer.rope,
                )
            )
        return StackParts(layers, final_norm=self.norm, activation="silu", rope=self.rotary)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], served: Container[str] = frozenset()
    ) -> None:
        """Copy Hugging Face-named tensors in, one at a time (so a stream of shards works);
        `served`: names the checkpoint leaves out (copy_checkpoint)."""
        if self.arch.moe is not None:  # each expert's own tensors (moe.py)
            weights = per_expert_weights(weights)
            served = per_expert_names(served, self.arch.moe.num_experts)
        copy_checkpoint(
            self,
            self._weight_targets(),
            weights,
            recomputed=("rotary_emb.inv_freq",),
            served=served,
        )
        if self.arch.classifier_tokens is not None:
            self._score_from_lm_head(self.arch.classifier_tokens)

    def _score_from_lm_head(self, tokens: list[int]) -> None:
        """A classifier made from the LM head (--hf-overrides classifier_from_token): its
        tokens' rows; one label from two tokens, the second's row less the first's (so its
        sigmoid is the softmax of the pair's logits at the second: Qwen3-Reranker's yes)."""
        assert self.score is not None
        if self.tp.enabled:
            raise ValueError(
                "--hf-overrides classifier_from_token: the LM head's rows are cut over tensor "
                "ranks; run it on one rank"
            )
        head = self.embed_tokens if self.lm_head is None else self.lm_head  # (tied: the embedding)
        rows = head.data[tokens].float()
        if self.arch.num_labels == 1 and len(tokens) == 2:
            rows = rows[1:] - rows[:1]
        self.score.data.copy_(rows.to(self.score.dtype))

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """Each Hugging Face weight name -> the tensor (a row slice for fused ones) it fills."""
        targets = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if not self.arch.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.data
        if self.score is not None and self.arch.classifier_tokens is None:
            targets["score.weight"] = self.score.data
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            if self.fused_checkpoint and not isinstance(mlp, MoEBlock):
                targets |= self._fused_targets(prefix, attn, mlp)
            else:
                targets |= attn.checkpoint_targets(f"{prefix}self_attn.")
                targets |= mlp.checkpoint_targets(f"{prefix}mlp.")
            targets[f"{prefix}input_layernorm.weight"] = layer.input_layernorm.weight.data
            targets[f"{prefix}post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm.weight.data
            )
        return targets

    @staticmethod
    def _fused_targets(prefix: str, attn: SelfAttention, mlp: GatedMLP) -> dict[str, torch.Tensor]:
        """Phi-3's qkv_proj and gate_up_proj tensors -> our fused matrices, whole."""
        targets = {
            f"{prefix}self_attn.qkv_proj.weight": attn.qkv_proj.weight.data,
            f"{prefix}self_attn.o_proj.weight": attn.o_proj.weight.data,
            f"{prefix}mlp.gate_up_proj.weight": mlp.gate_up_proj.weight.data,
            f"{prefix}mlp.down_proj.weight": mlp.down_proj.weight.data,
        }
        if attn.qkv_proj.bias is not None:
            targets[f"{prefix}self_attn.qkv_proj.bias"] = attn.qkv_proj.bias.data
        return targets
