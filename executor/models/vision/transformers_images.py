"""A vision-language model's image encoder on the transformers backend (LLaVA): transformers'
own vision tower and projector, inside the model the backend loaded, called through the
model's `get_image_features` (its vision tower attends with torch's SDPA: only the language
model's layers attend through zllm's paged cache), over the pixels the checkpoint's own image
processor makes."""

from __future__ import annotations

import torch
from torch import nn

from zllm.executor.models.vision.checkpoint import decoded_images, image_processor


class TransformersImages:
    """features.py's ImageEncoder over a transformers vision-language model."""

    def __init__(self, hf_model: nn.Module, model_path: str) -> None:
        self.model = hf_model
        self.processor = image_processor(model_path)
        config = hf_model.config
        self.options = {
            "vision_feature_layer": getattr(config, "vision_feature_layer", None),
            "vision_feature_select_strategy": getattr(
                config, "vision_feature_select_strategy", None
            ),
        }
        weight = hf_model.get_input_embeddings().weight
        self.dtype, self.device = weight.dtype, weight.device

    @classmethod
    def load(
        cls,
        model_path: str,
        config: dict,
        dtype: torch.dtype,
        language_model: nn.Module,
        device: torch.device | str = "cpu",
    ) -> TransformersImages:
        """The family's encoder (ImageRules.encoder), loaded: the one inside the loaded language model (transformers' vision tower)."""
        return cls(language_model.hf, model_path)

    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        pixels = self.processor(images=decoded_images(images), return_tensors="pt")["pixel_values"]
        out = self.model.get_image_features(
            pixel_values=pixels.to(self.device, self.dtype), return_dict=True, **self.options
        )
        features = out.pooler_output
        return [row.clone() for row in features]  # (each image's [tokens, hidden])
