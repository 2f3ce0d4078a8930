"""Qwen3-MoE: Qwen 3's decoder (q/k head norms) with mixture-of-experts MLPs
(executor/models/llama.py with the MoE layer); llama.cpp renormalises its chosen experts'
weights."""

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
    return hf_config.decoder_arch(cfg, where, FAMILY.name, qk_norm=True, experts=moe_from_hf)


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    experts = partial(moe_from_gguf, renormalise=True)
    return gguf_config.decoder_arch(gguf, FAMILY.name, qk_norm=True, experts=experts)


FAMILY = Family(
    name="qwen3_moe",
    title="Qwen3-MoE",
    model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names={**gguf_config.LAYER_NAMES, **gguf_config.QK_NORM_NAMES},
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.MOE}),
    lacks=MOE_LACKS,
)
