"""Qwen2.5-VL's image sizes (no torch: the tokenizer workers count an image's tokens from its
size, and the executor places its M-RoPE positions from the same grid).

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
        """The most tokens one image can take (its area at max_pixels)."""
        side = self.patch_size * self.merge_size
        return max(1, self.max_pixels // (side * side))
