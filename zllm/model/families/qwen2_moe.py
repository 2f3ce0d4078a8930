"""Qwen2-MoE: Qwen2's decoder with mixture-of-experts MLPs (executor/models/llama.py with the
MoE layer) beside an always-on, sigmoid-gated shared expert; dense MLPs where mlp_only_layers
and decoder_sparse_step say. llama.cpp does not renormalise its chosen experts' weights."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile
from zllm.model.moe_arch import MOE_LACKS, moe_from_gguf, moe_from_hf


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    experts = partial(moe_from_hf, shared_expert=True)
    bias = bool(cfg.get("attention_bias", False)) or bool(cfg.get("qkv_bias", True))
    return hf_config.decoder_arch(cfg, where, FAMILY.name, attention_bias=bias, experts=experts)


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    experts = partial(moe_from_gguf, renormalise=False)
    return gguf_config.decoder_arch(gguf, FAMILY.name, experts=experts)


FAMILY = Family(
    name="qwen2_moe",
    title="Qwen2-MoE",
    model_types=("qwen2_moe",),
    gguf_architectures=("qwen2moe",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names=gguf_config.LAYER_NAMES,
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.MOE}),
    lacks=MOE_LACKS,
)
