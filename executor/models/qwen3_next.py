"""Qwen3-Next and Qwen3.5: hybrid decoders whose layers are mostly Gated DeltaNet state layers
(executor/layers/gated_delta_net.py) with a full-attention layer every few (layer_types),
each followed by a dense MLP (Qwen3.5) or a mixture of experts with a sigmoid-gated shared
expert (Qwen3-Next, Qwen3.5-MoE).

    layer     x + mixer(norm(x)), then + mlp(norm(.))
    mixer     a state layer: its slot's conv window and recurrent state (no KV)
              an attention layer: Qwen 3's q/k head norms, RoPE over part of each head
              (partial_rotary_factor), its output times sigmoid(gate) before o_proj

The stack is DecoderStack's: a state layer's `kv_cache` is its LayerState and its metadata
the step's StateStep (executor/kv/), an attention layer's as for any model.

How the checkpoints differ from our layout, undone as the weights stream in (_canonical):
their RMS norms multiply by (1 + weight) (the gated norm of the state layers excepted), so
1 is added once; Qwen3-Next's in_proj_qkvz interleaves q, k, v, z per key head, where
Qwen3.5's projections are already ours (q_proj's interleaved query and gate per head, and
Qwen3-Next's in_proj_ba's b and a per key head, are kept as stored: the layers read them
so, and a GGUF file's blocks serve them as they are); A_log becomes the decay A = -exp(A_log), as llama.cpp's files store it;
multi-token-prediction heads (mtp.*) are not run, so not loaded, nor is a Qwen3.5
checkpoint's vision tower (its decoder's names lose "language_model."). A GGUF file comes
through executor/weights/loader.py under these names (zllm/model/state_arch.py
HYBRID_GGUF_NAMES), its norms with the one llama.cpp added taken off again there.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Iterator

import torch
from torch import nn

from zllm.executor.attention.backend import TORCH_ATTENTION, AttentionBackend
from zllm.executor.kv.state_pool import LayerState
from zllm.executor.layers.attention import SelfAttention
from zllm.executor.layers.decoder_mlp import make_mlp
from zllm.executor.layers.decoder_stack import DecoderStack
from zllm.executor.layers.gated_delta_net import GatedDeltaNet, in_proj_names
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.checkpoint import per_expert_names, per_expert_weights
from zllm.executor.layers.norms import RMSNorm
from zllm.executor.layers.rope import RotaryEmbedding
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import logits_weight
from zllm.executor.weights.checkpoint_copy import copy_checkpoint
from zllm.model.arch_config import ModelArchConfig

# The norms stored as weight - 1 (all but the state layers' gated norm, linear_attn.norm).
_PLUS_ONE_NORMS = re.compile(
    r"(^model\.norm|\.input_layernorm|\.post_attention_layernorm|\.self_attn\.[qk]_norm)\.weight$"
)


class HybridDecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, dtype: torch.dtype, attention: AttentionBackend, layer: int
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.linear_attn = GatedDeltaNet(arch, dtype) if arch.is_state_layer(layer) else None
        self.self_attn = (
            None
            if self.linear_attn is not None
            else SelfAttention(arch, dtype, attention, output_gate=True)
        )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = make_mlp(arch, layer, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor | LayerState,
        meta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        if self.linear_attn is not None:
            x = self.linear_attn(x, cache, meta)
        else:
            x = self.self_attn(x, cos, sin, cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3NextForCausalLM(DecoderStack, nn.Module):
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
        self.rotary = RotaryEmbedding(arch, dtype)
        self.layer_indices = pp.layer_range(arch.num_layers)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(arch, dtype, attention, i) for i in self.layer_indices
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
        """The checkpoint's tensors in our layout (the module docstring says what changes)."""
        s = self.arch.state
        assert s is not None
        per_group = s.num_heads // s.num_key_heads  # value heads per key head
        for name, tensor in weights:
            if name.startswith(("mtp.", "model.visual.")):
                continue  # multi-token prediction, a vision tower: not run
            if name.startswith("model.language_model."):  # a vision-language checkpoint's
                name = "model." + name.removeprefix("model.language_model.")
            if _PLUS_ONE_NORMS.search(name):
                yield name, tensor + 1
            elif name.endswith("linear_attn.A_log"):  # as transformers computes the decay
                yield name.removesuffix("_log"), -tensor.float().exp().to(tensor.dtype)
            elif name.endswith("linear_attn.dt.bias"):  # (a GGUF file's ssm_dt.bias)
                yield name.removesuffix(".dt.bias") + ".dt_bias", tensor
            elif name.endswith("linear_attn.conv1d.weight") and tensor.dim() == 2:
                yield name, tensor.unsqueeze(1)  # (llama.cpp squeezes the channel dim)
            elif name.endswith("mlp.shared_expert_gate.weight") and tensor.dim() == 1:
                yield name, tensor.unsqueeze(0)  # (and its qwen35moe files, this one's row)
            elif name.endswith("linear_attn.in_proj_qkvz.weight"):
                value_width = per_group * s.value_head_dim
                widths = [s.key_head_dim, s.key_head_dim, value_width, value_width]
                groups = tensor.view(s.num_key_heads, sum(widths), -1)
                q, k, v, z = (
                    part.reshape(-1, tensor.shape[-1]) for part in groups.split(widths, 1)
                )
                base = name.removesuffix("in_proj_qkvz.weight")
                yield base + "in_proj_qkv.weight", torch.cat((q, k, v))
                yield base + "in_proj_z.weight", z
            else:
                yield name, tensor

    def block_matmul_targets(self) -> Iterator[tuple[nn.Module, str, list[str]]]:
        """(module, attribute, checkpoint names) of each decoder matmul a GGUF file's blocks
        (or a 16-bit checkpoint's rows) may serve (executor/weights/blocks.py)."""
        grouped = self.arch.state.grouped_beta_alpha
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            p = f"model.layers.{i}."
            if layer.linear_attn is not None:
                gdn, a = layer.linear_attn, f"{p}linear_attn."
                yield gdn, "in_proj", in_proj_names(a, grouped)
                yield gdn, "out_proj", [f"{a}out_proj.weight"]
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
            if layer.linear_attn is not None:
                targets |= layer.linear_attn.checkpoint_targets(f"{prefix}linear_attn.")
            else:
                targets |= layer.self_attn.checkpoint_targets(f"{prefix}self_attn.")
            targets |= layer.mlp.checkpoint_targets(f"{prefix}mlp.")  # (experts or dense)
        return targets
