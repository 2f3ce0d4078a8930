"""Writes tests/text/gguf_pre_tokenizer_ids.json: the ids llama.cpp's own tokenizer gives, for
each pre-tokenizer name zllm reads that has no vocabulary test file of its own in llama.cpp
(names that share another's split included: llama.cpp's flags per name, such as taking words
whole, are held too), on llama-bpe's vocabulary
test file read with that `tokenizer.ggml.pre` (a kv override) — the texts of that file and
PRE_TOKENIZER_TEXTS (cased words, contractions, digit runs, CJK and kana, marks).

Run where llama-cpp-python of the pinned sdist (tests/llama_cpp_convert.py) is built:
    python tests/text/write_pre_tokenizer_ids.py
CI reads the JSON (tests/text/test_gguf_vocabularies.py); it cannot build llama.cpp in time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama_cpp_convert import LLAMA_CPP_PYTHON_VERSION, sdist_file  # noqa: E402

from zllm.text.gguf_pre_tokenizers import ROWS  # noqa: E402

# The names llama.cpp ships a vocabulary test file for (tests/text/test_gguf_vocabularies.py
# holds zllm to those); every other name zllm reads is recorded here.
WITH_TEST_FILES = {
    "gpt-2", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "falcon", "mpt",
    "starcoder", "refact", "command-r",
}  # fmt: skip
NAMES = sorted(set(ROWS) - WITH_TEST_FILES)
SEPARATOR = "\n__ggml_vocab_test__\n"
PRE_TOKENIZER_TEXTS = [
    "HTTPServer iPhone McDonald's DON'T we'll I'M they'RE",
    "1234567 12 3.14159 1,000,000 x2y3 ２０２４",
    "你好世界 こんにちは カタカナ 한국어 中文English混合",
    "naïve café résumé Zoë ÅNGSTRÖM a\u0301b\u0301c",
    "path/to/file\n\nline two\r\n\ttabbed   spaces  ",
    "!!!???... (x+y)*z == 42; foo_bar.baz() /* c */",
    "Ünïcödé ΑΒΓ αβγ АБВ абв Ωmega",
    "emoji 🙂👍🏽 and ⁂ marks",
    # Han runs beside kana, Hangul and Latin; ideographs of the extension and compatibility
    # blocks; contractions in capitals after a mark; digit runs past three.
    "ภาษาไทย ພາສາລາວ ខ្មែរ မြန်မာ ㄅㄆㄇ 가나다 ｶﾀｶﾅ —“quoted”… ！a b c d",
    "Arabic-Indic ٠١٢٣٤٥ Devanagari १२३४५ ABC123456def 7_8901",
    "中文English混合かな漢字カナ한글字 𠀀𠀁x 豈更 Ɐbc'LL x\u0301'Ve 12345678",
]


# The names whose BPE runs over raw UTF-8 (and the `whitespace` tokenizer model), read on
# Gemma 4's vocabulary test file (whose own name, gemma4, its test file covers): each case's
# metadata as llama.cpp is told it (kv overrides).
RAW_UTF8_CASES = {
    "sarvam-moe": {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "sarvam-moe"},
    "granite-embed-multi-311m": {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "granite-embed-multi-311m",
    },
    "whitespace": {"tokenizer.ggml.model": "whitespace", "tokenizer.ggml.pre": "whitespace"},
    "whitespace, lower-cased": {
        "tokenizer.ggml.model": "whitespace",
        "tokenizer.ggml.pre": "whitespace",
        "tokenizer.ggml.normalizer.lowercase": True,
    },
}
RAW_UTF8_TEXTS = [
    *PRE_TOKENIZER_TEXTS,
    "\n" * 40,
    "a\n\n\nb\n \n\n  \n\t\tx",
    " Hello  world   ",
    "<|turn>user\nhi<turn|>",
    "\u00a0non-breaking\u3000ideographic space\u2003em",
    "\x00\x01 control \x7f bytes",
]


def main() -> None:
    import llama_cpp

    vocab = sdist_file("models/ggml-vocab-llama-bpe.gguf")
    texts = sdist_file("models/ggml-vocab-llama-bpe.gguf.inp").read_text().split(SEPARATOR)
    texts += PRE_TOKENIZER_TEXTS
    ids = {}
    for name in NAMES:
        llm = llama_cpp.Llama(
            str(vocab), vocab_only=True, verbose=False, kv_overrides={"tokenizer.ggml.pre": name}
        )
        ids[name] = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
    raw_vocab = sdist_file("models/ggml-vocab-gemma-4.gguf")
    raw_ids = {}
    for case, overrides in RAW_UTF8_CASES.items():
        llm = llama_cpp.Llama(
            str(raw_vocab), vocab_only=True, verbose=False, kv_overrides=overrides
        )
        raw_ids[case] = [
            llm.tokenize(t.encode(), add_bos=False, special=True) for t in RAW_UTF8_TEXTS
        ]
    out = Path(__file__).with_name("gguf_pre_tokenizer_ids.json")
    record = {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "vocabulary": "ggml-vocab-llama-bpe.gguf",
        "texts": texts,
        "ids": ids,
        "raw_utf8": {
            "vocabulary": "ggml-vocab-gemma-4.gguf",
            "metadata": RAW_UTF8_CASES,
            "texts": RAW_UTF8_TEXTS,
            "ids": raw_ids,
        },
    }
    out.write_text(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {out}: {len(NAMES)} names x {len(texts)} texts, {len(raw_ids)} raw UTF-8 cases")


if __name__ == "__main__":
    main()
