"""LLaVA on the transformers backend: transformers' vision tower and projector
(executor/models/vision/transformers_images.py) beside a language model that attends through
zllm's paged cache. Its image tokens are causal; each image takes one <image> token per patch
of the cropped image, as LlavaProcessor counts them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zllm.model import transformers_config
from zllm.model.arch_config import ModelArchConfig
from zllm.model.family import Family, Feature, ImageRules, Trait
from zllm.model.image_tokens import ImagePlaceholders

# transformers' LlamaConfig defaults: the Hub's LLaVA 1.5 configs (written by transformers
# 4.3x) give only what differs from them in text_config.
_LLAMA_TEXT_DEFAULTS = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "vocab_size": 32000,
}  # fmt: skip


def read_hf(cfg: dict[str, Any], where: Path) -> ModelArchConfig:
    transformers_config.refuse_unservable(cfg, str(where), vision=True)
    return transformers_config.read_hf(_text_config(cfg), where, FAMILY.name, vision=True)


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model as a text model's config: its text_config over its text model
    type's defaults (Llama's), with the outer config's vocabulary and tied embeddings where
    it states them, named as the whole model."""
    text = dict(cfg.get("text_config") or {})
    defaults = _LLAMA_TEXT_DEFAULTS if text.get("model_type", "llama") == "llama" else {}
    outer = {k: cfg[k] for k in ("vocab_size", "tie_word_embeddings") if k in cfg}
    return {**defaults, **text, **outer, "model_type": cfg["model_type"]}


def tokens_per_image(model_path: str | Path, config: dict) -> int:
    """The cropped image's patches, plus the tower's extra tokens (CLIP's class token), less
    the one the "default" feature strategy drops (processor_config.json,
    preprocessor_config.json, config.json)."""
    folder = Path(model_path)
    processor = _json_or_empty(folder / "processor_config.json")
    image = _json_or_empty(folder / "preprocessor_config.json")
    patch = processor.get("patch_size") or config.get("vision_config", {}).get("patch_size")
    crop = image.get("crop_size") or image.get("size") or {}
    if isinstance(crop, int):
        crop = {"height": crop, "width": crop}
    height = crop.get("height") or crop.get("shortest_edge")
    width = crop.get("width") or crop.get("shortest_edge")
    if not (patch and height and width):
        raise ValueError(
            f"{model_path}: cannot count LLaVA's image tokens: processor_config.json's "
            f"patch_size and preprocessor_config.json's crop_size are needed"
        )
    count = (height // patch) * (width // patch) + processor.get("num_additional_image_tokens", 0)
    strategy = processor.get("vision_feature_select_strategy") or config.get(
        "vision_feature_select_strategy", "default"
    )
    return count - (strategy == "default")


def _json_or_empty(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def placeholders(
    model_path: str, config: dict, token_text: Callable[[int], str | None]
) -> ImagePlaceholders:
    """LlavaProcessor's expansion of "<image>" into its count of "<image>"."""
    token_id = int(config.get("image_token_id", config.get("image_token_index", 32000)))
    text = token_text(token_id)
    if text is None:
        raise ValueError(
            f"the tokenizer has no token {token_id} (config.json's image_token_index): a "
            f"LLaVA checkpoint's tokenizer holds its image token"
        )
    count = tokens_per_image(model_path, config)
    return ImagePlaceholders(text, "", text, "", token_id, tokens_per_image=count)


FAMILY = Family(
    name="llava",
    title="LLaVA",
    model_types=("llava",),
    read_hf=read_hf,
    model_class="zllm.executor.models.transformers.backend:TransformersForCausalLM",
    code="transformers",
    traits=frozenset({Trait.VISION}),
    # Its vision tower and projector are transformers' modules, outside the language model
    # that zllm cuts, quantizes and adapts.
    lacks={
        **transformers_config.TRANSFORMERS_LACKS,
        Feature.TENSOR_PARALLEL: "transformers' plan cuts its language model, not its vision tower",  # noqa: E501
        Feature.LORA: "adapters of transformers' vision models are not read",
        Feature.QUANTIZATION: "runs on zllm's own vision models only",
        Feature.CLASSIFIER_HEAD: "zllm runs it to generate only",
    },
    images=ImageRules(
        placeholders=placeholders,
        max_tokens=tokens_per_image,
        encoder="zllm.executor.models.vision.transformers_images:TransformersImages",
    ),
)
