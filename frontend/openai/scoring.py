"""vLLM's /score and Jina's and Cohere's /rerank: how well texts go together, by a pooling
model (issue 61): zllm/text/pairs.py ScorePlan says what runs (a cross-encoder's pairs, or an
embedding model's texts); each sequence is one engine request, answered by the embeddings
path.
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
from zllm.text.pairs import ScorePlan, score_pairs

# Pairs one request may score: a cross-encoder's are tokenized in the constructor, on the
# event loop (a thousand short pairs take milliseconds).
MAX_SCORE_PAIRS = 1024


def check_pair_count(count: int, param: str) -> None:
    if count > MAX_SCORE_PAIRS:
        raise RequestError(
            f"A request may score at most {MAX_SCORE_PAIRS} pairs, got {count}.", param=param
        )


def score_plan(pairs: list[tuple[str, str]], ctx: ApiContext) -> ScorePlan:
    """The engine prompts that score `pairs` (a 400 naming why the model cannot)."""
    engine = ctx.config.engine
    try:
        return ScorePlan(pairs, engine.runner, engine.pooler.labels, ctx.tokenizer.encode_pair)
    except ValueError as e:
        raise RequestError(str(e), param="model") from None


def plan_prompts(plan: ScorePlan) -> list[PromptInput]:
    return [
        PromptInput(token_ids=seq) if isinstance(seq, list) else PromptInput(text=seq)
        for seq in plan.sequences
    ]


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
        check_pair_count(len(pairs), "text_2")
        self.scoring = score_plan(pairs, ctx)
        self.prompts = plan_prompts(self.scoring)
        self.params = pooling_params(body.truncate_prompt_tokens)

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        got = PooledVectors()

        def response() -> ScoreResponse:
            scores = self.scoring.scores([got.vectors[i] for i in range(len(self.prompts))])
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
        check_pair_count(len(body.documents), "documents")
        self.documents = [d if isinstance(d, str) else d.text for d in body.documents]
        self.body = body
        self.scoring = score_plan([(body.query, doc) for doc in self.documents], ctx)
        self.prompts = plan_prompts(self.scoring)
        self.params = pooling_params(body.truncate_prompt_tokens)

    def job(self, ids: RequestIds, model: str, now: float) -> GenerationJob:
        got = PooledVectors()

        def response() -> RerankResponse:
            scores = self.scoring.scores([got.vectors[i] for i in range(len(self.prompts))])
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
