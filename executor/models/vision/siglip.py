"""SigLIP's vision transformer (Gemma 3's vision tower): an image cut into patches, each patch
embedded and given its position, then pre-norm encoder layers with bidirectional attention
over all patches, and a final LayerNorm. Its last hidden states are what Gemma 3 projects
(the pooling head SigLIP has for image-text matching is not used)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class SiglipConfig:
    """The vision_config fields the encoder reads."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, config: dict) -> SiglipConfig:
        act = config.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
            raise ValueError(
                f"vision_config.hidden_act {act!r}: SigLIP runs tanh-approximated GELU"
            )
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            image_size=config["image_size"],
            patch_size=config["patch_size"],
            num_channels=config.get("num_channels", 3),
            layer_norm_eps=config.get("layer_norm_eps", 1e-6),
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class _EncoderLayer(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.num_heads = config.num_heads
        self.layer_norm1 = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)
        self.layer_norm2 = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(width, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, patches, width = x.shape
        h = self.layer_norm1(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(images, patches, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        attended = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        x = x + self.out_proj(attended.transpose(1, 2).reshape(images, patches, width))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class SiglipVisionTower(nn.Module):
    """pixel_values [images, channels, size, size] -> [images, patches, hidden]."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, width, config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Parameter(torch.empty(config.patches_per_side**2, width))
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(config.num_layers))
        self.post_layernorm = nn.LayerNorm(width, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.position_embedding.dtype))
        x = patches.flatten(2).transpose(1, 2) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Each checkpoint name (transformers' SiglipVisionModel's, under `prefix`) -> the
        tensor it fills."""
        targets = {
            f"{prefix}embeddings.patch_embedding.weight": self.patch_embedding.weight,
            f"{prefix}embeddings.patch_embedding.bias": self.patch_embedding.bias,
            f"{prefix}embeddings.position_embedding.weight": self.position_embedding,
            f"{prefix}post_layernorm.weight": self.post_layernorm.weight,
            f"{prefix}post_layernorm.bias": self.post_layernorm.bias,
        }
        for i, layer in enumerate(self.layers):
            p = f"{prefix}encoder.layers.{i}."
            modules = {
                "layer_norm1": layer.layer_norm1, "layer_norm2": layer.layer_norm2,
                "self_attn.q_proj": layer.q_proj, "self_attn.k_proj": layer.k_proj,
                "self_attn.v_proj": layer.v_proj, "self_attn.out_proj": layer.out_proj,
                "mlp.fc1": layer.fc1, "mlp.fc2": layer.fc2,
            }  # fmt: skip
            for name, module in modules.items():
                targets[f"{p}{name}.weight"] = module.weight
                targets[f"{p}{name}.bias"] = module.bias
        return targets
