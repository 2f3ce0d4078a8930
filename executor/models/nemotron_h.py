"""Nemotron-H: a hybrid decoder whose every layer is one mixer after one RMS norm, the mixer a
Mamba-2 state layer (executor/layers/mamba2.py), attention without a position embedding, an
MLP alone (down(relu2(up(x))), no gate), or Nemotron 3's experts alone (a sigmoid router with
a score-correction bias, ungated relu2 experts and a shared relu2 MLP: an MoEBlock, held as
the layer's `mlp` and named mlp.* here); zllm/model/families/nemotron_h.py reads the pattern.

    layer  h + mixer(norm(h))      (the norm adds the previous layer's output to the stream)

The stack is DecoderStack's (no rotary: the layers get cos and sin None): a state layer's
`kv_cache` is its LayerState and its metadata the step's StateStep, an attention layer's as for
any model; an MLP-only layer takes neither (None and the StateStep, unread).

The checkpoints' names are backbone.* (embeddings, layers.N.norm, layers.N.mixer.*, norm_f),
turned into model.* as they stream in (_canonical); A_log becomes the decay A = -exp(A_log).
A GGUF file's tensors come under zllm/model/families/nemotron_h.py's GGUF_NAMES, their
llama.cpp shapes undone here as for Granite 4.0-H.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator

import torch
from torch import nn

from zllm.executor.attention.backend import TORCH_ATTENTION, AttentionBackend
from zllm.executor.kv.state_pool import LayerState
from zllm.executor.layers.attention import SelfAttention
from zllm.executor.layers.decoder_stack import DecoderStack
from zllm.executor.layers.mamba2 import Mamba2Mixer, as_held
from zllm.executor.layers.mlp import UngatedMLP
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.checkpoint import per_expert_names, per_expert_weights
from zllm.executor.layers.moe.router import RELU2, SIGMOID_BIAS_TOPK, MoERule
from zllm.executor.layers.norms import RMSNorm
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import logits_weight
from zllm.executor.weights.checkpoint_copy import copy_checkpoint
from zllm.model.arch_config import ModelArchConfig

_GLOBAL_NAMES = {
    "backbone.embeddings.weight": "model.embed_tokens.weight",
    "backbone.norm_f.weight": "model.norm.weight",
}


class NemotronHLayer(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, dtype: torch.dtype, attention: AttentionBackend, layer: int
    ) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp: MoEBlock | None = None  # an expert layer's (expert_blocks.py looks here)
        self.mixer: nn.Module | None = None
        if arch.is_state_layer(layer):
            self.mixer = Mamba2Mixer(arch, dtype)
        elif arch.is_moe_layer(layer):
            self.mlp = _experts(arch, dtype)
        elif arch.is_mlp_only(layer):
            self.mixer = UngatedMLP(arch, dtype, arch.hidden_act)
        else:
            self.mixer = SelfAttention(arch, dtype, attention)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: torch.Tensor | LayerState | None,
        meta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.norm(x, residual)
        if self.mlp is not None:
            return self.mlp(x), residual
        if isinstance(self.mixer, SelfAttention):
            return self.mixer(x, None, None, cache, meta), residual
        if isinstance(self.mixer, Mamba2Mixer):
            return self.mixer(x, cache, meta), residual
        return self.mixer(x), residual


def _experts(arch: ModelArchConfig, dtype: torch.dtype) -> MoEBlock:
    moe = arch.moe
    rule = MoERule(
        router=SIGMOID_BIAS_TOPK,
        norm_topk_prob=moe.norm_topk_prob,
        activation=RELU2,
        group_count=moe.expert_group_count,
        groups_used=moe.expert_groups_used,
        routed_scaling=moe.routed_scaling_factor,
        shared_expert_gated=False,
        shared_name="shared_experts",
    )
    shared = moe.shared_expert_intermediate_size
    shared_expert = UngatedMLP(arch, dtype, RELU2, shared) if shared else None
    return MoEBlock(arch, dtype, rule, shared_expert=shared_expert)


class NemotronHForCausalLM(DecoderStack, nn.Module):
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
        self.embed_tokens = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        )
        self.rotary = None  # no position embedding
        self.layer_indices = pp.layer_range(arch.num_layers)
        self.layers = nn.ModuleList(
            NemotronHLayer(arch, dtype, attention, i) for i in self.layer_indices
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = logits_weight(arch, dtype, tp)
        self.logits_proj: nn.Module | None = None
        self.embed_rows: nn.Module | None = None
        self.requires_grad_(False)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], served: Container[str] = frozenset()
    ) -> None:
        weights = self._canonical(weights)
        if self.arch.moe is not None:
            weights = per_expert_weights(weights)
            served = per_expert_names(served, self.arch.moe.num_experts)
        copy_checkpoint(self, self._weight_targets(), weights, served=served)

    def _canonical(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under our targets' names (the module docstring)."""
        for name, tensor in weights:
            if name.startswith("mtp."):
                continue  # multi-token prediction: not run
            name = _GLOBAL_NAMES.get(name) or name.replace("backbone.layers.", "model.layers.", 1)
            layer = name.split(".")[2] if name.startswith("model.layers.") else ""
            if layer.isdecimal() and self.arch.is_moe_layer(int(layer)):  # its experts: mlp.*
                name = name.replace(".mixer.", ".mlp.", 1)
                name = name.replace("gate.e_score_correction.bias", "gate.e_score_correction_bias")
            yield as_held(name, tensor, "mixer")

    def block_matmul_targets(self) -> Iterator[tuple[nn.Module, str, list[str]]]:
        """(module, attribute, checkpoint names) of each decoder matmul a GGUF file's blocks
        (or a 16-bit checkpoint's rows) may serve (executor/weights/blocks.py)."""
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            m, mixer = f"model.layers.{i}.mixer.", layer.mixer
            if layer.mlp is not None:  # experts: expert_blocks.py; the shared MLP here
                shared = layer.mlp.shared_expert
                if shared is not None:
                    s = f"model.layers.{i}.mlp.shared_experts."
                    yield shared, "up_proj", [f"{s}up_proj.weight"]
                    yield shared, "down_proj", [f"{s}down_proj.weight"]
            elif isinstance(mixer, SelfAttention):
                yield mixer, "qkv_proj", [f"{m}{x}_proj.weight" for x in "qkv"]
                yield mixer, "o_proj", [f"{m}o_proj.weight"]
            elif isinstance(mixer, Mamba2Mixer):
                yield mixer, "in_proj", [f"{m}in_proj.weight"]
                yield mixer, "out_proj", [f"{m}out_proj.weight"]
            else:
                yield mixer, "up_proj", [f"{m}up_proj.weight"]
                yield mixer, "down_proj", [f"{m}down_proj.weight"]

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        targets = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if not self.arch.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.data
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            prefix = f"model.layers.{i}."
            targets[f"{prefix}norm.weight"] = layer.norm.weight.data
            mixer, m = layer.mixer, f"{prefix}mixer."
            if layer.mlp is not None:
                targets |= layer.mlp.checkpoint_targets(f"{prefix}mlp.")
            elif isinstance(mixer, Mamba2Mixer):
                targets |= mixer.checkpoint_targets(m)
            elif isinstance(mixer, SelfAttention):
                targets |= mixer.checkpoint_targets(m)
            else:
                targets[f"{m}up_proj.weight"] = mixer.up_proj.weight.data
                targets[f"{m}down_proj.weight"] = mixer.down_proj.weight.data
        return targets
