"""Qwen2.5-VL's image encoder (executor/models/vision/qwen2_5_vl.py) against transformers'
`get_image_features` on a tiny random checkpoint: images of several sizes and aspect ratios
in one call (window attention with partial windows, full-attention blocks, the merger and the
window order undone), and the checkpoint refusals."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from zllm.executor.models.vision.qwen2_5_vl import (
    Qwen25VLImageEncoder,
    image_processor,
    pixel_values,
)

# 112-pixel windows over 28-pixel merged patches: 4x4 merged patches a window.
VISION = dict(
    depth=4,
    hidden_size=64,
    num_heads=4,
    intermediate_size=128,
    out_hidden_size=64,
    window_size=112,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    fullatt_block_indexes=[1, 3],
)
TEXT = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
# (width, height) -> merged grid (the processor rounds sides to multiples of 28 pixels, at most
# 256 patches): 2x2 (under one window), 4x7 (whole windows down, not across), 11x3, 9x6 (cut
# short both ways) and 8x8 (2x2 whole windows).
SIZES = [(56, 56), (200, 120), (90, 300), (224, 336), (224, 224)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """(model dir, transformers' model) of a seeded tiny Qwen2.5-VL with every vision tensor
    random (norm weights and biases too, so each one is checked)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.model.visual.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (param == 1).float())
    path = tmp_path_factory.mktemp("qwen25vl")
    model.save_pretrained(path)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112 * 4).save_pretrained(path)
    return path, model


def _png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def _encoder(path: Path) -> Qwen25VLImageEncoder:
    encoder = Qwen25VLImageEncoder(json.loads((path / "config.json").read_text()))
    encoder.load_checkpoint(str(path))
    return encoder.eval()


def test_encoder_matches_transformers_on_a_batch_of_sizes(checkpoint) -> None:
    path, model = checkpoint
    images = [_png(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    pixels, grid_thw = pixel_values(images, image_processor(str(path)))
    merged = [(h // 2, w // 2) for _, h, w in grid_thw.tolist()]
    # The batch has windows cut short by the image's edge and images of several windows.
    assert any(h % 4 or w % 4 for h, w in merged)
    assert any(h > 4 and w > 4 for h, w in merged)
    assert len({tuple(g) for g in grid_thw.tolist()}) == len(SIZES)
    with torch.no_grad():
        expected = torch.cat(model.model.get_image_features(pixels, grid_thw).pooler_output)
        ours = _encoder(path)(pixels, grid_thw)
    assert ours.shape == (int(grid_thw.prod(-1).sum()) // 4, VISION["out_hidden_size"])
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() < 1e-4
    # One image alone gives the same tokens as in the batch (attention never crosses images).
    with torch.no_grad():
        alone = _encoder(path)(pixels[-int(grid_thw[-1].prod()) :], grid_thw[-1:])
    assert (alone - ours[-alone.shape[0] :]).abs().max().item() < 1e-4


def _rewrite(path: Path, edit) -> Path:
    """A copy of the checkpoint with its tensors changed by `edit(tensors)`."""
    copy = path.parent / f"{path.name}_{edit.__name__}"
    copy.mkdir()
    (copy / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(copy / "model.safetensors"))
    return copy


def test_missing_and_misshaped_tensors_are_named(checkpoint) -> None:
    path, _ = checkpoint
    name = "visual.blocks.2.mlp.up_proj.bias"
    assert name in load_file(str(path / "model.safetensors"))

    def drop(tensors: dict) -> None:
        del tensors[name]

    def reshape(tensors: dict) -> None:
        tensors[name] = torch.zeros(7)

    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match=f"{name} is missing"):
        Qwen25VLImageEncoder(config).load_checkpoint(str(_rewrite(path, drop)))
    with pytest.raises(ValueError, match=rf"{name} has shape \[7\]"):
        Qwen25VLImageEncoder(config).load_checkpoint(str(_rewrite(path, reshape)))


def test_checkpoint_under_model_prefix_loads(checkpoint) -> None:
    path, _ = checkpoint

    def under_model(tensors: dict) -> None:
        for name in [n for n in tensors if n.startswith("visual.")]:
            tensors[f"model.{name}"] = tensors.pop(name)

    encoder = _encoder(_rewrite(path, under_model))
    reference = _encoder(path)
    for ours, theirs in zip(encoder.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
