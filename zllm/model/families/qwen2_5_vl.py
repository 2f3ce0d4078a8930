"""Qwen2.5-VL: a Qwen2 decoder (executor/models/llama.py) whose rotary frequencies split in
three sections turned by a token's (time, row, column) positions (multimodal RoPE), beside a
window-attention vision encoder (executor/models/vision/qwen2_5_vl.py). Its image tokens are
causal, as text; each image takes as many as its resized size holds (image_tokens.ImageGrid).
transformers 5 nests the language model in text_config, transformers 4 writes it at the top."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zllm.model import hf_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Feature, ImageRules, Trait
from zllm.model.image_tokens import ImageGrid, ImagePlaceholders


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    text, mrope_section = _text_config(cfg, where)
    decoder = hf_config.decoder_arch(
        text,
        where,
        FAMILY.name,
        attention_bias=True,
        windows=hf_config.windowed_from_max_window_layers,
    )
    return dataclasses.replace(
        decoder, architecture=cfg["model_type"], vision=True, mrope_section=mrope_section
    )


def _text_config(cfg: dict[str, Any], where: Path) -> tuple[dict[str, Any], list[int]]:
    """The language model's config as a Qwen2 config.json, and its M-RoPE sections (read from
    rope_scaling / rope_parameters, where transformers 4 calls the rope type "mrope")."""
    if "vision_config" not in cfg:
        raise ValueError(f"{where}: a Qwen2.5-VL config without vision_config")
    outer = {k: v for k, v in cfg.items() if k not in ("vision_config", "text_config")}
    text = {**outer, **(cfg.get("text_config") or {}), "model_type": "qwen2"}
    mrope_section = None
    for key in ("rope_scaling", "rope_parameters"):
        rope = dict(text.get(key) or {})
        mrope_section = rope.pop("mrope_section", None) or mrope_section
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text[key] = rope or None
    section = [int(n) for n in (mrope_section or [16, 24, 24])]  # transformers' default
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    if sum(section) != head_dim // 2 or len(section) != 3:
        raise ValueError(
            f"{where}: mrope_section {section} must be three parts summing to half the "
            f"head dimension ({head_dim // 2})"
        )
    return text, section


def placeholders(
    config: dict, grid: ImageGrid, token_text: Callable[[int], str | None]
) -> ImagePlaceholders:
    """Qwen2_5_VLProcessor's expansion of "<|image_pad|>" (between <|vision_start|> and
    <|vision_end|>, which the template writes) into one per merged patch of the image as its
    processor resizes it, from config.json's image_token_id and the tokenizer's text for it."""
    token_id = int(config.get("image_token_id", 151655))
    text = token_text(token_id)
    if text is None:
        raise ValueError(
            f"the tokenizer has no token {token_id} (config.json's image_token_id): a "
            f"Qwen2.5-VL checkpoint's tokenizer holds its image tokens"
        )
    return ImagePlaceholders(
        marker=text, before="", image_token=text, after="", image_token_id=token_id, grid=grid
    )


FAMILY = Family(
    name="qwen2_5_vl",
    title="Qwen2.5-VL",
    model_types=("qwen2_5_vl",),
    read_hf=read_hf,
    model_class="zllm.executor.models.llama:LlamaForCausalLM",
    traits=frozenset({Trait.SLIDING_WINDOW, Trait.VISION}),
    lacks={Feature.CLASSIFIER_HEAD: "zllm runs its language model to generate only"},
    images=ImageRules(
        placeholders=lambda model_path, config, token_text: placeholders(
            config, ImageGrid.of_model(model_path), token_text
        ),
        max_tokens=lambda model_path, config: ImageGrid.of_model(model_path).max_tokens(),
        encoder="zllm.executor.models.vision.qwen2_5_vl:Qwen25VLImages",
    ),
)
