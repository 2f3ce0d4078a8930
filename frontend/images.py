"""A chat request's images read and checked before the request is queued
(zllm/media/images.py has the rules): each refusal a 400 naming the part."""

from __future__ import annotations

import asyncio

from zllm.config.media import MediaConfig
from zllm.errors import RequestError
from zllm.frontend.openai.format import ImageRef
from zllm.media.images import (
    ImageError,
    check_image_count,
    image_from_bytes,
    read_image_url,
    require_vision,
)
from zllm.protocol import ImageData


async def load_images(
    refs: list[ImageRef], media: MediaConfig, vision: bool, model: str
) -> list[ImageData]:
    """The prompt's images, fetched and decoded off the event loop (a thread each), in
    order; then whether the model takes images at all (so a bad image is named as such)."""
    try:
        check_image_count(len(refs), media)
    except ImageError as exc:
        raise RequestError(str(exc), param=refs[-1].where) from None
    loads = (asyncio.to_thread(_load, ref, media) for ref in refs)
    images = await asyncio.gather(*loads, return_exceptions=True)
    for image in images:  # the first bad part in the request's order is the one named
        if isinstance(image, BaseException):
            raise image
    try:
        require_vision(vision, model)
    except ImageError as exc:
        raise RequestError(str(exc), param=refs[0].where) from None
    return images  # type: ignore[return-value]


def _load(ref: ImageRef, media: MediaConfig) -> ImageData:
    try:
        return image_from_bytes(read_image_url(ref.url, media), media)
    except ImageError as exc:
        raise RequestError(f"{ref.where}: {exc}", param=ref.where) from None
