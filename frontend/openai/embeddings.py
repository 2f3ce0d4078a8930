"""OpenAI's /v1/embeddings on the generation engine: one engine request per input, asking
for its prompt's pooled final hidden states (`SamplingParams.embed`) instead of tokens."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np

from zllm.config.pooler import PoolerConfig
from zllm.errors import ParamError, RequestError
from zllm.frontend.generate import ApiCall, ApiContext, GenerationJob, RequestIds
from zllm.frontend.openai.format import prompt_inputs
from zllm.frontend.openai.protocol import (
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
        if body.dimensions is not None:
            try:
                self.pooler.check_dimensions(body.dimensions, engine.arch.hidden_size)
            except ValueError as e:
                raise RequestError(str(e), param="dimensions") from None
        self.body = body
        self.prompts = list(prompt_inputs(body.input))
        if body.truncate_prompt_tokens is not None:
            try:
                self.params = SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    embed=True,
                    truncate_prompt_tokens=body.truncate_prompt_tokens,
                )
            except ParamError as e:
                raise RequestError(str(e), param=e.param) from None

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        assembler = EmbeddingsAssembler(
            len(self.prompts), self.body.encoding_format, self.pooler, self.body.dimensions
        )
        return GenerationJob(
            assembler=assembler, stream=False, response=lambda: assembler.response(model)
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
