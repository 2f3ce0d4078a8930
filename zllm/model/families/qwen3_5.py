"""Qwen3.5 and Qwen3.5-MoE: Qwen3-Next's hybrid decoder (Gated DeltaNet state layers, a gated
full-attention layer every few) with its projections stored apart, dense MLPs (Qwen3.5) or
experts with a gated shared expert (Qwen3.5-MoE); executor/models/qwen3_next.py runs both.

The released checkpoints are vision-language ones (model_type qwen3_5 / qwen3_5_moe, the
decoder's config under text_config): zllm serves their text, and refuses images sent to them
as it does for any text model (vision stays False); the text-only forms (qwen3_5_text,
qwen3_5_moe_text) are the decoder alone. llama.cpp's files of them (qwen35, qwen35moe) keep
their value heads in its tiled order, which the state layers follow as stored."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from zllm.model.arch_config import ModelArchConfig
from zllm.model.families.qwen3_next import GGUF_NAMES, read_hybrid_gguf, read_hybrid_hf
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile
from zllm.model.moe_arch import MOE_LACKS, moe_from_hf
from zllm.model.state_arch import HYBRID_LACKS, undo_gguf_norms

MODEL_CLASS = "zllm.executor.models.qwen3_next:Qwen3NextForCausalLM"


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a vision-language checkpoint's text_config (under the
    checkpoint's model_type, with its word-embedding tie), else config.json itself."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "model_type": cfg["model_type"], "tie_word_embeddings": tie}


def read_dense(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    return read_hybrid_hf(text_config(cfg), where, FAMILY.name)


def read_moe(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    # Every layer's MLP is experts, whose chosen weights its router always renormalises.
    experts = partial(moe_from_hf, shared_expert=True, always_renormalise=True, dense_layers=False)
    return read_hybrid_hf(text_config(cfg), where, MOE_FAMILY.name, experts)


def read_dense_gguf(gguf: GGUFFile) -> ModelArchConfig:
    return read_hybrid_gguf(gguf, FAMILY.name, moe=False, tiled=True)


def read_moe_gguf(gguf: GGUFFile) -> ModelArchConfig:
    return read_hybrid_gguf(gguf, MOE_FAMILY.name, moe=True, tiled=True)


FAMILY = Family(
    name="qwen3_5",
    title="Qwen3.5",
    model_types=("qwen3_5", "qwen3_5_text"),
    gguf_architectures=("qwen35",),
    read_hf=read_dense,
    read_gguf=read_dense_gguf,
    gguf_tensor_names=GGUF_NAMES,
    gguf_undo=undo_gguf_norms,
    model_class=MODEL_CLASS,
    traits=frozenset({Trait.RECURRENT_STATE}),
    lacks=HYBRID_LACKS,
)

MOE_FAMILY = Family(
    name="qwen3_5_moe",
    title="Qwen3.5-MoE",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    gguf_architectures=("qwen35moe",),
    read_hf=read_moe,
    read_gguf=read_moe_gguf,
    gguf_tensor_names=GGUF_NAMES,
    gguf_undo=undo_gguf_norms,
    model_class=MODEL_CLASS,
    traits=frozenset({Trait.MOE, Trait.RECURRENT_STATE}),
    lacks={**MOE_LACKS, **HYBRID_LACKS},
)
