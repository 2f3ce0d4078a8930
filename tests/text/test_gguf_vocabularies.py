"""A GGUF file's own tokenizer against llama.cpp's: for each pre-tokenizer (and the
SentencePiece vocabularies) llama.cpp ships a vocabulary-only GGUF with texts (multilingual,
code, digits, runs of whitespace, emoji) and the ids its tokenizer must give them
(models/ggml-vocab-NAME.gguf.inp / .out in its sources: what its own test-tokenizer-0
asserts). zllm's tokenizer built from each file's vocabulary, merges and tokenizer.ggml.pre
gives the same ids, text by text."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from llama_cpp_convert import sdist_file

import zllm.text.tokenizer as tokenizer_module
from zllm.model.gguf import read_gguf
from zllm.text.gguf_pre_tokenizers import NOT_READ, RAW_UTF8_ROWS, ROWS
from zllm.text.tokenizer import load_tokenizer

SEPARATOR = "\n__ggml_vocab_test__\n"
# Every vocabulary test file llama.cpp ships whose tokenizer model zllm reads (byte-level BPE
# by tokenizer.ggml.pre, and SentencePiece).
BPE_NAMES = [
    "gpt-2", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "falcon", "mpt",
    "starcoder", "refact", "command-r",
]  # fmt: skip
SPM_NAMES = ["llama-spm", "phi-3"]
# BPE over raw UTF-8: Gemma 4's tokenizer model (and pre-tokenizer), '▁' for spaces.
RAW_UTF8_NAMES = ["gemma-4"]


@pytest.mark.parametrize("name", BPE_NAMES + SPM_NAMES + RAW_UTF8_NAMES)
def test_ids_equal_llama_cpps(name: str) -> None:
    path = sdist_file(f"models/ggml-vocab-{name}.gguf")
    texts = sdist_file(f"models/ggml-vocab-{name}.gguf.inp").read_text().split(SEPARATOR)
    expected = sdist_file(f"models/ggml-vocab-{name}.gguf.out").read_text().split("\n")
    if len(expected) == len(texts) + 1 and not expected[-1]:
        expected.pop()  # (a file that ends its last line)
    assert len(texts) == len(expected) > 40
    metadata = read_gguf(str(path)).metadata
    if name in BPE_NAMES:
        assert metadata["tokenizer.ggml.pre"] == name and name in ROWS
    if name in RAW_UTF8_NAMES:
        assert metadata["tokenizer.ggml.model"] == "gemma4"
    tokenizer = load_tokenizer(str(path))
    for text, ids in zip(texts, expected, strict=True):
        assert tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()], repr(text)  # fmt: skip


def test_every_name_llama_cpp_knows_is_read_or_refused_saying_why() -> None:
    """Each `tokenizer.ggml.pre` name llama.cpp's vocabulary loader knows (its source, from the
    pinned sdist) has a row, or is refused with its reason (NOT_READ); no row names a name
    llama.cpp does not know."""
    source = sdist_file("src/llama-vocab.cpp").read_text()
    known = set(re.findall(r'tokenizer_pre == "([^"]+)"', source))
    assert len(known) > 80
    read = set(ROWS) | set(RAW_UTF8_ROWS)
    assert not known - read - set(NOT_READ), sorted(known - read - set(NOT_READ))
    assert read <= known and set(NOT_READ) <= known - read and not set(ROWS) & set(RAW_UTF8_ROWS)


def test_every_row_has_a_name_llama_cpp_tests_or_shares_one_that_does() -> None:
    """Each pre-tokenizer row zllm reads is one a vocabulary test file covers, or one whose
    ids llama.cpp's tokenizer gave below (names sharing a row are read alike by llama.cpp
    too)."""
    tested = {id(ROWS[name]) for name in BPE_NAMES + sorted(PRE_TOKENIZER_IDS["ids"])}
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


# ---- names llama.cpp ships no vocabulary test file for ---------------------------------------
# Their ids as llama.cpp's tokenizer gives them on llama-bpe's vocabulary read with that
# tokenizer.ggml.pre (written by tests/text/write_pre_tokenizer_ids.py where llama-cpp-python
# of the pinned sdist is built).
PRE_TOKENIZER_IDS = json.loads(
    (Path(__file__).with_name("gguf_pre_tokenizer_ids.json")).read_text(encoding="utf-8")
)


_TOKENIZERS_BY_ROW: dict[int, object] = {}


def _tokenizer_read_as(name: str):
    """llama-bpe's vocabulary file read as if its tokenizer.ggml.pre were `name`. Names that
    share a row get one tokenizer (the name does nothing but choose the row): one build of
    the 128k vocabulary per row, not per name."""
    row = id(ROWS[name])
    if row not in _TOKENIZERS_BY_ROW:
        vocabulary = PRE_TOKENIZER_IDS["vocabulary"]
        _TOKENIZERS_BY_ROW[row] = _read_with(vocabulary, {"tokenizer.ggml.pre": name})
    return _TOKENIZERS_BY_ROW[row]


def _read_with(vocabulary: str, metadata: dict[str, object]):
    """The tokenizer of one of llama.cpp's vocabulary files, its metadata changed as given
    (as llama.cpp's kv overrides change it)."""
    path = sdist_file(f"models/{vocabulary}")
    real = read_gguf(str(path))
    told = replace(real, metadata={**real.metadata, **metadata})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokenizer_module, "read_gguf", lambda _: told)
        return load_tokenizer(str(path))


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZER_IDS["ids"]))
def test_ids_of_names_without_a_test_file_equal_llama_cpps(name: str) -> None:
    tokenizer = _tokenizer_read_as(name)
    texts, expected = PRE_TOKENIZER_IDS["texts"], PRE_TOKENIZER_IDS["ids"][name]
    for text, ids in zip(texts, expected, strict=True):
        assert tokenizer.encode(text, add_special_tokens=False) == ids, repr(text)


def test_the_names_without_a_test_file_split_text_apart() -> None:
    """The recorded ids tell the rows apart (each row's ids differ from llama-bpe's own on
    some text), so the test above could not pass with one row standing in for another. (Rows
    that cut text as llama-bpe's and differ in their BOS flag alone: test_tokenizer.py's
    test_bos_as_llama_cpp_adds_it.)"""
    path = sdist_file(f"models/{PRE_TOKENIZER_IDS['vocabulary']}")
    llama_bpe = load_tokenizer(str(path))
    texts = PRE_TOKENIZER_IDS["texts"]
    own = [llama_bpe.encode(t, add_special_tokens=False) for t in texts]

    def split(name: str) -> tuple:
        return ROWS[name].patterns, ROWS[name].ignore_merges

    for name, ids in PRE_TOKENIZER_IDS["ids"].items():
        if split(name) != split("llama-bpe"):
            assert ids != own, name


# The names whose BPE runs over raw UTF-8 (and the `whitespace` tokenizer model): llama.cpp's
# ids on Gemma 4's vocabulary test file read with each case's metadata.
RAW_UTF8_IDS = PRE_TOKENIZER_IDS["raw_utf8"]


@pytest.mark.parametrize("case", sorted(RAW_UTF8_IDS["ids"]))
def test_raw_utf8_ids_equal_llama_cpps(case: str) -> None:
    assert set(RAW_UTF8_IDS["metadata"]) == set(RAW_UTF8_IDS["ids"])
    tokenizer = _read_with(RAW_UTF8_IDS["vocabulary"], RAW_UTF8_IDS["metadata"][case])
    texts, expected = RAW_UTF8_IDS["texts"], RAW_UTF8_IDS["ids"][case]
    for text, ids in zip(texts, expected, strict=True):
        assert tokenizer.encode(text, add_special_tokens=False) == ids, repr(text)
    # Gemma 4's text back from its ids: spaces for '▁', bytes joined into their characters.
    if not case.startswith("whitespace"):
        assert tokenizer.decode(tokenizer.encode(texts[3], add_special_tokens=False)) == texts[3]


def test_o200k_rows_split_as_tiktoken() -> None:
    """gpt-4o's row (Llama 4's, MiniMax-M2's files) cuts text as tiktoken's o200k pattern
    does (its pattern run by `regex`, as tiktoken's own reference splitter runs it)."""
    import regex
    import tiktoken_ext.openai_public as openai_public

    from zllm.text.gguf_pre_tokenizers import byte_level_pre_tokenizer

    # (o200k_base() downloads its ranks first; the pattern is all this needs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {})
        pattern = openai_public.o200k_base()["pat_str"]
    splitter, _ = byte_level_pre_tokenizer("gpt-4o")
    byte_level = byte_level_pre_tokenizer("gpt-2")[0]
    for text in PRE_TOKENIZER_IDS["texts"]:
        ours = [piece for piece, _ in splitter.pre_tokenize_str(text)]
        theirs = [
            "".join(p for p, _ in byte_level.pre_tokenize_str(piece))
            for piece in regex.findall(pattern, text)
        ]
        assert ours == theirs, repr(text)
