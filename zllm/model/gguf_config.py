"""Reading a GGUF file's metadata into the engine's record, the parts every decoder family
shares: llama.cpp's `{arch}.*` keys for the sizes, rope scaling (its parameters, LongRoPE's
factor tensors, Llama 3's per-frequency divisors, partial rotation) and the tokenizer's
BOS/EOS ids. A family's module (zllm/model/families/) calls `decoder_arch` with what is its
own; nothing here names an architecture. No torch here."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from zllm.model.arch_config import ModelArchConfig, MoEConfig
from zllm.model.gguf import GGUFFile, invalid_gguf


def need(gguf: GGUFFile, key: str, kind: type = float) -> Any:
    """The number under `key`, or an error naming the file and the key."""
    value = gguf.metadata.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        if value is None:
            raise invalid_gguf(gguf.path, f"missing metadata key {key!r}")
        raise invalid_gguf(gguf.path, f"metadata key {key!r} is {value!r}, expected {kind.__name__}")  # fmt: skip
    return kind(value)


def kv_heads(md: dict[str, Any], arch: str, heads: int) -> int:
    """{arch}.attention.head_count_kv: one number, or one per layer (a hybrid's files: 0 for
    a layer without attention), the attention layers' then."""
    value = md.get(f"{arch}.attention.head_count_kv", heads)
    return max(int(v) for v in value) if isinstance(value, list) else int(value)


def eos_token_ids(md: dict[str, Any]) -> list[int]:
    """End of sequence, end of turn (chat models), end of message (Llama 3.1 tool calls)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    return list(dict.fromkeys(int(md[f"tokenizer.ggml.{k}"]) for k in keys if f"tokenizer.ggml.{k}" in md))  # fmt: skip


def vocab_size(gguf: GGUFFile, arch: str) -> int:
    """{arch}.vocab_size, else the tokenizer's tokens, else the embedding's rows."""
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise invalid_gguf(gguf.path, "missing tensor 'token_embd.weight'")
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    return int(gguf.metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens else embd.shape[0]))  # fmt: skip


def f32_vector(gguf: GGUFFile, name: str) -> list[float]:
    info = gguf.tensors[name]
    if info.ggml_type != GGMLQuantizationType.F32 or len(info.shape) != 1:
        raise invalid_gguf(
            gguf.path, f"{name} is {info.ggml_type.name} {list(info.shape)}, not F32 [n]"
        )
    return gguf.tensor_data(name).view(np.float32).tolist()


def rope_freq_factors(gguf: GGUFFile) -> list[float] | None:
    """Llama 3.x files store their RoPE scaling as one divisor per frequency (F32
    rope_freqs.weight, [rotary_dim / 2]) rather than as rope.scaling.* parameters."""
    if "rope_freqs.weight" not in gguf.tensors:
        return None
    return f32_vector(gguf, "rope_freqs.weight")


def rope_scaling(md: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """rope.scaling.{type,factor,original_context_length} as config.json's rope parameters."""
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor") or md.get(f"{arch}.rope.scale_linear")
    if kind is None and factor:
        kind = "linear"  # old files only wrote rope.scale_linear
    if kind in (None, "none") or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def longrope(gguf: GGUFFile, arch: str) -> dict[str, Any] | None:
    """LongRoPE (Phi-3's): the converter stores the long and short per-frequency factors as
    F32 tensors (rope_factors_long/short.weight) and the pretraining context as
    rope.scaling.original_context_length; rope.scaling.type stays unwritten."""
    if "rope_factors_long.weight" not in gguf.tensors:
        return None
    md = gguf.metadata
    long, short = (f32_vector(gguf, f"rope_factors_{k}.weight") for k in ("long", "short"))
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if not isinstance(original, int) or original <= 0:
        raise invalid_gguf(
            gguf.path, f"LongRoPE factors without {arch}.rope.scaling.original_context_length"
        )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": long,
        "short_factor": short,
        "original_max_position_embeddings": original,
    }
    # The converter writes the attention factor in float32; when it is LongRoPE's own
    # sqrt(1 + ln(s) / ln(original)) (s: the context extension), it is recomputed in float64
    # (as transformers does from config.json), else kept.
    stored = md.get(f"{arch}.rope.scaling.attn_factor")
    context = md.get(f"{arch}.context_length") or original
    extension = context / original
    default = math.sqrt(1 + math.log(extension) / math.log(original)) if extension > 1 else 1.0
    if stored is not None and np.float32(stored) != np.float32(default):
        scaling["attention_factor"] = float(stored)
    return scaling


def partial_rotary(
    gguf: GGUFFile, arch: str, head_dim: int, scaling: dict[str, Any] | None, allowed: bool
) -> dict[str, Any] | None:
    """RoPE over the first rope.dimension_count dimensions of each head (Phi-4-mini: 3/4), as
    the partial_rotary_factor transformers reads; `allowed`: the family rotates part of a
    head (its checkpoints' transformers class does)."""
    rotary = gguf.metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary == head_dim:
        return scaling
    if not allowed or not 0 < rotary < head_dim or rotary % 2:
        raise ValueError(
            f"{gguf.path}: {arch}.rope.dimension_count is {rotary} for heads of {head_dim} "
            f"(transformers rotates whole heads of {arch!r} models)"
        )
    return {"rope_type": "default", **(scaling or {}), "partial_rotary_factor": rotary / head_dim}


def decoder_arch(
    gguf: GGUFFile,
    family: str,
    *,
    qk_norm: bool = False,
    partial_rotation: bool = False,
    windows: bool = False,
    experts: Callable[[GGUFFile, int], MoEConfig | None] | None = None,
) -> ModelArchConfig:
    """A Llama-style decoder's record from its GGUF file. `windows`: the family's files carry
    {arch}.attention.sliding_window for every layer (0: none); `experts`: how it reads its
    experts (a moe_arch.moe_from_gguf with the family's arguments bound), None for a dense
    family."""
    md = gguf.metadata
    arch = str(md["general.architecture"])
    if md.get(f"{arch}.expert_count") and experts is None:
        raise ValueError(f"{gguf.path}: mixture-of-experts {arch!r} files are not supported")
    hidden = need(gguf, f"{arch}.embedding_length", int)
    heads = need(gguf, f"{arch}.attention.head_count", int)
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // heads))
    num_layers = need(gguf, f"{arch}.block_count", int)
    max_positions = need(gguf, f"{arch}.context_length", int)
    moe = experts(gguf, num_layers) if experts else None
    window = md.get(f"{arch}.attention.sliding_window") if windows else None
    if not window or window >= max_positions:  # a window no shorter than the context: none
        window = None
    scaling = longrope(gguf, arch) or rope_scaling(md, arch)
    return ModelArchConfig(
        architecture=arch,
        family=family,
        vocab_size=vocab_size(gguf, arch),
        hidden_size=hidden,
        # (a mixture of experts' file may leave it out: no dense MLP to size)
        intermediate_size=int(md[f"{arch}.feed_forward_length"])
        if moe is not None and f"{arch}.feed_forward_length" in md
        else moe.moe_intermediate_size
        if moe is not None
        else need(gguf, f"{arch}.feed_forward_length", int),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads(md, arch, heads),
        head_dim=head_dim,
        rms_norm_eps=need(gguf, f"{arch}.attention.layer_norm_rms_epsilon", float),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        # q/k/v biases; a fused q/k/v matrix (Phi-3's) has none.
        attention_bias="blk.0.attn_q.bias" in gguf.tensors or "blk.0.attn_qkv.bias" in gguf.tensors,
        rope_scaling=partial_rotary(gguf, arch, head_dim, scaling, partial_rotation),
        rope_freq_factors=rope_freq_factors(gguf),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_token_ids(md),
        layer_types=["sliding_attention"] * num_layers if window else None,
        sliding_window=int(window) if window else None,
        qk_norm=qk_norm,
        moe=moe,
    )


# llama.cpp's per-layer tensor keys (blk.{i}.<key>.weight|bias) -> Hugging Face module paths,
# as its converter writes every Llama-style decoder; a family's table adds or overrides keys.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # Mixture of experts (Qwen-MoE, Mixtral): the router, each projection of every expert
    # stacked in one 3-D tensor [E, out, in] (the MoE layer cuts it per expert), Qwen2-MoE's
    # shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Per-head q/k norms (Qwen 3's, Gemma 3's).
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
