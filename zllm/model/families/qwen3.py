"""Qwen 3: Llama's decoder with an RMSNorm over each query and key head before RoPE
(executor/models/llama.py, qk_norm), windows as Qwen2's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    windows = hf_config.windowed_from_max_window_layers
    return hf_config.decoder_arch(cfg, where, FAMILY.name, qk_norm=True, windows=windows)


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    return gguf_config.decoder_arch(gguf, FAMILY.name, qk_norm=True)


FAMILY = Family(
    name="qwen3",
    title="Qwen 3",
    model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names={**gguf_config.LAYER_NAMES, **gguf_config.QK_NORM_NAMES},
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW}),
)
