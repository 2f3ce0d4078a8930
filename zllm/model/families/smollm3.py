"""SmolLM3: Llama's decoder (executor/models/llama.py) with NoPE layers, whose attention takes no
position embedding: config.json's no_rope_layers (1: rotate, 0: not; transformers' default,
and llama.cpp's fixed rule for `smollm3` files, leaves every fourth layer unrotated), and
optionally a window on those layers (use_sliding_window, which the released checkpoints leave
off). GGUF files (`smollm3`) hold the q/k rows permuted as Llama's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Trait
from zllm.model.gguf import GGUFFile

# transformers' no_rope_layer_interval default and llama.cpp's n_no_rope_layer_step for smollm3.
NO_ROPE_INTERVAL = 4


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    arch = hf_config.decoder_arch(cfg, where, FAMILY.name, windows=_nope_windows)
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or NO_ROPE_INTERVAL)
        flags = [int((i + 1) % interval != 0) for i in range(arch.num_layers)]
    if len(flags) != arch.num_layers:
        raise ValueError(f"{where}: no_rope_layers has {len(flags)} entries for {arch.num_layers} layers")  # fmt: skip
    arch.nope_layers = tuple(i for i, rotate in enumerate(flags) if not rotate)
    return arch


def _nope_windows(cfg: dict[str, Any], num_layers: int) -> tuple[list[str] | None, int | None]:
    """Windows only with use_sliding_window, on config.json's sliding layers."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return None, None
    return cfg.get("layer_types"), int(cfg["sliding_window"])


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    arch = gguf_config.decoder_arch(gguf, FAMILY.name)
    arch.nope_layers = tuple(i for i in range(arch.num_layers) if (i + 1) % NO_ROPE_INTERVAL == 0)
    return arch


FAMILY = Family(
    name="smollm3",
    title="SmolLM3",
    model_types=("smollm3",),
    gguf_architectures=("smollm3",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names=gguf_config.LAYER_NAMES,
    gguf_permuted_qk=True,
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW}),
)
