"""Phi-3 (and Phi-4-mini): Llama's decoder over checkpoints that store qkv_proj and
gate_up_proj fused (executor/models/llama.py fills its fused matrices whole), LongRoPE over
part of each head (partial_rotary_factor), a window on every layer when sliding_window is set.

llama.cpp's converter writes the window for Phi-3 only (phi3.attention.sliding_window: its
config's sliding_window, 0 for none); llama.cpp itself ignores it, zllm runs the file as its
checkpoint runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile

# Phi-3's early names for LongRoPE, which transformers reads as longrope.
_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    return hf_config.decoder_arch(
        cfg,
        where,
        FAMILY.name,
        windows=hf_config.every_layer_windowed(),
        partial_rotary=True,
        rope_aliases=_ROPE_ALIASES,
    )


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    return gguf_config.decoder_arch(gguf, FAMILY.name, partial_rotation=True, windows=True)


def _transformers_gguf_problem(gguf: GGUFFile) -> str | None:
    """transformers' GGUF reader reads neither a window nor LongRoPE factors."""
    window = "phi3.attention.sliding_window" in gguf.metadata
    if not window and "rope_factors_long.weight" not in gguf.tensors:
        return None
    return (
        "transformers' GGUF reader drops this Phi-3 file's sliding window and LongRoPE factors "
        "(it would run another model)"
    )


FAMILY = Family(
    name="phi3",
    title="Phi-3",
    model_types=("phi3",),
    gguf_architectures=("phi3",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    # Its fused matrices as its checkpoints store them: attn_qkv holds [q | k | v] and
    # ffn_up holds [gate | up] (no ffn_gate), HF's qkv_proj and gate_up_proj row for row.
    gguf_tensor_names={
        **gguf_config.LAYER_NAMES,
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",
    },
    fused_checkpoint=True,
    transformers_gguf_problem=_transformers_gguf_problem,
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW}),
)
