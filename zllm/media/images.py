"""An image a request brings, read from where it says and checked before anything is queued
(no torch: the frontend and the offline `LLM` run this; the executor decodes the bytes again
for the model's processor).

Where an image may come from (zllm/config/media.py MediaConfig says which are open):
  data:image/...;base64,...   always (the image is in the request)
  http:// and https://        hosts named by --allowed-media-domains only, within
                              --media-fetch-timeout and --max-image-bytes; a redirect to
                              another host is checked as the first URL was
  file://                     files under --allowed-local-media-path only (symlinks resolved)
  a PIL image                 offline (LLM.generate's multi_modal_data)

What is checked, each refusal an `ImageError` naming the reason (its caller names the part):
the bytes are an image PIL can identify; its width x height is within --max-image-pixels,
read from the header before any pixel is decoded (a small file claiming a huge image, a
decompression bomb, is never expanded); its pixels decode completely (a truncated file is
refused, not padded). The image's identity for caches is a hash of its decoded RGB pixels and
size (`ImageData.digest`), so the same picture sent as PNG or as a data URL or a file is one
image, and two pictures are never one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from zllm.config.media import MediaConfig
from zllm.protocol import ImageData


class ImageError(ValueError):
    """An image that cannot be taken; the message says why (without the part's path)."""


def require_vision(vision: bool, model: str) -> None:
    """Refuse images for a model that does not take them (checked after the images
    themselves, so a bad image is named as such whatever the model)."""
    if not vision:
        raise ImageError(
            f"model {model!r} does not take image input (a text-only model); images need a "
            f"vision-language model"
        )


def check_image_count(count: int, media: MediaConfig) -> None:
    if count > media.images_per_prompt:
        raise ImageError(
            f"{count} images in one prompt; at most {media.images_per_prompt} are allowed "
            f"(--limit-mm-per-prompt)"
        )


def read_image_url(url: str, media: MediaConfig) -> bytes:
    """The encoded image a URL names (data:, http(s): or file:), by the server's rules."""
    try:
        return _read_url(url, media)
    except ImageError:
        raise
    except ValueError as exc:  # urllib's parsing of a malformed URL ("Invalid IPv6 URL")
        raise ImageError(f"malformed image URL ({exc})") from None


def _read_url(url: str, media: MediaConfig) -> bytes:
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return _data_url(url, media)
    if scheme in ("http", "https"):
        return _fetch(url, media)
    if scheme == "file":
        return _local_file(url, media)
    shown = url if len(url) <= 40 else url[:37] + "..."
    raise ImageError(f"unsupported image URL {shown!r} (data:, http(s): or file: URLs)")


def image_from_bytes(data: bytes, media: MediaConfig) -> ImageData:
    """The encoded image checked and identified (see the module's docstring)."""
    from PIL import Image

    if len(data) > media.max_image_bytes:
        raise ImageError(_too_many_bytes(len(data), media))
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # PIL's own limit, met before ours is read
        raise ImageError(
            f"the image is over {2 * Image.MAX_IMAGE_PIXELS:,} pixels; at most "
            f"{media.max_image_pixels:,} are allowed (--max-image-pixels)"
        ) from None
    except Exception:  # noqa: BLE001 (PIL's "cannot identify image file", and what a
        # hostile file makes its parsers raise: struct.error, SyntaxError, ...)
        raise ImageError("the data is not an image (no image format recognised)") from None
    _check_pixels(image.width, image.height, media)
    try:
        image.load()
    except Exception as exc:  # noqa: BLE001 (OSError "image file is truncated", and the rest)
        raise ImageError(f"the {image.format} image is truncated or corrupt ({exc})") from None
    return ImageData(data, image.width, image.height, _digest(image))


def image_from_pil(image: Any, media: MediaConfig) -> ImageData:
    """An offline caller's PIL image, checked as a sent one is (stored as PNG bytes)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ImageError(f"an image must be a PIL.Image.Image, not {type(image).__name__}")
    _check_pixels(image.width, image.height, media)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return ImageData(buffer.getvalue(), image.width, image.height, _digest(image))


def _check_pixels(width: int, height: int, media: MediaConfig) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width}x{height} pixels")
    if width * height > media.max_image_pixels:
        raise ImageError(
            f"the image is {width}x{height} = {width * height:,} pixels; at most "
            f"{media.max_image_pixels:,} are allowed (--max-image-pixels)"
        )


def _digest(image: Any) -> str:
    rgb = image.convert("RGB")
    hasher = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    hasher.update(rgb.tobytes())
    return hasher.hexdigest()


def _too_many_bytes(size: int, media: MediaConfig) -> str:
    return (
        f"the image is {size:,} bytes; at most {media.max_image_bytes:,} are allowed "
        f"(--max-image-bytes)"
    )


def _data_url(url: str, media: MediaConfig) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise ImageError("a data: image URL must be base64 (data:image/png;base64,...)")
    media_type = header[5:].split(";")[0].lower()
    if media_type and not media_type.startswith("image/"):
        raise ImageError(f"a data: URL of type {media_type!r} is not an image")
    if len(payload) * 3 // 4 > media.max_image_bytes:
        raise ImageError(_too_many_bytes(len(payload) * 3 // 4, media))
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's base64 does not decode") from None


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to a host the first URL could have named."""

    def __init__(self, media: MediaConfig) -> None:
        self.media = media

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        _check_host(newurl, self.media)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_host(url: str, media: MediaConfig) -> None:
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in ("http", "https"):
        raise ImageError(f"a redirect to a {parts.scheme}: URL is not followed")
    if host not in media.allowed_domains:
        allowed = ", ".join(media.allowed_domains) or "none: only data: URLs are read"
        raise ImageError(
            f"image URLs from host {host!r} are not allowed (--allowed-media-domains: {allowed})"
        )


def _fetch(url: str, media: MediaConfig) -> bytes:
    _check_host(url, media)
    opener = urllib.request.build_opener(_CheckedRedirects(media))
    request = urllib.request.Request(url, headers={"User-Agent": "zllm"})
    try:
        with opener.open(request, timeout=media.fetch_timeout_s) as response:
            data = response.read(media.max_image_bytes + 1)
    except ImageError:
        raise
    except urllib.error.HTTPError as exc:
        raise ImageError(f"fetching the image URL failed: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ImageError(f"fetching the image URL failed: {reason}") from None
    if len(data) > media.max_image_bytes:
        raise ImageError(_too_many_bytes(len(data), media))
    return data


def _local_file(url: str, media: MediaConfig) -> bytes:
    if media.allowed_local_path is None:
        raise ImageError("file: image URLs are not read (no --allowed-local-media-path)")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageError(f"a file: URL names host {parts.netloc!r}; only local files are read")
    path = Path(urllib.parse.unquote(parts.path)).resolve()
    root = Path(media.allowed_local_path)
    if not path.is_relative_to(root):
        raise ImageError(f"{path} is outside --allowed-local-media-path {root}")
    try:
        size = path.stat().st_size
        if size > media.max_image_bytes:
            raise ImageError(_too_many_bytes(size, media))
        return path.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read {path}: {exc.strerror}") from None
