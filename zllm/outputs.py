"""What `LLM.generate` returns (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> its logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # First entry is None: the first prompt token has nothing before it.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class EmbeddingOutput:
    # As the model's pooler makes it (normalised or not); its length is the model's hidden
    # size, or the `dimensions` asked for.
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, as vLLM's `EmbeddingRequestOutput`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # each label's probability, in the model's label order

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """What `LLM.classify` returns per prompt, as vLLM's `ClassificationRequestOutput`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    score: float  # a cross-encoder's sigmoid score, or the cosine of two embeddings


@dataclass(slots=True)
class ScoringRequestOutput:
    """What `LLM.score` returns per pair, as vLLM's `ScoringRequestOutput`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass(slots=True)
class BeamSearchSequence:
    """One hypothesis of `LLM.beam_search`: prompt and output tokens, their text."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]
