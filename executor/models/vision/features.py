"""A step's image features: which rows of the flat batch are image tokens, and the encoder
output that replaces their embeddings. The model's encoder (`ImageEncoder`: Gemma 3's in
gemma3.py, Qwen2.5-VL's in qwen2_5_vl.py, a transformers model's own in
transformers_images.py) turns encoded images into their tokens' features.

Each image is encoded the first time a step computes any of its tokens (a step's new images
in one batch), and kept by its pixel digest in an LRU cache bounded in bytes
(`EncoderCache`): the same picture sent again, by any request, is not encoded again while the
cache holds it, and a request whose image tokens span chunks (Qwen2.5-VL's and LLaVA's images
are chunked like text; any image after a prefix hit inside it) reads its later rows from
there. The cache holds at least two steps' worth of images; an image it no longer holds is
encoded again.
"""

from __future__ import annotations

import importlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from zllm.executor.requests.state import RequestState
from zllm.executor.weights.placement import move_weights
from zllm.model.registry import family_for_config
from zllm.protocol import CacheSize, PlacedImage

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 << 20


class EncoderCache:
    """Image digest -> its features [tokens, hidden], least recently used evicted first."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, digest: str) -> torch.Tensor | None:
        found = self._entries.get(digest)
        if found is not None:
            self._entries.move_to_end(digest)
        return found

    def put(self, digest: str, features: torch.Tensor) -> None:
        if digest in self._entries:
            return
        size = features.numel() * features.element_size()
        while self._entries and self.bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        if size <= self.max_bytes:
            self._entries[digest] = features
            self.bytes += size

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def sizes(self) -> list[CacheSize]:
        """For /metrics: the images held, and their bytes against the bound."""
        return [
            CacheSize("executor", "image_encoder", len(self._entries)),
            CacheSize("executor", "image_encoder_bytes", self.bytes, self.max_bytes),
        ]


@dataclass(slots=True)
class StepImages:
    """The flat batch's image rows and the features that replace their embeddings."""

    rows: torch.Tensor  # int64 [N]
    features: torch.Tensor  # [N, hidden]


class ImageEncoder(Protocol):
    """A vision model's encoder as the step calls it."""

    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        """Each encoded image's (PNG, JPEG, ...) features: [its tokens, text hidden]."""
        ...


def image_encoder(
    model_path: str,
    config: dict,
    dtype: torch.dtype,
    model: torch.nn.Module,
    device: torch.device | str = "cpu",
) -> ImageEncoder:
    """The checkpoint's encoder, as its family names it (ImageRules.encoder), loaded: zllm's
    own onto `device`, or the one inside `model` (the language model, loaded) where
    transformers' code runs it."""
    family = family_for_config(config)
    if family is None or family.images is None:
        raise ValueError(f"{model_path}: no image encoder for model_type {config.get('model_type')!r}")  # fmt: skip
    module, _, name = family.images.encoder.partition(":")
    encoder_class = getattr(importlib.import_module(module), name)
    return encoder_class.load(model_path, config, dtype, model, device)


class ImageFeatures:
    """The model's image encoder (loaded beside the language model) and its cache; a memory
    owner of sleep mode (executor/host/sleep_mode.py) beside the weights."""

    def __init__(
        self,
        make_encoder: Callable[[nn.Module], ImageEncoder],
        model: nn.Module,
        min_cache_bytes: int = 0,
    ) -> None:
        """`make_encoder(model)`: the encoder, loaded, for the language model `model` (again
        after a level-2 sleep). `min_cache_bytes`: what the cache holds at least (two steps'
        worth of images, so an image a chunk started is still there for the next chunk)."""
        self._make_encoder = make_encoder
        self.encoder: ImageEncoder | None = make_encoder(model)
        self.cache = EncoderCache(max(DEFAULT_CACHE_BYTES, min_cache_bytes))
        self._on_host: torch.device | None = None  # level 1 on a GPU: where it came from

    def release(self, level: int) -> None:
        """Sleep: the cached features go (an image is encoded again when next seen); level 2
        drops the encoder (made again from the checkpoint on restore); level 1 on a GPU
        moves zllm's own encoder's weights to pinned host memory (transformers' encoder is
        part of the language model, which its owner moves)."""
        self.cache.clear()
        if level >= 2:
            self.encoder = None
            return
        module = getattr(self.encoder, "encoder", None)
        if isinstance(module, nn.Module):
            device = next(module.parameters()).device
            if device.type == "cuda":
                move_weights(module, torch.device("cpu"), pin=True)
                self._on_host = device

    def restore(self, model: nn.Module) -> None:
        """After the weights: the encoder back on the device, or made again for `model`."""
        if self.encoder is None:
            self.encoder = self._make_encoder(model)
        elif self._on_host is not None:
            move_weights(self.encoder.encoder, self._on_host)  # type: ignore[attr-defined]
            self._on_host = None

    def for_step(
        self, states: list[RequestState], query_lens: list[int], seq_lens: list[int]
    ) -> StepImages | None:
        """The step's image rows and features (None when it computes no image token)."""
        placed = []  # (first flat row, image, first, end): the image's tokens this step computes
        first_row = 0
        for st, q_len, seq_len in zip(states, query_lens, seq_lens, strict=True):
            start = seq_len - q_len
            for image in st.images:
                lo, hi = max(start, image.offset), min(seq_len, image.end)
                if lo < hi:
                    placed.append((first_row + lo - start, image, lo, hi))
            first_row += q_len
        if not placed:
            return None
        encoded = self._encode([image for _, image, _, _ in placed])
        rows = [torch.arange(row, row + hi - lo) for row, _, lo, hi in placed]
        features = [
            encoded[image.image.digest][lo - image.offset : hi - image.offset]
            for _, image, lo, hi in placed
        ]
        return StepImages(torch.cat(rows), torch.cat(features))

    def _encode(self, images: list[PlacedImage]) -> dict[str, torch.Tensor]:
        """Each image's features by digest: from the cache, the rest encoded in one batch."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, PlacedImage] = {}
        for image in images:
            digest = image.image.digest
            cached = found.get(digest) if digest in found else self.cache.get(digest)
            if cached is not None:
                self.cache.hits += digest not in found
                found[digest] = cached
            else:
                missing[digest] = image
        if missing:
            self.cache.misses += len(missing)
            assert self.encoder is not None, "images asked for while asleep"
            with torch.inference_mode():
                batch = self.encoder.encode([image.image.data for image in missing.values()])
            for (digest, image), encoded in zip(missing.items(), batch, strict=True):
                if encoded.shape[0] != image.length:
                    raise ValueError(
                        f"the image encoder gives {encoded.shape[0]} features for "
                        f"{image.length} tokens"
                    )
                self.cache.put(digest, encoded)
                found[digest] = encoded
        return found
