"""Where a prompt holds its images and how many tokens each takes: `ImagePlaceholders`, which
a vision-language family makes for its checkpoint (zllm/model/families/: Gemma 3's fixed count
per image, LLaVA's patches, Qwen2.5-VL's count from the image's own size through `ImageGrid`,
below). No torch: the tokenizer workers expand the placeholders by these counts, the engine's
checks and the scheduler's encoder budget read them, and the executor places Qwen2.5-VL's
M-RoPE positions from its grid.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zllm.protocol import ImageData

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


@dataclass(frozen=True, slots=True)
class ImagePlaceholders:
    """A model's image placeholders: the marker a prompt holds per image, the text around
    the image's tokens, and the token whose embeddings the image's features replace."""

    marker: str
    before: str
    image_token: str
    after: str
    image_token_id: int
    tokens_per_image: int = 0  # a fixed count per image (Gemma 3)
    grid: ImageGrid | None = None  # else the count from the image's size (Qwen2.5-VL)

    def count(self, width: int, height: int) -> int:
        """One image's tokens (ValueError for a size the model's processor refuses)."""
        if self.grid is None:
            return self.tokens_per_image
        return self.grid.tokens(width, height)

    def counts(self, images: Sequence[ImageData]) -> list[int]:
        return [self.count(image.width, image.height) for image in images]

    def expand(self, text: str, counts: Sequence[int]) -> str:
        """The prompt with its i-th marker expanded to counts[i] image tokens; ValueError
        when the prompt's markers and its images differ in number."""
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(counts):
            raise ValueError(
                f"the prompt holds {len(pieces) - 1} image marker(s) {self.marker!r} for "
                f"{len(counts)} image(s): each image needs its marker where it goes in the "
                f"prompt (a chat message's image part writes one)"
            )
        out = [pieces[0]]
        for count, piece in zip(counts, pieces[1:], strict=True):
            out += (self.before, self.image_token * count, self.after, piece)
        return "".join(out)
