"""gpt-oss (GptOssForCausalLM) over a flat, unpadded token batch.

A pre-norm decoder as Llama's (executor/models/llama.py), with, as transformers computes them:

    attention   q/k/v and o with biases; a sink logit per query head in every softmax's
                denominator (`sinks`, fp32 [heads], passed to the attention layer each call:
                executor/attention/sinks.py and the kernels); YaRN RoPE (rotate-half)
    layers      sliding-window (128) and full attention alternating: the model runner gives
                sliding layers window-limited metadata over their own KV cache groups (the
                hybrid cache, as Gemma 3's)
    MLP         a mixture of experts on every layer (executor/layers/moe/, GPT_OSS_RULE):
                a router with a bias, softmax over each token's top-k logits, experts with
                biases and the clamped SwiGLU (clamp(up) + 1) * g * sigmoid(1.702 g)

Every source fills one layout, each expert's gate_up rows as [gate | up] (the rule's
interleaved_gate_up off), under the MoE layer's per-expert names
(`mlp.experts.{e}.gate_proj.weight`):

    config.json checkpoints   mlp.router.*; mlp.experts.gate_up_proj [E, hidden, 2I], its
                              columns alternating gate, up (and its _bias); down_proj [E, I, hidden]
    MXFP4 checkpoints         mlp.experts.{gate_up,down}_proj_{blocks,scales} (weights/mxfp4.py)
    GGUF (llama.cpp gpt-oss)  ffn_{gate,up,down}_exps weights and biases (gate and up apart),
                              ffn_gate_inp (the router), attn_sinks, post_attention_norm

MXFP4 experts stay in blocks, never widened: a GGUF file's through executor/weights/
expert_blocks.py, a checkpoint's repacked as GGUF's MXFP4 blocks here, where the CPU kernels
serve the model (the cpu-kernels attention backend: CPU, fp32); elsewhere (a GPU) they are
dequantized to the model's dtype.
"""

from __future__ import annotations

import dataclasses
import re
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
from zllm.executor.layers.moe.block import MoEBlock
from zllm.executor.layers.moe.checkpoint import per_expert_names
from zllm.executor.layers.moe.router import GPT_OSS_RULE
from zllm.executor.layers.norms import RMSNorm
from zllm.executor.layers.rope import RotaryEmbedding
from zllm.executor.parallel.groups import SINGLE, WHOLE, PipelineParallel, TensorParallel
from zllm.executor.parallel.shards import local_arch, logits_weight
from zllm.executor.weights import mxfp4
from zllm.executor.weights.checkpoint_copy import copy_checkpoint
from zllm.model.arch_config import ModelArchConfig

RULE = dataclasses.replace(GPT_OSS_RULE, interleaved_gate_up=False)


class GptOssDecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, dtype: torch.dtype, attention: AttentionBackend
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        # q/k/v and o with biases, a sink logit per head (layers/attention.py)
        self.self_attn = SelfAttention(
            arch, dtype, attention, output_bias=arch.attention_bias, sinks=True
        )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MoEBlock(arch, dtype, RULE)

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


class GptOssForCausalLM(DecoderStack, nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        attention: AttentionBackend = TORCH_ATTENTION,
        tp: TensorParallel = SINGLE,
        pp: PipelineParallel = WHOLE,
    ) -> None:
        """`arch` is the checkpoint's; with `pp` only its stage's layers are built
        (self.layers[i] is layer layer_indices[i]). Tensor parallelism does not split the
        experts yet (zllm/config/parallel.py refuses it first)."""
        super().__init__()
        if tp.enabled:
            raise ValueError("tensor parallelism does not split gpt-oss's experts yet")
        if arch.num_heads % arch.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={arch.num_heads} must be a multiple of num_kv_heads={arch.num_kv_heads}"
            )
        self.checkpoint_arch = arch
        self.tp = tp
        self.arch = arch = local_arch(arch, tp)
        self.dtype = dtype
        # MXFP4 checkpoint experts held in blocks only where the CPU kernels run the model.
        self.holds_mxfp4 = attention.name == "cpu-kernels"
        self.embed_tokens = nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        )
        self.rotary = RotaryEmbedding(arch, dtype)
        self.layer_indices = pp.layer_range(arch.num_layers)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(arch, dtype, attention) for _ in self.layer_indices
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = logits_weight(arch, dtype, tp)
        # Set by quantization: modules computing logits and looking up embedding rows in place
        # of the fp32 tensors (which it then releases).
        self.logits_proj: nn.Module | None = None
        self.embed_rows: nn.Module | None = None
        self.requires_grad_(False)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], served: Container[str] = frozenset()
    ) -> None:
        """Checkpoint tensors under any source's names (module docstring), one at a time;
        `served`: names the loader left out (GGUF blocks serve them)."""
        held: set[str] = set()  # experts this load holds as MXFP4 blocks (filled as it goes)
        served_or_held = _Union(per_expert_names(served, self.arch.moe.num_experts), held)
        canonical = _canonical_names(weights, self.arch.moe.num_experts)
        stream = _MXFP4Experts(self, held).take(canonical)
        copy_checkpoint(
            self,
            self._weight_targets(),
            stream,
            recomputed=("rotary_emb.inv_freq",),
            served=served_or_held,
        )

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """Each canonical weight name -> the tensor (a row slice for fused ones) it fills."""
        targets = {
            "model.embed_tokens.weight": self.embed_tokens.data,
            "model.norm.weight": self.norm.weight.data,
        }
        if not self.arch.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.data
        for i, layer in zip(self.layer_indices, self.layers, strict=True):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            targets |= attn.checkpoint_targets(f"{prefix}self_attn.")
            targets[f"{prefix}input_layernorm.weight"] = layer.input_layernorm.weight.data
            targets[f"{prefix}post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm.weight.data
            )
            targets |= mlp.checkpoint_targets(f"{prefix}mlp.")
            targets |= _bias_targets(f"{prefix}mlp.", mlp)
        return targets


def _bias_targets(prefix: str, mlp: MoEBlock) -> dict[str, torch.Tensor]:
    """The router's and every expert's biases (MoEBlock.checkpoint_targets names the weights)."""
    targets = {f"{prefix}gate.bias": mlp.gate.bias.data}
    gate_up, down = mlp.experts_gate_up.bias, mlp.experts_down.bias
    for e in range(mlp.num_experts):
        gate, up = gate_up.data[e].split(mlp.intermediate_size)
        targets[f"{prefix}experts.{e}.gate_proj.bias"] = gate
        targets[f"{prefix}experts.{e}.up_proj.bias"] = up
        targets[f"{prefix}experts.{e}.down_proj.bias"] = down.data[e]
    return targets


class _Union(Container[str]):
    """Names in either collection (the second grows while the load streams)."""

    def __init__(self, first: Container[str], second: Container[str]) -> None:
        self.first, self.second = first, second

    def __contains__(self, name: object) -> bool:
        return name in self.first or name in self.second


_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.)(router|experts)\.(.+)")


def _canonical_names(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream under the names the model's targets use: the router as `gate`, each
    expert's own tensors (views) from a checkpoint's fused, transposed, interleaved ones and
    from a GGUF file's stacks; GGUF's `sinks.weight` as the checkpoint's `sinks`. MXFP4
    tensors pass through (_MXFP4Experts takes them)."""
    for name, tensor in weights:
        if name.endswith("self_attn.sinks.weight"):
            yield name.removesuffix(".weight"), tensor
            continue
        match = _EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, kind, rest = match.groups()
        if kind == "router":
            yield f"{prefix}gate.{rest}", tensor
        elif rest.endswith(("_blocks", "_scales")):
            yield name, tensor
        else:
            yield from _expert_tensors(prefix + "experts.", rest, tensor, num_experts)


def _expert_tensors(
    prefix: str, rest: str, tensor: torch.Tensor, num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked or fused expert tensor `prefix + rest` as each expert's."""
    if tensor.shape[0] != num_experts:
        raise ValueError(f"{prefix}{rest} holds {tensor.shape[0]} experts, not {num_experts}")
    for e in range(num_experts):
        t = tensor[e]
        if rest == "gate_up_proj":  # [hidden, 2I], columns gate, up, gate, up, ...
            yield f"{prefix}{e}.gate_proj.weight", t[:, 0::2].T
            yield f"{prefix}{e}.up_proj.weight", t[:, 1::2].T
        elif rest == "gate_up_proj_bias":
            yield f"{prefix}{e}.gate_proj.bias", t[0::2]
            yield f"{prefix}{e}.up_proj.bias", t[1::2]
        elif rest == "down_proj":  # [I, hidden]
            yield f"{prefix}{e}.down_proj.weight", t.T
        elif rest == "down_proj_bias":
            yield f"{prefix}{e}.down_proj.bias", t
        else:  # GGUF stacks: {gate,up,down}_proj.{weight,bias}, [E, out, in] / [E, out]
            yield f"{prefix}{e}.{rest}", t


class _MXFP4Experts:
    """A checkpoint's MXFP4 expert tensors (`*_blocks` with their `*_scales`), taken out of
    the stream: held as GGUF MXFP4 blocks by the layer's experts where the model holds them
    (their per-expert names added to `held`), else dequantized into the stream as each
    expert's weights. gate_up's rows alternate gate, up: they are put in [gate | up] order."""

    def __init__(self, model: GptOssForCausalLM, held: set[str]) -> None:
        self.model, self.held = model, held
        self.layers = dict(zip(model.layer_indices, model.layers, strict=True))
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}  # projection -> its parts

    def take(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if not name.endswith(("_blocks", "_scales")):
                yield name, tensor
                continue
            projection, part = name.rsplit("_", 1)
            parts = self.waiting.setdefault(projection, {})
            parts[part] = tensor.to(torch.uint8)
            if len(parts) == 2:
                del self.waiting[projection]
                yield from self._complete(projection, parts["blocks"], parts["scales"])
        if self.waiting:
            raise ValueError(f"MXFP4 blocks without their scales: {sorted(self.waiting)}")

    def _complete(
        self, projection: str, blocks: torch.Tensor, scales: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`projection`: model.layers.{i}.mlp.experts.{gate_up,down}_proj."""
        prefix, proj = projection.rsplit(".", 1)
        layer = int(prefix.split(".")[2])
        if proj == "gate_up_proj":  # rows gate, up, gate, up, ... -> [gate | up]
            blocks = torch.cat((blocks[:, 0::2], blocks[:, 1::2]), dim=1)
            scales = torch.cat((scales[:, 0::2], scales[:, 1::2]), dim=1)
        if layer not in self.layers:
            return  # another pipeline stage's
        mlp = self.layers[layer].mlp
        experts = mlp.experts_gate_up if proj == "gate_up_proj" else mlp.experts_down
        names = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        if self.model.holds_mxfp4:
            rows = mxfp4.gguf_rows(blocks, scales)  # [E, out, bytes]
            experts.hold_blocks_([(rows, mxfp4.MXFP4_GGML_TYPE)])
            self.held.update(
                f"{prefix}.{e}.{n}.weight" for e in range(experts.num_experts) for n in names
            )
            return
        weight = mxfp4.dequantize(blocks, scales, self.model.dtype)  # [E, out, in]
        for e in range(experts.num_experts):
            for n, part in zip(names, weight[e].chunk(len(names)), strict=True):
                yield f"{prefix}.{e}.{n}.weight", part
