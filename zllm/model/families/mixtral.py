"""Mixtral: Mistral's decoder with a mixture of experts on every layer (Llama's model code,
executor/models/llama.py, with the MoE layer), its router always renormalising the chosen
experts' weights. Its GGUF files are "llama" files with llama.expert_count."""

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
    # Every expert intermediate_size wide; the router always renormalises.
    experts = partial(
        moe_from_hf, width_key="intermediate_size", always_renormalise=True, dense_layers=False
    )
    windows = hf_config.every_layer_windowed()  # (Mixtral's config class defaults it to None)
    return hf_config.decoder_arch(cfg, where, FAMILY.name, windows=windows, experts=experts)


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    experts = partial(moe_from_gguf, renormalise=True)
    return gguf_config.decoder_arch(gguf, FAMILY.name, experts=experts)


FAMILY = Family(
    name="mixtral",
    title="Mixtral",
    model_types=("mixtral",),
    gguf_architectures=("llama",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    claims_gguf=lambda gguf: bool(gguf.metadata.get("llama.expert_count")),
    gguf_tensor_names=gguf_config.LAYER_NAMES,
    gguf_permuted_qk=True,
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW, Trait.MOE}),
    lacks=MOE_LACKS,
)
