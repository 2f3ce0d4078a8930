"""`bad_words` (vLLM's sampling extra): words the output never contains.

A word is banned as the token sequences it encodes to, both at the start of a text and
after a space ("cat" and " cat" are different tokens in most vocabularies):

    word "bad cat" -> [b, c]      output ... x b   -> the next token may not be c
    word "cat"     -> [c]         always banned

A one-token word is never sampled; a longer one has its last token banned whenever the
output so far ends with the tokens before it. The encodings are made where a tokenizer is
(the tokenizer worker, the offline LLM) and travel in SamplingParams.bad_words_token_ids;
the executor's BadWords processor asks `banned_next` each step. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from zllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from zllm.text.tokenizer import Tokenizer


def encode_bad_words(words: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Each word's encodings, bare and after a space, without repeats."""
    encodings: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in encodings:
                encodings.append(ids)
    return encodings


def with_bad_words_ids(params: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """`params` with its bad words' encodings filled in (unchanged without bad words)."""
    if not params.bad_words:
        return params
    return msgspec.structs.replace(
        params,
        bad_words_token_ids=[
            *params.bad_words_token_ids,
            *encode_bad_words(params.bad_words, tokenizer),
        ],
    )


def banned_next(encodings: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word after `output` (the tokens generated so
    far; the prompt does not count, as in vLLM)."""
    banned = []
    for ids in encodings:
        prefix = len(ids) - 1
        if prefix == 0 or (
            prefix <= len(output) and list(output[len(output) - prefix :]) == list(ids[:-1])
        ):
            banned.append(ids[-1])
    return banned
