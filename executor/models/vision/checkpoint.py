"""What every vision encoder here reads the same way: its tensors from the checkpoint's
safetensors (each checked by name and shape), and the checkpoint's own transformers image
processor over the decoded images."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from safetensors import safe_open


def tensor_index(model_dir: str) -> dict[str, Path]:
    """Each tensor name of the checkpoint -> the safetensors file holding it."""
    names: dict[str, Path] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as shard:
            names.update({name: file for name in shard.keys()})
    return names


def copy_tensors(model_dir: str, names: dict[str, Path], targets: dict[str, torch.Tensor]) -> None:
    """Fill each target from the checkpoint (`names`: tensor_index's), one file open at a
    time; ValueError naming a missing or mis-shaped tensor."""
    missing = sorted(set(targets) - set(names))
    if missing:
        raise ValueError(f"{model_dir}: the vision encoder's {missing[0]} is missing")
    with torch.no_grad():
        for file in sorted({names[name] for name in targets}):
            with safe_open(str(file), "pt") as shard:
                for name in (n for n in targets if names[n] == file):
                    tensor = shard.get_tensor(name)
                    if tensor.shape != targets[name].shape:
                        raise ValueError(
                            f"{name} has shape {list(tensor.shape)}; the config makes it "
                            f"{list(targets[name].shape)}"
                        )
                    targets[name].copy_(tensor)


def image_processor(model_dir: str):
    """The checkpoint's transformers image processor (preprocessor_config.json)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir)


def decoded_images(images: list[bytes]) -> list:
    """The encoded images (PNG, JPEG, ...) as RGB PIL images."""
    from PIL import Image

    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
