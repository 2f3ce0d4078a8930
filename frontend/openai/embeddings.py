"""OpenAI's /v1/embeddings and vLLM's /classify on the generation engine: one engine request
per input, asking for its prompt's pooled final hidden states (`SamplingParams.embed`)
instead of tokens: an embedding model's vector, or a classifier's label probabilities
(zllm/config/pooler.py says which the model gives)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np

from zllm.config.pooler import PoolerConfig
from zllm.errors import ParamError, RequestError
from zllm.frontend.generate import ApiCall, ApiContext, GenerationJob, RequestIds
from zllm.frontend.openai.format import prompt_inputs
from zllm.frontend.openai.pooling_protocol import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    ClassifyUsage,
    EmbeddingData,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbeddingsUsage,
)
from zllm.frontend.replies import check_failed
from zllm.protocol import RequestOutputDelta
from zllm.sampling_params import SamplingParams

EMBED_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, embed=True)


class EmbeddingsCall(ApiCall):
    id_prefix = "embd"
    params = EMBED_PARAMS

    def __init__(self, body: EmbeddingsRequest, ctx: ApiContext) -> None:
        engine = ctx.config.engine
        self.pooler = engine.pooler
        if self.pooler.task != "embed":
            raise RequestError(
                "this model is a classifier (a sequence-classification head): it answers "
                "/classify, not /v1/embeddings",
                param="model",
            )
        if body.dimensions is not None:
            try:
                self.pooler.check_dimensions(body.dimensions, engine.arch.hidden_size)
            except ValueError as e:
                raise RequestError(str(e), param="dimensions") from None
        self.body = body
        self.prompts = list(prompt_inputs(body.input))
        self.params = pooling_params(body.truncate_prompt_tokens)

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        assembler = EmbeddingsAssembler(
            len(self.prompts), self.body.encoding_format, self.pooler, self.body.dimensions
        )
        return GenerationJob(
            assembler=assembler, stream=False, response=lambda: assembler.response(model)
        )


def pooling_params(truncate_prompt_tokens: int | None) -> SamplingParams:
    """An embeddings or classification request's params (a 400 for a bad truncation)."""
    if truncate_prompt_tokens is None:
        return EMBED_PARAMS
    try:
        return SamplingParams(
            max_tokens=1, temperature=0.0, embed=True, truncate_prompt_tokens=truncate_prompt_tokens
        )
    except ParamError as e:
        raise RequestError(str(e), param=e.param) from None


class ClassifyCall(ApiCall):
    """vLLM's /classify: each input's label probabilities from a classifier's head."""

    id_prefix = "classify"
    params = EMBED_PARAMS

    def __init__(self, body: ClassifyRequest, ctx: ApiContext) -> None:
        self.labels = ctx.config.engine.pooler.labels
        if not self.labels:
            raise RequestError(
                "this model has no sequence-classification head (it is not a "
                "*ForSequenceClassification checkpoint): /classify needs a classifier",
                param="model",
            )
        self.prompts = list(prompt_inputs(body.input))
        self.params = pooling_params(body.truncate_prompt_tokens)

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        assembler = ClassifyAssembler(len(self.prompts), self.labels)
        return GenerationJob(
            assembler=assembler,
            stream=False,
            response=lambda: assembler.response(ids.response_id, int(now), model),
        )


@dataclass
class ClassifyAssembler:
    num_inputs: int
    labels: tuple[str, ...]
    probs: dict[int, list[float]] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)

    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        check_failed(delta)
        self.prompt_tokens[prompt_index] = delta.num_prompt_tokens
        if delta.embedding is not None:
            self.probs[prompt_index] = delta.embedding

    def response(self, response_id: str, created: int, model: str) -> ClassifyResponse:
        data = []
        for i in range(self.num_inputs):
            probs = self.probs[i]
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassifyData(index=i, label=self.labels[best], probs=probs,
                                     num_classes=len(probs)))  # fmt: skip
        tokens = sum(self.prompt_tokens.values())
        usage = ClassifyUsage(prompt_tokens=tokens, total_tokens=tokens)
        return ClassifyResponse(
            id=response_id, created=created, model=model, data=data, usage=usage
        )


@dataclass
class EmbeddingsAssembler:
    num_inputs: int
    encoding_format: str
    pooler: PoolerConfig
    dimensions: int | None  # a Matryoshka model's smaller embedding (None: the full one)
    vectors: dict[int, list[float]] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)

    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        check_failed(delta)
        self.prompt_tokens[prompt_index] = delta.num_prompt_tokens
        if delta.embedding is not None:
            self.vectors[prompt_index] = self.pooler.truncated(delta.embedding, self.dimensions)

    def response(self, model: str) -> EmbeddingsResponse:
        data = [
            EmbeddingData(index=i, embedding=self._encode(self.vectors[i]))
            for i in range(self.num_inputs)
        ]
        tokens = sum(self.prompt_tokens.values())
        return EmbeddingsResponse(
            data=data, model=model, usage=EmbeddingsUsage(prompt_tokens=tokens, total_tokens=tokens)
        )

    def _encode(self, vector: list[float]) -> list[float] | str:
        if self.encoding_format == "base64":  # what OpenAI's client asks for, and decodes
            return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        return vector
