"""The HTTP bodies of the pooling routes: OpenAI's /v1/embeddings and vLLM's /classify
(frontend/openai/embeddings.py answers both)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from zllm.frontend.openai.protocol import TokenId, TokenIds

_INT64_MAX = 2**63 - 1


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """OpenAI's /v1/embeddings: a string, a list of strings, token ids or lists of them."""

    input: str | Annotated[list[str | TokenId | TokenIds], Meta(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # a Matryoshka model's first ones (zllm/config/pooler.py)
    user: str | None = None
    # vLLM's: each input cut to its last k tokens (-1: the context length).
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=_INT64_MAX)] | None = None


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32
    object: str = "embedding"


class EmbeddingsUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct, kw_only=True):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingsUsage
    object: str = "list"


class ClassifyRequest(msgspec.Struct, kw_only=True):
    """vLLM's /classify: a string, a list of strings, token ids or lists of them."""

    input: str | Annotated[list[str | TokenId | TokenIds], Meta(min_length=1)]
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=_INT64_MAX)] | None = None


class ClassifyData(msgspec.Struct, kw_only=True):
    index: int
    label: str  # the most probable label
    probs: list[float]  # each label's probability, in the model's label order
    num_classes: int


class ClassifyUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassifyResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ClassifyData]
    usage: ClassifyUsage
    object: str = "list"
