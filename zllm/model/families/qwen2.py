"""Qwen2: Llama's decoder with q/k/v biases (executor/models/llama.py), windows on the layers
from max_window_layers on when use_sliding_window is set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    return hf_config.decoder_arch(
        cfg,
        where,
        FAMILY.name,
        attention_bias=True,
        windows=hf_config.windowed_from_max_window_layers,
    )


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    return gguf_config.decoder_arch(gguf, FAMILY.name)


FAMILY = Family(
    name="qwen2",
    title="Qwen2",
    model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names=gguf_config.LAYER_NAMES,
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW}),
)
