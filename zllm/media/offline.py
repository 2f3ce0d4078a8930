"""Images in the offline API, as vLLM's `LLM` takes them, read and checked by images.py's
rules before a prompt is built:

  LLM.generate({"prompt": ..., "multi_modal_data": {"image": <PIL image or a list>}})
  LLM.chat([{"role": "user", "content": [
      {"type": "image_url", "image_url": {"url": "data:..." | "https://..." | "file://..."}},
      {"type": "image_pil", "image_pil": <PIL image>},
      {"type": "text", "text": "..."}]}])

A chat message's image parts become `{"type": "image"}` for the chat template (transformers'
convention), in the order the images are returned.
"""

from __future__ import annotations

from typing import Any

from zllm.config.media import MODALITIES, MediaConfig
from zllm.errors import ParamError
from zllm.media.images import (
    ImageError,
    check_image_count,
    image_from_bytes,
    image_from_pil,
    read_image_url,
    require_vision,
)
from zllm.protocol import ImageData

_IMAGE_PARTS = ("image_url", "image_pil")


def prompt_images(prompt: dict[str, Any], media: MediaConfig) -> list[ImageData]:
    """A prompt dict's multi_modal_data images (none without the key)."""
    data = prompt.get("multi_modal_data")
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ParamError("multi_modal_data must be a dict like {'image': image}", "prompt")
    unknown = sorted(set(data) - set(MODALITIES))
    if unknown:
        raise ParamError(
            f"multi_modal_data: zllm takes {', '.join(MODALITIES)} input, not {unknown[0]!r}",
            "prompt",
        )
    items = data.get("image", [])
    items = items if isinstance(items, list | tuple) else [items]
    return _checked(
        [(item, f"multi_modal_data['image'][{i}]") for i, item in enumerate(items)], media
    )


def chat_images(
    messages: list[dict[str, Any]], media: MediaConfig
) -> tuple[list[dict[str, Any]], list[ImageData]]:
    """The conversation with its image parts as the template's `{"type": "image"}`, and the
    images in order (messages without images come back as they are)."""
    found: list[tuple[Any, str]] = []
    result = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            result.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if _is_image(part):
                found.append((_source(part), f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        result.append({**message, "content": parts})
    return result, _checked(found, media)


def require_vision_for(images: list[ImageData], vision: bool, model: str, where: str) -> None:
    if images:
        try:
            require_vision(vision, model)
        except ImageError as exc:
            raise ParamError(str(exc), where) from None


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in _IMAGE_PARTS


def _source(part: dict[str, Any]) -> Any:
    """An image part's PIL image or URL."""
    if part["type"] == "image_pil":
        return part.get("image_pil")
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def _checked(items: list[tuple[Any, str]], media: MediaConfig) -> list[ImageData]:
    if not items:
        return []
    try:
        check_image_count(len(items), media)
    except ImageError as exc:
        raise ParamError(str(exc), items[-1][1]) from None
    images = []
    for item, where in items:
        try:
            if isinstance(item, str):
                images.append(image_from_bytes(read_image_url(item, media), media))
            else:
                images.append(image_from_pil(item, media))
        except ImageError as exc:
            raise ParamError(f"{where}: {exc}", where) from None
    return images
