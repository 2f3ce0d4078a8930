"""What a request may bring besides text (no torch): how many images a prompt may hold, how
large one may be, and where the server may read one from. zllm/media/ applies it, in the
frontend before anything is queued and in the offline `LLM` before a prompt is built."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Image sources the server reads by default: data: URLs only (the image is in the request).
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # 16.8 megapixels, a 4K photo's size with room
DEFAULT_IMAGES_PER_PROMPT = 8
DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # an encoded image fetched or sent (PNG, JPEG, ...)
DEFAULT_FETCH_TIMEOUT_S = 10.0
MODALITIES = ("image",)


@dataclass(slots=True)
class MediaConfig:
    """--limit-mm-per-prompt, --max-image-pixels, --allowed-media-domains,
    --allowed-local-media-path, --media-fetch-timeout, --max-image-bytes."""

    images_per_prompt: int = DEFAULT_IMAGES_PER_PROMPT
    # Width x height of a decoded image, checked from its header before its pixels are
    # decoded: a small file that claims a huge image (a decompression bomb) is refused unread.
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    # Hosts http(s) image URLs may name (exact host names; empty: no URL is fetched).
    allowed_domains: list[str] = field(default_factory=list)
    # A directory whose files `file://` URLs may name (None: no local file is read).
    allowed_local_path: str | None = None
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """vLLM's form: a JSON object of modality -> most items per prompt, '{"image": 2}'."""
    try:
        limits = json.loads(text)
    except ValueError as exc:
        msg = f'--limit-mm-per-prompt takes a JSON object like {{"image": 2}}: {exc}'
        raise ValueError(msg) from None
    return check_limit_mm_per_prompt(limits)


def check_limit_mm_per_prompt(limits: object) -> dict[str, int]:
    """The limits as given (the flag's JSON, or `LLM(limit_mm_per_prompt=...)`), checked."""
    if not isinstance(limits, dict):
        raise ValueError('--limit-mm-per-prompt takes a JSON object like {"image": 2}')
    for modality, limit in limits.items():
        if modality not in MODALITIES:
            raise ValueError(
                f"--limit-mm-per-prompt: zllm takes {', '.join(MODALITIES)} input, not {modality!r}"
            )
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality} needs a count >= 0, not {limit!r}")
    return limits


def parse_domains(text: str) -> list[str]:
    """Host names, comma-separated or a JSON list."""
    text = text.strip()
    hosts = json.loads(text) if text.startswith("[") else text.split(",")
    return [str(h).strip().lower() for h in hosts if str(h).strip()]


def media_config_of(
    limit_mm_per_prompt: dict | None,
    max_image_pixels: int,
    max_image_bytes: int,
    allowed_media_domains: list[str],
    allowed_local_media_path: str | None,
    media_fetch_timeout: float,
) -> MediaConfig:
    """The engine options' MediaConfig, checked (ValueError naming the option)."""
    limits = check_limit_mm_per_prompt(limit_mm_per_prompt or {})
    local = allowed_local_media_path
    if local is not None and not Path(local).is_dir():
        raise ValueError(f"--allowed-local-media-path {local}: not a directory")
    return MediaConfig(
        images_per_prompt=limits.get("image", DEFAULT_IMAGES_PER_PROMPT),
        max_image_pixels=max_image_pixels,
        max_image_bytes=max_image_bytes,
        allowed_domains=[d.lower() for d in allowed_media_domains],
        allowed_local_path=None if local is None else str(Path(local).resolve()),
        fetch_timeout_s=media_fetch_timeout,
    )
