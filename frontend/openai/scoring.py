"""vLLM's /score and Jina's and Cohere's /rerank: how well texts go together, by a pooling
model (issue 61).

A cross-encoder (a classifier of one label: zllm/config/pooler.py) reads each pair as one
sequence, the tokenizer's pair template around it, and its sigmoid score is the pair's; an
embedding model embeds each distinct text once and a pair's score is the cosine of their
vectors. Either way each sequence is one engine request, answered by the embeddings path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zllm.errors import RequestError
from zllm.frontend.generate import ApiCall, ApiContext, GenerationJob, RequestIds
from zllm.frontend.openai.embeddings import EMBED_PARAMS, pooling_params
from zllm.frontend.openai.format import PromptInput
from zllm.frontend.openai.pooling_protocol import (
    ClassifyUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from zllm.frontend.replies import check_failed
from zllm.protocol import RequestOutputDelta
from zllm.text.pairs import cosine, score_pairs


class PairScores:
    """The engine prompts that score `pairs`, and the scores from their pooled vectors."""

    def __init__(self, pairs: list[tuple[str, str]], ctx: ApiContext) -> None:
        engine = ctx.config.engine
        pooler = engine.pooler
        if engine.runner != "pooling":
            raise RequestError(
                "this model generates text: scoring needs a pooling model (a cross-encoder, "
                "or an embedding model)",
                param="model",
            )
        if pooler.task == "classify" and len(pooler.labels) != 1:
            raise RequestError(
                f"this classifier has {len(pooler.labels)} labels: scoring needs one (a "
                f"cross-encoder's relevance)",
                param="model",
            )
        self.pairs = pairs
        self.cross_encoder = pooler.task == "classify"
        if self.cross_encoder:
            self.prompts = [
                PromptInput(token_ids=ctx.tokenizer.encode_pair(a, b)) for a, b in pairs
            ]
        else:
            texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            self.index = {text: i for i, text in enumerate(texts)}
            self.prompts = [PromptInput(text=text) for text in texts]

    def scores(self, vectors: dict[int, list[float]]) -> list[float]:
        if self.cross_encoder:
            return [vectors[i][0] for i in range(len(self.pairs))]
        return [cosine(vectors[self.index[a]], vectors[self.index[b]]) for a, b in self.pairs]


@dataclass
class PooledVectors:
    """Each prompt's pooled vector and prompt tokens, as they come."""

    vectors: dict[int, list[float]] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)

    def collect(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        check_failed(delta)
        self.prompt_tokens[prompt_index] = delta.num_prompt_tokens
        if delta.embedding is not None:
            self.vectors[prompt_index] = delta.embedding

    @property
    def tokens(self) -> int:
        return sum(self.prompt_tokens.values())


class ScoreCall(ApiCall):
    id_prefix = "score"
    params = EMBED_PARAMS

    def __init__(self, body: ScoreRequest, ctx: ApiContext) -> None:
        try:
            pairs = score_pairs(body.text_1, body.text_2)
        except ValueError as e:
            raise RequestError(str(e), param="text_2") from None
        self.scoring = PairScores(pairs, ctx)
        self.prompts = list(self.scoring.prompts)
        self.params = pooling_params(body.truncate_prompt_tokens)

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        got = PooledVectors()

        def response() -> ScoreResponse:
            scores = self.scoring.scores(got.vectors)
            data = [ScoreData(index=i, score=score) for i, score in enumerate(scores)]
            usage = ClassifyUsage(prompt_tokens=got.tokens, total_tokens=got.tokens)
            return ScoreResponse(
                id=ids.response_id, created=int(now), model=model, data=data, usage=usage
            )

        return GenerationJob(assembler=got, stream=False, response=response)


class RerankCall(ApiCall):
    id_prefix = "rerank"
    params = EMBED_PARAMS

    def __init__(self, body: RerankRequest, ctx: ApiContext) -> None:
        if not body.documents:
            raise RequestError("documents must not be empty", param="documents")
        self.documents = [d if isinstance(d, str) else d.text for d in body.documents]
        self.body = body
        self.scoring = PairScores([(body.query, doc) for doc in self.documents], ctx)
        self.prompts = list(self.scoring.prompts)
        self.params = pooling_params(body.truncate_prompt_tokens)

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        got = PooledVectors()

        def response() -> RerankResponse:
            scores = self.scoring.scores(got.vectors)
            ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
            ranked = ranked[: self.body.top_n or len(ranked)]
            results = [
                RerankResult(
                    index=i,
                    relevance_score=scores[i],
                    document=RerankDocument(text=self.documents[i])
                    if self.body.return_documents
                    else None,
                )
                for i in ranked
            ]
            return RerankResponse(
                id=ids.response_id, model=model, results=results,
                usage=RerankUsage(total_tokens=got.tokens),
            )  # fmt: skip

        return GenerationJob(assembler=got, stream=False, response=response)
