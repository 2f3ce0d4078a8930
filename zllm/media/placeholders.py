"""Where a prompt holds its images, per architecture (no torch: the tokenizer workers expand
them). A chat template writes one marker per image part; the marker becomes the tokens the
image's features replace, as the model's transformers processor writes them, so the prompt is
tokenized with them in place:

  Gemma 3      "<start_of_image>" -> "\\n\\n<start_of_image>" + mm_tokens_per_image x
               "<image_soft_token>" + "<end_of_image>\\n\\n" (a fixed count per image)
  Qwen2.5-VL   "<|image_pad|>" (between <|vision_start|> and <|vision_end|>, which the
               template writes) -> one "<|image_pad|>" per merged patch of the image as its
               processor resizes it (zllm/model/image_tokens.py: the count follows its size)
  LLaVA        "<image>" -> its count of "<image>", one per patch of the cropped image
               (the transformers backend runs it)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zllm.model.image_tokens import ImageGrid, llava_tokens_per_image, mm_tokens_per_image
from zllm.protocol import ImageData, PlacedImage


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
    return ImagePlaceholders(
        marker=texts["boi_token_index"],
        before=f"\n\n{texts['boi_token_index']}",
        image_token=texts["image_token_index"],
        after=f"{texts['eoi_token_index']}\n\n",
        image_token_id=ids["image_token_index"],
        tokens_per_image=mm_tokens_per_image(config),
    )


def qwen_vl_placeholders(
    config: dict, grid: ImageGrid, token_text: Callable[[int], str | None]
) -> ImagePlaceholders:
    """Qwen2.5-VL's (Qwen2_5_VLProcessor's expansion of <|image_pad|>), from config.json's
    image_token_id and the tokenizer's text for it."""
    token_id = int(config.get("image_token_id", 151655))
    text = token_text(token_id)
    if text is None:
        raise ValueError(
            f"the tokenizer has no token {token_id} (config.json's image_token_id): a "
            f"Qwen2.5-VL checkpoint's tokenizer holds its image tokens"
        )
    return ImagePlaceholders(
        marker=text, before="", image_token=text, after="", image_token_id=token_id, grid=grid
    )


def llava_placeholders(
    model_path: str, config: dict, token_text: Callable[[int], str | None]
) -> ImagePlaceholders:
    """LLaVA's (LlavaProcessor's expansion of <image> into its count of <image>)."""
    token_id = int(config.get("image_token_id", config.get("image_token_index", 32000)))
    text = token_text(token_id)
    if text is None:
        raise ValueError(
            f"the tokenizer has no token {token_id} (config.json's image_token_index): a "
            f"LLaVA checkpoint's tokenizer holds its image token"
        )
    count = llava_tokens_per_image(model_path, config)
    return ImagePlaceholders(text, "", text, "", token_id, tokens_per_image=count)


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
    if config.get("model_type") == "gemma3":
        return gemma3_placeholders(config, token_text)
    if config.get("model_type") == "qwen2_5_vl":
        return qwen_vl_placeholders(config, ImageGrid.of_model(model_path), token_text)
    if config.get("model_type") == "llava":
        return llava_placeholders(model_path, config, token_text)
    raise ValueError(f"{model_path}: no image placeholder rule for {config.get('model_type')!r}")
