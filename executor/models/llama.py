"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) over a flat, unpadded token batch.

Per layer, q/k/v are one GEMM into a fused [q | k | v] projection and gate/up are one GEMM into
a fused [gate | up] projection; load_weights fills the fused matrices from Hugging Face's
separate tensors (Phi-3 checkpoints store them fused already). Attention reads and writes the
paged KV cache through the layers of the attention backend the model is built with
(zllm.executor.attention.backend; torch by default).

What the family members add, each switched on by ModelArchConfig:
  - Qwen2: q/k/v biases (attention_bias);
  - Qwen3: an RMSNorm over each query and key head before RoPE (qk_norm, QKNorm below);
  - Phi-3: LongRoPE scaling, RoPE over part of each head (partial_rotary_factor);
  - Mistral, Phi-3, Qwen2/3: sliding-window layers (the attention metadata windows them);
  - Llama 3.x GGUFs: per-frequency RoPE divisors (rope_freq_factors);
  - Qwen3-MoE, Qwen2-MoE, Mixtral: mixture-of-experts MLPs in the layers ModelArchConfig's
    is_moe_layer names (executor/models/moe.py), Qwen2-MoE's with a shared expert.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.attention.backend import (
    TORCH_ATTENTION,
    AttentionBackend,
    StepAttentionMetadata,
)
from zllm.executor.kernels import cpu_layer_ops, cuda_layer_ops
from zllm.executor.models.decoder_stack import DecoderStack
from zllm.executor.models.moe import MoEBlock, per_expert_names, per_expert_weights
from zllm.executor.models.rope import RotaryEmbedding, rope, rope_into_cache
from zllm.executor.ranks.parallel import (
    SINGLE,
    WHOLE,
    PipelineParallel,
    TensorParallel,
    fill_tied_logits_shard,
    local_arch,
    logits_weight,
    shard_weight,
)
from zllm.executor.weights.loader import layer_of
from zllm.model.arch_config import ModelArchConfig

# Architectures whose checkpoints store qkv_proj and gate_up_proj fused, in our [q | k | v] and
# [gate | up] order: their tensors fill the fused matrices whole.
FUSED_CHECKPOINTS = frozenset({"phi3"})


def empty_linear(
    in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False
) -> nn.Linear:
    """A Linear with uninitialised weights: load_weights overwrites them anyway. Made on the
    meta device and given plain empty tensors (untouched pages), not through `skip_init`,
    whose `to_empty` runs torch's reference ops and imports torch.fx's symbolic shapes: half
    a second of a CPU engine's start-up."""
    linear = nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)
    linear.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
    if bias:
        linear.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))
    return linear


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, accumulated in fp32 as Hugging Face does.

    With `residual`, first adds it to x and returns (normed, x): the pre-norm residual stream.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cuda_layer_ops.usable(x):
            fused = cuda_layer_ops.rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        elif cpu_layer_ops.usable(x):  # csrc/cpu/row_ops.h, as the fused decode step
            fused = cpu_layer_ops.rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32:
            # One fused op instead of six; bit-identical to the lines below in fp32 on CPU
            # (checked in tests/test_model.py), ~15 us less per call at one token.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype), x


class QKNorm(nn.Module):
    """Qwen 3: an RMSNorm over each query head and each key head before RoPE, one weight
    [head_dim] shared by the query heads and one by the key heads (HF's q_norm, k_norm)."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        """qk [T, heads + kv_heads, head_dim] -> the same with every head normalized."""
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return torch.cat((self.q_norm(q)[0], self.k_norm(k)[0]), dim=1)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        attention: AttentionBackend,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """`arch`: this rank's (executor/ranks/parallel.py local_arch): its heads only."""
        super().__init__()
        self.tp = tp
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = empty_linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, dtype, bias=arch.attention_bias
        )
        self.qk_norm = QKNorm(arch, dtype) if arch.qk_norm else None
        self.o_proj = empty_linear(self.q_size, arch.hidden_size, dtype)
        self.attn = attention.make_layer(arch.num_heads, arch.num_kv_heads, arch.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepAttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k sit side by side in qkv, so one rotation covers both.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        written = rope_into_cache(qk, v, cos, sin, kv_cache, meta)  # one kernel on a GPU
        if not written:
            qk = rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v, kv_cache, meta, kv_written=written)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        intermediate_size: int | None = None,
    ) -> None:
        """`intermediate_size`: other than arch's (Qwen2-MoE's shared expert)."""
        super().__init__()
        self.tp = tp
        inter = arch.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate_size = inter
        self.gate_up_proj = empty_linear(arch.hidden_size, 2 * inter, dtype)
        self.down_proj = empty_linear(inter, arch.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = None
        if cuda_layer_ops.usable(gate_up):
            fused = cuda_layer_ops.silu_mul(gate_up)
        elif cpu_layer_ops.usable(gate_up):
            fused = cpu_layer_ops.gated_act(gate_up, "silu")
        if fused is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            fused = F.silu(gate) * up
        return self.tp.all_reduce(self.down_proj(fused))


def make_mlp(
    arch: ModelArchConfig, layer: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
) -> nn.Module:
    """Layer `layer`'s MLP: dense, or a mixture of experts (with Qwen2-MoE's shared expert)."""
    if not arch.is_moe_layer(layer):
        return LlamaMLP(arch, dtype, tp)
    if tp.enabled:  # zllm/config/parallel.py refuses it first; a model built directly too
        raise ValueError("tensor parallelism does not split mixture-of-experts layers yet")
    shared = arch.shared_expert_intermediate_size
    shared_expert = LlamaMLP(arch, dtype, tp, intermediate_size=shared) if shared else None
    return MoEBlock(arch, dtype, shared_expert=shared_expert)


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
        self.self_attn = LlamaAttention(arch, dtype, attention, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = make_mlp(arch, layer, dtype, tp)

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


def copy_checkpoint(
    model: nn.Module,
    targets: dict[str, torch.Tensor],
    weights: Iterable[tuple[str, torch.Tensor]],
    recomputed: tuple[str, ...] = (),
    served: Container[str] = frozenset(),
) -> None:
    """Copy Hugging Face-named checkpoint tensors into `targets` (name -> the tensor it
    fills), each cut to this rank's part first (model.tp); names ending in `recomputed`, a
    tied model's lm_head and the layers of other pipeline stages are skipped. Refuses
    unexpected names, wrong shapes and missing ones, but for `served` (GGUF blocks will
    serve those matrices: the loader skipped them, weight_blocks.BlockPlan)."""
    arch, tp = model.arch, model.tp
    layers = model.layer_indices
    loaded: set[str] = set()
    for name, tensor in weights:
        layer = layer_of(name)
        if layer is not None and layer not in layers:
            continue  # another pipeline stage's
        tensor = shard_weight(name, tensor, model.checkpoint_arch, tp)
        target = targets.get(name)
        if target is None:
            if (recomputed and name.endswith(recomputed)) or (
                name == "lm_head.weight" and arch.tie_word_embeddings
            ):
                continue  # recomputed by the model / the tied embedding serves as lm_head
            raise ValueError(f"unexpected weight {name!r} for a {arch.architecture} model")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        loaded.add(name)
        if name == "model.embed_tokens.weight":
            fill_tied_logits_shard(model.lm_head, tensor, arch, tp)
    missing = sorted(name for name in targets.keys() - loaded if name not in served)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")


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

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], served: Container[str] = frozenset()
    ) -> None:
        """Copy Hugging Face-named tensors in, one at a time (so a stream of shards works);
        `served`: names the checkpoint leaves out (copy_checkpoint)."""
        if self.arch.num_experts:  # each expert's own tensors (moe.py)
            weights = per_expert_weights(weights)
            served = per_expert_names(served, self.arch.num_experts)
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
            if isinstance(mlp, MoEBlock):
                targets |= self._split_targets(prefix, attn, None)
                targets |= mlp.checkpoint_targets(f"{prefix}mlp.")
            elif self.arch.architecture in FUSED_CHECKPOINTS:
                targets |= self._fused_targets(prefix, attn, mlp)
            else:
                targets |= self._split_targets(prefix, attn, mlp)
                targets[f"{prefix}mlp.down_proj.weight"] = mlp.down_proj.weight.data
            if attn.qk_norm is not None:
                targets[f"{prefix}self_attn.q_norm.weight"] = attn.qk_norm.q_norm.weight.data
                targets[f"{prefix}self_attn.k_norm.weight"] = attn.qk_norm.k_norm.weight.data
            targets[f"{prefix}self_attn.o_proj.weight"] = attn.o_proj.weight.data
            targets[f"{prefix}input_layernorm.weight"] = layer.input_layernorm.weight.data
            targets[f"{prefix}post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm.weight.data
            )
        return targets

    @staticmethod
    def _split_targets(
        prefix: str, attn: LlamaAttention, mlp: LlamaMLP | None
    ) -> dict[str, torch.Tensor]:
        """HF's separate q/k/v (weights and biases) and gate/up tensors -> row slices (no
        gate/up for a mixture-of-experts layer: mlp None)."""
        targets = {}
        sections = {"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}
        fused = {"weight": attn.qkv_proj.weight.data}
        if attn.qkv_proj.bias is not None:
            fused["bias"] = attn.qkv_proj.bias.data
        for kind, param in fused.items():
            for proj, part in zip(sections, param.split(list(sections.values())), strict=True):
                targets[f"{prefix}self_attn.{proj}_proj.{kind}"] = part
        if mlp is None:
            return targets
        gate, up = mlp.gate_up_proj.weight.data.split(mlp.intermediate_size)
        targets[f"{prefix}mlp.gate_proj.weight"] = gate
        targets[f"{prefix}mlp.up_proj.weight"] = up
        return targets

    @staticmethod
    def _fused_targets(prefix: str, attn: LlamaAttention, mlp: LlamaMLP) -> dict[str, torch.Tensor]:
        """Phi-3's qkv_proj and gate_up_proj tensors -> our fused matrices, whole."""
        targets = {
            f"{prefix}self_attn.qkv_proj.weight": attn.qkv_proj.weight.data,
            f"{prefix}mlp.gate_up_proj.weight": mlp.gate_up_proj.weight.data,
            f"{prefix}mlp.down_proj.weight": mlp.down_proj.weight.data,
        }
        if attn.qkv_proj.bias is not None:
            targets[f"{prefix}self_attn.qkv_proj.bias"] = attn.qkv_proj.bias.data
        return targets
