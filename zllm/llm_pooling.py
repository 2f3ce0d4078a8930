"""The `LLM` methods of pooling models (issue 61): `embed`, `classify`, `score`, as vLLM's
(zllm/llm.py holds the engine they run on). Each prompt is one pooling request
(`SamplingParams.embed`): its pooled vector comes back instead of tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from zllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from zllm.pooling_params import PoolingParams
from zllm.sampling_params import SamplingParams
from zllm.text.pairs import ScorePlan, score_pairs

if TYPE_CHECKING:
    from zllm.config.engine import EngineConfig
    from zllm.text.tokenizer import Tokenizer

PromptType = str | dict[str, Any]
POOLING = SamplingParams(max_tokens=1, temperature=0.0, embed=True)


class PoolingCalls:
    """What LLM answers for a pooling model (it provides config, tokenizer, _make_tracker
    and _run)."""

    config: EngineConfig
    tokenizer: Tokenizer

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, as `/v1/embeddings` returns them: its final hidden states
        pooled and normalised as the model's pooler says (zllm/config/pooler.py: its
        sentence-transformers files, `pooling`, `pooler_config`), a text prompt prefixed with
        the model's default instruction; `pooling_params.dimensions`: a Matryoshka model's
        smaller embedding."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        dimensions = pooling_params.dimensions if pooling_params is not None else None
        pooler = self.config.pooler
        if pooler.task != "embed":
            raise ValueError("this model is a classifier: LLM.classify, not LLM.embed")
        if dimensions is not None:
            pooler.check_dimensions(dimensions, self.config.arch.hidden_size)
        trackers = [self._make_tracker(p, POOLING) for p in prompts]
        self._run(trackers, use_tqdm)
        return [
            EmbeddingRequestOutput(
                t.req_id,
                list(t.prompt_token_ids),
                EmbeddingOutput(pooler.truncated(t.embedding or [], dimensions)),
            )
            for t in trackers
        ]

    def classify(
        self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities from a classifier's head (a
        `*ForSequenceClassification` checkpoint), as /classify returns them (vLLM's)."""
        if not self.config.pooler.labels:
            raise ValueError(
                "LLM.classify needs a sequence-classification model (a "
                "*ForSequenceClassification checkpoint)"
            )
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        trackers = [self._make_tracker(p, POOLING) for p in prompts]
        self._run(trackers, use_tqdm)
        return [
            ClassificationRequestOutput(
                t.req_id, list(t.prompt_token_ids), ClassificationOutput(t.embedding or [])
            )
            for t in trackers
        ]

    def score(
        self, text_1: str | list[str], text_2: str | list[str], use_tqdm: bool = True
    ) -> list[ScoringRequestOutput]:
        """How well each pair goes together, as /score answers (vLLM's): text_1 against each
        of text_2, or two lists zipped; a cross-encoder's sigmoid score of the pair, or an
        embedding model's cosine of the two texts' vectors (zllm/text/pairs.py ScorePlan)."""
        config = self.config
        plan = ScorePlan(
            score_pairs(text_1, text_2), config.runner, config.pooler.labels,
            self.tokenizer.encode_pair,
        )  # fmt: skip
        prompts = [
            {"prompt_token_ids": seq} if isinstance(seq, list) else seq for seq in plan.sequences
        ]
        trackers = [self._make_tracker(p, POOLING) for p in prompts]
        self._run(trackers, use_tqdm)
        scores = plan.scores([t.embedding or [] for t in trackers])
        outputs = []
        for pair, score in enumerate(scores):
            used = [trackers[i] for i in plan.sequences_of(pair)]
            outputs.append(
                ScoringRequestOutput(
                    "+".join(t.req_id for t in used),
                    [token for t in used for token in t.prompt_token_ids],
                    ScoringOutput(score),
                )
            )
        return outputs
