"""Text pairs for scoring (vLLM's /score, /rerank, `LLM.score`): how the two sides pair up,
and how two embeddings compare. No torch here."""

from __future__ import annotations

import math


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
