"""Where a prompt holds its images, per architecture (no torch: the tokenizer workers expand
them). A chat template writes one marker per image part (Gemma 3: `<start_of_image>`); the
marker becomes the tokens the image's features replace, as the model's transformers processor
writes them (Gemma 3: "\\n\\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" +
"<end_of_image>\\n\\n"), so the prompt is tokenized with them in place.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zllm.config.vision import mm_tokens_per_image
from zllm.protocol import ImageData, PlacedImage


@dataclass(frozen=True, slots=True)
class ImagePlaceholders:
    """A model's image placeholders: the marker a prompt holds per image, the text each
    becomes, and the token whose embeddings the image's features replace."""

    marker: str
    expansion: str
    image_token_id: int
    tokens_per_image: int

    def expand(self, text: str, images: int) -> str:
        """The prompt with each marker expanded; ValueError when the prompt's markers and
        its images differ in number."""
        found = text.count(self.marker)
        if found != images:
            raise ValueError(
                f"the prompt holds {found} image marker(s) {self.marker!r} for {images} "
                f"image(s): each image needs its marker where it goes in the prompt (a chat "
                f"message's image part writes one)"
            )
        return text.replace(self.marker, self.expansion)


def gemma3_placeholders(config: dict, token_text: Callable[[int], str | None]) -> ImagePlaceholders:
    """Gemma 3's (Gemma3Processor's expansion), from config.json's token ids and the
    tokenizer's text for them (`token_text`: id -> token string, None when unknown)."""
    ids = {
        "boi_token_index": config.get("boi_token_index", 255999),
        "eoi_token_index": config.get("eoi_token_index", 256000),
        "image_token_index": config.get("image_token_index", 262144),
    }
    texts = {}
    for field, token_id in ids.items():
        text = token_text(token_id)
        if text is None:
            raise ValueError(
                f"the tokenizer has no token {token_id} (config.json's {field}): a Gemma 3 "
                f"vision checkpoint's tokenizer holds its image tokens"
            )
        texts[field] = text
    count = mm_tokens_per_image(config)
    image = texts["image_token_index"]
    expansion = f"\n\n{texts['boi_token_index']}{image * count}{texts['eoi_token_index']}\n\n"
    return ImagePlaceholders(texts["boi_token_index"], expansion, ids["image_token_index"], count)


def image_spans(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of image tokens, in order: one per image."""
    spans = []
    start = None
    for i, token in enumerate([*token_ids, -1]):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            spans.append((start, i - start))
            start = None
    return spans


def place_images(
    token_ids: list[int], images: list[ImageData], placeholders: ImagePlaceholders
) -> list[PlacedImage]:
    """Each image with the run of its tokens in the prompt (ValueError when the runs and
    the images do not pair up: a prompt cut through an image, or image tokens typed in)."""
    spans = image_spans(token_ids, placeholders.image_token_id)
    if len(spans) != len(images) or any(n != placeholders.tokens_per_image for _, n in spans):
        raise ValueError(
            f"the prompt's image tokens make {len(spans)} run(s) of "
            f"{sorted({n for _, n in spans})} tokens for {len(images)} image(s) of "
            f"{placeholders.tokens_per_image} tokens each (was the prompt truncated through "
            f"an image?)"
        )
    return [PlacedImage(image, start, n) for image, (start, n) in zip(images, spans, strict=True)]


def model_placeholders(
    model_path: str, vision: bool, token_text: Callable[[int], str | None]
) -> ImagePlaceholders | None:
    """The served model's placeholders (None for a text-only model)."""
    if not vision:
        return None
    config = json.loads((Path(model_path) / "config.json").read_text())
    if config.get("model_type") == "gemma3":
        return gemma3_placeholders(config, token_text)
    raise ValueError(f"{model_path}: no image placeholder rule for {config.get('model_type')!r}")
