"""A GGUF file's own tokenizer against llama.cpp's: for each pre-tokenizer (and the
SentencePiece vocabularies) llama.cpp ships a vocabulary-only GGUF with texts (multilingual,
code, digits, runs of whitespace, emoji) and the ids its tokenizer must give them
(models/ggml-vocab-NAME.gguf.inp / .out in its sources: what its own test-tokenizer-0
asserts). zllm's tokenizer built from each file's vocabulary, merges and tokenizer.ggml.pre
gives the same ids, text by text."""

from __future__ import annotations

import pytest
from llama_cpp_convert import sdist_file

from zllm.model.gguf import read_gguf
from zllm.text.gguf_pre_tokenizers import ROWS
from zllm.text.tokenizer import load_tokenizer

SEPARATOR = "\n__ggml_vocab_test__\n"
# Every vocabulary test file llama.cpp ships whose tokenizer model zllm reads (byte-level BPE
# by tokenizer.ggml.pre, and SentencePiece).
BPE_NAMES = [
    "gpt-2", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "falcon", "mpt",
    "starcoder", "refact", "command-r",
]  # fmt: skip
SPM_NAMES = ["llama-spm", "phi-3"]


@pytest.mark.parametrize("name", BPE_NAMES + SPM_NAMES)
def test_ids_equal_llama_cpps(name: str) -> None:
    path = sdist_file(f"models/ggml-vocab-{name}.gguf")
    texts = sdist_file(f"models/ggml-vocab-{name}.gguf.inp").read_text().split(SEPARATOR)
    expected = sdist_file(f"models/ggml-vocab-{name}.gguf.out").read_text().split("\n")
    assert len(texts) == len(expected) > 40
    metadata = read_gguf(str(path)).metadata
    if name in BPE_NAMES:
        assert metadata["tokenizer.ggml.pre"] == name and name in ROWS
    tokenizer = load_tokenizer(str(path))
    for text, ids in zip(texts, expected, strict=True):
        assert tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()], repr(text)  # fmt: skip


def test_every_row_has_a_name_llama_cpp_tests_or_shares_one_that_does() -> None:
    """Each pre-tokenizer row zllm reads is one a vocabulary test file covers (names sharing
    a row are read alike by llama.cpp too)."""
    tested = {id(ROWS[name]) for name in BPE_NAMES}
    untested = sorted(name for name, row in ROWS.items() if id(row) not in tested)
    assert not untested, untested


# What llama.cpp's tokenizer (llama-cpp-python 0.3.36, the pinned sdist, built here; a
# vocabulary-only load, llama_tokenize with special tokens parsed) gives on llama-spm's
# vocabulary for text around special tokens: a '▁' before each text piece, also after a
# special token, also before a piece that starts with a space.
AROUND_SPECIAL_TOKENS = {
    "</s>hi<s> there": [2, 7251, 1, 29871, 727],
    "a</s> b": [263, 2, 29871, 289],
    " there": [29871, 727],
    "<s>x": [1, 921],
}


def test_sentencepiece_text_around_special_tokens_as_llama_cpp() -> None:
    tokenizer = load_tokenizer(str(sdist_file("models/ggml-vocab-llama-spm.gguf")))
    for text, ids in AROUND_SPECIAL_TOKENS.items():
        assert tokenizer.encode(text, add_special_tokens=False) == ids, text
