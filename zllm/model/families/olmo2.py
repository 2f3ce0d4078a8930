"""OLMo 2 and OLMo 3 (executor/models/olmo2.py): post-norm decoder layers (each sublayer's output
normed before it joins the residual stream, no norm before it) with RMSNorms over all query
heads and over all key heads at once, from config.json (model_type olmo2, olmo3) or a GGUF
file of llama.cpp's `olmo2` architecture, which holds both. No torch here.

OLMo 3 adds sliding-window layers (layer_types; transformers' default: three sliding, then one
full) and RoPE parameters per layer kind: transformers applies config.json's rope_scaling to the
full layers only, the sliding ones keep the plain table of the same base. llama.cpp's converter
writes the window and `attention.sliding_window_pattern` (true: sliding)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zllm.model import gguf_config, hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Feature, Trait
from zllm.model.gguf import GGUFFile, invalid_gguf

FAMILY_NAME = "olmo2"
# OLMo 3's config class: every fourth layer full, the others windowed.
FULL_EVERY = 4


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    cfg = _flat_rope(cfg, where)
    windows = _olmo3_windows if cfg.get("model_type") == "olmo3" else hf_config.no_windows
    arch = hf_config.decoder_arch(cfg, where, FAMILY_NAME, windows=windows)
    arch.qk_norm_whole = True
    return arch


def _olmo3_windows(cfg: dict[str, Any], num_layers: int) -> tuple[list[str], int | None]:
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % FULL_EVERY else "full_attention" for i in range(num_layers)
    ]
    return layer_types, cfg.get("sliding_window", 4096)


def _flat_rope(cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    """config.json with OLMo 3's per-kind rope_parameters ({"full_attention": ...,
    "sliding_attention": ...}, transformers 5) as one: the full layers'. The model gives
    the sliding layers the same base unscaled, as transformers does; other sliding
    parameters are refused, naming them."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" not in params:
        return cfg
    full = dict(params["full_attention"] or {})
    sliding = dict(params.get("sliding_attention") or {})
    theta = full.get("rope_theta")
    if (
        sliding.get("rope_type", "default") != "default"
        or sliding.get("rope_theta", theta) != theta
    ):
        raise ValueError(
            f"{where}: rope_parameters.sliding_attention {sliding} (zllm runs OLMo 3's sliding "
            f"layers on the full layers' base, unscaled)"
        )
    return {**cfg, "rope_parameters": full}


def read_gguf(gguf: GGUFFile) -> ModelArchConfig:
    arch = gguf_config.decoder_arch(gguf, FAMILY_NAME, windows=True)
    arch.qk_norm_whole = True
    pattern = gguf.metadata.get("olmo2.attention.sliding_window_pattern")
    if arch.sliding_window is not None and pattern is not None:
        if len(pattern) != arch.num_layers:
            raise invalid_gguf(gguf.path, f"sliding_window_pattern of {len(pattern)} layers")
        kinds = ["sliding_attention" if p else "full_attention" for p in pattern]
        arch.layer_types = kinds if "sliding_attention" in kinds else None
        arch.sliding_window = arch.sliding_window if arch.layer_types else None
    return arch


FAMILY = Family(
    name=FAMILY_NAME,
    title="OLMo 2/3",
    model_types=("olmo2", "olmo3"),
    gguf_architectures=("olmo2",),
    read_hf=read_hf,
    read_gguf=read_gguf,
    gguf_tensor_names={
        **gguf_config.LAYER_NAMES,
        **gguf_config.QK_NORM_NAMES,  # (over all heads at once here)
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    model_class="zllm.executor.models.olmo2:Olmo2ForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW}),
    lacks={
        Feature.FUSED_CPU_DECODE: (
            "the fused step's layers are pre-norm with per-head q/k norms; OLMo's are post-norm "
            "with q/k norms over all heads"
        ),
        Feature.TENSOR_PARALLEL: "its q/k norms span every head, which ranks would split",
        Feature.CLASSIFIER_HEAD: "its model code carries no score head",
    },
)
