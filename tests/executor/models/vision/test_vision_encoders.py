"""Vision encoders in zllm's code (executor/models/vision/) against transformers': the same
checkpoint's image features for the same processed pixels (issue 60)."""

from __future__ import annotations

import json

import pytest
import torch
from vision_models import png, write_tiny_gemma3_vlm

from zllm.executor.models.vision.gemma3 import Gemma3ImageEncoder, pixel_values


def test_gemma3_image_features_equal_transformers(tmp_path) -> None:
    from transformers import Gemma3ForConditionalGeneration

    path = write_tiny_gemma3_vlm(tmp_path / "gemma3")
    encoder = Gemma3ImageEncoder(json.loads((path / "config.json").read_text()))
    encoder.load_checkpoint(str(path))
    pixels = pixel_values(str(path), [png(seed, (40 + 10 * seed, 30)) for seed in range(3)])
    assert pixels.shape == (3, 3, 56, 56)
    reference = Gemma3ForConditionalGeneration.from_pretrained(path).eval()
    with torch.no_grad():
        ours = encoder(pixels)
        theirs = reference.model.get_image_features(pixels).pooler_output
    assert ours.shape == theirs.shape == (3, 4, 64)
    assert float((ours - theirs).abs().max()) < 1e-4 * float(theirs.abs().max())
    assert float((ours[0] - ours[1]).abs().max()) > 0.1  # different images, different features


def test_a_checkpoint_without_the_encoders_tensors_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = write_tiny_gemma3_vlm(tmp_path / "gemma3")
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    name = next(n for n in tensors if n.endswith("layers.1.mlp.fc2.weight"))
    del tensors[name]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"the vision encoder's .*layers\.1\.mlp\.fc2\.weight"):
        Gemma3ImageEncoder(config).load_checkpoint(str(path))
    config["mm_tokens_per_image"] = 3
    with pytest.raises(ValueError, match="mm_tokens_per_image 3 is not a square grid"):
        Gemma3ImageEncoder(config)
