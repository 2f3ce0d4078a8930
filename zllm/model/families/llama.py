"""Llama and Mistral: the plain pre-norm decoder (executor/models/llama.py), with Llama 3's
rope scaling (config.json's rope parameters or a GGUF file's rope_freqs divisors) and
Mistral's window on every layer. Mistral checkpoints convert to "llama" GGUF files, without
their window (they attend over the whole context there, as in llama.cpp), q/k rows permuted
for llama.cpp's rotary layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    # Mistral's config class defaults the window to 4096 when config.json leaves it out.
    mistral = cfg["model_type"] == "mistral"
    windows = hf_config.every_layer_windowed(4096) if mistral else hf_config.no_windows
    return hf_config.decoder_arch(cfg, where, FAMILY.name, windows=windows)


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    return gguf_config.decoder_arch(gguf, FAMILY.name)


FAMILY = Family(
    name="llama",
    title="Llama",
    model_types=("llama", "mistral"),
    gguf_architectures=("llama",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    claims_gguf=lambda gguf: not gguf.metadata.get("llama.expert_count"),  # else Mixtral's
    gguf_tensor_names=gguf_config.LAYER_NAMES,
    gguf_permuted_qk=True,
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW}),
)
