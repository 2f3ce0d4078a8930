"""A model's class, by its family (zllm/model/registry.py): each family names where its model
code lives (`Family.model_class`), imported here on first use, so the runner is the only
place that imports a model module, and only the one it runs."""

from __future__ import annotations

import importlib

from torch import nn

from zllm.model.arch_config import ModelArchConfig
from zllm.model.registry import family_of


def model_class_of(arch: ModelArchConfig) -> type[nn.Module]:
    """The class whose code runs `arch`'s family."""
    module, _, name = family_of(arch).model_class.partition(":")
    return getattr(importlib.import_module(module), name)
