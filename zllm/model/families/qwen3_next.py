"""Qwen3-Next: a hybrid decoder, three Gated DeltaNet state layers to one gated full-attention
layer (layer_types), every MLP a mixture of experts with a sigmoid-gated shared expert
(executor/models/qwen3_next.py; zllm/kv/state_layout.py keeps the state)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile
from zllm.model.hf_config import ExpertRule
from zllm.model.moe_arch import MOE_LACKS, moe_from_gguf, moe_from_hf
from zllm.model.state_arch import (
    HYBRID_GGUF_NAMES,
    HYBRID_LACKS,
    gated_delta_net_from_gguf,
    gated_delta_net_from_hf,
    hybrid_layer_types,
    undo_gguf_norms,
    with_partial_rotary,
)

# A hybrid's GGUF tensor names: the Llama-style ones, Qwen 3's head norms, the state layers'.
GGUF_NAMES = {**gguf_config.LAYER_NAMES, **gguf_config.QK_NORM_NAMES, **HYBRID_GGUF_NAMES}


def read_hybrid_hf(
    cfg: dict[str, Any],
    where: Path,
    family: str,
    experts: ExpertRule | None = None,
    grouped_beta_alpha: bool = False,
) -> ModelArchConfig:
    """A Gated DeltaNet hybrid's record (Qwen3-Next's and Qwen3.5's config.json alike);
    `experts`: how the family reads its experts (None: dense MLPs); `grouped_beta_alpha`: its
    b and a projections are stored interleaved per key head (Qwen3-Next's in_proj_ba)."""
    moe = experts is not None
    if moe and cfg.get("intermediate_size") is None:  # (no dense layer to size)
        cfg = {**cfg, "intermediate_size": cfg.get("moe_intermediate_size")}
    arch = hf_config.decoder_arch(
        with_partial_rotary(cfg), where, family, qk_norm=True, partial_rotary=True, experts=experts
    )  # fmt: skip
    arch = replace(
        arch,
        layer_types=hybrid_layer_types(cfg, arch.num_layers, where),
        state=replace(gated_delta_net_from_hf(cfg, where), grouped_beta_alpha=grouped_beta_alpha),
    )
    if moe and arch.moe.shared_expert_intermediate_size == 0:
        raise ValueError(f"{where}: a {cfg['model_type']} config without a shared expert")
    return arch


def read_hybrid_gguf(
    gguf: GGUFFile, family: str, moe: bool, tiled: bool, grouped_beta_alpha: bool = False
) -> ModelArchConfig:
    """A Gated DeltaNet hybrid's record from llama.cpp's file (qwen3next, qwen35, qwen35moe);
    `tiled`: its value heads in llama.cpp's tiled order (the converter's Qwen3.5 files);
    `grouped_beta_alpha`: as read_hybrid_hf's (Qwen3-Next's ssm_ba)."""
    state, layer_types, num_layers = gated_delta_net_from_gguf(gguf, tiled)
    experts = partial(moe_from_gguf, renormalise=True) if moe else None
    arch = gguf_config.decoder_arch(
        gguf, family, qk_norm=True, partial_rotation=True, experts=experts
    )
    state = replace(state, grouped_beta_alpha=grouped_beta_alpha)
    return replace(arch, num_layers=num_layers, layer_types=layer_types, state=state)


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    return read_hybrid_gguf(gguf, FAMILY.name, moe=True, tiled=False, grouped_beta_alpha=True)


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    # Qwen2-MoE's experts: norm_topk_prob, mlp_only_layers and decoder_sparse_step as
    # config.json says.
    experts = partial(moe_from_hf, shared_expert=True)
    return read_hybrid_hf(cfg, where, FAMILY.name, experts, grouped_beta_alpha=True)


FAMILY = Family(
    name="qwen3_next",
    title="Qwen3-Next",
    model_types=("qwen3_next",),
    gguf_architectures=("qwen3next",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names=GGUF_NAMES,
    gguf_undo=undo_gguf_norms,
    model_class="zllm.executor.models.qwen3_next:Qwen3NextForCausalLM",
    traits=frozenset({Trait.MOE, Trait.RECURRENT_STATE}),
    lacks={**MOE_LACKS, **HYBRID_LACKS},
)
