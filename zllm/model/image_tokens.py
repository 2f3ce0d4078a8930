"""How many tokens an image takes in a prompt, per model (no torch: the tokenizer workers
expand the placeholders by these counts, the engine's checks and the scheduler's encoder
budget read them, and the executor places Qwen2.5-VL's M-RoPE positions from its grid).

  Gemma 3      mm_tokens_per_image (config.json), whatever the image
  LLaVA        the cropped image's patches, as LlavaProcessor counts them
  Qwen2.5-VL   the image's own size, resized by its processor (ImageGrid, below)

Qwen2-VL's image processor resizes each image so both sides are multiples of
patch_size x merge_size (28 pixels) and its area lies within [min_pixels, max_pixels],
keeping the aspect ratio as closely as that allows; the vision encoder cuts it into
patch_size patches and merges each merge_size x merge_size square of them into one token.
So an image of W x H pixels takes (h / merge) x (w / merge) tokens, where h x w are its
patches after the resize. The numbers come from the checkpoint's preprocessor_config.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Qwen2VLImageProcessor's defaults, where preprocessor_config.json leaves a field out.
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
_MAX_ASPECT = 200  # the processor refuses a longer side over 200x the shorter one


@dataclass(frozen=True, slots=True)
class ImageGrid:
    """How a checkpoint's processor cuts an image: patch side, merge side, area bounds."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = _DEFAULT_MIN_PIXELS
    max_pixels: int = _DEFAULT_MAX_PIXELS

    @classmethod
    def of_model(cls, model_path: str | Path) -> ImageGrid:
        """The grid preprocessor_config.json describes (transformers 5's `size` with
        shortest_edge / longest_edge as pixel areas, or the older min_pixels / max_pixels)."""
        path = Path(model_path) / "preprocessor_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        size = config.get("size") or {}
        return cls(
            patch_size=int(config.get("patch_size", 14)),
            merge_size=int(config.get("merge_size", 2)),
            min_pixels=int(
                config.get("min_pixels") or size.get("shortest_edge") or _DEFAULT_MIN_PIXELS
            ),
            max_pixels=int(
                config.get("max_pixels") or size.get("longest_edge") or _DEFAULT_MAX_PIXELS
            ),
        )

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the processor's resize; ValueError for an image whose
        sides differ by more than 200x (which the processor refuses)."""
        if min(width, height) <= 0 or max(width, height) / min(width, height) > _MAX_ASPECT:
            raise ValueError(
                f"an image of {width}x{height} pixels: its sides may differ by at most "
                f"{_MAX_ASPECT}x for this model"
            )
        factor = self.patch_size * self.merge_size
        # Python's round() halves to even, as the processor's does: the counts must agree.
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / scale / factor) * factor)
            w = max(factor, math.floor(width / scale / factor) * factor)
        elif h * w < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * scale / factor) * factor
            w = math.ceil(width * scale / factor) * factor
        return w, h

    def merged(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of the image's tokens: its merged patches."""
        w, h = self.resized(width, height)
        side = self.patch_size * self.merge_size
        return h // side, w // side

    def tokens(self, width: int, height: int) -> int:
        rows, columns = self.merged(width, height)
        return rows * columns

    def max_tokens(self) -> int:
        """The tokens of an image whose area reaches max_pixels: the most a usual image
        takes (a very thin one scaled up to min_pixels can take a few more; the scheduler
        lets any one image alone into a step)."""
        side = self.patch_size * self.merge_size
        return max(1, self.max_pixels // (side * side))


def mm_tokens_per_image(config: dict) -> int:
    """The tokens one image takes in a Gemma 3 prompt, from its config.json (transformers'
    default where the config leaves it out)."""
    return int(config.get("mm_tokens_per_image", 256))


def llava_tokens_per_image(model_path: str | Path, config: dict) -> int:
    """LLaVA's image tokens, as LlavaProcessor counts them: the cropped image's patches, plus
    the tower's extra tokens (CLIP's class token), less the one the "default" feature
    strategy drops (processor_config.json, preprocessor_config.json, config.json)."""
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


def max_image_tokens(model_path: str, config: dict) -> int:
    """The most tokens one image usually takes in this model's prompts (above)."""
    if config.get("model_type") == "qwen2_5_vl":
        return ImageGrid.of_model(model_path).max_tokens()
    if config.get("model_type") == "llava":
        return llava_tokens_per_image(model_path, config)
    return mm_tokens_per_image(config)


def _json_or_empty(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
