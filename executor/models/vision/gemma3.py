"""Gemma 3's image encoder: SigLIP's vision tower (siglip.py) over the image resized to its
image_size, its patches' last hidden states average-pooled to mm_tokens_per_image tokens
(a square grid), RMS-normalised (Gemma's 1 + w scale) and projected to the language model's
width. The result replaces the prompt's <image_soft_token> embeddings, after the text
embedding's sqrt(hidden) scaling (the image features are not scaled).

The pixels come from the checkpoint's own transformers image processor
(preprocessor_config.json: resize, rescale, normalise), run here, where torch is."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.models.vision.checkpoint import (
    copy_tensors,
    decoded_images,
    image_processor,
    tensor_index,
)
from zllm.executor.models.vision.siglip import SiglipConfig, SiglipVisionTower
from zllm.model.families.gemma3 import tokens_per_image

# Where the encoder's tensors live in a checkpoint: transformers 5 saves the tower as
# `vision_tower.`, the Hub's Gemma 3 checkpoints (and transformers 4) as
# `vision_tower.vision_model.`; some prefix it all with `model.`.
_TOWER_PREFIXES = (
    "vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
    "model.vision_tower.",
)  # fmt: skip
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


class Gemma3ImageEncoder(nn.Module):
    """pixel_values [images, 3, size, size] -> [images, mm_tokens_per_image, text hidden]."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        vision = SiglipConfig.from_dict(config["vision_config"])
        self.tokens_per_image = tokens_per_image(config)
        side = round(self.tokens_per_image**0.5)
        if side * side != self.tokens_per_image or vision.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {self.tokens_per_image} is not a square grid that "
                f"divides the {vision.patches_per_side}x{vision.patches_per_side} patches"
            )
        self.pool = vision.patches_per_side // side
        self.eps = vision.layer_norm_eps
        self.tower = SiglipVisionTower(vision)
        text_hidden = config["text_config"]["hidden_size"]
        self.soft_emb_norm = nn.Parameter(torch.zeros(vision.hidden_size))
        self.projection = nn.Parameter(torch.zeros(vision.hidden_size, text_hidden))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.tower(pixel_values)  # [images, patches, width]
        images, patches, width = hidden.shape
        side = self.tower.config.patches_per_side
        grid = hidden.transpose(1, 2).reshape(images, width, side, side)
        pooled = F.avg_pool2d(grid, self.pool, stride=self.pool).flatten(2).transpose(1, 2)
        normed = pooled.float() * torch.rsqrt(
            pooled.float().pow(2).mean(-1, keepdim=True) + self.eps
        )
        normed = (normed * (1.0 + self.soft_emb_norm.float())).to(pooled.dtype)
        return normed @ self.projection

    def load_checkpoint(self, model_dir: str) -> None:
        """Fill every tensor from the checkpoint's safetensors (ValueError naming a missing one)."""
        names = tensor_index(model_dir)
        tower_prefix = next(
            (p for p in _TOWER_PREFIXES if f"{p}post_layernorm.weight" in names), None
        )
        projector = next(
            (p for p in _PROJECTOR_PREFIXES if f"{p}mm_input_projection_weight" in names), None
        )
        if tower_prefix is None or projector is None:
            raise ValueError(f"{model_dir}: no Gemma 3 vision tower and projector tensors found")
        targets = self.tower.checkpoint_targets(tower_prefix)
        targets[f"{projector}mm_soft_emb_norm.weight"] = self.soft_emb_norm
        targets[f"{projector}mm_input_projection_weight"] = self.projection
        copy_tensors(model_dir, names, targets)


def pixel_values(model_dir: str, images: list[bytes], processor=None) -> torch.Tensor:
    """The encoded images as the checkpoint's transformers image processor prepares them
    (`processor`: that processor, loaded once by the caller; else loaded here)."""
    processor = processor or image_processor(model_dir)
    return processor(images=decoded_images(images), return_tensors="pt")["pixel_values"]


class Gemma3Images:
    """Gemma 3's encoder with its processor, as features.py's ImageEncoder."""

    def __init__(
        self, model_path: str, config: dict, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.model_path = model_path
        self.encoder = Gemma3ImageEncoder(config).to(dtype)
        self.encoder.load_checkpoint(model_path)
        self.encoder.to(device).eval()
        self.processor = image_processor(model_path)

    @classmethod
    def load(
        cls,
        model_path: str,
        config: dict,
        dtype: torch.dtype,
        language_model: nn.Module,
        device: torch.device | str = "cpu",
    ) -> Gemma3Images:
        """The family's encoder (ImageRules.encoder), loaded: its own weights onto `device`."""
        return cls(model_path, config, dtype, device)

    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        pixels = pixel_values(self.model_path, images, self.processor)
        weight = self.encoder.projection
        batch = self.encoder(pixels.to(weight.device, weight.dtype))
        return [row.clone() for row in batch]  # (not views keeping the whole batch alive)
