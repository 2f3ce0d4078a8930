"""Granite 4.0-H: a hybrid decoder whose layers are mostly Mamba-2 state layers
(executor/layers/mamba2.py) with an attention layer every few (layer_types), each followed by a
mixture of experts beside an always-on shared MLP (the shared MLP alone in a model without
experts). Granite's multipliers (zllm/model/families/granite_hybrid.py GraniteFields):

    x     = embed(tokens) * embedding_multiplier
    layer x + mixer(norm(x)) * residual_multiplier, then + mlp(norm(.)) * residual_multiplier
    mixer a state layer: its slot's conv window and recurrent state (no KV)
          an attention layer: scores scaled by attention_multiplier, no position embedding
          (RoPE when position_embedding_type is "rope")
    logits = lm_head(norm(x)) / logits_scaling

The stack is DecoderStack's: a state layer's `kv_cache` is its LayerState and its metadata the
step's StateStep (executor/kv/), an attention layer's as for any model.

The checkpoints' names are Granite-MoE's (block_sparse_moe.input_linear [E, gate | up, H],
output_linear, router.layer; shared_mlp.input_linear [gate | up, H], output_linear), turned
into our targets' as they stream in (_canonical); A_log becomes the decay A = -exp(A_log),
as llama.cpp's files store it (their ssm_* tensors come through executor/weights/loader.py
under zllm/model/families/granite_hybrid.py's GGUF_NAMES).
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Iterator

import torch
from torch import nn

from zllm.executor.attention.backend import TORCH_ATTENTION, AttentionBackend
from zllm.executor.kv.state_pool import LayerState
from zllm.executor.layers.attention import SelfAttention
from zllm.executor.layers.decoder_stack import DecoderStack
from zllm.executor.layers.mamba2 import Mamba2Mixer, as_held
from zllm.executor.layers.mlp import GatedMLP
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.checkpoint import per_expert_names, per_expert_weights
from zllm.executor.layers.moe.router import MoERule
from zllm.executor.layers.norms import RMSNorm
from zllm.executor.layers.rope import RotaryEmbedding
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import logits_weight
from zllm.executor.weights.checkpoint_copy import copy_checkpoint
from zllm.model.arch_config import ModelArchConfig

# Granite-MoE's names -> ours (the experts' fused forms, which per_expert_weights cuts).
_RENAMES = (
    (re.compile(r"\.block_sparse_moe\.router\.layer\.weight$"), ".mlp.gate.weight"),
    (re.compile(r"\.block_sparse_moe\.router\.weight$"), ".mlp.gate.weight"),
    (
        re.compile(r"\.block_sparse_moe\.(input_linear\.weight|experts\.gate_up_proj)$"),
        ".mlp.experts.gate_up_proj",
    ),  # fmt: skip
    (
        re.compile(r"\.block_sparse_moe\.(output_linear\.weight|experts\.down_proj)$"),
        ".mlp.experts.down_proj",
    ),  # fmt: skip
)
_SHARED = re.compile(r"\.shared_mlp\.(input_linear|output_linear)\.weight$")


class GraniteHybridLayer(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, dtype: torch.dtype, attention: AttentionBackend, layer: int
    ) -> None:
        super().__init__()
        fields = arch.family_fields
        self.residual_multiplier = fields.residual_multiplier
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        state = arch.is_state_layer(layer)
        self.mamba = Mamba2Mixer(arch, dtype) if state else None
        self.self_attn = (
            None
            if state
            else SelfAttention(
                arch,
                dtype,
                attention,
                output_bias=arch.attention_bias,  # (o_proj's bias goes with q/k/v's here)
                scale=fields.attention_multiplier,
            )
        )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        shared = GatedMLP(arch, dtype)  # (arch.intermediate_size is the shared MLP's)
        self.mlp: nn.Module = shared
        if arch.is_moe_layer(layer):
            # top k of the logits, softmax over those: softmax, top k, renormalised
            rule = MoERule(norm_topk_prob=True, shared_expert_gated=False)
            self.mlp = MoEBlock(arch, dtype, rule, shared_expert=shared)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: torch.Tensor | LayerState,
        meta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        if self.mamba is not None:
            x = self.mamba(x, cache, meta)
        else:
            x = self.self_attn(x, cos, sin, cache, meta)
        x, residual = self.post_attention_layernorm(x * self.residual_multiplier, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteHybridForCausalLM(DecoderStack, nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        attention: AttentionBackend = TORCH_ATTENTION,
        tp: TensorParallel = SINGLE,
        pp: PipelineParallel = WHOLE,
    ) -> None:
        super().__init__()
        if tp.enabled or pp.enabled:  # (the family lacks both; zllm/config refuses first)
            raise ValueError("a hybrid model runs on one rank")
        self.checkpoint_arch = self.arch = arch
        self.tp = tp
        self.dtype = dtype
        fields = arch.family_fields
        self.embedding_multiplier = fields.embedding_multiplier
        self.logits_scaling = fields.logits_scaling
        self.embed_tokens = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        )
        self.rotary = RotaryEmbedding(arch, dtype) if fields.rope else None
        self.layer_indices = pp.layer_range(arch.num_layers)
        self.layers = nn.ModuleList(
            GraniteHybridLayer(arch, dtype, attention, i) for i in self.layer_indices
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = logits_weight(arch, dtype, tp)
        self.logits_proj: nn.Module | None = None
        self.embed_rows: nn.Module | None = None
        self.requires_grad_(False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], served: Container[str] = frozenset()
    ) -> None:
        weights = self._canonical(weights)
        if self.arch.moe is not None:
            weights = per_expert_weights(weights)
            served = per_expert_names(served, self.arch.moe.num_experts)
        copy_checkpoint(
            self, self._weight_targets(), weights, recomputed=("rotary_emb.inv_freq",), served=served
        )  # fmt: skip

    def _canonical(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under our targets' names (the module docstring)."""
        for name, tensor in weights:
            for pattern, replacement in _RENAMES:
                name = pattern.sub(replacement, name)
            shared = _SHARED.search(name)
            if shared is not None:
                base = name[: shared.start()] + (
                    ".mlp.shared_expert." if self.arch.moe is not None else ".mlp."
                )
                if shared.group(1) == "input_linear":
                    gate, up = tensor.chunk(2)
                    yield base + "gate_proj.weight", gate
                    yield base + "up_proj.weight", up
                else:
                    yield base + "down_proj.weight", tensor
            else:
                yield as_held(name, tensor, "mamba")

    def block_matmul_targets(self) -> Iterator[tuple[nn.Module, str, list[str]]]:
        """(module, attribute, checkpoint names) of each decoder matmul a GGUF file's blocks
        (or a 16-bit checkpoint's rows) may serve (executor/weights/blocks.py)."""
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            p = f"model.layers.{i}."
            if layer.mamba is not None:
                yield layer.mamba, "in_proj", [f"{p}mamba.in_proj.weight"]
                yield layer.mamba, "out_proj", [f"{p}mamba.out_proj.weight"]
            else:
                attn = layer.self_attn
                yield attn, "qkv_proj", [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
                yield attn, "o_proj", [f"{p}self_attn.o_proj.weight"]
            mlp, m = layer.mlp, f"{p}mlp."
            if isinstance(mlp, MoEBlock):  # experts: expert_blocks.py; the shared one as an MLP
                mlp, m = mlp.shared_expert, f"{m}shared_expert."
            yield mlp, "gate_up_proj", [f"{m}gate_proj.weight", f"{m}up_proj.weight"]
            yield mlp, "down_proj", [f"{m}down_proj.weight"]

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        targets = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if not self.arch.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.data
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            prefix = f"model.layers.{i}."
            targets[f"{prefix}input_layernorm.weight"] = layer.input_layernorm.weight.data
            targets[f"{prefix}post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm.weight.data
            )
            if layer.mamba is not None:
                targets |= layer.mamba.checkpoint_targets(f"{prefix}mamba.")
            else:
                targets |= layer.self_attn.checkpoint_targets(f"{prefix}self_attn.")
            targets |= layer.mlp.checkpoint_targets(f"{prefix}mlp.")  # (experts or dense)
        return targets
