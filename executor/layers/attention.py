"""Self-attention with one fused q/k/v projection, over the paged KV cache through the layer
of the attention backend the model is built with (executor/attention/backend.py): Llama's
family (with Qwen2's q/k/v biases, Qwen3's per-head q/k norms or OLMo's and MiniMax-M2's over
all heads at once) and gpt-oss (biases on
o_proj too, a sink logit per query head).

    qkv = qkv_proj(x)                          [T, q | k | v]: one GEMM
    q, k = rope(norm(q), norm(k))               one rotation over q and k side by side; on a GPU
                                                fused with the KV cache write (rope_into_cache)
    out = o_proj(attention(q, k, v))           the backend's layer; all-reduced across
                                                tensor-parallel ranks (o_proj is row-parallel)

With an output gate (Qwen3-Next's, Qwen3.5's full-attention layers) the projection also
makes a gate per query value, each head's query then its gate as the checkpoints' q_proj
holds them, [q0 g0 q1 g1 ... | k | v], and the attention's output is multiplied by the
gate's sigmoid before o_proj.

Gemma 3 (its own norms, scale and RoPE per head) and DeepSeek-V2 (latent attention) keep
modules of their own.
"""

from __future__ import annotations

import torch
from torch import nn

from zllm.executor.attention.backend import AttentionBackend, StepAttentionMetadata
from zllm.executor.layers.linear.dense import empty_linear
from zllm.executor.layers.norms import QKNorm, WholeQKNorm
from zllm.executor.layers.rope import rope, rope_into_cache
from zllm.executor.parallel.groups import SINGLE, TensorParallel
from zllm.model.arch_config import ModelArchConfig


def qkv_targets(prefix: str, qkv_proj: nn.Linear, q_rows: int, kv_rows: int) -> dict:
    """A checkpoint's separate q_proj/k_proj/v_proj weights (and biases where the fused
    projection has one) -> the row slices of `qkv_proj` [q | k | v] they fill."""
    sizes = {"q": q_rows, "k": kv_rows, "v": kv_rows}
    targets = {}
    for kind in ("weight", "bias"):
        param = getattr(qkv_proj, kind)
        if param is None:
            continue
        for proj, part in zip(sizes, param.data.split(list(sizes.values())), strict=True):
            targets[f"{prefix}{proj}_proj.{kind}"] = part
    return targets


class SelfAttention(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        attention: AttentionBackend,
        tp: TensorParallel = SINGLE,
        output_bias: bool = False,
        sinks: bool = False,
        output_gate: bool = False,
        scale: float | None = None,
    ) -> None:
        """`arch`: this rank's (executor/parallel/shards.py local_arch): its heads only; its
        attention_bias puts biases on q/k/v, its qk_norm per-head norms. gpt-oss's:
        `output_bias` on o_proj too, `sinks` a sink logit per query head. `output_gate`: a
        sigmoid gate per query value before o_proj (Qwen3-Next's). `scale`: the attention scale
        (None: head_dim ** -0.5; Granite's attention_multiplier). The model passes cos and sin
        None for layers without a position embedding (Granite 4.0-H's)."""
        super().__init__()
        self.tp = tp
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.gate_size = self.q_size if output_gate else 0  # (its rows inside q's)
        self.qkv_proj = empty_linear(
            arch.hidden_size,
            self.q_size + 2 * self.kv_size + self.gate_size,
            dtype,
            bias=arch.attention_bias,
        )
        self.qk_norm: nn.Module | None = None  # per head, or over all heads at once
        if arch.qk_norm:
            self.qk_norm = QKNorm(arch, dtype)
        elif arch.qk_norm_whole:
            self.qk_norm = WholeQKNorm(arch, dtype)
        self.o_proj = empty_linear(self.q_size, arch.hidden_size, dtype, bias=output_bias)
        # fp32 whatever the model's dtype: every attention path reads them so (a bf16
        # checkpoint's values widen exactly).
        self.sinks = (
            nn.Parameter(torch.zeros(arch.num_heads, dtype=torch.float32)) if sinks else None
        )
        self.attn = attention.make_layer(arch.num_heads, arch.num_kv_heads, arch.head_dim, scale)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Hugging Face's separate q/k/v/o tensors (weights, biases where this layer has them,
        gpt-oss's sinks, the q/k norms' q_norm and k_norm) -> what each fills of ours (row
        slices of the fused q/k/v; q's rows hold an output gate's too, as Qwen3-Next stores
        them). `prefix` names the module in the checkpoint ("model.layers.3.self_attn.")."""
        targets = {f"{prefix}o_proj.weight": self.o_proj.weight.data}
        if self.o_proj.bias is not None:
            targets[f"{prefix}o_proj.bias"] = self.o_proj.bias.data
        if self.sinks is not None:
            targets[f"{prefix}sinks"] = self.sinks.data
        norms = self.qk_norm
        if isinstance(norms, QKNorm | WholeQKNorm):  # (Llama 4's HeadL2Norm has no weight)
            targets[f"{prefix}q_norm.weight"] = norms.q_norm.weight.data
            targets[f"{prefix}k_norm.weight"] = norms.k_norm.weight.data
        return targets | qkv_targets(
            prefix, self.qkv_proj, self.q_size + self.gate_size, self.kv_size
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: StepAttentionMetadata,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`q_scale` [T]: each token's queries multiplied by it before attending (Llama 4's
        temperature on its NoPE layers)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q_end = self.q_size + self.gate_size
        gate = None
        if self.gate_size:  # each head's query, then its gate: q and k joined in a copy
            q_gate = qkv[:, :q_end].view(num_tokens, self.num_heads, 2, self.head_dim)
            gate = q_gate[:, :, 1].reshape(num_tokens, self.q_size)
            k = qkv[:, q_end : q_end + self.kv_size].view(num_tokens, -1, self.head_dim)
            qk = torch.cat((q_gate[:, :, 0], k), dim=1)
        else:  # q and k sit side by side in qkv, so one rotation covers both
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        v = qkv[:, q_end + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        written = False
        if cos is not None:
            written = rope_into_cache(qk, v, cos, sin, kv_cache, meta)  # one kernel on a GPU
            if not written:
                qk = rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if q_scale is not None:
            q = q * q_scale.to(q.dtype).view(-1, 1, 1)
        if self.sinks is None:  # (what a piecewise graph's attention site takes, too)
            out = self.attn(q, k, v, kv_cache, meta, kv_written=written)
        else:
            out = self.attn(q, k, v, kv_cache, meta, kv_written=written, sinks=self.sinks)
        out = out.reshape(num_tokens, self.q_size)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.tp.all_reduce(self.o_proj(out))
