"""The HTTP bodies of the pooling routes: OpenAI's /v1/embeddings and vLLM's /classify
(frontend/openai/embeddings.py), vLLM's /score and Jina's and Cohere's /rerank
(frontend/openai/scoring.py)."""

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


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's /score: text_1 against each of text_2 (one to many), or pairs (two equal lists)."""

    text_1: str | Annotated[list[str], Meta(min_length=1)]
    text_2: str | Annotated[list[str], Meta(min_length=1)]
    model: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=_INT64_MAX)] | None = None


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: ClassifyUsage
    object: str = "list"


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    """Jina's and Cohere's /rerank (vLLM serves both shapes): the documents ranked by their
    relevance to the query, the best `top_n`."""

    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0)] | None = None  # (0 or none: every document)
    return_documents: bool = True
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=_INT64_MAX)] | None = None


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct, kw_only=True):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
