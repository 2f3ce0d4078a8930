"""Any other architecture, on transformers' modeling code with zllm's paged attention plugged
in (executor/models/transformers/backend.py): the registry's answer to a config.json model_type
or a GGUF architecture no family claims, under --model-impl transformers or auto. Its reader
takes the KV cache layout under the names the common families use (zllm/model/
transformers_config.py) and refuses what the backend cannot serve, by its config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import transformers_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Feature
from zllm.model.gguf import GGUFFile

# GGUF architectures that are no decoder (llama.cpp's names): refused by name.
ENCODER_GGUF = frozenset({"t5", "t5encoder", "umt5", "bert", "nomic-bert"})
# llama.cpp's general.architecture names that transformers' GGUF reader spells otherwise
# (for a family's own files, its model types are transformers' spellings).
GGUF_SPELLINGS = {"minimax-m2": "minimax_m2", "t5encoder": "t5"}


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    transformers_config.refuse_unservable(cfg, str(where))
    return transformers_config.read_hf(cfg, where, FAMILY.name)


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    arch = str(gguf.metadata.get("general.architecture"))
    if arch in ENCODER_GGUF:
        raise ValueError(
            f"{gguf.path}: {arch} is an encoder model; zllm serves decoder-only causal LMs"
        )
    return transformers_config.read_gguf(gguf, FAMILY.name)


FAMILY = Family(
    name="transformers",
    title="transformers backend",
    read_hf=read_hf,
    read_gguf=read_gguf,
    model_class="zllm.executor.models.transformers.backend:TransformersForCausalLM",
    code="transformers",
    lacks={
        **transformers_config.TRANSFORMERS_LACKS,
        Feature.CLASSIFIER_HEAD: "zllm reads classifier heads of its own models and of encoders",
    },
)
