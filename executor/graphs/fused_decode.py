"""Decode steps on CPU through the whole decoder stack in one C++ call (csrc/cpu/decode_stack.h).

A decode path, not a kernel: beside the CUDA graph runners it stands in for on CPU (one call
for the whole stack), chosen among them by the decode path (executor/host/decode_path.py).

At one sequence a SmolLM2 step on two cores spends ~7 ms dispatching the ~3,500 small torch
ops of the module path (norms, RoPE, slicing, cache writes, activations) beside ~11 ms of
matmuls. `FusedDecode` hands a decode-only step's layers to `DecodeStack`, which runs them
as loops between the same matmul and attention kernels the modules call, and returns the
final norm's output; the logits, sampling and everything else stay as they are.

What it covers, checked once when the model is loaded (`FusedDecode.build` says why not):
  - models that describe their stack by role (`decode_stack_parts()`, executor/layers/
    stack_parts.py): the Llama family (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3's head
    norms, partial rotary) and Gemma 3 (its sandwich norms, GeGLU, local and global RoPE).
    The path reads the parts, never the model's class: what differs per family (sandwich
    norms, the activation, a local RoPE table for sliding layers) comes as plain fields;
  - fp32 on CPU with the csrc/cpu decode attention; matmuls in GGUF blocks (`gguf`,
    `gguf-float`, `gguf-int8`, `int8`'s Q8_0 blocks, a quantized checkpoint's: each matmul's
    integer-dot row limit is copied) or fp32 (`none`);
  - sliding-window layers (the kernel windows its decode attention), NoPE layers (no rope
    table: SmolLM3's).
Not covered, so the module path runs: LoRA (its per-row adapter updates live in the
modules), deterministic mode (the modules tile their matmuls), the transformers backend,
`--enforce-eager`, any step with a prefill chunk in it, and with AMX a bf16 model's steps of
8+ rows, whose BF16 matmuls the modules send to bf16 GEMMs (gguf_arithmetic.bf16_gemm_rows:
1.2x the float kernel at 8 rows, 3.7x at 32, more than the fused path saves), and a
quantized model's decode steps of 64+ rows, whose matmuls the modules send to the GEMM over
dequantized panels (1.05-1.3x the integer tiles at 64 rows; not measured against the fused
step, rarely met on a CPU: concurrency 64 and up).
Speculative verify steps (a sequence's last token and its proposals) run fused: each token
is a decode row attending up to its own position, after every row's K/V is in the cache.
`ZLLM_FUSED_DECODE=0` turns the path off for A/B measurements.

The step's arithmetic is the module path's, bit for bit: the modules run the same matmul
and attention kernels and, on CPU, the same row-wise ops (csrc/cpu/row_ops.h through
cpu_layer_ops.py); tests/test_fused_decode.py runs both paths on the same steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zllm.executor.attention.backend import StepAttentionMetadata, metadata_per_layer
from zllm.executor.attention.paged import AttentionMetadata, PagedAttention
from zllm.executor.kernels import cpu as cpu_kernels
from zllm.executor.kernels import cpu_layer_ops
from zllm.executor.layers.linear.dense import DENSE_LINEAR_TYPES
from zllm.executor.layers.linear.gguf import GGUFLinear, GGUFSplitLinear
from zllm.executor.layers.stack_parts import LayerParts, Norm, StackParts

logger = logging.getLogger(__name__)


class Unsupported(Exception):
    """Why the fused path cannot serve this model (the module path then serves every step)."""


def enabled() -> bool:
    return os.environ.get("ZLLM_FUSED_DECODE", "1") != "0"


class FusedDecode:
    """A model's decoder stack as one `DecodeStack`, for decode-only steps."""

    def __init__(self, model: nn.Module, stack: Any) -> None:
        self.model = model
        self.stack = stack
        # Steps of this many rows or more run the modules (their bf16 GEMMs); 0: none do.
        gemm_rows = [getattr(m, "bf16_gemm_rows", 0) for m in model.modules()]
        self.module_rows = min((r for r in gemm_rows if r > 0), default=0)

    @classmethod
    def build(cls, model: nn.Module) -> FusedDecode:
        """Raises Unsupported naming what the fused path does not cover."""
        describe = getattr(model, "decode_stack_parts", None)
        if describe is None:
            raise Unsupported(f"{type(model).__name__} has no fused decode path")
        if model.dtype != torch.float32:
            raise Unsupported(f"dtype {model.dtype} (the fused path is fp32)")
        if model.arch.moe is not None:
            raise Unsupported("mixture-of-experts layers (executor/layers/moe/ routes them)")
        if model.arch.qk_norm_whole:
            raise Unsupported("q/k norms over all heads (the stack's are per head)")
        parts: StackParts = describe()
        for layer in parts.layers:
            attn = layer.attention
            if not isinstance(attn, PagedAttention) or attn.decode_kernel is None:
                raise Unsupported("the attention backend is not the CPU kernel's")
        if parts.activation not in cpu_layer_ops.ACTIVATIONS:
            raise Unsupported(f"activation {parts.activation!r}")
        return cls(model, _decode_stack(model.arch, parts))

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: StepAttentionMetadata | Sequence[StepAttentionMetadata],
        stream: torch.Tensor | None = None,
        final_norm: bool = True,
    ) -> torch.Tensor | None:
        """The final hidden states [T, hidden] of a decode-only step, or None when the step
        is not one (the caller then runs the model's modules). A pipeline stage passes the
        residual `stream` entering its layers (not the first stage) and, before the last
        stage, gets the stream leaving them (`final_norm` False)."""
        if 0 < self.module_rows <= input_ids.shape[0]:
            return None
        metas = metadata_per_layer(attn_metadata, len(kv_caches))
        unique: dict[int, int] = {}
        meta_of_layer = [unique.setdefault(id(meta), len(unique)) for meta in metas]
        distinct = list({id(m): m for m in metas}.values())
        num_tokens = input_ids.shape[0]
        for meta in distinct:
            if not _decode_only(meta, num_tokens):
                return None
        decode = distinct[0].decode
        return self.stack.forward(
            x=self.model.embed(input_ids) if stream is None else stream,
            positions=positions,
            kv_caches=kv_caches,
            meta_of_layer=meta_of_layer,
            block_tables=[
                m.decode.block_ids.view(num_tokens, m.decode.max_blocks) for m in distinct
            ],
            slots=[m.slot_mapping for m in distinct],
            windows=[m.sliding_window or 0 for m in distinct],
            seq_lens=decode.seq_lens,
            final_norm=final_norm,
        )


def _decode_stack(arch: Any, parts: StackParts) -> Any:
    """The C++ DecodeStack over `parts`' weights (the model's own tensors, not copies)."""
    kernels = cpu_kernels.load()
    stack = kernels.DecodeStack(
        hidden=arch.hidden_size,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        rotary_dim=parts.rope.cos_sin_cache.shape[1],
        intermediate=arch.intermediate_size,
        eps=arch.rms_norm_eps,
        sandwich=parts.sandwich,
        activation=cpu_layer_ops.ACTIVATIONS[parts.activation],
        final_norm=_norm_weight(parts.final_norm),
    )
    global_rope = stack.add_rope_table(parts.rope.cos_sin_cache)
    local_rope = None
    if parts.local_rope is not None:
        local_rope = stack.add_rope_table(parts.local_rope.cos_sin_cache)
    for layer in parts.layers:
        stack.add_layer(
            **_layer_norms(layer),
            **_layer_matmuls(kernels, layer),
            rope_table=-1 if not layer.rope else local_rope if layer.local_rope else global_rope,
            scale=layer.attention.scale,
        )
    return stack


def _layer_norms(layer: LayerParts) -> dict[str, torch.Tensor | None]:
    """A layer's norm weights as DecodeStack.add_layer takes them (None: no such norm)."""
    norms = {
        "attn_norm": layer.attn_norm,
        "ffn_norm": layer.ffn_norm,
        "post_attn_norm": layer.post_attn_norm,
        "post_ffn_norm": layer.post_ffn_norm,
        "q_norm": layer.q_norm,
        "k_norm": layer.k_norm,
    }
    return {k: None if v is None else _norm_weight(v) for k, v in norms.items()}


def _layer_matmuls(kernels: Any, layer: LayerParts) -> dict[str, Any]:
    """A layer's four matmuls as DecodeStack.add_layer takes them."""
    matmuls = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down}
    return {name: _matmul(kernels, module) for name, module in matmuls.items()}


def _decode_only(meta: StepAttentionMetadata, num_tokens: int) -> bool:
    """Every token a decode row, in order (one per sequence, or a verify step's few per
    sequence), nothing to prefill."""
    if not isinstance(meta, AttentionMetadata) or meta.prefills:
        return False
    decode = meta.decode
    return (
        decode is not None
        and decode.is_whole_batch
        and not decode.exact
        and decode.seq_lens.shape[0] == num_tokens
    )


def _norm_weight(norm: Norm) -> torch.Tensor:
    """What a norm multiplies the normed rows by (Llama's weight, Gemma's 1 + weight)."""
    return norm.multiplier().detach().contiguous()


def _matmul(kernels: Any, module: nn.Module) -> Any:
    """The module's weights as a FusedMatmul (GGUF blocks or fp32), or Unsupported."""
    if isinstance(module, GGUFLinear):
        parts = [(module.qweight, module.ggml_type)]
    elif isinstance(module, GGUFSplitLinear):
        parts = list(module.parts)
    elif type(module) in DENSE_LINEAR_TYPES:
        bias = None if module.bias is None else module.bias.detach()
        return kernels.FusedMatmul(
            blocks=[],
            types=[],
            dense=module.weight.detach(),
            bias=bias,
            in_features=module.in_features,
            int8_max_rows=0,
        )
    else:
        raise Unsupported(f"{type(module).__name__} matmuls")
    return kernels.FusedMatmul(
        blocks=[qweight for qweight, _ in parts],
        types=[ggml_type for _, ggml_type in parts],
        dense=None,
        bias=module.bias,
        in_features=module.in_features,
        int8_max_rows=module.int8_max_rows,
    )
