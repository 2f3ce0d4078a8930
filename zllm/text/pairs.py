"""Text pairs for scoring (vLLM's /score, /rerank, `LLM.score`): how the two sides pair up,
what a pooling model runs to score them, and how two embeddings compare. No torch here."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others, or two lists zipped (ValueError
    for two lists of different lengths)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds) or not seconds:
        raise ValueError(
            f"text_1 and text_2: one text against many, or two lists of one length (got "
            f"{len(firsts)} and {len(seconds)})"
        )
    return list(zip(firsts, seconds, strict=True))


def cosine(a: list[float], b: list[float]) -> float:
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norms or 1.0)


class ScorePlan:
    """How a pooling model scores text pairs: the sequences it pools, and each pair's score
    from their vectors. A cross-encoder (a classifier of one label) reads each pair as one
    sequence through the tokenizer's pair template (`encode_pair`: token ids) and its sigmoid
    score is the pair's; an embedding model pools each distinct text once (the sequence is
    the text) and a pair's score is the cosine of its two vectors. ValueError for a model
    that cannot score (a generating one, a classifier of several labels)."""

    def __init__(
        self,
        pairs: list[tuple[str, str]],
        runner: str,
        labels: tuple[str, ...],
        encode_pair: Callable[[str, str], list[int]],
    ) -> None:
        if runner != "pooling":
            raise ValueError(
                "this model generates text: scoring needs a pooling model (a cross-encoder, "
                "or an embedding model: --runner pooling)"
            )
        if len(labels) > 1:
            raise ValueError(
                f"this classifier has {len(labels)} labels: scoring needs one (a "
                f"cross-encoder's relevance)"
            )
        self.pairs = pairs
        self.cross_encoder = bool(labels)
        self.sequences: list[str | list[int]]
        if self.cross_encoder:
            self.sequences = [encode_pair(a, b) for a, b in pairs]
        else:
            texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            self._index = {text: i for i, text in enumerate(texts)}
            self.sequences = list(texts)

    def scores(self, vectors: Sequence[list[float]]) -> list[float]:
        """Each pair's score from the sequences' pooled vectors (in `sequences`' order)."""
        if self.cross_encoder:
            return [vectors[i][0] for i in range(len(self.pairs))]
        return [cosine(vectors[self._index[a]], vectors[self._index[b]]) for a, b in self.pairs]

    def sequences_of(self, pair: int) -> list[int]:
        """The indices into `sequences` pair `pair` was scored from."""
        if self.cross_encoder:
            return [pair]
        a, b = self.pairs[pair]
        return [self._index[a], self._index[b]]
