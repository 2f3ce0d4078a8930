"""A model's class, by its family (zllm/model/registry.py): each family names where its model
code lives (`Family.model_class`), imported here on first use, so the runner is the only
place that imports a model module, and only the one it runs."""

from __future__ import annotations

import importlib

from torch import nn

from zllm.model.arch_config import ModelArchConfig
from zllm.model.registry import code_family


def model_class_of(arch: ModelArchConfig, model_impl: str = "zllm") -> type[nn.Module]:
    """The class whose code runs `arch` under `model_impl` (registry.code_family)."""
    module, _, name = code_family(arch, model_impl).model_class.partition(":")
    return getattr(importlib.import_module(module), name)
