"""Where a prompt holds its images (no torch: the tokenizer workers expand them). A chat
template writes one marker per image part; the marker becomes the tokens the image's features
replace, as the model's transformers processor writes them, so the prompt is tokenized with
them in place. Each vision-language family says how (its `ImageRules.placeholders`, in
zllm/model/families/); here the served model's are made and a prompt's image runs placed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from zllm.model.image_tokens import ImagePlaceholders
from zllm.model.registry import family_for_config
from zllm.protocol import ImageData, PlacedImage


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
    counts = placeholders.counts(images)
    if [n for _, n in spans] != counts:
        raise ValueError(
            f"the prompt's image tokens make {len(spans)} run(s) of "
            f"{[n for _, n in spans]} tokens for {len(images)} image(s) of {counts} tokens "
            f"(was the prompt truncated through an image?)"
        )
    return [PlacedImage(image, start, n) for image, (start, n) in zip(images, spans, strict=True)]


def model_placeholders(
    model_path: str, vision: bool, token_text: Callable[[int], str | None]
) -> ImagePlaceholders | None:
    """The served model's placeholders (None for a text-only model)."""
    if not vision:
        return None
    config = json.loads((Path(model_path) / "config.json").read_text())
    family = family_for_config(config)
    if family is None or family.images is None:
        raise ValueError(
            f"{model_path}: no image placeholder rule for {config.get('model_type')!r}"
        )
    return family.images.placeholders(model_path, config, token_text)
