"""What an embeddings request asks of the model's pooler beyond its prompt (vLLM's
`PoolingParams`, for `LLM.embed`; /v1/embeddings takes the same as request fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolingParams:
    # A Matryoshka model's smaller embedding: its first `dimensions`, normalised again where
    # the model normalises (zllm/config/pooler.py; refused for a model that is not one).
    dimensions: int | None = None
